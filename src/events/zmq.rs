//! Live vLLM KV-event subscriber over ZeroMQ (feature `zmq`).
//!
//! A vLLM engine started with `--kv-events-config '{"enable_kv_cache_events": true,
//! "publisher": "zmq", ...}'` binds a **PUB** socket that sends every `KVEventBatch` as three
//! frames `[topic, seq (8-byte big-endian), payload (msgpack)]`, `seq` counting batches from 0
//! per publisher, and optionally a **ROUTER** "replay" socket that answers a `start_seq`
//! (8-byte BE) with every buffered `[seq, payload]` from there on, closed by
//! `seq = 0xFFFF_FFFF_FFFF_FFFF` and an empty payload.
//!
//! [`Subscriber::spawn`] runs one background thread per engine ([`EngineConfig`]) that
//! connects a SUB socket, decodes each payload with a stateful [`Decoder`] and applies the
//! events, in order, to a shared [`BlockIndex`]. Sequence numbers, never timing, are the truth:
//!
//! * **Gaps.** A batch whose `seq` is not `last + 1` is a gap (the SUB socket dropped batches:
//!   high-water mark, reconnect, slow start). With a replay endpoint, the thread asks it for
//!   everything from `last + 1`, applies the replayed batches in `last + 1 .. seq` in order,
//!   skipping any already applied, then applies the live batch and carries on. Batches the
//!   replay buffer no longer holds (or every batch of the gap when there is no replay endpoint,
//!   or the replay failed [`REPLAY_ATTEMPTS`] times) are counted in [`EngineStats::lost`]; the
//!   index then misses those changes until the engine stores or removes the blocks again.
//! * **First batch.** If the first `seq` seen is above 0 and a replay endpoint exists, the
//!   thread first replays `0 .. seq` ([`EngineConfig::with_initial_replay`], on by default):
//!   a router started after the engine, or a SUB socket that joined late (the PUB/SUB
//!   "slow joiner"), still learns the blocks stored before it joined, as far as the engine's
//!   replay buffer reaches back. Those batches are counted in [`EngineStats::caught_up`], not
//!   in [`EngineStats::replayed`] (which is for gaps only) and the first batch is not a gap.
//! * **Engine restarts.** A `seq` *below* the last one means the publisher restarted (its
//!   counter starts again at 0, and its KV cache is empty): the thread applies
//!   [`KvEvent::Cleared`] to every worker it has fed, resets its decoder, counts a
//!   [`EngineStats::restarts`] and treats the batch as a first batch.
//! * **Malformed messages** (not 3 frames, a `seq` frame that is not 8 bytes) and payloads
//!   that fail to decode count as [`EngineStats::decode_errors`] and never panic. A payload
//!   that fails to decode still consumes its (valid) `seq`, so it is not replayed again.
//! * **Events the index rejects** (a `BlockStored` whose parent it does not hold) count as
//!   [`EngineStats::apply_errors`]; the rest of the batch is applied.
//!
//! # Workers and data-parallel ranks
//!
//! One engine (one publisher endpoint) is one [`WorkerId`] ([`EngineConfig::worker`]). vLLM's
//! data-parallel ranks each publish on their own port (the endpoint's port offset by the
//! rank) with their own `seq`, so the usual setup is one [`EngineConfig`] per rank, each with
//! its own worker id, and the default [`WorkerMapping::Fixed`]. When a batch's
//! `data_parallel_rank` must choose the worker, use [`WorkerMapping::AddRank`]
//! (`WorkerId(worker.0 + rank)`, rank `nil` = 0) or [`WorkerMapping::Custom`].
//!
//! # Threads, stop and reconnects
//!
//! Every socket has a receive timeout of [`POLL_INTERVAL`] (50 ms), so a thread notices
//! [`Subscriber::stop`] (or `Drop`) within about that long, even in the middle of a replay.
//! libzmq reconnects a connected socket by itself when its peer goes away and comes back
//! (SUB: retry interval 100 ms, backing off exponentially to 5 s); a socket that fails
//! outright (creation, `connect` of a malformed endpoint, a receive error other than a
//! timeout) is closed and re-created after an exponential backoff (100 ms doubling to 5 s),
//! counted in [`EngineStats::reconnects`], with the error in [`EngineStats::last_error`]. The
//! replay DEALER socket is kept between gaps and re-created after a failed replay.
//!
//! # Why the `zmq` crate (libzmq) and not the pure-Rust `zeromq` crate
//!
//! Both were tried here (SUB from PUB and DEALER to ROUTER on loopback; both work):
//!
//! * **Build / CI.** `zmq` 0.10 builds its own libzmq 4.3 from vendored sources
//!   (`zmq-sys` → `zeromq-src`, no `libzmq3-dev`, no `pkg-config`, no cmake): the only
//!   requirement is a C++ compiler, which the Rust image has (`build-essential`). It costs a
//!   one-time ~80 s C++ compile on 2 cores. `zeromq` compiles in ~30 s but pulls ~110 crates
//!   (tokio, futures, ...) into the tree, and its current 0.7 needs rustc 1.89, above this
//!   crate's MSRV 1.85 (0.6 would do).
//! * **Blocking vs async.** The subscriber is a few long-lived threads doing blocking receives
//!   with a timeout: exactly libzmq's model (`ZMQ_RCVTIMEO`). `zeromq` is async only; it would
//!   need a tokio runtime per subscriber and timeouts wrapped around every receive.
//! * **Reconnects.** libzmq's `connect` never blocks and reconnects in the background with
//!   backoff — the same library vLLM's pyzmq publisher runs on. With `zeromq` 0.6, `connect`
//!   to an endpoint that is not bound yet blocked (we saw it hang for as long as we waited),
//!   so a router started before its engines would stall.
//!
//! # Example
//!
//! ```no_run
//! use std::sync::Arc;
//! use kvtrie::blocks::{BlockIndex, WorkerId};
//! use kvtrie::events::vllm::DecodeConfig;
//! use kvtrie::events::zmq::{EngineConfig, Subscriber};
//!
//! let index = Arc::new(BlockIndex::new());
//! let engine = EngineConfig::new("tcp://10.0.0.5:5557", WorkerId(1), DecodeConfig::new(16))
//!     .with_replay("tcp://10.0.0.5:5558");
//! let subscriber = Subscriber::spawn(Arc::clone(&index), vec![engine]);
//! // ... route with `index.find_matches(...)` ...
//! for s in subscriber.stats() {
//!     println!("{}: {} batches, {} gaps, last seq {:?}", s.name, s.batches, s.gaps, s.last_seq);
//! }
//! subscriber.stop();
//! ```

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::blocks::{BlockIndex, KvEvent, WorkerId};
use crate::events::vllm::{DecodeConfig, Decoder};

/// Receive timeout of every socket: how long a thread may take to notice a stop request.
pub const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// The `seq` that ends a replay answer.
pub const END_OF_REPLAY: u64 = u64::MAX;

/// How many times a gap's replay is attempted before its batches are counted as lost.
pub const REPLAY_ATTEMPTS: u32 = 3;

/// First delay before re-creating a failed socket or retrying a replay; doubles up to
/// [`MAX_BACKOFF`].
pub const MIN_BACKOFF: Duration = Duration::from_millis(100);

/// Longest delay between socket re-creations or replay attempts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Default SUB receive high-water mark (messages): how many batches libzmq queues while the
/// thread is busy (e.g. replaying) before it drops some (which then shows up as a gap).
pub const DEFAULT_RCVHWM: i32 = 100_000;

/// How a batch's `data_parallel_rank` chooses the worker its events are applied to.
#[derive(Clone, Default)]
pub enum WorkerMapping {
    /// Every batch goes to [`EngineConfig::worker`], whatever its rank (the default).
    #[default]
    Fixed,
    /// `WorkerId(worker.0 + rank)` (a missing or `nil` rank counts as 0; wraps on overflow).
    /// Give such engines worker ids far enough apart that their ranges do not overlap.
    AddRank,
    /// A user callback `(engine worker, rank) -> worker`, called once per batch.
    Custom(Arc<dyn Fn(WorkerId, Option<u32>) -> WorkerId + Send + Sync>),
}

impl WorkerMapping {
    /// The worker for a batch with this rank from an engine configured as `worker`.
    pub fn map(&self, worker: WorkerId, rank: Option<u32>) -> WorkerId {
        match self {
            WorkerMapping::Fixed => worker,
            WorkerMapping::AddRank => WorkerId(worker.0.wrapping_add(u64::from(rank.unwrap_or(0)))),
            WorkerMapping::Custom(f) => f(worker, rank),
        }
    }
}

impl fmt::Debug for WorkerMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkerMapping::Fixed => f.write_str("Fixed"),
            WorkerMapping::AddRank => f.write_str("AddRank"),
            WorkerMapping::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

/// One engine (one vLLM publisher) to subscribe to.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Label in [`EngineStats::name`] and the thread name (default: the PUB endpoint).
    pub name: String,
    /// The engine's PUB endpoint, e.g. `tcp://10.0.0.5:5557`.
    pub pub_endpoint: String,
    /// The engine's replay ROUTER endpoint, if it has one, e.g. `tcp://10.0.0.5:5558`.
    pub replay_endpoint: Option<String>,
    /// Topic prefix to subscribe to (`""`, vLLM's default, = every batch).
    pub topic: String,
    /// The worker this engine's events are applied to (see [`WorkerMapping`]).
    pub worker: WorkerId,
    /// How `data_parallel_rank` maps to a worker (default [`WorkerMapping::Fixed`]).
    pub mapping: WorkerMapping,
    /// Decoder settings (router block size, namespace, engine block size).
    pub decode: DecodeConfig,
    /// Replay `0 .. first seq` when the first batch seen has `seq > 0` (default `true`).
    pub initial_replay: bool,
    /// SUB receive high-water mark in messages (default [`DEFAULT_RCVHWM`]; 0 = unbounded).
    pub rcvhwm: i32,
    /// Give up on one replay answer when no frame arrives for this long (default 2 s).
    pub replay_timeout: Duration,
}

impl EngineConfig {
    /// An engine publishing on `pub_endpoint`, applied to `worker`, decoded with `decode`; no
    /// replay endpoint, topic `""`.
    pub fn new(pub_endpoint: impl Into<String>, worker: WorkerId, decode: DecodeConfig) -> Self {
        let pub_endpoint = pub_endpoint.into();
        EngineConfig {
            name: pub_endpoint.clone(),
            pub_endpoint,
            replay_endpoint: None,
            topic: String::new(),
            worker,
            mapping: WorkerMapping::Fixed,
            decode,
            initial_replay: true,
            rcvhwm: DEFAULT_RCVHWM,
            replay_timeout: Duration::from_secs(2),
        }
    }

    /// Use this replay ROUTER endpoint to fill gaps.
    pub fn with_replay(mut self, endpoint: impl Into<String>) -> Self {
        self.replay_endpoint = Some(endpoint.into());
        self
    }

    /// Subscribe to this topic prefix only.
    pub fn with_topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = topic.into();
        self
    }

    /// Set the label used in stats and the thread name.
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Set how `data_parallel_rank` maps to a worker.
    pub fn with_mapping(mut self, mapping: WorkerMapping) -> Self {
        self.mapping = mapping;
        self
    }

    /// Whether to replay `0 .. first seq` when the first batch seen has `seq > 0`.
    pub fn with_initial_replay(mut self, on: bool) -> Self {
        self.initial_replay = on;
        self
    }

    /// Set the SUB receive high-water mark (messages; 0 = unbounded).
    pub fn with_rcvhwm(mut self, hwm: i32) -> Self {
        self.rcvhwm = hwm;
        self
    }

    /// Set how long a replay may go without receiving a frame before it is abandoned.
    pub fn with_replay_timeout(mut self, timeout: Duration) -> Self {
        self.replay_timeout = timeout;
        self
    }
}

/// Counters of one engine's subscription (see [`Subscriber::stats`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// [`EngineConfig::name`].
    pub name: String,
    /// Batches decoded and applied (live, replayed and caught up).
    pub batches: u64,
    /// Events applied successfully.
    pub events: u64,
    /// Sequence gaps detected between two live batches.
    pub gaps: u64,
    /// Batches recovered from the replay endpoint to fill gaps.
    pub replayed: u64,
    /// Batches before the first live one recovered by the initial replay.
    pub caught_up: u64,
    /// Batches of gaps that could not be recovered (no replay endpoint, no longer buffered,
    /// or the replay failed).
    pub lost: u64,
    /// Malformed messages and payloads that failed to decode.
    pub decode_errors: u64,
    /// Events the index rejected ([`crate::blocks::EventError`], e.g. an unknown parent).
    pub apply_errors: u64,
    /// Times the publisher's `seq` went backwards (engine restart).
    pub restarts: u64,
    /// Replays that failed (timeout, socket error, malformed answer).
    pub replay_failures: u64,
    /// Sockets re-created after an error.
    pub reconnects: u64,
    /// `seq` of the last batch consumed (applied, or failed to decode), if any.
    pub last_seq: Option<u64>,
    /// The last socket or replay error, for diagnosis.
    pub last_error: Option<String>,
}

/// Background subscription of a [`BlockIndex`] to vLLM engines; see the [module docs](self).
///
/// Stops and joins its threads on [`Subscriber::stop`] or when dropped.
pub struct Subscriber {
    stop: Arc<AtomicBool>,
    stats: Vec<Arc<Mutex<EngineStats>>>,
    threads: Vec<JoinHandle<()>>,
    // Dropped after the threads are joined (they own its sockets).
    _ctx: zmq::Context,
}

impl fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscriber")
            .field("engines", &self.stats.len())
            .field("stopped", &self.stop.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Subscriber {
    /// Start one background thread per engine, feeding `index`.
    ///
    /// Never fails: sockets are connected in the background and a failing engine is retried
    /// (with backoff) and reported in its [`EngineStats::last_error`].
    pub fn spawn(index: Arc<BlockIndex>, engines: Vec<EngineConfig>) -> Subscriber {
        let ctx = zmq::Context::new();
        let stop = Arc::new(AtomicBool::new(false));
        let mut stats = Vec::with_capacity(engines.len());
        let mut threads = Vec::with_capacity(engines.len());
        for cfg in engines {
            let st = Arc::new(Mutex::new(EngineStats {
                name: cfg.name.clone(),
                ..EngineStats::default()
            }));
            stats.push(Arc::clone(&st));
            let name = format!("kvtrie-zmq-{}", cfg.name);
            let mut worker =
                EngineThread::new(cfg, ctx.clone(), Arc::clone(&index), Arc::clone(&stop), st);
            let handle = std::thread::Builder::new()
                .name(name)
                .spawn(move || worker.run())
                .expect("spawn subscriber thread");
            threads.push(handle);
        }
        Subscriber {
            stop,
            stats,
            threads,
            _ctx: ctx,
        }
    }

    /// A snapshot of every engine's counters, in the order the engines were given.
    pub fn stats(&self) -> Vec<EngineStats> {
        self.stats.iter().map(|s| lock(s).clone()).collect()
    }

    /// Stop the threads, wait for them (about [`POLL_INTERVAL`]), and return the final stats.
    pub fn stop(mut self) -> Vec<EngineStats> {
        self.shutdown();
        self.stats()
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            // a panicking thread already reported itself; nothing more to do here
            let _ = t.join();
        }
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn lock(m: &Mutex<EngineStats>) -> MutexGuard<'_, EngineStats> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Why a receive loop ended early.
enum Interrupt {
    /// Stop was requested.
    Stop,
    /// The socket failed (or its peer misbehaved); re-create it.
    Failed(String),
}

fn failed(e: zmq::Error) -> Interrupt {
    Interrupt::Failed(e.to_string())
}

/// One engine's subscription, run on its own thread.
struct EngineThread {
    cfg: EngineConfig,
    ctx: zmq::Context,
    index: Arc<BlockIndex>,
    stop: Arc<AtomicBool>,
    stats: Arc<Mutex<EngineStats>>,
    decoder: Decoder,
    /// Seq of the next batch to apply; `None` before the first batch (or after a restart).
    next: Option<u64>,
    /// Workers this engine has fed (cleared on an engine restart).
    workers: Vec<WorkerId>,
    replay: Option<zmq::Socket>,
}

impl EngineThread {
    fn new(
        cfg: EngineConfig,
        ctx: zmq::Context,
        index: Arc<BlockIndex>,
        stop: Arc<AtomicBool>,
        stats: Arc<Mutex<EngineStats>>,
    ) -> Self {
        // An invalid decode config is reported once and every batch then counts as a
        // decode error (a decoder with a valid fallback config could apply wrong hashes).
        let decoder = Decoder::new(cfg.decode.clone());
        let decoder = match decoder {
            Ok(d) => d,
            Err(e) => {
                lock(&stats).last_error = Some(e.to_string());
                Decoder::new(DecodeConfig::new(1)).expect("block size 1 is valid")
            }
        };
        EngineThread {
            cfg,
            ctx,
            index,
            stop,
            stats,
            decoder,
            next: None,
            workers: Vec::new(),
            replay: None,
        }
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Sleep `d` in slices, returning early (true) when stop is requested.
    fn sleep(&self, d: Duration) -> bool {
        let end = Instant::now() + d;
        loop {
            if self.stopped() {
                return true;
            }
            let now = Instant::now();
            if now >= end {
                return false;
            }
            std::thread::sleep((end - now).min(POLL_INTERVAL));
        }
    }

    fn error(&self, what: &str, e: impl fmt::Display) {
        lock(&self.stats).last_error = Some(format!("{what}: {e}"));
    }

    fn run(&mut self) {
        let valid_config = Decoder::new(self.cfg.decode.clone()).is_ok();
        let mut backoff = MIN_BACKOFF;
        while !self.stopped() {
            let sub = match self.connect_sub() {
                Ok(s) => s,
                Err(e) => {
                    self.error("SUB socket", e);
                    lock(&self.stats).reconnects += 1;
                    if self.sleep(backoff) {
                        break;
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue;
                }
            };
            match self.recv_loop(&sub, valid_config, &mut backoff) {
                Interrupt::Stop => break,
                Interrupt::Failed(e) => {
                    self.error("SUB receive", e);
                    lock(&self.stats).reconnects += 1;
                    drop(sub);
                    if self.sleep(backoff) {
                        break;
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    fn connect_sub(&self) -> Result<zmq::Socket, zmq::Error> {
        let s = self.ctx.socket(zmq::SUB)?;
        s.set_linger(0)?;
        s.set_rcvtimeo(POLL_INTERVAL.as_millis() as i32)?;
        s.set_rcvhwm(self.cfg.rcvhwm)?;
        s.set_reconnect_ivl(100)?;
        s.set_reconnect_ivl_max(MAX_BACKOFF.as_millis() as i32)?;
        s.set_subscribe(self.cfg.topic.as_bytes())?;
        s.connect(&self.cfg.pub_endpoint)?;
        Ok(s)
    }

    fn recv_loop(
        &mut self,
        sub: &zmq::Socket,
        valid_config: bool,
        backoff: &mut Duration,
    ) -> Interrupt {
        loop {
            if self.stopped() {
                return Interrupt::Stop;
            }
            let frames = match sub.recv_multipart(0) {
                Ok(f) => f,
                Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => continue,
                Err(e) => return failed(e),
            };
            *backoff = MIN_BACKOFF;
            let seq = match frames.as_slice() {
                [_topic, seq, _payload] => match <[u8; 8]>::try_from(seq.as_slice()) {
                    Ok(b) => u64::from_be_bytes(b),
                    Err(_) => {
                        self.decode_error("seq frame is not 8 bytes");
                        continue;
                    }
                },
                _ => {
                    self.decode_error("message is not 3 frames");
                    continue;
                }
            };
            let payload = &frames[2];
            if !valid_config {
                self.decode_error("invalid decode config");
                self.next = Some(seq.wrapping_add(1));
                lock(&self.stats).last_seq = Some(seq);
                continue;
            }
            match self.next {
                Some(n) if seq == n => {}
                Some(n) if seq > n => {
                    lock(&self.stats).gaps += 1;
                    if self.fill(n, seq, false) {
                        return Interrupt::Stop;
                    }
                }
                Some(_) => {
                    // seq went backwards: the publisher restarted with an empty cache
                    self.restart();
                    if self.first(seq) {
                        return Interrupt::Stop;
                    }
                }
                None => {
                    if self.first(seq) {
                        return Interrupt::Stop;
                    }
                }
            }
            self.consume(seq, payload, Source::Live);
        }
    }

    /// The first batch (since start or a restart) is `seq`: catch up on `0 .. seq` if
    /// configured. Returns true if stop was requested meanwhile.
    fn first(&mut self, seq: u64) -> bool {
        self.next = Some(0);
        if seq > 0 && self.cfg.initial_replay && self.cfg.replay_endpoint.is_some() {
            self.fill(0, seq, true)
        } else {
            // batches before the first one are not a gap: we were not there
            self.next = Some(seq);
            false
        }
    }

    fn restart(&mut self) {
        for &w in &self.workers {
            let _ = self.index.apply(w, KvEvent::Cleared);
        }
        self.workers.clear();
        self.decoder = Decoder::new(self.cfg.decode.clone()).expect("validated at start");
        self.next = None;
        lock(&self.stats).restarts += 1;
    }

    fn decode_error(&self, what: &str) {
        let mut st = lock(&self.stats);
        st.decode_errors += 1;
        st.last_error = Some(format!("decode: {what}"));
    }

    /// Decode and apply batch `seq` (which must be `self.next`), then advance.
    fn consume(&mut self, seq: u64, payload: &[u8], source: Source) {
        self.next = Some(seq.wrapping_add(1));
        let batch = match self.decoder.decode(payload) {
            Ok(b) => b,
            Err(e) => {
                let mut st = lock(&self.stats);
                st.decode_errors += 1;
                st.last_error = Some(format!("decode batch {seq}: {e}"));
                st.last_seq = Some(seq);
                return;
            }
        };
        let worker = self
            .cfg
            .mapping
            .map(self.cfg.worker, batch.data_parallel_rank);
        if !self.workers.contains(&worker) {
            self.workers.push(worker);
        }
        let (mut ok, mut failed) = (0u64, 0u64);
        for ev in batch.events {
            match self.index.apply(worker, ev.event) {
                Ok(()) => ok += 1,
                Err(_) => failed += 1,
            }
        }
        let mut st = lock(&self.stats);
        st.batches += 1;
        st.events += ok;
        st.apply_errors += failed;
        st.last_seq = Some(seq);
        match source {
            Source::Live => {}
            Source::Replay => st.replayed += 1,
            Source::CatchUp => st.caught_up += 1,
        }
    }

    /// Fill `from .. to` (`self.next == from`) from the replay endpoint, counting what cannot
    /// be recovered as lost; afterwards `self.next == to`. Returns true if stop was requested.
    fn fill(&mut self, from: u64, to: u64, initial: bool) -> bool {
        debug_assert_eq!(self.next, Some(from));
        if self.cfg.replay_endpoint.is_some() {
            let mut backoff = MIN_BACKOFF;
            for attempt in 0..REPLAY_ATTEMPTS {
                if attempt > 0 && self.sleep(backoff) {
                    return true;
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                match self.replay(to, initial) {
                    Ok(()) => break,
                    Err(Interrupt::Stop) => return true,
                    Err(Interrupt::Failed(e)) => {
                        self.replay = None;
                        let mut st = lock(&self.stats);
                        st.replay_failures += 1;
                        st.last_error = Some(format!("replay: {e}"));
                    }
                }
                if self.next == Some(to) {
                    break;
                }
            }
        }
        let next = self.next.unwrap_or(from);
        if next < to && !initial {
            lock(&self.stats).lost += to - next;
        }
        self.next = Some(to);
        false
    }

    /// One replay request from `self.next`; applies answers in `self.next .. to` in order.
    fn replay(&mut self, to: u64, initial: bool) -> Result<(), Interrupt> {
        let Some(endpoint) = self.cfg.replay_endpoint.clone() else {
            return Ok(());
        };
        let start = self.next.unwrap_or(0);
        if self.replay.is_none() {
            let s = self.ctx.socket(zmq::DEALER).map_err(failed)?;
            s.set_linger(0).map_err(failed)?;
            s.set_rcvtimeo(POLL_INTERVAL.as_millis() as i32)
                .map_err(failed)?;
            s.set_sndtimeo(POLL_INTERVAL.as_millis() as i32)
                .map_err(failed)?;
            s.connect(&endpoint).map_err(failed)?;
            self.replay = Some(s);
        }
        let sock = self.replay.take().expect("set above");
        let result = self.replay_on(&sock, start, to, initial);
        if result.is_ok() {
            self.replay = Some(sock);
        }
        result
    }

    fn replay_on(
        &mut self,
        sock: &zmq::Socket,
        start: u64,
        to: u64,
        initial: bool,
    ) -> Result<(), Interrupt> {
        // The empty delimiter frame makes this look like a REQ request, which is what vLLM's
        // replay ROUTER expects: [identity, "", start_seq].
        let sent = Instant::now();
        loop {
            match sock.send_multipart([&b""[..], &start.to_be_bytes()[..]], 0) {
                Ok(()) => break,
                // no connected peer yet: keep trying until the timeout, noticing stop
                Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => {
                    if self.stopped() {
                        return Err(Interrupt::Stop);
                    }
                    if sent.elapsed() >= self.cfg.replay_timeout {
                        return Err(Interrupt::Failed("timed out".into()));
                    }
                }
                Err(e) => return Err(failed(e)),
            }
        }
        let mut last_frame = Instant::now();
        let source = if initial {
            Source::CatchUp
        } else {
            Source::Replay
        };
        loop {
            if self.stopped() {
                return Err(Interrupt::Stop);
            }
            let mut frames = match sock.recv_multipart(0) {
                Ok(f) => f,
                Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => {
                    if last_frame.elapsed() >= self.cfg.replay_timeout {
                        return Err(Interrupt::Failed("timed out".into()));
                    }
                    continue;
                }
                Err(e) => return Err(failed(e)),
            };
            last_frame = Instant::now();
            // vLLM answers [identity, "", seq, payload]; the DEALER sees ["", seq, payload].
            // Accept the bare [seq, payload] too.
            if frames.len() == 3 && frames[0].is_empty() {
                frames.remove(0);
            }
            let (seq, payload) = match frames.as_slice() {
                [seq, payload] => match <[u8; 8]>::try_from(seq.as_slice()) {
                    Ok(b) => (u64::from_be_bytes(b), payload),
                    Err(_) => return Err(Interrupt::Failed("malformed answer".into())),
                },
                _ => return Err(Interrupt::Failed("malformed answer".into())),
            };
            if seq == END_OF_REPLAY {
                return Ok(());
            }
            let next = self.next.unwrap_or(start);
            if seq < next || seq >= to {
                // already applied, or the live stream will bring it
                continue;
            }
            if seq > next && !initial {
                // the replay buffer no longer holds `next .. seq`
                lock(&self.stats).lost += seq - next;
            }
            self.consume(seq, payload, source);
        }
    }
}

#[derive(Clone, Copy)]
enum Source {
    Live,
    Replay,
    CatchUp,
}

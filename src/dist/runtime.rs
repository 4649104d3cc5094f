//! The blocking side of the `dist` facades: a tokio runtime on a background thread (clean
//! shutdown on drop), the NATS connection with reconnect backoff, and its counters.

use super::{DistError, NatsConfig};
use crate::sync::os::thread;
use crate::sync::{self, AtomicBool, AtomicU64, Mutex, Ordering};
use async_nats::{Client, ConnectOptions, Event};
use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// What the connection has been through (part of every facade's stats).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Connected to a NATS server right now.
    pub connected: bool,
    /// Connections established (the first one and every reconnect).
    pub connects: u64,
    /// Connections lost.
    pub disconnects: u64,
    /// Errors the client or the server reported on the connection (failed reconnect
    /// attempts, permission errors, slow consumers, …).
    pub errors: u64,
}

/// The last error a facade met, in words, and when: its counters say how many errors there
/// were, this says what the last one was (see each facade's `last_error`).
#[derive(Debug, Default)]
pub(crate) struct LastError(Mutex<Option<(Instant, String)>>);

impl LastError {
    /// Records `e`, met while doing `what` (e.g. "publish").
    pub(crate) fn set(&self, what: &str, e: impl Display) {
        *sync::lock(&self.0) = Some((Instant::now(), format!("{what}: {e}")));
    }

    /// The error recorded last, if any.
    pub(crate) fn get(&self) -> Option<String> {
        sync::lock(&self.0).as_ref().map(|e| e.1.clone())
    }

    /// The newer of the errors `a` and `b` recorded, if any.
    pub(crate) fn newest(a: &LastError, b: &LastError) -> Option<String> {
        let a = sync::lock(&a.0).clone();
        let b = sync::lock(&b.0).clone();
        match (a, b) {
            (Some(a), Some(b)) => Some(if a.0 >= b.0 { a.1 } else { b.1 }),
            (a, b) => a.or(b).map(|(_, e)| e),
        }
    }
}

/// Connection counters, updated by the client's event callback.
#[derive(Debug)]
pub(crate) struct Link {
    connected: AtomicBool,
    connects: AtomicU64,
    disconnects: AtomicU64,
    errors: AtomicU64,
    /// The last error event's text.
    pub(crate) last_error: LastError,
    /// How the first connection went: `None` while the first attempt over the server pool is
    /// on its way, then `Some(true)` once connected (and from every later connect), or
    /// `Some(false)` if that attempt failed before any connection was made.
    first: watch::Sender<Option<bool>>,
}

impl Default for Link {
    fn default() -> Self {
        Self {
            connected: AtomicBool::new(false),
            connects: AtomicU64::new(0),
            disconnects: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            last_error: LastError::default(),
            first: watch::Sender::new(None),
        }
    }
}

impl Link {
    fn on_event(&self, e: &Event) {
        match e {
            Event::Connected => {
                self.connected.store(true, Ordering::Relaxed);
                self.connects.fetch_add(1, Ordering::Relaxed);
                self.first.send_replace(Some(true));
            }
            Event::Disconnected | Event::Closed
                if self.connected.swap(false, Ordering::Relaxed) =>
            {
                self.disconnects.fetch_add(1, Ordering::Relaxed);
            }
            Event::ClientError(_) | Event::ServerError(_) | Event::SlowConsumer(_) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                self.last_error.set("connection", e);
                if let Event::ClientError(_) = e {
                    // The client reports a failed pass over its server pool as a client
                    // error; before the first connection that is the first attempt failing.
                    self.first.send_if_modified(|f| {
                        let first = f.is_none();
                        if first {
                            *f = Some(false);
                        }
                        first
                    });
                }
            }
            _ => {}
        }
    }

    /// Resolves once the first attempt to reach a server (every server of the pool, tried in
    /// turn) has failed before any connection was made; never if a connection was made first.
    pub(crate) async fn unreachable_at_start(&self) {
        let mut rx = self.first.subscribe();
        if rx.wait_for(|f| *f == Some(false)).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    pub(crate) fn stats(&self) -> LinkStats {
        LinkStats {
            connected: self.connected.load(Ordering::Relaxed),
            connects: self.connects.load(Ordering::Relaxed),
            disconnects: self.disconnects.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }
}

/// Polls `done` every millisecond until it holds (`true`), `timeout` has passed or `bg` has
/// stopped (`false`). A timeout beyond the clock's range (e.g. `Duration::MAX`) waits without
/// limit.
pub(crate) fn poll_until(
    bg: &Background,
    timeout: Duration,
    mut done: impl FnMut() -> bool,
) -> bool {
    let deadline = std::time::Instant::now().checked_add(timeout);
    loop {
        if done() {
            return true;
        }
        if deadline.is_some_and(|d| std::time::Instant::now() >= d) || !bg.is_running() {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// `now + d` on tokio's clock; a `d` beyond the clock's range is a day (waits that long are
/// cut short by whatever else the caller waits for).
pub(crate) fn tokio_deadline(d: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(86_400))
}

/// Exponential backoff: `base × 2^attempt`, capped at `max`.
pub(crate) fn backoff(attempt: usize, base: Duration, max: Duration) -> Duration {
    let shift = attempt.min(20) as u32;
    base.saturating_mul(1u32 << shift).min(max)
}

/// Opens the connection. With `retry_on_initial_connect` the client connects (and
/// reconnects, forever, with backoff) in the background: an unreachable server is not an
/// error here, only an invalid address is.
pub(crate) async fn connect(cfg: &NatsConfig, link: Arc<Link>) -> Result<Client, DistError> {
    let (base, max) = (cfg.reconnect_base, cfg.reconnect_max);
    ConnectOptions::new()
        .name(&cfg.client_name)
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connection_timeout(cfg.connect_timeout)
        .reconnect_delay_callback(move |attempt| backoff(attempt, base, max))
        .event_callback(move |e| {
            link.on_event(&e);
            async {}
        })
        .connect(cfg.servers())
        .await
        .map_err(|e| DistError::Connect(e.to_string()))
}

/// One continuous ordered pull subscription on `consumer`: messages arrive in stream order
/// (separate fetches can lose a message sent to an expired request, or reorder it), or why the
/// subscription could not be opened.
pub(crate) async fn pull_in_order(
    consumer: &async_nats::jetstream::consumer::Consumer<
        async_nats::jetstream::consumer::pull::Config,
    >,
    batch: usize,
    wait: Duration,
) -> Result<async_nats::jetstream::consumer::pull::Stream, String> {
    consumer
        .stream()
        .max_messages_per_batch(batch)
        .expires(wait.max(Duration::from_secs(2)))
        .heartbeat(Duration::from_millis(500))
        .messages()
        .await
        .map_err(|e| e.to_string())
}

/// The tick of an idle consumer's checks for lost deliveries ([`IdleChecks`]).
pub(crate) const IDLE_TICK: Duration = Duration::from_secs(1);
/// The longest wait between two idle checks.
pub(crate) const IDLE_CHECK_MAX: Duration = Duration::from_secs(64);

/// A pull consumer that has received nothing for a while asks the server whether deliveries
/// were lost in transit at the end of a burst, with no newer message to show the jump
/// ([`jump`]; a connection that dropped while they were on the way, the pull going on over the
/// new connection). Without acks the server never sends them again, with acks only after the
/// ack wait, so the consumer must be attached again right after what it applied.
///
/// It asks one tick ([`IDLE_TICK`]) after the last message, then at doubling intervals up to
/// [`IDLE_CHECK_MAX`] while nothing comes, and at the first tick after a reconnect (a dropped
/// connection is what loses deliveries). A loss is the server reporting a consumer delivery
/// sequence past the last one received on this attach and a stream sequence past the last
/// one applied (a consumer started past expired or deleted messages reports a stream
/// sequence past what it applied, but has delivered nothing), and still so a whole tick later
/// with nothing received meanwhile (a message may be on its way, or unread in the
/// subscription, when the server answers).
///
/// The consumer loop waits on [`Self::tick_due`] beside its messages, reports each message
/// received with [`Self::received`], and calls [`Self::tick`] when the tick comes.
pub(crate) struct IdleChecks {
    stats: Arc<async_nats::Statistics>,
    /// Connections seen so far.
    connects: u64,
    /// A reconnect whose check has not been answered yet (asked again at the next tick).
    reconnected: bool,
    /// Checks since the last message.
    checks: u32,
    /// Idle ticks since the last check or message.
    ticks: u64,
    /// The consumer delivery sequence the server reported at the last check, when it was past
    /// what this attach received (to be confirmed at the next tick).
    suspect: Option<u64>,
    /// The last consumer delivery sequence received on this attach, duplicates included.
    seen: u64,
    /// When the next tick comes: a tick after the last message or tick (a deadline, so that
    /// other branches of the loop's `select!` do not push it back).
    next_tick: tokio::time::Instant,
}

impl IdleChecks {
    pub(crate) fn new(client: &Client) -> Self {
        let stats = client.statistics();
        let connects = stats.connects.load(Ordering::Relaxed);
        IdleChecks {
            stats,
            connects,
            reconnected: false,
            checks: 0,
            ticks: 0,
            suspect: None,
            seen: 0,
            next_tick: tokio::time::Instant::now() + IDLE_TICK,
        }
    }

    /// A new consumer, which had delivered through `delivered` (its cached info): delivery
    /// sequences start over.
    pub(crate) fn attached(&mut self, delivered: u64) {
        (self.seen, self.suspect) = (delivered, None);
        self.next_tick = tokio::time::Instant::now() + IDLE_TICK;
    }

    /// A message came with consumer delivery sequence `delivery` (new or a duplicate): the
    /// next check one tick after the next quiet spell begins.
    pub(crate) fn received(&mut self, delivery: u64) {
        self.seen = self.seen.max(delivery);
        (self.checks, self.ticks, self.suspect) = (0, 0, None);
        self.next_tick = tokio::time::Instant::now() + IDLE_TICK;
    }

    /// Completes when the next tick is due.
    pub(crate) fn tick_due(&self) -> tokio::time::Sleep {
        tokio::time::sleep_until(self.next_tick)
    }

    /// The tick came, with nothing received, for `consumer`, which has applied stream
    /// sequences through `applied`: whether deliveries were lost (the caller attaches again
    /// after `applied`). An unanswered query is no loss (a later check asks again).
    pub(crate) async fn tick(
        &mut self,
        consumer: &async_nats::jetstream::consumer::Consumer<
            async_nats::jetstream::consumer::pull::Config,
        >,
        applied: u64,
    ) -> bool {
        self.next_tick = tokio::time::Instant::now() + IDLE_TICK;
        if let Some(suspect) = self.suspect.take() {
            if self.seen < suspect {
                return true;
            }
        }
        if self.due() {
            // (unanswered after a reconnect, say while JetStream is not back yet: asked again
            // at the next tick, not after the doubling wait)
            if let Ok(info) = consumer.get_info().await {
                self.reconnected = false;
                let d = info.delivered;
                if d.stream_sequence > applied && d.consumer_sequence > self.seen {
                    self.suspect = Some(d.consumer_sequence);
                }
            }
        }
        false
    }

    /// A tick passed without a message: whether to ask now.
    fn due(&mut self) -> bool {
        // (async-nats's own counter, not a protocol of this crate)
        let connects = self.stats.connects.load(Ordering::Relaxed);
        self.ticks += 1;
        if connects != self.connects {
            (self.connects, self.reconnected) = (connects, true);
        }
        if self.reconnected || self.ticks >= Self::wait(self.checks) {
            (self.checks, self.ticks) = (self.checks.saturating_add(1), 0);
            return true;
        }
        false
    }

    /// Ticks before the check after `checks` checks in a row.
    fn wait(checks: u32) -> u64 {
        let max = IDLE_CHECK_MAX.as_secs() / IDLE_TICK.as_secs();
        (1u64 << checks.min(63)).min(max)
    }
}

/// What a jump in the stream sequences a consumer is delivered means: `applied` is the last
/// stream sequence applied, `seq` the one just delivered; `last` and `delivery` the consumer's
/// delivery sequences of the message before (0 at the first after an attach) and of this one.
/// `None`: no jump. A delivery sequence one past the last means the server had nothing in
/// between for this consumer: the skipped messages no longer exist (expired or deleted). A
/// delivery sequence that jumped too means deliveries were lost in transit (a connection that
/// dropped while they were on the way; the pull goes on over the new connection, and the
/// server would deliver them again only after the ack wait, behind newer ones, or never
/// without acks): the stream still holds them, so the consumer must be attached again right
/// after `applied`.
pub(crate) fn jump(applied: u64, seq: u64, last: u64, delivery: u64) -> Option<Jump> {
    if seq <= applied.saturating_add(1) {
        None
    } else if delivery == last.wrapping_add(1) {
        Some(Jump::Gone(seq - applied - 1))
    } else {
        Some(Jump::InTransit)
    }
}

/// See [`jump`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Jump {
    /// This many messages no longer exist in the stream.
    Gone(u64),
    /// Deliveries were lost on the way: attach again after the last applied sequence.
    InTransit,
}

/// A JetStream context whose API requests and publish acks time out after `cfg.op_timeout`.
pub(crate) fn jetstream(cfg: &NatsConfig, client: Client) -> async_nats::jetstream::Context {
    async_nats::jetstream::ContextBuilder::new()
        .timeout(cfg.op_timeout)
        .build(client)
}

/// A JetStream context for a publisher that keeps up to `window` acks outstanding and polls
/// them itself: room for `2 × window` acks (the window, and one window of ack futures
/// dropped after a failure, which the client's background task holds until they settle or
/// `cfg.op_timeout` passes), and a publish that finds no room fails at once
/// (`PublishErrorKind::MaxAckPending`) instead of waiting. By default async-nats waits for
/// room among 5,000 acks, and a publisher that polls its own acks only between publishes
/// then waits for ever once it has 5,000 outstanding.
pub(crate) fn jetstream_window(
    cfg: &NatsConfig,
    client: Client,
    window: usize,
) -> async_nats::jetstream::Context {
    async_nats::jetstream::ContextBuilder::new()
        .timeout(cfg.op_timeout)
        .ack_timeout(cfg.op_timeout)
        .max_ack_inflight(window.saturating_mul(2))
        .backpressure_on_inflight(false)
        .build(client)
}

/// Resolves when shutdown is requested (or the facade is gone).
#[derive(Clone, Debug)]
pub(crate) struct Shutdown(watch::Receiver<bool>);

impl Shutdown {
    pub(crate) async fn wait(&mut self) {
        // An error means the sender was dropped: shut down as well.
        let _ = self.0.wait_for(|stop| *stop).await;
    }

    pub(crate) fn requested(&self) -> bool {
        *self.0.borrow()
    }

    /// Sleeps `d`; `false` if shutdown was requested meanwhile.
    pub(crate) async fn sleep(&mut self, d: Duration) -> bool {
        self.or_stop(tokio::time::sleep(d)).await.is_some()
    }

    /// Counts one more failure in a row and sleeps the reconnect backoff for that many
    /// (`cfg.reconnect_base` doubling up to `cfg.reconnect_max`); `false` if shutdown was
    /// requested meanwhile.
    pub(crate) async fn back_off(&mut self, failures: &mut usize, cfg: &NatsConfig) -> bool {
        *failures += 1;
        self.sleep(backoff(*failures, cfg.reconnect_base, cfg.reconnect_max))
            .await
    }

    /// Runs `f` to its end, or until shutdown is requested (`None`): a request to a server
    /// that is down waits out its timeout, and a dropped facade must not wait with it.
    pub(crate) async fn or_stop<F: std::future::IntoFuture>(&mut self, f: F) -> Option<F::Output> {
        let f = f.into_future();
        tokio::select! {
            _ = self.wait() => None,
            r = f => Some(r),
        }
    }
}

/// A current-thread tokio runtime driving one task on its own OS thread. Dropping it requests
/// shutdown, lets the task finish, and joins the thread.
#[derive(Debug)]
pub(crate) struct Background {
    stop: watch::Sender<bool>,
    handle: tokio::runtime::Handle,
    thread: Option<thread::JoinHandle<()>>,
}

impl Background {
    /// Starts `task` (given the shutdown signal) on a new thread called `name`.
    pub(crate) fn start<F, Fut>(name: &str, task: F) -> Result<Self, DistError>
    where
        F: FnOnce(Shutdown) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| DistError::Runtime(e.to_string()))?;
        let handle = rt.handle().clone();
        let (stop, rx) = watch::channel(false);
        let thread = thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                rt.block_on(task(Shutdown(rx)));
                rt.shutdown_timeout(Duration::from_millis(500));
            })
            .map_err(|e| DistError::Runtime(e.to_string()))?;
        Ok(Self {
            stop,
            handle,
            thread: Some(thread),
        })
    }

    /// Whether the background thread is still running (it ends only on drop, or if a task
    /// panicked).
    pub(crate) fn running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Runs `fut` on the runtime and waits for its result (from a thread outside the
    /// runtime), at most `timeout`. `None`: timed out or the runtime is gone.
    pub(crate) fn run<T, Fut>(&self, timeout: Duration, fut: Fut) -> Option<T>
    where
        T: Send + 'static,
        Fut: Future<Output = T> + Send + 'static,
    {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let task = self.handle.spawn(async move {
            let _ = tx.send(fut.await);
        });
        let r = rx.recv_timeout(timeout).ok();
        task.abort();
        r
    }

    /// Is the background thread still running its task?
    pub(crate) fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.thread.take() {
            if t.thread().id() != thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_checks_back_off_to_a_minute_and_come_back_after_a_reconnect() {
        let stats = Arc::new(async_nats::Statistics::default());
        let mut idle = IdleChecks {
            stats: Arc::clone(&stats),
            connects: 0,
            reconnected: false,
            checks: 0,
            ticks: 0,
            suspect: None,
            seen: 0,
            next_tick: tokio::time::Instant::now(),
        };
        // The ticks at which a quiet consumer checks.
        let mut at = Vec::new();
        for tick in 1..=300u64 {
            if idle.due() {
                at.push(tick);
            }
        }
        assert_eq!(at, [1, 3, 7, 15, 31, 63, 127, 191, 255]);
        // A reconnect: a check at the next tick, and at every tick until one is answered,
        // then the quiet sequence goes on.
        stats.connects.fetch_add(1, Ordering::Relaxed);
        assert!(idle.due());
        assert!(idle.due());
        idle.reconnected = false; // (answered)
        assert!(!idle.due());
        // A message: one tick after it.
        idle.received(7);
        assert_eq!(idle.seen, 7);
        assert!(idle.due());
        assert!(!idle.due());
        assert!(idle.due());
    }

    #[test]
    fn a_jump_with_contiguous_deliveries_is_gone_else_in_transit() {
        // no jump: the next sequence, or one already applied
        assert_eq!(jump(10, 11, 4, 9), None);
        assert_eq!(jump(10, 7, 4, 5), None);
        assert_eq!(jump(0, 1, 0, 1), None);
        // the server delivered nothing in between: 11..=13 no longer exist
        assert_eq!(jump(10, 14, 4, 5), Some(Jump::Gone(3)));
        // a fresh consumer whose first delivery skips expired messages
        assert_eq!(jump(0, 8, 0, 1), Some(Jump::Gone(7)));
        // deliveries 5 and 6 never arrived
        assert_eq!(jump(10, 14, 4, 7), Some(Jump::InTransit));
        assert_eq!(jump(u64::MAX - 1, u64::MAX, 0, 9), None);
    }

    #[test]
    fn backoff_grows_and_saturates() {
        let b = Duration::from_millis(10);
        let m = Duration::from_secs(2);
        assert_eq!(backoff(0, b, m), b);
        assert_eq!(backoff(3, b, m), Duration::from_millis(80));
        assert_eq!(backoff(usize::MAX, b, m), m);
    }

    #[test]
    fn background_runs_and_stops() {
        let bg = Background::start("kvtrie-test", |mut s| async move { s.wait().await }).unwrap();
        assert!(bg.is_running());
        assert_eq!(bg.run(Duration::from_secs(5), async { 41 + 1 }), Some(42));
        drop(bg); // joins: the task returns on the shutdown signal
    }

    #[test]
    fn last_error_reports_the_newer_of_the_two() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_millis(1);
        let at = |t: Instant, e: &str| LastError(Mutex::new(Some((t, e.to_owned()))));
        let none = LastError::default();
        let newest = |a: &LastError, b: &LastError| LastError::newest(a, b);
        assert_eq!(
            newest(&at(t0, "publish: old"), &at(t1, "connection: new")),
            Some("connection: new".to_owned())
        );
        assert_eq!(
            newest(&at(t1, "publish: new"), &at(t0, "connection: old")),
            Some("publish: new".to_owned())
        );
        assert_eq!(
            newest(&none, &at(t0, "connection: only")),
            Some("connection: only".to_owned())
        );
        assert_eq!(
            newest(&at(t0, "publish: only"), &none),
            Some("publish: only".to_owned())
        );
        assert_eq!(newest(&none, &none), None);
    }
}

//! Many routers, one view: KV events and routing state over NATS JetStream (feature `nats`).
//!
//! - [`KvEventRelay`] publishes engine KV events (decoded by the ZMQ subscriber, or from any
//!   caller) to a JetStream stream, one subject per worker (`<prefix>.kv.<engine>.<rank>`),
//!   in the compact binary [`codec`] format. Publishing never blocks the caller: events go
//!   through a bounded queue to a background task; overflow is counted.
//! - [`KvConsumer`] applies that stream to a [`BlockIndex`](crate::blocks::BlockIndex)
//!   through a durable pull consumer: at-least-once delivery, idempotent application (the
//!   last applied stream sequence is tracked and anything at or below it is skipped), acks
//!   after applying, resumes after a restart.
//! - [`SharedRouter`] wraps a [`PrefixAffinityRouter`](crate::router::PrefixAffinityRouter):
//!   every route is published (in batches, without blocking the route) to a routes stream,
//!   and every other router's decisions are applied to the local tree. A router that falls
//!   behind by more than [`SharedConfig::max_lag`] messages merges the newest snapshot and
//!   skips ahead instead of queueing.
//! - Warm start: shared routers periodically store a snapshot of their tree in the JetStream
//!   object store, tagged with the routes-stream sequence it covers and the time it was
//!   written; a new router restores the newest, moves its clock on by the time since, and
//!   consumes from the next sequence, so it starts warm.
//!
//! NATS being unreachable never stops routing: the facades start without a server, route on
//! local state, and the client reconnects with exponential backoff
//! ([`NatsConfig::reconnect_base`], [`NatsConfig::reconnect_max`]); consumers catch up from the
//! stream once it is back. Every reconnect, drop, lag, skip and malformed message is counted
//! in the facades' `stats()`.
//!
//! Each facade owns a small tokio runtime on a background thread (the routers are sync code);
//! dropping the facade stops it and joins the thread.
//!
//! ```no_run
//! use kvtrie::dist::{NatsConfig, SharedConfig, SharedRouter};
//! use kvtrie::router::{Candidate, PrefixAffinityConfig};
//!
//! let cfg = SharedConfig::new(NatsConfig::new("nats://127.0.0.1:4222"));
//! let router = SharedRouter::start(PrefixAffinityConfig::default(), cfg).unwrap();
//! let ids = router.router().update_replicas(&["r0", "r1"]);
//! let idle: Vec<Candidate> = ids.iter().map(|&r| Candidate::new(r, 0)).collect();
//! let route = router.route("You are a helpful assistant. Hi!", &idle).unwrap();
//! println!("{:?} {:?}", route.replica, router.stats());
//! ```

pub mod codec;
mod consumer;
mod recent;
mod relay;
mod runtime;
mod shared;
mod warm;

pub use codec::{
    decode_decisions, decode_kv_events, encode_decisions, encode_kv_events, split_kv_events,
    CodecError, Decision, DecisionBatch, KvEventBatch, TieredEvent, CODEC_VERSION, MIN_SPLIT_BYTES,
};
pub use consumer::{KvConsumer, KvConsumerConfig, KvConsumerStats};
pub use relay::{KvEventRelay, RelayConfig, RelayStats, MAX_IN_FLIGHT, MAX_QUEUE_CAPACITY};
pub use runtime::LinkStats;
pub use shared::{SharedConfig, SharedRouter, SharedStats, MAX_BUFFER_DECISIONS};
pub use warm::{latest_snapshot, SnapshotInfo, Snapshottable};

use crate::blocks::WorkerId;
use crate::router::ConfigError;
use std::fmt;
use std::time::Duration;

/// The longest stream name the NATS server accepts.
pub const MAX_STREAM_NAME: usize = 255;
/// The longest snapshot bucket name: the object store keeps the bucket in a stream named
/// `OBJ_<bucket>`, at most [`MAX_STREAM_NAME`] chars.
pub const MAX_BUCKET_NAME: usize = MAX_STREAM_NAME - 4;
/// The longest prefix [`NatsConfig::with_prefix`] takes: the bucket named after it,
/// `<prefix>-snapshots`, must fit [`MAX_BUCKET_NAME`].
pub const MAX_PREFIX: usize = MAX_BUCKET_NAME - SNAPSHOTS_SUFFIX.len();
/// What [`NatsConfig::with_prefix`] appends to the prefix to name the snapshot bucket.
const SNAPSHOTS_SUFFIX: &str = "-snapshots";
// The error texts quote it.
const _: () = assert!(MAX_PREFIX == 241);
/// The longest [`NatsConfig::retention`]: 100 years.
pub const MAX_RETENTION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The most messages one pull request of a consumer asks for
/// ([`KvConsumerConfig::batch`], [`SharedConfig::fetch_batch`]): 2^20.
pub const MAX_FETCH_BATCH: usize = 1 << 20;

/// The longest wait of one pull request ([`KvConsumerConfig::fetch_wait`],
/// [`SharedConfig::fetch_wait`]): an hour. A pull that waits ends and the next begins at
/// once, so a longer wait would change nothing but what the server accepts (it refuses
/// waits of about 292 years and more).
pub const MAX_FETCH_WAIT: Duration = Duration::from_secs(3600);

/// Refuses a pull request's size or wait out of `1..=MAX_FETCH_BATCH` and
/// `(0, MAX_FETCH_WAIT]`: the server would refuse every pull, and the consumer would apply
/// nothing while it runs.
fn check_fetch(batch: usize, wait: Duration) -> Result<(), DistError> {
    if batch == 0 || batch > MAX_FETCH_BATCH || wait.is_zero() || wait > MAX_FETCH_WAIT {
        return Err(DistError::Config(
            "fetch batch must be in 1..=MAX_FETCH_BATCH (2^20) and fetch_wait positive and \
             at most MAX_FETCH_WAIT (an hour)",
        ));
    }
    Ok(())
}

/// A subject token, stream or bucket name the server takes: non-empty `[A-Za-z0-9_-]`.
fn token_ok(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Where the NATS server is and how the client and the streams behave.
///
/// ```
/// use kvtrie::blocks::WorkerId;
/// use kvtrie::dist::NatsConfig;
/// let cfg = NatsConfig::new("nats://127.0.0.1:4222");
/// assert_eq!(cfg.retention, std::time::Duration::from_secs(3600));
/// assert_eq!(cfg.kv_subject(WorkerId::new(7, 2)), "kvtrie.kv.7.2");
/// assert_eq!(cfg.routes_subject(), "kvtrie.routes");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NatsConfig {
    /// Server address(es), e.g. `nats://127.0.0.1:4222`; comma-separated for a cluster
    /// (`nats://a:4222,nats://b:4222`).
    pub url: String,
    /// The client's connection name (shows in the server's monitoring).
    pub client_name: String,
    /// First token of every subject (default `kvtrie`).
    pub subject_prefix: String,
    /// Name of the KV-event stream (default `KVTRIE_KV`; at most [`MAX_STREAM_NAME`] chars).
    pub kv_stream: String,
    /// Name of the routing-decision stream (default `KVTRIE_ROUTES`; at most
    /// [`MAX_STREAM_NAME`] chars).
    pub routes_stream: String,
    /// Object-store bucket for snapshots (default `kvtrie-snapshots`; at most
    /// [`MAX_BUCKET_NAME`] chars).
    pub snapshot_bucket: String,
    /// How long the streams keep messages (and the bucket its snapshots): default 1 hour, at
    /// least 1 s, at most [`MAX_RETENTION`].
    pub retention: Duration,
    /// Timeout of one connection attempt (default 2 s).
    pub connect_timeout: Duration,
    /// First reconnect delay; it doubles per failed attempt (default 10 ms).
    pub reconnect_base: Duration,
    /// Longest reconnect delay (default 2 s).
    pub reconnect_max: Duration,
    /// Timeout of one JetStream request or publish ack (default 2 s).
    pub op_timeout: Duration,
}

impl NatsConfig {
    /// The defaults, for the server(s) at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            client_name: "kvtrie".into(),
            subject_prefix: "kvtrie".into(),
            kv_stream: "KVTRIE_KV".into(),
            routes_stream: "KVTRIE_ROUTES".into(),
            snapshot_bucket: "kvtrie-snapshots".into(),
            retention: Duration::from_secs(3600),
            connect_timeout: Duration::from_secs(2),
            reconnect_base: Duration::from_millis(10),
            reconnect_max: Duration::from_secs(2),
            op_timeout: Duration::from_secs(2),
        }
    }

    /// These settings with every name made from `prefix`: the subjects' first token, the
    /// streams `<prefix>_KV` and `<prefix>_ROUTES` and the snapshot bucket
    /// `<prefix>-snapshots`, so that deployments with different prefixes share nothing on one
    /// server (names are case-sensitive). The default prefix, `kvtrie`, keeps the default
    /// names (`KVTRIE_KV`, `KVTRIE_ROUTES`, `kvtrie-snapshots`).
    ///
    /// # Errors
    ///
    /// [`DistError::Config`] if `prefix` is not one non-empty token of `[A-Za-z0-9_-]` or is
    /// longer than [`MAX_PREFIX`] (241) chars (the server would refuse the names made from
    /// it), or is `KVTRIE` (its streams would be the default prefix's).
    ///
    /// ```
    /// use kvtrie::dist::NatsConfig;
    /// let cfg = NatsConfig::new("nats://127.0.0.1:4222").with_prefix("llama-70b").unwrap();
    /// assert_eq!(cfg.routes_subject(), "llama-70b.routes");
    /// assert_eq!(cfg.kv_stream, "llama-70b_KV");
    /// assert_eq!(cfg.routes_stream, "llama-70b_ROUTES");
    /// assert_eq!(cfg.snapshot_bucket, "llama-70b-snapshots");
    /// assert!(NatsConfig::new("nats://127.0.0.1:4222").with_prefix("a.b").is_err());
    /// ```
    pub fn with_prefix(mut self, prefix: &str) -> Result<Self, DistError> {
        if !token_ok(prefix) {
            return Err(DistError::Config(
                "subject_prefix must be one non-empty token of [A-Za-z0-9_-]",
            ));
        }
        if prefix == "KVTRIE" {
            // `KVTRIE_KV` and `KVTRIE_ROUTES` are the default prefix's streams (for subjects
            // `kvtrie.*`): the server would refuse one of the two deployments' streams.
            return Err(DistError::Config(
                "subject_prefix KVTRIE would name its streams as the default prefix, kvtrie, \
                 names its own",
            ));
        }
        if prefix.len() > MAX_PREFIX {
            return Err(DistError::Config(
                "subject_prefix must be at most 241 chars (the streams and the snapshot bucket \
                 named after it must fit the server's limits)",
            ));
        }
        if prefix != self.subject_prefix {
            self.subject_prefix = prefix.to_owned();
            self.kv_stream = format!("{prefix}_KV");
            self.routes_stream = format!("{prefix}_ROUTES");
            self.snapshot_bucket = format!("{prefix}{SNAPSHOTS_SUFFIX}");
        }
        Ok(self)
    }

    /// The subject of `worker`'s KV events: `<prefix>.kv.<engine>.<dp rank>`.
    pub fn kv_subject(&self, worker: WorkerId) -> String {
        format!(
            "{}.kv.{}.{}",
            self.subject_prefix,
            worker.engine(),
            worker.dp_rank()
        )
    }

    /// The subject routing decisions are published to: `<prefix>.routes`.
    pub fn routes_subject(&self) -> String {
        format!("{}.routes", self.subject_prefix)
    }

    fn kv_subjects(&self) -> String {
        format!("{}.kv.>", self.subject_prefix)
    }

    /// The subjects the stream called `stream` captures (one of the two configured streams).
    fn subjects_of(&self, stream: &str) -> String {
        if stream == self.kv_stream {
            self.kv_subjects()
        } else {
            self.routes_subject()
        }
    }

    /// The server addresses in [`url`](Self::url): split at commas, trimmed, empty ones left
    /// out.
    pub fn servers(&self) -> Vec<&str> {
        self.url
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect()
    }

    /// Checks names and durations.
    ///
    /// # Errors
    ///
    /// [`DistError::Config`] naming the bad field.
    pub fn validate(&self) -> Result<(), DistError> {
        if self.servers().is_empty() {
            return Err(DistError::Config("url names no server"));
        }
        if !token_ok(&self.subject_prefix) {
            return Err(DistError::Config(
                "subject_prefix must be one non-empty token of [A-Za-z0-9_-]",
            ));
        }
        if !token_ok(&self.kv_stream) || !token_ok(&self.routes_stream) {
            return Err(DistError::Config(
                "stream names must be non-empty [A-Za-z0-9_-]",
            ));
        }
        if self.kv_stream.len().max(self.routes_stream.len()) > MAX_STREAM_NAME {
            // The server refuses longer names: nothing would ever be published.
            return Err(DistError::Config(
                "stream names must be at most 255 chars (the server's limit)",
            ));
        }
        if self.kv_stream == self.routes_stream {
            // One stream cannot capture both subject sets under one name's configuration.
            return Err(DistError::Config("kv_stream and routes_stream must differ"));
        }
        if !token_ok(&self.snapshot_bucket) {
            return Err(DistError::Config(
                "snapshot_bucket must be non-empty [A-Za-z0-9_-]",
            ));
        }
        if self.snapshot_bucket.len() > MAX_BUCKET_NAME {
            return Err(DistError::Config(
                "snapshot_bucket must be at most 251 chars (its stream, OBJ_<bucket>, at most 255)",
            ));
        }
        if self.op_timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(DistError::Config(
                "op_timeout and connect_timeout must be positive",
            ));
        }
        if self.retention < Duration::from_secs(1) {
            // The server refuses stream ages under 100 ms, and snapshots are refreshed every
            // half retention.
            return Err(DistError::Config("retention must be at least 1 s"));
        }
        if self.retention > MAX_RETENTION {
            // The server keeps ages in signed nanoseconds; past that, it never made the stream.
            return Err(DistError::Config("retention must be at most 100 years"));
        }
        if self.reconnect_base.is_zero() || self.reconnect_max < self.reconnect_base {
            return Err(DistError::Config(
                "reconnect_base must be positive and at most reconnect_max",
            ));
        }
        Ok(())
    }
}

/// Why a `dist` facade could not start.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DistError {
    /// A configuration value is invalid.
    Config(&'static str),
    /// The router's own configuration is invalid.
    Router(ConfigError),
    /// The NATS address is invalid (an unreachable server is not an error: the client keeps
    /// trying in the background).
    Connect(String),
    /// The background runtime or thread could not be created.
    Runtime(String),
}

impl fmt::Display for DistError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DistError::Config(m) => write!(f, "invalid configuration: {m}"),
            DistError::Router(e) => write!(f, "invalid configuration: {e}"),
            DistError::Connect(m) => write!(f, "cannot connect to NATS: {m}"),
            DistError::Runtime(m) => write!(f, "cannot start the background runtime: {m}"),
        }
    }
}

impl std::error::Error for DistError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DistError::Router(e) => Some(e),
            _ => None,
        }
    }
}

/// Creates (or finds) a stream with the configured retention.
async fn ensure_stream(
    js: &async_nats::jetstream::Context,
    cfg: &NatsConfig,
    name: &str,
    subject: String,
) -> Result<async_nats::jetstream::stream::Stream, String> {
    use async_nats::jetstream::stream;
    let s = js
        .get_or_create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![subject.clone()],
            max_age: cfg.retention,
            storage: stream::StorageType::File,
            duplicate_window: Duration::from_secs(120).min(cfg.retention),
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    check_subjects(s.cached_info(), &subject)?;
    Ok(s)
}

/// Refuses a stream made for other subjects than `subject`: another deployment's stream of
/// the same name (its `subject_prefix` under the default stream names). Reading it would
/// apply the other deployment's messages (or load its snapshots), and publishes to ours would
/// never be acknowledged.
fn check_subjects(info: &async_nats::jetstream::stream::Info, subject: &str) -> Result<(), String> {
    let subjects = &info.config.subjects;
    if subjects.iter().any(|s| s == subject) {
        return Ok(());
    }
    Err(format!(
        "stream {} exists for subjects {subjects:?}, not {subject:?}: give this deployment \
         its own stream names",
        info.config.name
    ))
}

/// Whether the stream a reader re-attaches to (identity `now`, see `warm::stream_id`) is not
/// the one it applied through sequence `applied`: another than the one it last attached to
/// (`known`; e.g. a server restarted without its store), or holding fewer messages than were
/// applied. Its sequence numbers start again at 1 then, and a reader resuming after `applied`
/// would skip the new stream's first messages. The caller records `now` as known once it has
/// acted on the answer.
fn stream_replaced(now: &str, last_sequence: u64, known: Option<&str>, applied: u64) -> bool {
    known.is_some_and(|k| k != now) || applied > last_sequence
}

/// A random-enough 64-bit id for a relay or router (time, process id, a counter), never 0.
fn new_id() -> u64 {
    use crate::sync::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&t.to_le_bytes());
    h.update(&std::process::id().to_le_bytes());
    h.update(&NEXT.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    h.digest().max(1)
}

/// Milliseconds since the Unix epoch.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Every name made from the longest prefix fits the server's limits (so `validate`
    /// passes), and a prefix one char longer is refused by `with_prefix` itself; the default
    /// prefix keeps the default names.
    #[test]
    fn names_made_from_a_prefix_fit_the_servers_limits() {
        let base = NatsConfig::new("nats://127.0.0.1:4222");
        let longest = base.clone().with_prefix(&"p".repeat(MAX_PREFIX)).unwrap();
        assert_eq!(longest.validate(), Ok(()));
        assert_eq!(longest.snapshot_bucket.len(), MAX_BUCKET_NAME);
        assert!(longest.kv_stream.len() <= MAX_STREAM_NAME);
        assert!(base
            .clone()
            .with_prefix(&"p".repeat(MAX_PREFIX + 1))
            .is_err_and(|e| e.to_string().contains("at most 241")));
        for bad in ["", "a.b", "a b", "é", "KVTRIE"] {
            assert!(base.clone().with_prefix(bad).is_err(), "{bad:?}");
        }
        assert_eq!(base.clone().with_prefix("kvtrie"), Ok(base.clone()));
        let other = base.with_prefix("blue").unwrap();
        assert_eq!(
            (other.kv_stream.as_str(), other.routes_subject().as_str()),
            ("blue_KV", "blue.routes")
        );
    }

    /// The bounds are inclusive: a retention of exactly 1 s is accepted, a nanosecond less is
    /// not.
    #[test]
    fn a_retention_of_exactly_one_second_is_accepted() {
        let mut cfg = NatsConfig::new("nats://127.0.0.1:4222");
        cfg.retention = Duration::from_secs(1);
        assert_eq!(cfg.validate(), Ok(()));
        cfg.retention = Duration::from_secs(1) - Duration::from_nanos(1);
        assert_eq!(
            cfg.validate(),
            Err(DistError::Config("retention must be at least 1 s"))
        );
    }

    /// A reconnect delay that does not grow (`reconnect_max` equal to `reconnect_base`) is
    /// accepted; a `reconnect_max` below the base is not.
    #[test]
    fn a_reconnect_max_equal_to_the_base_is_accepted() {
        let mut cfg = NatsConfig::new("nats://127.0.0.1:4222");
        cfg.reconnect_max = cfg.reconnect_base;
        assert_eq!(cfg.validate(), Ok(()));
        cfg.reconnect_max = cfg.reconnect_base - Duration::from_nanos(1);
        assert_eq!(
            cfg.validate(),
            Err(DistError::Config(
                "reconnect_base must be positive and at most reconnect_max"
            ))
        );
    }
}

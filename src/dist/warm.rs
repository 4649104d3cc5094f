//! Warm starts: snapshots in the JetStream object store, tagged with the stream sequence they
//! cover, and the newest one loaded by a starting router.
//!
//! An object is named `<kind>-<sequence, 20 digits>-<writer id, 16 hex digits>` (so names sort
//! by sequence) and carries the same facts as metadata (`kvtrie-kind`, `kvtrie-seq`). The
//! sequence is read before the snapshot is taken, and a snapshot holds everything applied
//! before it began, so it covers the stream up to that sequence (and maybe a little more:
//! re-applying a decision is harmless). Each writer deletes its own older snapshots; the
//! bucket's max age ([`NatsConfig::retention`]) removes what writers that died left behind.
//!
//! A sequence means something only in the stream it counts: a server restarted without its
//! store numbers a new stream from 1 again, and a snapshot tagged with the old stream's
//! (larger) sequence would make a loader skip the new stream's first messages. So each object
//! also carries the creation time of the stream its sequence counts (`kvtrie-stream`): a
//! writer stores a snapshot only for the stream it applied (the one still there, not past its
//! last sequence), and a loader takes only snapshots of the stream that is there now, at most
//! at its last sequence (snapshots written before this tag existed: by sequence alone).

use super::runtime::{connect, jetstream, Link};
use super::{check_subjects, DistError, NatsConfig};
use crate::blocks::BlockIndex;
use crate::snapshot::SnapshotError;
use crate::sync::os::thread;
use crate::tenant::TenantId;
use crate::tree::PrefixTree;
use async_nats::jetstream::object_store::{self, ObjectMetadata, ObjectStore};
use async_nats::jetstream::Context;
use futures_util::StreamExt;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncReadExt;

/// A structure that can be stored in and restored from the snapshot bucket. Implemented by
/// [`PrefixTree`]; a [`BlockIndex`](crate::blocks::BlockIndex) implementation needs only its
/// `write_snapshot` / `read_snapshot` pair.
pub trait Snapshottable: Sized + Send + Sync + 'static {
    /// The object-name prefix of this kind (`tree`, `index`).
    const KIND: &'static str;
    /// The stream whose sequences tag this kind's snapshots.
    fn stream(cfg: &NatsConfig) -> &str;
    /// Appends a snapshot of `self` to `out`.
    ///
    /// # Errors
    ///
    /// Whatever the structure's writer reports.
    fn write_to(&self, out: &mut Vec<u8>) -> Result<(), SnapshotError>;
    /// Restores a structure from snapshot bytes.
    ///
    /// # Errors
    ///
    /// Whatever the structure's reader reports for malformed input.
    fn read_from(bytes: &[u8]) -> Result<Self, SnapshotError>;
    /// Called on a restored structure with the milliseconds since its snapshot was written
    /// (0 if unknown): a structure with a clock moves it on by that much. Nothing by default.
    fn resume_after(&mut self, _ms: u64) {}
}

impl Snapshottable for PrefixTree {
    const KIND: &'static str = "tree";
    fn stream(cfg: &NatsConfig) -> &str {
        &cfg.routes_stream
    }
    fn write_to(&self, out: &mut Vec<u8>) -> Result<(), SnapshotError> {
        self.write_snapshot(out).map(|_| ())
    }
    fn read_from(bytes: &[u8]) -> Result<Self, SnapshotError> {
        PrefixTree::read_snapshot(bytes)
    }
    /// A restored tree resumes at the clock its snapshot recorded; the time since it was
    /// written is added, so that what is inserted afterwards counts as newer than everything
    /// it holds by as much as it is.
    fn resume_after(&mut self, ms: u64) {
        self.advance_clock(ms);
    }
}

impl Snapshottable for BlockIndex {
    const KIND: &'static str = "index";
    fn stream(cfg: &NatsConfig) -> &str {
        &cfg.kv_stream
    }
    fn write_to(&self, out: &mut Vec<u8>) -> Result<(), SnapshotError> {
        self.write_snapshot(out).map(|_| ())
    }
    fn read_from(bytes: &[u8]) -> Result<Self, SnapshotError> {
        BlockIndex::read_snapshot(bytes)
    }
}

/// A stored snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// The object's name.
    pub name: String,
    /// The stream sequence it covers.
    pub seq: u64,
    /// Its size in bytes.
    pub bytes: usize,
    /// The identity of the stream `seq` counts (its creation time, as text): give it to a
    /// reader that resumes after `seq` ([`KvConsumerConfig::applied_stream`]), so that it
    /// notices if that stream is replaced before it attaches.
    ///
    /// [`KvConsumerConfig::applied_stream`]: super::KvConsumerConfig::applied_stream
    pub stream: String,
    /// When the snapshot was written (Unix milliseconds, the writer's clock), if it says. A
    /// tree loaded from the bucket has had the time since added to its clock already
    /// ([`Snapshottable::resume_after`]).
    pub written_unix_ms: Option<u64>,
}

/// The metadata key of the creation time of the stream a snapshot's sequence counts.
const STREAM_KEY: &str = "kvtrie-stream";
/// The metadata key of the time a snapshot was written (Unix milliseconds).
const WRITTEN_KEY: &str = "kvtrie-written-ms";

/// The identity of stream `name` of `cfg` as snapshots record it (its creation time, as
/// text) and its last sequence; an error for a stream made for other subjects (see
/// `check_subjects`).
pub(crate) async fn stream_identity(
    js: &Context,
    cfg: &NatsConfig,
    name: &str,
) -> Result<(String, u64), String> {
    // `get_stream` asks the server for the stream's info: one round trip.
    let stream = js.get_stream(name).await.map_err(|e| e.to_string())?;
    let info = stream.cached_info();
    check_subjects(info, &cfg.subjects_of(name))?;
    Ok((stream_id(info), info.state.last_sequence))
}

/// How snapshots name the stream described by `info`: its creation time, as text.
pub(crate) fn stream_id(info: &async_nats::jetstream::stream::Info) -> String {
    info.created.to_string()
}

fn object_name(kind: &str, seq: u64, writer: u64) -> String {
    format!("{kind}-{seq:020}-{writer:016x}")
}

/// `(seq, writer)` of an object name of `kind`.
fn parse_name(kind: &str, name: &str) -> Option<(u64, u64)> {
    let rest = name.strip_prefix(kind)?.strip_prefix('-')?;
    let (seq, writer) = rest.split_once('-')?;
    if seq.len() != 20 || writer.len() != 16 {
        return None;
    }
    Some((seq.parse().ok()?, u64::from_str_radix(writer, 16).ok()?))
}

async fn bucket(js: &Context, cfg: &NatsConfig, create: bool) -> Result<ObjectStore, String> {
    match js.get_object_store(&cfg.snapshot_bucket).await {
        Ok(b) => Ok(b),
        Err(e) if !create => Err(e.to_string()),
        Err(_) => js
            .create_object_store(object_store::Config {
                bucket: cfg.snapshot_bucket.clone(),
                description: Some("kvtrie snapshots".into()),
                max_age: cfg.retention,
                storage: async_nats::jetstream::stream::StorageType::File,
                ..Default::default()
            })
            .await
            .map_err(|e| e.to_string()),
    }
}

/// Writes a snapshot of `item` (covering the stream whose identity is `stream`, see
/// [`stream_id`], through `seq`) to the bucket, then deletes `writer`'s older snapshots of the
/// same kind and those of other streams. Fails without writing if that stream is no longer the
/// one there (replaced by a server that lost its store) or is shorter than `seq`.
pub(crate) async fn store<T: Snapshottable>(
    js: &Context,
    cfg: &NatsConfig,
    item: Arc<T>,
    seq: u64,
    writer: u64,
    stream: &str,
) -> Result<SnapshotInfo, String> {
    // Before the write: the tree's clock it records is read after this.
    let written = super::unix_ms();
    let bytes = tokio::task::spawn_blocking(move || {
        let mut v = Vec::new();
        item.write_to(&mut v).map(|_| v)
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| e.to_string())?;
    // Only for the stream that was applied, if it is still the one there.
    let (now, last) = stream_identity(js, cfg, T::stream(cfg)).await?;
    if now != stream || seq > last {
        return Err(format!(
            "stream {} was replaced since sequence {seq} was applied",
            T::stream(cfg)
        ));
    }
    let b = bucket(js, cfg, true).await?;
    let name = object_name(T::KIND, seq, writer);
    let meta = ObjectMetadata {
        name: name.clone(),
        description: Some(format!("kvtrie {} snapshot", T::KIND)),
        metadata: HashMap::from([
            ("kvtrie-kind".to_owned(), T::KIND.to_owned()),
            ("kvtrie-seq".to_owned(), seq.to_string()),
            (STREAM_KEY.to_owned(), stream.to_owned()),
            (WRITTEN_KEY.to_owned(), written.to_string()),
        ]),
        ..Default::default()
    };
    b.put(meta, &mut &bytes[..])
        .await
        .map_err(|e| e.to_string())?;
    // Prune this writer's older snapshots (best effort).
    if let Ok(mut list) = b.list().await {
        let mut old = Vec::new();
        while let Some(Ok(o)) = list.next().await {
            if let Some((s, w)) = parse_name(T::KIND, &o.name) {
                let other_stream = o.metadata.get(STREAM_KEY).is_some_and(|x| x != stream);
                if w == writer && (s < seq || other_stream) {
                    old.push(o.name);
                }
            }
        }
        for n in old {
            let _ = b.delete(&n).await;
        }
    }
    Ok(SnapshotInfo {
        name,
        seq,
        bytes: bytes.len(),
        stream: stream.to_owned(),
        written_unix_ms: Some(written),
    })
}

/// Snapshots [`load_latest`] tries, newest first, before it gives up.
const LOAD_CANDIDATES: usize = 4;

/// The snapshots [`load_latest`] passed over as unreadable: how many, and why the newest of
/// them could not be read.
#[derive(Debug, Default)]
pub(crate) struct Unreadable {
    pub(crate) count: u64,
    pub(crate) first_error: Option<String>,
}

/// The newest snapshot of kind `T` (highest sequence) that can be read, restored; `None` if
/// there is none. Objects larger than `max_bytes` are not read. A newer snapshot that cannot
/// be read or restored (damaged, a stray object under a snapshot's name; each is tried twice,
/// 100 ms apart) is passed over for the next newest, at most [`LOAD_CANDIDATES`] in all, and
/// counted in `unreadable` (with the newest one's error); when every one tried fails, that
/// error is returned.
pub(crate) async fn load_latest<T: Snapshottable>(
    js: &Context,
    cfg: &NatsConfig,
    max_bytes: usize,
    unreadable: &mut Unreadable,
) -> Result<Option<(T, SnapshotInfo)>, String> {
    let b = match bucket(js, cfg, false).await {
        Ok(b) => b,
        // No bucket yet: nothing was ever stored.
        Err(e) if e.contains("not found") => return Ok(None),
        Err(e) => return Err(e),
    };
    // Only snapshots of the stream there now, at most at its last sequence.
    let (now, last) = match stream_identity(js, cfg, T::stream(cfg)).await {
        Ok(x) => x,
        Err(e) if e.contains("not found") => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut found: Vec<(u64, String, usize, Option<u64>)> = Vec::new();
    let mut list = b.list().await.map_err(|e| e.to_string())?;
    while let Some(o) = list.next().await {
        let o = o.map_err(|e| e.to_string())?;
        if let Some((seq, _)) = parse_name(T::KIND, &o.name) {
            let same_stream = o.metadata.get(STREAM_KEY).is_none_or(|s| *s == now);
            if same_stream && seq <= last && o.size <= max_bytes {
                let written = o.metadata.get(WRITTEN_KEY).and_then(|w| w.parse().ok());
                found.push((seq, o.name, o.size, written));
            }
        }
    }
    // Newest first (the name breaks ties, so every reader tries the same order).
    found.sort_unstable_by(|a, b| (b.0, &b.1).cmp(&(a.0, &a.1)));
    for (seq, name, size, written) in found.into_iter().take(LOAD_CANDIDATES) {
        // Twice: a writer that refreshes a snapshot rewrites the object under its name, and
        // a read at that moment fails.
        let mut read = read_one::<T>(&b, seq, name.clone(), size, written, max_bytes, &now).await;
        if read.is_err() {
            tokio::time::sleep(Duration::from_millis(100)).await;
            read = read_one::<T>(&b, seq, name, size, written, max_bytes, &now).await;
        }
        match read {
            Ok(x) => return Ok(Some(x)),
            Err(e) => {
                unreadable.count += 1;
                unreadable.first_error.get_or_insert(e);
            }
        }
    }
    match &unreadable.first_error {
        Some(e) => Err(e.clone()),
        None => Ok(None),
    }
}

/// Reads and restores snapshot `name` (see [`load_latest`]).
async fn read_one<T: Snapshottable>(
    b: &ObjectStore,
    seq: u64,
    name: String,
    size: usize,
    written_unix_ms: Option<u64>,
    max_bytes: usize,
    now: &str,
) -> Result<(T, SnapshotInfo), String> {
    let mut obj = b.get(&name).await.map_err(|e| e.to_string())?;
    // The size is the server's word: reserve at most 64 MiB ahead of the bytes read.
    let mut bytes = Vec::with_capacity(size.min(64 << 20));
    (&mut obj)
        .take((max_bytes as u64).saturating_add(1))
        .read_to_end(&mut bytes)
        .await
        .map_err(|e| e.to_string())?;
    if bytes.len() > max_bytes {
        return Err(format!("snapshot {name} is larger than {max_bytes} bytes"));
    }
    let n = bytes.len();
    let mut item = tokio::task::spawn_blocking(move || T::read_from(&bytes))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("snapshot {name}: {e}"))?;
    // The time since it was written, on this machine's clock (0 if behind the writer's).
    item.resume_after(written_unix_ms.map_or(0, |w| super::unix_ms().saturating_sub(w)));
    Ok((
        item,
        SnapshotInfo {
            name,
            seq,
            bytes: n,
            stream: now.to_owned(),
            written_unix_ms,
        },
    ))
}

/// Loads the newest snapshot of kind `T` from the bucket of `cfg` (blocking, at most
/// `timeout`): the structure and the stream sequence it covers, or `None` if there is none.
/// For a consumer that restores its own structure, e.g. a
/// [`KvConsumer`](super::KvConsumer) started with `applied_through = info.seq`.
///
/// It runs its own small runtime on a thread of its own, so it may be called from async code
/// (inside a tokio runtime) as well; it blocks the calling thread meanwhile, so an async
/// caller that must not stall its executor calls it through `spawn_blocking`.
///
/// # Errors
///
/// [`DistError::Connect`] if no server can be reached (at once, without waiting out
/// `timeout`), the snapshot does not arrive in time or cannot be read (the message says
/// which).
pub fn latest_snapshot<T: Snapshottable>(
    cfg: &NatsConfig,
    timeout: Duration,
) -> Result<Option<(T, SnapshotInfo)>, DistError> {
    cfg.validate()?;
    let load = || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| DistError::Runtime(e.to_string()))?;
        rt.block_on(async {
            let link = Arc::new(Link::default());
            let fut = async {
                let client = connect(cfg, link.clone()).await?;
                let js = jetstream(cfg, client);
                load_latest::<T>(&js, cfg, usize::MAX, &mut Unreadable::default())
                    .await
                    .map_err(DistError::Connect)
            };
            tokio::select! {
                r = tokio::time::timeout(timeout, fut) => {
                    r.unwrap_or_else(|_| Err(DistError::Connect("timed out".into())))
                }
                () = link.unreachable_at_start() => Err(DistError::Connect(format!(
                    "no server reachable ({})",
                    link.last_error.get().unwrap_or_default()
                ))),
            }
        })
    };
    // On a thread of its own: a runtime cannot be started (`block_on`) or dropped on a
    // thread that drives another one, and the caller may be a task of an async runtime.
    thread::scope(|s| {
        thread::Builder::new()
            .name("kvtrie-snapshot-load".into())
            .spawn_scoped(s, load)
            .map_err(|e| DistError::Runtime(e.to_string()))?
            .join()
            .unwrap_or_else(|_| Err(DistError::Runtime("the snapshot loader panicked".into())))
    })
}

/// Merges `src` into `dst`: every prefix a tenant owns in `src` is inserted for the tenant
/// of the same name in `dst` (tenants `dst` does not have are skipped), with its age kept
/// (times are converted between the two trees' clocks). A node is inserted when the tenant's
/// time there is later than at every child it owns (a leaf of the tenant, or an inner node a
/// shorter prompt reached later): the others get their times from the nodes below them.
/// Returns the prefixes inserted.
pub(crate) fn merge_tree(dst: &PrefixTree, src: &PrefixTree) -> usize {
    let snap = src.snapshot();
    let (src_now, dst_now) = (src.now(), dst.now());
    let map: HashMap<_, _> = src
        .tenants()
        .into_iter()
        .filter_map(|t| {
            let name = src.tenant_name(t)?;
            Some((t, dst.tenant_id(&name)?))
        })
        .collect();
    let mut inserted = 0;
    let mut path = String::new();
    // (node, length of `path` before the node's edge)
    let mut stack = vec![(&snap, 0usize)];
    // The children's (tenant, time) pairs of the node at hand, sorted.
    let mut below: Vec<(TenantId, u64)> = Vec::new();
    while let Some((node, base)) = stack.pop() {
        path.truncate(base);
        path.push_str(&node.text);
        // The root's owners are every tenant; its edge is empty, nothing to insert.
        if !path.is_empty() {
            below.clear();
            below.extend(node.children.iter().flat_map(|c| c.tenants.iter().copied()));
            below.sort_unstable();
            for &(t, ts) in &node.tenants {
                // The tenant's latest time among the children it owns: the last of its pairs.
                let end = below.partition_point(|&(u, _)| u <= t);
                if end > 0 && below[end - 1].0 == t && below[end - 1].1 >= ts {
                    continue;
                }
                if let Some(&d) = map.get(&t) {
                    let ts = dst_now.saturating_sub(src_now.saturating_sub(ts));
                    if dst.insert_at(&path, d, ts).is_ok() {
                        inserted += 1;
                    }
                }
            }
        }
        let len = path.len();
        for c in node.children.iter().rev() {
            stack.push((c, len));
        }
    }
    // A peer's tree may be deeper than this thread's stack would take a recursive drop of.
    snap.drop_flat();
    inserted
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A merged tree keeps every node's age: an inner node whose time is later than its
    /// children's (a shorter prompt routed later) keeps it (inserting leaves only gave it
    /// theirs), so the merged tree evicts in the source's order.
    #[test]
    fn merge_keeps_inner_node_times() {
        // Times in the past of both clocks (ages are what the merge converts).
        let mut src = PrefixTree::new();
        src.advance_clock(1_000);
        let a = src.add_tenant("r0");
        src.insert_at("hello world", a, 10).unwrap();
        src.insert_at("hello", a, 20).unwrap();
        src.insert_at("help me", a, 15).unwrap();
        let mut dst = PrefixTree::new();
        dst.advance_clock(1_000);
        let b = dst.add_tenant("r0");
        dst.add_tenant("other");
        // The two leaves, and "lo", later than its child " world".
        assert_eq!(merge_tree(&dst, &src), 3);
        dst.check_invariants().unwrap();
        for n in ["hello world", "hello", "help me"] {
            assert_eq!(dst.prefix_match(n, Some(&[b])).matched_chars, n.len());
        }
        // Ages kept: " world" (10) goes first, then "p me" (15), then "hel" + "lo".
        for want in [6, 4, 5] {
            assert_eq!(dst.evict_tenant_by_lru(b, 1), want);
            assert_eq!(src.evict_tenant_by_lru(a, 1), want);
        }
        assert_eq!(dst.char_count(b), Some(0));
    }

    #[test]
    fn names_sort_and_parse() {
        let a = object_name("tree", 9, 0xabc);
        let b = object_name("tree", 10, 0x1);
        assert!(a < b);
        assert_eq!(parse_name("tree", &a), Some((9, 0xabc)));
        assert_eq!(parse_name("index", &a), None);
        assert_eq!(parse_name("tree", "tree-12-zz"), None);
    }

    /// Only names of the documented shape parse: `<kind>-<20 digits>-<16 hex digits>`. An
    /// object whose writer part is shorter or longer is not a snapshot of this kind.
    #[test]
    fn names_with_a_writer_of_another_width_do_not_parse() {
        let seq = format!("{:020}", 9);
        assert_eq!(
            parse_name("tree", &format!("tree-{seq}-{:016x}", 0xabc)),
            Some((9, 0xabc))
        );
        for writer in ["abc", "000000000000abc", "00000000000000abc"] {
            assert_eq!(
                parse_name("tree", &format!("tree-{seq}-{writer}")),
                None,
                "{writer}"
            );
        }
    }

    /// A merge keeps each prefix's age, whatever the two trees' clocks: a source far behind
    /// the destination's clock gives its prefixes the destination's time less their age, so
    /// they take their place among the destination's own prefixes by age.
    #[test]
    fn merge_converts_times_between_clocks() {
        let mut src = PrefixTree::new();
        src.advance_clock(1_000);
        let a = src.add_tenant("r0");
        // Ages 100 (6 chars) and 900 (2 chars) in the source.
        src.insert_at("young!", a, 900).unwrap();
        src.insert_at("ol", a, 100).unwrap();
        let mut dst = PrefixTree::new();
        dst.advance_clock(1_000_000);
        let b = dst.add_tenant("r0");
        // Age 500 (4 chars) in the destination: between the two.
        dst.insert_at("mid!", b, 999_500).unwrap();
        assert_eq!(merge_tree(&dst, &src), 2);
        dst.check_invariants().unwrap();
        // Oldest first: "ol" (900), "mid!" (500), "young!" (100).
        for want in [2, 4, 6] {
            assert_eq!(dst.evict_tenant_by_lru(b, 1), want);
        }
    }

    #[test]
    fn merge_keeps_every_owned_prefix() {
        let src = PrefixTree::new();
        let (a, b) = (src.add_tenant("a"), src.add_tenant("b"));
        src.insert_at("hello world", a, 1).unwrap();
        src.insert_at("hello there", b, 2).unwrap();
        src.insert_at("hello", a, 3).unwrap();
        src.insert_at("bye", b, 4).unwrap();
        let dst = PrefixTree::new();
        let da = dst.add_tenant("a");
        let db = dst.add_tenant("b");
        dst.insert_at("other", da, 0).unwrap();
        merge_tree(&dst, &src);
        dst.check_invariants().unwrap();
        assert_eq!(dst.char_count(da), Some(11 + 5));
        assert_eq!(dst.char_count(db), Some(11 + 3));
        let m = dst.prefix_match("hello wo", Some(&[da]));
        assert_eq!(m.matched_chars, 8);
    }
}

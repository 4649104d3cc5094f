//! Binary snapshots of a [`PrefixTree`](crate::PrefixTree) and a
//! [`BlockIndex`](crate::BlockIndex): save a structure while it is in use, restore it in a new
//! process (warm restarts), faster than replaying what built it.
//!
//! ```
//! use kvtrie::PrefixTree;
//!
//! let tree = PrefixTree::new();
//! let a = tree.add_tenant("replica-a");
//! tree.insert_at("You are a helpful assistant.", a, 7).unwrap();
//! let mut bytes = Vec::new();
//! tree.write_snapshot(&mut bytes).unwrap();
//! let restored = PrefixTree::read_snapshot(&bytes[..]).unwrap();
//! assert_eq!(restored.snapshot(), tree.snapshot());
//! assert_eq!(restored.prefix_match("You are", None).matched_chars, 7);
//! ```
//!
//! # Format (version 2)
//!
//! All integers are little-endian. A snapshot is a header, a sequence of length-prefixed
//! records, and a trailer:
//!
//! | part | bytes |
//! |---|---|
//! | magic | `b"KVTRIESN"` (8) |
//! | format version | `u16` (2; version 1 is read too) |
//! | kind | `u8`: 1 = prefix tree, 2 = block index |
//! | crate version | `u8` length, then that many bytes of UTF-8 (the writer's `kvtrie` version) |
//! | records | each: tag `u8`, length `u32`, then `length` bytes of payload |
//! | end record | tag 0, length 8, payload: the number of records before it (`u64`) |
//! | checksum | `u64`: xxh3-64 (seed 0) of every byte before it |
//!
//! The payloads of each kind are documented with the structure (`PrefixTree::write_snapshot`,
//! `BlockIndex::write_snapshot`). A reader checks the magic, version and kind first, reads
//! records one at a time, and checks the record count and the checksum at the end; it never
//! allocates for a length it has not read the bytes of, so a hostile length costs nothing.
//!
//! Snapshots are written streaming to any [`std::io::Write`] and read from any
//! [`std::io::Read`]; neither side builds the whole structure as intermediate data.

use std::fmt;
use std::io::{self, Read, Write};
use xxhash_rust::xxh3::Xxh3;

/// The first eight bytes of every snapshot.
pub const MAGIC: [u8; 8] = *b"KVTRIESN";

/// The format version this crate writes. It reads this one and every earlier one.
///
/// Version 2 adds, to a prefix tree's snapshot, the generation of every tenant slot (see
/// `PrefixTree::write_snapshot`), so that the id of a tenant removed before the snapshot stays
/// stale after a restore; a block index's snapshot is the same in both versions.
pub const FORMAT_VERSION: u16 = 2;

/// The oldest format version this crate reads.
pub const OLDEST_FORMAT_VERSION: u16 = 1;

/// Longest record payload a reader accepts (a record is one node, tenant or worker): all a
/// record's 32-bit length can say, so that any node a tree holds (an edge of up to
/// `MAX_TEXT_BYTES` and every tenant's time) fits one. A reader's memory still grows only
/// with the bytes it has read.
pub const MAX_RECORD: u32 = u32::MAX;

/// What a snapshot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SnapshotKind {
    /// A [`PrefixTree`](crate::PrefixTree).
    PrefixTree,
    /// A [`BlockIndex`](crate::BlockIndex).
    BlockIndex,
}

impl SnapshotKind {
    fn code(self) -> u8 {
        match self {
            SnapshotKind::PrefixTree => 1,
            SnapshotKind::BlockIndex => 2,
        }
    }

    fn from_code(c: u8) -> Option<Self> {
        match c {
            1 => Some(SnapshotKind::PrefixTree),
            2 => Some(SnapshotKind::BlockIndex),
            _ => None,
        }
    }
}

/// Why a snapshot could not be written or restored.
#[derive(Debug)]
#[non_exhaustive]
pub enum SnapshotError {
    /// Reading or writing failed.
    Io(io::Error),
    /// The input does not start with [`MAGIC`]: not a kvtrie snapshot.
    NotASnapshot,
    /// The snapshot's format version is not one this crate reads ([`OLDEST_FORMAT_VERSION`]
    /// to [`FORMAT_VERSION`]).
    UnsupportedVersion {
        /// The version in the snapshot.
        found: u16,
    },
    /// The snapshot holds another structure.
    WrongKind {
        /// What the reader expected.
        expected: SnapshotKind,
        /// What the snapshot says it holds (`None`: an unknown code).
        found: Option<SnapshotKind>,
    },
    /// The input ended early.
    Truncated {
        /// What was being read.
        reading: &'static str,
    },
    /// The checksum at the end does not match the bytes: the snapshot was damaged.
    ChecksumMismatch {
        /// The checksum stored in the snapshot.
        stored: u64,
        /// The checksum of the bytes read.
        computed: u64,
    },
    /// The bytes are well framed but do not describe a valid structure.
    Invalid {
        /// Which record (0-based), if one is to blame.
        record: Option<u64>,
        /// What is wrong.
        reason: String,
    },
}

impl fmt::Display for SnapshotError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SnapshotError::Io(e) => write!(f, "snapshot i/o error: {e}"),
            SnapshotError::NotASnapshot => write!(f, "not a kvtrie snapshot (bad magic)"),
            SnapshotError::UnsupportedVersion { found } => write!(
                f,
                "snapshot format version {found} is not supported (this crate reads versions \
                 {OLDEST_FORMAT_VERSION} to {FORMAT_VERSION})"
            ),
            SnapshotError::WrongKind { expected, found } => match found {
                Some(k) => write!(f, "snapshot holds a {k:?}, not a {expected:?}"),
                None => write!(f, "snapshot holds an unknown kind, not a {expected:?}"),
            },
            SnapshotError::Truncated { reading } => {
                write!(f, "snapshot is truncated (while reading {reading})")
            }
            SnapshotError::ChecksumMismatch { stored, computed } => write!(
                f,
                "snapshot checksum mismatch: stored {stored:#018x}, computed {computed:#018x} \
                 (the snapshot is damaged)"
            ),
            SnapshotError::Invalid {
                record: Some(r),
                reason,
            } => write!(f, "invalid snapshot (record {r}): {reason}"),
            SnapshotError::Invalid {
                record: None,
                reason,
            } => write!(f, "invalid snapshot: {reason}"),
        }
    }
}

impl std::error::Error for SnapshotError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SnapshotError::Io(e) => Some(e),
            _ => None,
        }
    }
}

impl From<io::Error> for SnapshotError {
    fn from(e: io::Error) -> Self {
        SnapshotError::Io(e)
    }
}

/// The end record's tag.
const END: u8 = 0;

/// Writes the framing: header, records, trailer, hashing everything written.
pub(crate) struct SnapshotWriter<W: Write> {
    out: W,
    hash: Xxh3,
    records: u64,
    buf: Vec<u8>,
    bytes: u64,
}

impl<W: Write> SnapshotWriter<W> {
    /// Writes the header of a `kind` snapshot.
    pub(crate) fn new(out: W, kind: SnapshotKind) -> Result<Self, SnapshotError> {
        let mut w = Self {
            out,
            hash: Xxh3::new(),
            records: 0,
            buf: Vec::new(),
            bytes: 0,
        };
        let version = env!("CARGO_PKG_VERSION").as_bytes();
        let mut h = Vec::with_capacity(12 + version.len());
        h.extend_from_slice(&MAGIC);
        h.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        h.push(kind.code());
        h.push(version.len().min(255) as u8);
        h.extend_from_slice(&version[..version.len().min(255)]);
        w.raw(&h)?;
        Ok(w)
    }

    /// The sink, for a writer that buffers and drains it itself.
    pub(crate) fn get_mut(&mut self) -> &mut W {
        &mut self.out
    }

    fn raw(&mut self, b: &[u8]) -> Result<(), SnapshotError> {
        self.hash.update(b);
        self.bytes += b.len() as u64;
        self.out.write_all(b)?;
        Ok(())
    }

    /// Starts a record: the payload is built in [`Self::payload`] and written by
    /// [`Self::end_record`].
    pub(crate) fn payload(&mut self) -> &mut Vec<u8> {
        self.buf.clear();
        &mut self.buf
    }

    /// Writes the record whose payload [`Self::payload`] built, with tag `tag` (not 0).
    pub(crate) fn end_record(&mut self, tag: u8) -> Result<(), SnapshotError> {
        debug_assert_ne!(tag, END);
        // `MAX_RECORD` is all a `u32` holds.
        let len = u32::try_from(self.buf.len())
            .ok()
            .ok_or_else(|| SnapshotError::Invalid {
                record: Some(self.records),
                reason: format!("a record of {} bytes is too long", self.buf.len()),
            })?;
        let mut head = [0u8; 5];
        head[0] = tag;
        head[1..].copy_from_slice(&len.to_le_bytes());
        self.raw(&head)?;
        let buf = std::mem::take(&mut self.buf);
        let r = self.raw(&buf);
        self.buf = buf;
        r?;
        self.records += 1;
        Ok(())
    }

    /// Writes the end record and the checksum; returns the bytes written and the writer.
    pub(crate) fn finish(mut self) -> Result<(u64, W), SnapshotError> {
        let mut end = [0u8; 13];
        end[0] = END;
        end[1..5].copy_from_slice(&8u32.to_le_bytes());
        end[5..].copy_from_slice(&self.records.to_le_bytes());
        self.raw(&end)?;
        let sum = self.hash.digest();
        self.out.write_all(&sum.to_le_bytes())?;
        self.out.flush()?;
        Ok((self.bytes + 8, self.out))
    }
}

/// Reads the framing: checks the header, hands out records, checks the trailer.
pub(crate) struct SnapshotReader<R: Read> {
    input: R,
    /// The format version in the header (checked to be one this crate reads).
    version: u16,
    hash: Xxh3,
    records: u64,
    buf: Vec<u8>,
    done: bool,
}

/// A record: its tag and payload.
pub(crate) struct Record<'a> {
    pub(crate) tag: u8,
    pub(crate) payload: &'a [u8],
}

impl<R: Read> SnapshotReader<R> {
    /// Reads and checks the header of a snapshot that must hold `kind`.
    pub(crate) fn new(input: R, kind: SnapshotKind) -> Result<Self, SnapshotError> {
        let mut r = Self {
            input,
            version: FORMAT_VERSION,
            hash: Xxh3::new(),
            records: 0,
            buf: Vec::new(),
            done: false,
        };
        let mut head = [0u8; 12];
        r.exact(&mut head, "the header").map_err(|e| match e {
            SnapshotError::Truncated { .. } => SnapshotError::NotASnapshot,
            e => e,
        })?;
        if head[..8] != MAGIC {
            return Err(SnapshotError::NotASnapshot);
        }
        let version = u16::from_le_bytes([head[8], head[9]]);
        if !(OLDEST_FORMAT_VERSION..=FORMAT_VERSION).contains(&version) {
            return Err(SnapshotError::UnsupportedVersion { found: version });
        }
        r.version = version;
        let found = SnapshotKind::from_code(head[10]);
        if found != Some(kind) {
            return Err(SnapshotError::WrongKind {
                expected: kind,
                found,
            });
        }
        let mut v = vec![0u8; head[11] as usize];
        r.exact(&mut v, "the crate version")?;
        Ok(r)
    }

    /// Reads exactly `out.len()` bytes (hashing them).
    fn exact(&mut self, out: &mut [u8], reading: &'static str) -> Result<(), SnapshotError> {
        read_hashed(&mut self.input, &mut self.hash, out, reading)
    }

    /// The format version of the snapshot being read.
    pub(crate) fn version(&self) -> u16 {
        self.version
    }

    /// The index of the next record (for error messages).
    pub(crate) fn position(&self) -> u64 {
        self.records
    }

    /// The next record, or `None` after the end record (whose count and the checksum that
    /// follows it are checked then).
    pub(crate) fn next_record(&mut self) -> Result<Option<Record<'_>>, SnapshotError> {
        if self.done {
            return Ok(None);
        }
        let mut head = [0u8; 5];
        self.exact(&mut head, "a record header")?;
        let tag = head[0];
        // Any length is at most `MAX_RECORD` (all a `u32` holds).
        let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]);
        // Read the payload in bounded steps: memory grows only with bytes actually read.
        self.buf.clear();
        let mut left = len as usize;
        while left > 0 {
            let n = left.min(1 << 20);
            let start = self.buf.len();
            self.buf.resize(start + n, 0);
            read_hashed(
                &mut self.input,
                &mut self.hash,
                &mut self.buf[start..],
                "a record payload",
            )?;
            left -= n;
        }
        if tag == END {
            let count = (self.buf.len() == 8)
                .then(|| u64::from_le_bytes(self.buf[..8].try_into().expect("8 bytes")))
                .ok_or_else(|| SnapshotError::Invalid {
                    record: Some(self.records),
                    reason: "the end record is malformed".into(),
                })?;
            if count != self.records {
                return Err(SnapshotError::Invalid {
                    record: Some(self.records),
                    reason: format!(
                        "the end record counts {count} records, {} were read",
                        self.records
                    ),
                });
            }
            let computed = self.hash.digest();
            let mut sum = [0u8; 8];
            match self.input.read_exact(&mut sum) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    return Err(SnapshotError::Truncated {
                        reading: "the checksum",
                    })
                }
                Err(e) => return Err(SnapshotError::Io(e)),
            }
            let stored = u64::from_le_bytes(sum);
            if stored != computed {
                return Err(SnapshotError::ChecksumMismatch { stored, computed });
            }
            self.done = true;
            return Ok(None);
        }
        self.records += 1;
        Ok(Some(Record {
            tag,
            payload: &self.buf,
        }))
    }
}

/// Reads exactly `out.len()` bytes from `input` into `out` and hashes them.
fn read_hashed<R: Read>(
    input: &mut R,
    hash: &mut Xxh3,
    out: &mut [u8],
    reading: &'static str,
) -> Result<(), SnapshotError> {
    match input.read_exact(out) {
        Ok(()) => {
            hash.update(out);
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            Err(SnapshotError::Truncated { reading })
        }
        Err(e) => Err(SnapshotError::Io(e)),
    }
}

/// A cursor over a record payload that turns running out of bytes into a clear error.
pub(crate) struct Payload<'a> {
    bytes: &'a [u8],
    record: u64,
}

impl<'a> Payload<'a> {
    pub(crate) fn new(bytes: &'a [u8], record: u64) -> Self {
        Self { bytes, record }
    }

    /// An [`SnapshotError::Invalid`] for this record.
    pub(crate) fn invalid(&self, reason: impl Into<String>) -> SnapshotError {
        SnapshotError::Invalid {
            record: Some(self.record),
            reason: reason.into(),
        }
    }

    pub(crate) fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8], SnapshotError> {
        if n > self.bytes.len() {
            return Err(self.invalid(format!("the record ends inside {what}")));
        }
        let (a, b) = self.bytes.split_at(n);
        self.bytes = b;
        Ok(a)
    }

    pub(crate) fn u32(&mut self, what: &str) -> Result<u32, SnapshotError> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }

    pub(crate) fn u64(&mut self, what: &str) -> Result<u64, SnapshotError> {
        let b = self.bytes(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    /// A `u32`-length-prefixed byte string.
    pub(crate) fn blob(&mut self, what: &str) -> Result<&'a [u8], SnapshotError> {
        let n = self.u32(what)? as usize;
        self.bytes(n, what)
    }

    /// Fails unless the whole payload was consumed.
    pub(crate) fn end(&self) -> Result<(), SnapshotError> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(self.invalid(format!("{} trailing bytes", self.bytes.len())))
        }
    }
}

/// Appends a `u32`-length-prefixed byte string.
pub(crate) fn put_blob(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

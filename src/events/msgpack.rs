//! A small, dependency-free, panic-free MessagePack reader.
//!
//! Two ways to read:
//!
//! * **Streaming** ([`Reader`]): pull one [`Token`] at a time (a scalar, a borrowed string or
//!   byte slice, or the *header* of an array/map whose elements follow), or use the typed
//!   helpers ([`Reader::read_u64`], [`Reader::read_str`], [`Reader::read_array_len`], ...).
//!   [`Reader::skip_value`] skips a whole value of any depth without recursion. This is what
//!   the engine-event decoders use: no intermediate tree, token lists go straight into their
//!   final `Vec`.
//! * **Tree** ([`Value`]): [`Value::decode`] / [`Reader::read_value`] build a borrowed tree of
//!   the whole value (strings and binaries borrow from the input). Nesting is limited to
//!   [`MAX_DEPTH`].
//!
//! Robustness guarantees (the input is untrusted network data):
//!
//! * every length is checked against the remaining input before anything is sliced;
//! * a declared array/map length never drives an allocation by itself: pre-allocation is
//!   capped by the remaining input and by a small constant, so a 5-byte header claiming
//!   4 billion elements allocates nothing big;
//! * tree decoding refuses nesting deeper than [`MAX_DEPTH`] (no stack overflow);
//! * every failure is an [`Error`] value: no panics, no `unwrap` on input-derived data.
//!
//! Extension types (`fixext*`, `ext*`) are decoded as opaque [`Token::Ext`] / [`Value::Ext`]
//! (type byte + borrowed payload); the event decoders skip them. The timestamp extension is
//! not interpreted. The reserved marker `0xc1` is an error.
//!
//! ```
//! use kvtrie::events::msgpack::{Reader, Token, Value};
//!
//! // [1, "a", {"k": -2}]
//! let bytes = [0x93, 0x01, 0xa1, b'a', 0x81, 0xa1, b'k', 0xfe];
//! let v = Value::decode(&bytes).unwrap();
//! assert_eq!(v.as_array().unwrap()[1].as_str(), Some("a"));
//!
//! let mut r = Reader::new(&bytes);
//! assert_eq!(r.read_array_len().unwrap(), 3);
//! assert_eq!(r.read_u64().unwrap(), 1);
//! r.skip_value().unwrap(); // "a"
//! assert_eq!(r.next_token().unwrap(), Token::Map(1));
//! assert!(Reader::new(&bytes[..4]).read_value().is_err()); // truncated: an error, no panic
//! ```

use std::fmt;

/// Deepest nesting of arrays/maps [`Value::decode`] accepts (the root container is depth 1).
pub const MAX_DEPTH: usize = 64;

/// Largest number of elements pre-allocated for one array or map, whatever its header claims
/// (the vector still grows as far as the actual input goes).
const MAX_PREALLOC: usize = 1024;

/// The kind of a MessagePack value, for error messages and dispatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// `nil`.
    Nil,
    /// `true` / `false`.
    Bool,
    /// Any integer encoding.
    Int,
    /// `float32` / `float64`.
    Float,
    /// `str` (fixstr, str8/16/32).
    Str,
    /// `bin` (bin8/16/32).
    Bin,
    /// `array` (fixarray, array16/32).
    Array,
    /// `map` (fixmap, map16/32).
    Map,
    /// Extension types (fixext, ext8/16/32).
    Ext,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Nil => "nil",
            Kind::Bool => "bool",
            Kind::Int => "integer",
            Kind::Float => "float",
            Kind::Str => "string",
            Kind::Bin => "binary",
            Kind::Array => "array",
            Kind::Map => "map",
            Kind::Ext => "extension",
        })
    }
}

/// Why reading failed. Every variant carries the byte offset where the offending item starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// The input ended inside a value.
    UnexpectedEof {
        /// Offset of the value that could not be completed.
        offset: usize,
    },
    /// The reserved marker byte `0xc1`.
    ReservedMarker {
        /// Offset of the marker.
        offset: usize,
    },
    /// A value of another kind than the caller asked for.
    TypeMismatch {
        /// Offset of the value.
        offset: usize,
        /// What the caller wanted (e.g. `"unsigned integer"`).
        expected: &'static str,
        /// What was there.
        found: Kind,
    },
    /// An integer outside the range the caller asked for (e.g. negative for `u64`).
    IntOutOfRange {
        /// Offset of the integer.
        offset: usize,
    },
    /// A string that is not valid UTF-8, read with [`Reader::read_str`].
    InvalidUtf8 {
        /// Offset of the string.
        offset: usize,
    },
    /// Arrays/maps nested deeper than [`MAX_DEPTH`].
    DepthLimitExceeded {
        /// Offset of the container that went too deep.
        offset: usize,
    },
    /// Bytes left over after a complete top-level value ([`Value::decode`]).
    TrailingBytes {
        /// Offset of the first unread byte.
        offset: usize,
    },
}

impl Error {
    /// The byte offset the error refers to.
    pub fn offset(&self) -> usize {
        match *self {
            Error::UnexpectedEof { offset }
            | Error::ReservedMarker { offset }
            | Error::TypeMismatch { offset, .. }
            | Error::IntOutOfRange { offset }
            | Error::InvalidUtf8 { offset }
            | Error::DepthLimitExceeded { offset }
            | Error::TrailingBytes { offset } => offset,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::UnexpectedEof { offset } => {
                write!(f, "msgpack: input ends inside the value at byte {offset}")
            }
            Error::ReservedMarker { offset } => {
                write!(f, "msgpack: reserved marker 0xc1 at byte {offset}")
            }
            Error::TypeMismatch {
                offset,
                expected,
                found,
            } => write!(
                f,
                "msgpack: expected {expected}, found {found} at byte {offset}"
            ),
            Error::IntOutOfRange { offset } => {
                write!(f, "msgpack: integer out of range at byte {offset}")
            }
            Error::InvalidUtf8 { offset } => {
                write!(f, "msgpack: string is not valid UTF-8 at byte {offset}")
            }
            Error::DepthLimitExceeded { offset } => write!(
                f,
                "msgpack: nesting deeper than {MAX_DEPTH} levels at byte {offset}"
            ),
            Error::TrailingBytes { offset } => {
                write!(
                    f,
                    "msgpack: trailing bytes after the value, from byte {offset}"
                )
            }
        }
    }
}

impl std::error::Error for Error {}

/// One item of the MessagePack stream, as returned by [`Reader::next_token`].
///
/// Scalars are complete; for [`Token::Array`] and [`Token::Map`] only the header has been
/// read and the `n` elements (`2 × n` keys and values for maps) follow in the stream.
///
/// Integers are normalized: every non-negative integer is [`Token::Uint`] whatever its wire
/// encoding (so `int8 5` and `uint64 5` read the same); [`Token::Int`] is always negative.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Token<'a> {
    /// `nil`.
    Nil,
    /// A boolean.
    Bool(bool),
    /// A non-negative integer.
    Uint(u64),
    /// A negative integer.
    Int(i64),
    /// A `float32`.
    F32(f32),
    /// A `float64`.
    F64(f64),
    /// A string's raw bytes (not validated as UTF-8 here; see [`Reader::read_str`]).
    Str(&'a [u8]),
    /// A binary blob.
    Bin(&'a [u8]),
    /// An array header: that many values follow.
    Array(u32),
    /// A map header: that many key/value pairs follow.
    Map(u32),
    /// An extension value: its type byte and payload.
    Ext(i8, &'a [u8]),
}

impl Token<'_> {
    /// The kind of value this token starts.
    pub fn kind(&self) -> Kind {
        match self {
            Token::Nil => Kind::Nil,
            Token::Bool(_) => Kind::Bool,
            Token::Uint(_) | Token::Int(_) => Kind::Int,
            Token::F32(_) | Token::F64(_) => Kind::Float,
            Token::Str(_) => Kind::Str,
            Token::Bin(_) => Kind::Bin,
            Token::Array(_) => Kind::Array,
            Token::Map(_) => Kind::Map,
            Token::Ext(..) => Kind::Ext,
        }
    }
}

/// A cursor over a MessagePack byte slice.
///
/// On error the cursor position is unspecified (somewhere inside the failed value); callers
/// are expected to abandon the input.
#[derive(Clone, Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A reader positioned at the start of `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// Current byte offset into the input.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Number of unread bytes.
    pub fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    /// Whether the whole input has been consumed.
    pub fn is_empty(&self) -> bool {
        self.remaining() == 0
    }

    /// Take `n` bytes; `start` is the offset reported if they are not there.
    fn take(&mut self, n: usize, start: usize) -> Result<&'a [u8], Error> {
        let end = self
            .pos
            .checked_add(n)
            .ok_or(Error::UnexpectedEof { offset: start })?;
        let bytes = self
            .buf
            .get(self.pos..end)
            .ok_or(Error::UnexpectedEof { offset: start })?;
        self.pos = end;
        Ok(bytes)
    }

    fn take_array<const N: usize>(&mut self, start: usize) -> Result<[u8; N], Error> {
        let bytes = self.take(N, start)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes); // lengths are equal by construction of `take`
        Ok(out)
    }

    fn be_u8(&mut self, start: usize) -> Result<u8, Error> {
        Ok(self.take_array::<1>(start)?[0])
    }

    fn be_u16(&mut self, start: usize) -> Result<u16, Error> {
        Ok(u16::from_be_bytes(self.take_array(start)?))
    }

    fn be_u32(&mut self, start: usize) -> Result<u32, Error> {
        Ok(u32::from_be_bytes(self.take_array(start)?))
    }

    fn be_u64(&mut self, start: usize) -> Result<u64, Error> {
        Ok(u64::from_be_bytes(self.take_array(start)?))
    }

    /// Take a length-prefixed payload of `len` bytes.
    fn take_len(&mut self, len: u32, start: usize) -> Result<&'a [u8], Error> {
        let len = usize::try_from(len).map_err(|_| Error::UnexpectedEof { offset: start })?;
        self.take(len, start)
    }

    fn uint(v: u64) -> Token<'a> {
        Token::Uint(v)
    }

    fn sint(v: i64) -> Token<'a> {
        if v >= 0 {
            Token::Uint(v.unsigned_abs())
        } else {
            Token::Int(v)
        }
    }

    fn ext(&mut self, len: u32, start: usize) -> Result<Token<'a>, Error> {
        let ty = i8::from_be_bytes(self.take_array(start)?);
        let data = self.take_len(len, start)?;
        Ok(Token::Ext(ty, data))
    }

    /// Read the next token (see [`Token`]). For arrays and maps only the header is consumed.
    pub fn next_token(&mut self) -> Result<Token<'a>, Error> {
        let start = self.pos;
        let m = self.be_u8(start)?;
        let tok = match m {
            0x00..=0x7f => Token::Uint(u64::from(m)),
            0x80..=0x8f => Token::Map(u32::from(m & 0x0f)),
            0x90..=0x9f => Token::Array(u32::from(m & 0x0f)),
            0xa0..=0xbf => Token::Str(self.take_len(u32::from(m & 0x1f), start)?),
            0xc0 => Token::Nil,
            0xc1 => return Err(Error::ReservedMarker { offset: start }),
            0xc2 => Token::Bool(false),
            0xc3 => Token::Bool(true),
            0xc4 => {
                let n = self.be_u8(start)?;
                Token::Bin(self.take_len(u32::from(n), start)?)
            }
            0xc5 => {
                let n = self.be_u16(start)?;
                Token::Bin(self.take_len(u32::from(n), start)?)
            }
            0xc6 => {
                let n = self.be_u32(start)?;
                Token::Bin(self.take_len(n, start)?)
            }
            0xc7 => {
                let n = self.be_u8(start)?;
                self.ext(u32::from(n), start)?
            }
            0xc8 => {
                let n = self.be_u16(start)?;
                self.ext(u32::from(n), start)?
            }
            0xc9 => {
                let n = self.be_u32(start)?;
                self.ext(n, start)?
            }
            0xca => Token::F32(f32::from_bits(self.be_u32(start)?)),
            0xcb => Token::F64(f64::from_bits(self.be_u64(start)?)),
            0xcc => Self::uint(u64::from(self.be_u8(start)?)),
            0xcd => Self::uint(u64::from(self.be_u16(start)?)),
            0xce => Self::uint(u64::from(self.be_u32(start)?)),
            0xcf => Self::uint(self.be_u64(start)?),
            0xd0 => Self::sint(i64::from(i8::from_be_bytes(self.take_array(start)?))),
            0xd1 => Self::sint(i64::from(i16::from_be_bytes(self.take_array(start)?))),
            0xd2 => Self::sint(i64::from(i32::from_be_bytes(self.take_array(start)?))),
            0xd3 => Self::sint(i64::from_be_bytes(self.take_array(start)?)),
            0xd4 => self.ext(1, start)?,
            0xd5 => self.ext(2, start)?,
            0xd6 => self.ext(4, start)?,
            0xd7 => self.ext(8, start)?,
            0xd8 => self.ext(16, start)?,
            0xd9 => {
                let n = self.be_u8(start)?;
                Token::Str(self.take_len(u32::from(n), start)?)
            }
            0xda => {
                let n = self.be_u16(start)?;
                Token::Str(self.take_len(u32::from(n), start)?)
            }
            0xdb => {
                let n = self.be_u32(start)?;
                Token::Str(self.take_len(n, start)?)
            }
            0xdc => Token::Array(u32::from(self.be_u16(start)?)),
            0xdd => Token::Array(self.be_u32(start)?),
            0xde => Token::Map(u32::from(self.be_u16(start)?)),
            0xdf => Token::Map(self.be_u32(start)?),
            // negative fixint 0xe0..=0xff: -32..=-1
            0xe0..=0xff => Token::Int(i64::from(i8::from_be_bytes([m]))),
        };
        Ok(tok)
    }

    /// The kind of the next value, without consuming it.
    pub fn peek_kind(&self) -> Result<Kind, Error> {
        let m = *self
            .buf
            .get(self.pos)
            .ok_or(Error::UnexpectedEof { offset: self.pos })?;
        Ok(match m {
            0x00..=0x7f | 0xcc..=0xd3 | 0xe0..=0xff => Kind::Int,
            0x80..=0x8f | 0xde | 0xdf => Kind::Map,
            0x90..=0x9f | 0xdc | 0xdd => Kind::Array,
            0xa0..=0xbf | 0xd9..=0xdb => Kind::Str,
            0xc0 => Kind::Nil,
            0xc1 => return Err(Error::ReservedMarker { offset: self.pos }),
            0xc2 | 0xc3 => Kind::Bool,
            0xc4..=0xc6 => Kind::Bin,
            0xc7..=0xc9 | 0xd4..=0xd8 => Kind::Ext,
            0xca | 0xcb => Kind::Float,
        })
    }

    /// Consume a `nil` if one is next; returns whether it did.
    pub fn read_nil_opt(&mut self) -> Result<bool, Error> {
        if self.peek_kind()? == Kind::Nil {
            self.pos = self.pos.saturating_add(1);
            Ok(true)
        } else {
            Ok(false)
        }
    }

    fn mismatch<T>(start: usize, expected: &'static str, tok: &Token<'_>) -> Result<T, Error> {
        Err(Error::TypeMismatch {
            offset: start,
            expected,
            found: tok.kind(),
        })
    }

    /// Read a boolean.
    pub fn read_bool(&mut self) -> Result<bool, Error> {
        let start = self.pos;
        match self.next_token()? {
            Token::Bool(b) => Ok(b),
            t => Self::mismatch(start, "bool", &t),
        }
    }

    /// Read a non-negative integer (any encoding).
    pub fn read_u64(&mut self) -> Result<u64, Error> {
        let start = self.pos;
        match self.next_token()? {
            Token::Uint(v) => Ok(v),
            Token::Int(_) => Err(Error::IntOutOfRange { offset: start }),
            t => Self::mismatch(start, "unsigned integer", &t),
        }
    }

    /// Read an integer (any encoding) that fits an `i64`.
    pub fn read_i64(&mut self) -> Result<i64, Error> {
        let start = self.pos;
        match self.next_token()? {
            Token::Uint(v) => i64::try_from(v).map_err(|_| Error::IntOutOfRange { offset: start }),
            Token::Int(v) => Ok(v),
            t => Self::mismatch(start, "integer", &t),
        }
    }

    /// Read a number as `f64`: `float32`, `float64`, or an integer (converted, possibly
    /// rounding).
    pub fn read_f64(&mut self) -> Result<f64, Error> {
        let start = self.pos;
        match self.next_token()? {
            Token::F64(v) => Ok(v),
            Token::F32(v) => Ok(f64::from(v)),
            #[allow(clippy::cast_precision_loss)]
            Token::Uint(v) => Ok(v as f64),
            #[allow(clippy::cast_precision_loss)]
            Token::Int(v) => Ok(v as f64),
            t => Self::mismatch(start, "number", &t),
        }
    }

    /// Read a string, validated as UTF-8.
    pub fn read_str(&mut self) -> Result<&'a str, Error> {
        let start = self.pos;
        match self.next_token()? {
            Token::Str(b) => {
                std::str::from_utf8(b).map_err(|_| Error::InvalidUtf8 { offset: start })
            }
            t => Self::mismatch(start, "string", &t),
        }
    }

    /// Read a binary blob.
    pub fn read_bin(&mut self) -> Result<&'a [u8], Error> {
        let start = self.pos;
        match self.next_token()? {
            Token::Bin(b) => Ok(b),
            t => Self::mismatch(start, "binary", &t),
        }
    }

    /// Read an array header; the returned number of elements follow.
    pub fn read_array_len(&mut self) -> Result<u32, Error> {
        let start = self.pos;
        match self.next_token()? {
            Token::Array(n) => Ok(n),
            t => Self::mismatch(start, "array", &t),
        }
    }

    /// Read a map header; the returned number of key/value pairs follow.
    pub fn read_map_len(&mut self) -> Result<u32, Error> {
        let start = self.pos;
        match self.next_token()? {
            Token::Map(n) => Ok(n),
            t => Self::mismatch(start, "map", &t),
        }
    }

    /// Skip one complete value of any kind and depth.
    ///
    /// Iterative (no recursion, so no depth limit is needed): it counts the values still owed.
    /// Every token consumes at least one byte, so the loop is bounded by the input length even
    /// when headers declare absurd element counts.
    pub fn skip_value(&mut self) -> Result<(), Error> {
        let mut owed: u64 = 1;
        while owed > 0 {
            owed -= 1;
            match self.next_token()? {
                Token::Array(n) => owed = owed.saturating_add(u64::from(n)),
                Token::Map(n) => owed = owed.saturating_add(u64::from(n).saturating_mul(2)),
                _ => {}
            }
        }
        Ok(())
    }

    /// Skip `n` complete values.
    pub fn skip_values(&mut self, n: u64) -> Result<(), Error> {
        for _ in 0..n {
            self.skip_value()?;
        }
        Ok(())
    }

    /// Pre-allocation for a container of `n` declared elements, each at least `min_bytes`
    /// bytes long on the wire.
    pub(crate) fn capacity_hint(&self, n: u32, min_bytes: usize) -> usize {
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        n.min(self.remaining() / min_bytes.max(1)).min(MAX_PREALLOC)
    }

    /// Decode the next value into a borrowed [`Value`] tree (nesting limited to [`MAX_DEPTH`]).
    pub fn read_value(&mut self) -> Result<Value<'a>, Error> {
        self.read_value_at(1)
    }

    fn read_value_at(&mut self, depth: usize) -> Result<Value<'a>, Error> {
        let start = self.pos;
        let tok = self.next_token()?;
        Ok(match tok {
            Token::Nil => Value::Nil,
            Token::Bool(b) => Value::Bool(b),
            Token::Uint(v) => Value::Uint(v),
            Token::Int(v) => Value::Int(v),
            Token::F32(v) => Value::F32(v),
            Token::F64(v) => Value::F64(v),
            Token::Str(s) => Value::Str(s),
            Token::Bin(b) => Value::Bin(b),
            Token::Ext(t, d) => Value::Ext(t, d),
            Token::Array(n) => {
                if depth > MAX_DEPTH {
                    return Err(Error::DepthLimitExceeded { offset: start });
                }
                let mut items = Vec::with_capacity(self.capacity_hint(n, 1));
                for _ in 0..n {
                    items.push(self.read_value_at(depth + 1)?);
                }
                Value::Array(items)
            }
            Token::Map(n) => {
                if depth > MAX_DEPTH {
                    return Err(Error::DepthLimitExceeded { offset: start });
                }
                let mut items = Vec::with_capacity(self.capacity_hint(n, 2));
                for _ in 0..n {
                    let k = self.read_value_at(depth + 1)?;
                    let v = self.read_value_at(depth + 1)?;
                    items.push((k, v));
                }
                Value::Map(items)
            }
        })
    }
}

/// A decoded MessagePack value borrowing strings and binaries from the input.
///
/// Integers are normalized as in [`Token`]: non-negative → [`Value::Uint`], negative →
/// [`Value::Int`]. Maps keep their wire order and duplicate keys.
#[derive(Clone, Debug, PartialEq)]
pub enum Value<'a> {
    /// `nil`.
    Nil,
    /// A boolean.
    Bool(bool),
    /// A non-negative integer.
    Uint(u64),
    /// A negative integer.
    Int(i64),
    /// A `float32`.
    F32(f32),
    /// A `float64`.
    F64(f64),
    /// A string's raw bytes (use [`Value::as_str`] for UTF-8 text).
    Str(&'a [u8]),
    /// A binary blob.
    Bin(&'a [u8]),
    /// An array.
    Array(Vec<Value<'a>>),
    /// A map as key/value pairs in wire order.
    Map(Vec<(Value<'a>, Value<'a>)>),
    /// An extension value: type byte and payload.
    Ext(i8, &'a [u8]),
}

impl<'a> Value<'a> {
    /// Decode exactly one value spanning all of `buf` (trailing bytes are an error).
    pub fn decode(buf: &'a [u8]) -> Result<Value<'a>, Error> {
        let mut r = Reader::new(buf);
        let v = r.read_value()?;
        if r.is_empty() {
            Ok(v)
        } else {
            Err(Error::TrailingBytes {
                offset: r.position(),
            })
        }
    }

    /// The kind of this value.
    pub fn kind(&self) -> Kind {
        match self {
            Value::Nil => Kind::Nil,
            Value::Bool(_) => Kind::Bool,
            Value::Uint(_) | Value::Int(_) => Kind::Int,
            Value::F32(_) | Value::F64(_) => Kind::Float,
            Value::Str(_) => Kind::Str,
            Value::Bin(_) => Kind::Bin,
            Value::Array(_) => Kind::Array,
            Value::Map(_) => Kind::Map,
            Value::Ext(..) => Kind::Ext,
        }
    }

    /// Whether this is `nil`.
    pub fn is_nil(&self) -> bool {
        matches!(self, Value::Nil)
    }

    /// The value as `u64`, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::Uint(v) => Some(v),
            _ => None,
        }
    }

    /// The value as `i64`, if it is an integer in range.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::Uint(v) => i64::try_from(v).ok(),
            Value::Int(v) => Some(v),
            _ => None,
        }
    }

    /// The value as `f64`, if it is a float or an integer.
    #[allow(clippy::cast_precision_loss)]
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F64(v) => Some(v),
            Value::F32(v) => Some(f64::from(v)),
            Value::Uint(v) => Some(v as f64),
            Value::Int(v) => Some(v as f64),
            _ => None,
        }
    }

    /// The value as text, if it is a string holding valid UTF-8.
    pub fn as_str(&self) -> Option<&'a str> {
        match *self {
            Value::Str(s) => std::str::from_utf8(s).ok(),
            _ => None,
        }
    }

    /// The bytes, if this is a binary blob.
    pub fn as_bin(&self) -> Option<&'a [u8]> {
        match *self {
            Value::Bin(b) => Some(b),
            _ => None,
        }
    }

    /// The elements, if this is an array.
    pub fn as_array(&self) -> Option<&[Value<'a>]> {
        match self {
            Value::Array(v) => Some(v),
            _ => None,
        }
    }

    /// The key/value pairs, if this is a map.
    pub fn as_map(&self) -> Option<&[(Value<'a>, Value<'a>)]> {
        match self {
            Value::Map(v) => Some(v),
            _ => None,
        }
    }

    /// The value of the first entry whose key is the string `key`, if this is a map.
    pub fn get(&self, key: &str) -> Option<&Value<'a>> {
        self.as_map()?
            .iter()
            .find(|(k, _)| matches!(k, Value::Str(s) if *s == key.as_bytes()))
            .map(|(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_of_every_width() {
        let cases: &[(&[u8], Value<'_>)] = &[
            (&[0xc0], Value::Nil),
            (&[0xc2], Value::Bool(false)),
            (&[0xc3], Value::Bool(true)),
            (&[0x7f], Value::Uint(127)),
            (&[0xe0], Value::Int(-32)),
            (&[0xff], Value::Int(-1)),
            (&[0xcc, 0xff], Value::Uint(255)),
            (&[0xcd, 0x01, 0x00], Value::Uint(256)),
            (&[0xce, 0, 1, 0, 0], Value::Uint(65536)),
            (
                &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
                Value::Uint(u64::MAX),
            ),
            (&[0xd0, 0x80], Value::Int(-128)),
            (&[0xd0, 0x05], Value::Uint(5)),
            (&[0xd1, 0xff, 0x00], Value::Int(-256)),
            (&[0xd2, 0xff, 0xff, 0xff, 0xff], Value::Int(-1)),
            (&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0], Value::Int(i64::MIN)),
            (&[0xca, 0x3f, 0x80, 0, 0], Value::F32(1.0)),
            (&[0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0], Value::F64(1.0)),
            (&[0xa2, b'h', b'i'], Value::Str(b"hi")),
            (&[0xd9, 0x01, b'x'], Value::Str(b"x")),
            (&[0xda, 0x00, 0x01, b'x'], Value::Str(b"x")),
            (&[0xdb, 0, 0, 0, 1, b'x'], Value::Str(b"x")),
            (&[0xc4, 0x02, 1, 2], Value::Bin(&[1, 2])),
            (&[0xc5, 0x00, 0x01, 9], Value::Bin(&[9])),
            (&[0xc6, 0, 0, 0, 0], Value::Bin(&[])),
            (&[0xd4, 0x01, 0xaa], Value::Ext(1, &[0xaa])),
            (&[0xd5, 0xff, 1, 2], Value::Ext(-1, &[1, 2])),
            (&[0xc7, 0x01, 0x05, 0x07], Value::Ext(5, &[7])),
            (&[0xc8, 0x00, 0x00, 0x05], Value::Ext(5, &[])),
            (&[0xc9, 0, 0, 0, 1, 0x05, 0x07], Value::Ext(5, &[7])),
        ];
        for (bytes, want) in cases {
            assert_eq!(&Value::decode(bytes).unwrap(), want, "{bytes:x?}");
            let mut r = Reader::new(bytes);
            r.skip_value().unwrap();
            assert!(r.is_empty());
            // every strict prefix is an error
            for cut in 0..bytes.len() {
                assert!(Value::decode(&bytes[..cut]).is_err());
            }
        }
    }

    /// A zero in a signed encoding is non-negative: [`Token::Uint`], readable as a `u64` (an
    /// encoder may write any integer signed), as every other non-negative one.
    #[test]
    fn signed_encodings_of_zero_read_as_unsigned() {
        for bytes in [
            &[0xd0, 0][..],
            &[0xd1, 0, 0][..],
            &[0xd2, 0, 0, 0, 0][..],
            &[0xd3, 0, 0, 0, 0, 0, 0, 0, 0][..],
        ] {
            assert_eq!(
                Reader::new(bytes).next_token(),
                Ok(Token::Uint(0)),
                "{bytes:x?}"
            );
            assert_eq!(Reader::new(bytes).read_u64(), Ok(0), "{bytes:x?}");
            assert_eq!(Value::decode(bytes), Ok(Value::Uint(0)), "{bytes:x?}");
        }
    }

    /// [`Reader::peek_kind`] names the kind of the value [`Reader::next_token`] reads, for
    /// every marker byte, without consuming it.
    #[test]
    fn peek_kind_agrees_with_the_token_for_every_marker() {
        for m in 0..=0xffu8 {
            // Room for every fixstr and fixext, and every longer form's zero length.
            let mut bytes = vec![m];
            bytes.extend_from_slice(&[0; 32]);
            let r = Reader::new(&bytes);
            let peeked = r.peek_kind();
            assert_eq!(r.position(), 0);
            match Reader::new(&bytes).next_token() {
                Ok(t) => assert_eq!(peeked, Ok(t.kind()), "marker {m:#04x}"),
                Err(e) => assert_eq!(peeked, Err(e), "marker {m:#04x}"),
            }
        }
    }

    #[test]
    fn containers() {
        // {"a": [1, nil], "b": {}} with array16 / map16 / array32 / map32 encodings
        let bytes = [0x82, 0xa1, b'a', 0x92, 0x01, 0xc0, 0xa1, b'b', 0x80];
        let v = Value::decode(&bytes).unwrap();
        assert_eq!(
            v.get("a").unwrap().as_array().unwrap(),
            &[Value::Uint(1), Value::Nil]
        );
        assert_eq!(v.get("b").unwrap().as_map().unwrap().len(), 0);
        let wide = [
            0xdc, 0, 1, 0xdd, 0, 0, 0, 1, 0xde, 0, 1, 0x01, 0xdf, 0, 0, 0, 0,
        ];
        let v = Value::decode(&wide).unwrap();
        assert_eq!(
            v,
            Value::Array(vec![Value::Array(vec![Value::Map(vec![(
                Value::Uint(1),
                Value::Map(vec![])
            )])])])
        );
    }

    #[test]
    fn huge_declared_lengths_do_not_allocate() {
        for bytes in [
            &[0xdd, 0xff, 0xff, 0xff, 0xff][..],
            &[0xdf, 0xff, 0xff, 0xff, 0xff][..],
            &[0xdb, 0xff, 0xff, 0xff, 0xff][..],
            &[0xc6, 0xff, 0xff, 0xff, 0xff][..],
            &[0xc9, 0xff, 0xff, 0xff, 0xff, 0x01][..],
        ] {
            assert!(matches!(
                Value::decode(bytes),
                Err(Error::UnexpectedEof { offset: 0 | 5 })
            ));
            assert!(Reader::new(bytes).skip_value().is_err());
        }
    }

    #[test]
    fn depth_limit() {
        let mut deep = vec![0x91u8; MAX_DEPTH];
        deep.push(0xc0);
        assert!(Value::decode(&deep).is_ok());
        let mut too_deep = vec![0x91u8; MAX_DEPTH + 1];
        too_deep.push(0xc0);
        assert_eq!(
            Value::decode(&too_deep),
            Err(Error::DepthLimitExceeded { offset: MAX_DEPTH })
        );
        // skipping is iterative: any depth works
        let mut very_deep = vec![0x91u8; 100_000];
        very_deep.push(0xc0);
        let mut r = Reader::new(&very_deep);
        r.skip_value().unwrap();
        assert!(r.is_empty());
    }

    /// Maps count towards the depth limit as arrays do: [`MAX_DEPTH`] nested maps decode, one
    /// more is refused.
    #[test]
    fn depth_limit_of_maps() {
        // {0: {0: ... nil}}
        let nested = |depth: usize| {
            let mut b = [0x81u8, 0x00].repeat(depth);
            b.push(0xc0);
            b
        };
        assert!(Value::decode(&nested(MAX_DEPTH)).is_ok());
        assert_eq!(
            Value::decode(&nested(MAX_DEPTH + 1)),
            Err(Error::DepthLimitExceeded {
                offset: 2 * MAX_DEPTH
            })
        );
    }

    #[test]
    fn errors() {
        assert_eq!(
            Value::decode(&[0xc1]),
            Err(Error::ReservedMarker { offset: 0 })
        );
        assert_eq!(
            Value::decode(&[0xc0, 0xc0]),
            Err(Error::TrailingBytes { offset: 1 })
        );
        assert_eq!(
            Reader::new(&[0xff]).read_u64(),
            Err(Error::IntOutOfRange { offset: 0 })
        );
        assert_eq!(
            Reader::new(&[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]).read_i64(),
            Err(Error::IntOutOfRange { offset: 0 })
        );
        assert_eq!(
            Reader::new(&[0xa1, 0xff]).read_str(),
            Err(Error::InvalidUtf8 { offset: 0 })
        );
        assert!(matches!(
            Reader::new(&[0xc0]).read_array_len(),
            Err(Error::TypeMismatch {
                found: Kind::Nil,
                ..
            })
        ));
        assert!(Reader::new(&[]).peek_kind().is_err());
    }

    #[test]
    fn garbage_never_panics() {
        // a cheap deterministic PRNG sweep over short inputs
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 24) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|i| (x.rotate_left(i as u32 * 5) & 0xff) as u8)
                .collect();
            let _ = Value::decode(&bytes);
            let _ = Reader::new(&bytes).skip_value();
        }
    }
}

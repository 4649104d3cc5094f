//! Request traces in the Mooncake format: one JSON object per line with `timestamp`
//! (milliseconds: an integer, or a number with a fraction or an exponent as Dynamo's and
//! aiperf's tools write them, `27482.0`, rounded to the nearest millisecond; a string holding
//! such a number is read too), `input_length`, `output_length` (tokens) and `hash_ids` (one id per
//! trace block of the prompt, the last one possibly partial; two prompts share a prefix of
//! `k` blocks exactly when their first `k` ids are equal). Mooncake's blocks are
//! [`TRACE_BLOCK_TOKENS`] (512) tokens; other generators write other sizes (NVIDIA Dynamo's
//! `--block-size`, e.g. 16, 64 or 128): [`parse_trace_with`] reads a trace of any size that
//! is a multiple of the engine's [`BLOCK_SIZE`](super::BLOCK_SIZE), and a line whose counts
//! do not match says which common size they would fit ([`COMMON_TRACE_BLOCK_TOKENS`]).
//!
//! [`parse_trace`] is strict about what it reads and says where it stopped: every error names
//! the line (and the column for syntax errors). Other fields are allowed and skipped; blank
//! lines, CRLF line ends, a last line without a newline and a UTF-8 byte order mark are fine.

use std::fmt;
use std::io::{BufRead, Read};

/// Tokens per trace block (Mooncake's): the default trace block size.
pub const TRACE_BLOCK_TOKENS: usize = 512;
/// The trace block sizes a mismatched line is tried against, to name the one its counts fit.
pub const COMMON_TRACE_BLOCK_TOKENS: [usize; 7] = [16, 32, 64, 128, 256, 512, 1024];
/// The largest `input_length` or `output_length` accepted (16 M tokens).
pub const MAX_TRACE_TOKENS: usize = 1 << 24;
/// The longest line accepted (64 MiB): a record at the largest `input_length` with the
/// smallest trace blocks lists 2^20 ids, about 10 MB. Longer lines (a file without newlines,
/// `/dev/zero`) are an error before they fill memory.
pub const MAX_LINE_BYTES: usize = 64 << 20;
/// Nesting allowed inside skipped (unknown) fields.
const MAX_DEPTH: usize = 64;

/// One request of a trace.
///
/// ```
/// use kvtrie::sim::parse_trace_str;
/// let t = parse_trace_str(r#"{"timestamp": 27, "input_length": 600, "output_length": 9, "hash_ids": [0, 5]}"#).unwrap();
/// assert_eq!((t[0].timestamp_ms, t[0].input_length, t[0].output_length), (27, 600, 9));
/// assert_eq!(t[0].hash_ids, vec![0, 5]);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceRecord {
    /// Arrival time, milliseconds since the start of the trace (a fractional timestamp is
    /// rounded to the nearest millisecond).
    pub timestamp_ms: u64,
    /// Prompt length in tokens (at least 1).
    pub input_length: usize,
    /// Response length in tokens.
    pub output_length: usize,
    /// The prompt's blocks: `⌈input_length / trace block size⌉` ids (the size is
    /// [`TRACE_BLOCK_TOKENS`] unless the trace was read with another, see
    /// [`parse_trace_with`]).
    pub hash_ids: Vec<u64>,
}

impl TraceRecord {
    /// Checks the fields against each other: a non-empty prompt of at most
    /// [`MAX_TRACE_TOKENS`] tokens, a response of at most as many, and one id per
    /// [`TRACE_BLOCK_TOKENS`]-token block ([`check_with`](Self::check_with) for other sizes).
    ///
    /// # Errors
    ///
    /// What is inconsistent, in words.
    pub fn check(&self) -> Result<(), String> {
        self.check_with(TRACE_BLOCK_TOKENS)
    }

    /// [`check`](Self::check) with trace blocks of `block_tokens` tokens. When the id count
    /// does not match, the error names the common sizes ([`COMMON_TRACE_BLOCK_TOKENS`]) the
    /// counts would fit, if any.
    ///
    /// ```
    /// use kvtrie::sim::parse_trace_str;
    /// let mut rec = parse_trace_str(r#"{"timestamp": 0, "input_length": 200, "output_length": 1, "hash_ids": [3]}"#).unwrap().remove(0);
    /// rec.hash_ids = vec![3, 4, 5, 6];
    /// let e = rec.check_with(512).unwrap_err();
    /// assert!(e.contains("fit a trace block size of 64 tokens"), "{e}");
    /// assert_eq!(rec.check_with(64), Ok(()));
    /// ```
    ///
    /// # Errors
    ///
    /// What is inconsistent, in words; a `block_tokens` of 0 is an error too.
    pub fn check_with(&self, block_tokens: usize) -> Result<(), String> {
        if block_tokens == 0 {
            return Err("the trace block size must be at least 1 token".into());
        }
        if self.input_length == 0 {
            return Err("`input_length` must be at least 1".into());
        }
        if self.input_length > MAX_TRACE_TOKENS {
            return Err(format!(
                "`input_length` {} exceeds {MAX_TRACE_TOKENS} tokens",
                self.input_length
            ));
        }
        if self.output_length > MAX_TRACE_TOKENS {
            return Err(format!(
                "`output_length` {} exceeds {MAX_TRACE_TOKENS} tokens",
                self.output_length
            ));
        }
        let need = self.input_length.div_ceil(block_tokens);
        if self.hash_ids.len() != need {
            let fits = fitting_block_tokens(self.input_length, self.hash_ids.len());
            let hint = match fits.as_slice() {
                [] => format!(
                    "; no common trace block size ({} to {} tokens) fits these counts",
                    COMMON_TRACE_BLOCK_TOKENS[0],
                    COMMON_TRACE_BLOCK_TOKENS[COMMON_TRACE_BLOCK_TOKENS.len() - 1]
                ),
                [one] => format!(
                    "; these counts fit a trace block size of {one} tokens (simulate \
                     --trace-block-tokens {one}, `SimConfig::trace_block_tokens`)"
                ),
                [init @ .., last] => {
                    let init: Vec<String> = init.iter().map(usize::to_string).collect();
                    format!(
                        "; these counts fit a trace block size of {} or {last} tokens \
                         (simulate --trace-block-tokens N, `SimConfig::trace_block_tokens`)",
                        init.join(", ")
                    )
                }
            };
            return Err(format!(
                "`hash_ids` has {} ids but `input_length` {} needs {need} (one per \
                 {block_tokens}-token block){hint}",
                self.hash_ids.len(),
                self.input_length
            ));
        }
        Ok(())
    }
}

/// The common trace block sizes ([`COMMON_TRACE_BLOCK_TOKENS`]) at which a prompt of
/// `input_length` tokens has `ids` blocks, smallest first.
///
/// ```
/// assert_eq!(kvtrie::sim::fitting_block_tokens(600, 2), vec![512]);
/// assert_eq!(kvtrie::sim::fitting_block_tokens(100, 1), vec![128, 256, 512, 1024]);
/// assert!(kvtrie::sim::fitting_block_tokens(600, 0).is_empty());
/// ```
pub fn fitting_block_tokens(input_length: usize, ids: usize) -> Vec<usize> {
    COMMON_TRACE_BLOCK_TOKENS
        .into_iter()
        .filter(|&b| input_length.div_ceil(b) == ids)
        .collect()
}

/// Checks a trace block size: a multiple of the engine's
/// [`BLOCK_SIZE`](super::BLOCK_SIZE), from one engine block up to [`MAX_TRACE_TOKENS`].
///
/// ```
/// use kvtrie::sim::check_trace_block_tokens;
/// assert_eq!(check_trace_block_tokens(64), Ok(()));
/// assert!(check_trace_block_tokens(100).unwrap_err().contains("multiple of the engine block size 16"));
/// ```
///
/// # Errors
///
/// What is wrong with it, in words.
pub fn check_trace_block_tokens(block_tokens: usize) -> Result<(), String> {
    let engine = super::BLOCK_SIZE;
    if block_tokens == 0 || !block_tokens.is_multiple_of(engine) || block_tokens > MAX_TRACE_TOKENS
    {
        return Err(format!(
            "must be a multiple of the engine block size {engine} tokens, from {engine} to \
             {MAX_TRACE_TOKENS} (got {block_tokens}): each trace block is cut into whole \
             engine blocks"
        ));
    }
    Ok(())
}

/// Why a trace could not be read.
///
/// ```
/// use kvtrie::sim::{parse_trace_str, TraceError};
/// assert_eq!(parse_trace_str("\n\n"), Err(TraceError::Empty));
/// let e = parse_trace_str("{\"timestamp\": 1, \"input_length\": 5,").unwrap_err();
/// assert_eq!(e.line(), Some(1));
/// assert!(e.to_string().starts_with("line 1, column 36: truncated line"), "{e}");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TraceError {
    /// The trace holds no request.
    Empty,
    /// Reading failed (the I/O error's message).
    Io(String),
    /// The trace block size asked of [`parse_trace_with`] is not one the simulator can
    /// replay (see [`check_trace_block_tokens`]): the size, and why.
    BlockTokens {
        /// The size asked for.
        block_tokens: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// Line `line` (1-based) is not a valid record.
    Line {
        /// The line number, 1-based.
        line: usize,
        /// What is wrong, with the column for syntax errors.
        reason: String,
    },
}

impl TraceError {
    /// The line the error is on, if it is about one line.
    pub fn line(&self) -> Option<usize> {
        match self {
            TraceError::Line { line, .. } => Some(*line),
            _ => None,
        }
    }
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceError::Empty => write!(f, "the trace has no requests"),
            TraceError::Io(e) => write!(f, "reading the trace: {e}"),
            TraceError::BlockTokens { reason, .. } => write!(f, "trace block size: {reason}"),
            TraceError::Line { line, reason } => write!(f, "line {line}{reason}"),
        }
    }
}

impl std::error::Error for TraceError {}

/// Reads a whole trace of [`TRACE_BLOCK_TOKENS`]-token blocks (blank lines are skipped).
///
/// # Errors
///
/// The first malformed line ([`TraceError::Line`]), an I/O error, or a trace with no
/// request ([`TraceError::Empty`]).
pub fn parse_trace(reader: impl BufRead) -> Result<Vec<TraceRecord>, TraceError> {
    parse_trace_with(reader, TRACE_BLOCK_TOKENS)
}

/// Reads a whole trace whose `hash_ids` are one per `block_tokens`-token block (blank lines
/// are skipped). A line whose id count does not fit says which common block sizes it would
/// fit.
///
/// ```
/// use kvtrie::sim::parse_trace_with;
/// let line = r#"{"timestamp": 0, "input_length": 40, "output_length": 1, "hash_ids": [1, 2, 3]}"#;
/// assert_eq!(parse_trace_with(line.as_bytes(), 16).unwrap()[0].hash_ids, vec![1, 2, 3]);
/// let e = parse_trace_with(line.as_bytes(), 512).unwrap_err().to_string();
/// assert!(e.contains("fit a trace block size of 16 tokens"), "{e}");
/// ```
///
/// # Errors
///
/// As [`parse_trace`], and [`TraceError::BlockTokens`] for a size that is not a multiple of
/// the engine block size.
pub fn parse_trace_with(
    mut reader: impl BufRead,
    block_tokens: usize,
) -> Result<Vec<TraceRecord>, TraceError> {
    check_trace_block_tokens(block_tokens).map_err(|reason| TraceError::BlockTokens {
        block_tokens,
        reason,
    })?;
    let mut out = Vec::new();
    let mut buf = Vec::new();
    let mut line = 0usize;
    loop {
        buf.clear();
        let n = (&mut reader)
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut buf)
            .map_err(|e| TraceError::Io(e.to_string()))?;
        if n == 0 {
            break;
        }
        line += 1;
        if buf.len() > MAX_LINE_BYTES {
            return Err(TraceError::Line {
                line,
                reason: format!(
                    ": longer than {} MiB (not a JSON-lines trace, or lines without newlines)",
                    MAX_LINE_BYTES >> 20
                ),
            });
        }
        let text = buf.strip_suffix(b"\n").unwrap_or(&buf);
        // A UTF-8 byte order mark (as some Windows tools write) opens the file, not a record.
        let text = match line {
            1 => text.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(text),
            _ => text,
        };
        let text = text.strip_suffix(b"\r").unwrap_or(text);
        if text.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let rec =
            parse_line(text, block_tokens).map_err(|reason| TraceError::Line { line, reason })?;
        out.push(rec);
    }
    if out.is_empty() {
        return Err(TraceError::Empty);
    }
    Ok(out)
}

/// [`parse_trace`] over a string.
///
/// # Errors
///
/// As [`parse_trace`].
pub fn parse_trace_str(s: &str) -> Result<Vec<TraceRecord>, TraceError> {
    parse_trace(s.as_bytes())
}

/// [`parse_trace_with`] over a string.
///
/// # Errors
///
/// As [`parse_trace_with`].
pub fn parse_trace_str_with(s: &str, block_tokens: usize) -> Result<Vec<TraceRecord>, TraceError> {
    parse_trace_with(s.as_bytes(), block_tokens)
}

/// A cursor over one line; errors are `", column N: ..."` or `": ..."` suffixes of "line L".
struct Cursor<'a> {
    s: &'a [u8],
    pos: usize,
}

type Res<T> = Result<T, String>;

impl<'a> Cursor<'a> {
    fn syntax<T>(&self, what: &str) -> Res<T> {
        let column = self.pos + 1;
        match self.s.get(self.pos) {
            None => Err(format!(
                ", column {column}: truncated line (expected {what})"
            )),
            Some(&c) => Err(format!(
                ", column {column}: expected {what}, found {}",
                describe(c)
            )),
        }
    }

    fn ws(&mut self) {
        while self.s.get(self.pos).is_some_and(u8::is_ascii_whitespace) {
            self.pos += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    fn eat(&mut self, c: u8) -> bool {
        if self.peek() == Some(c) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: u8, what: &str) -> Res<()> {
        if self.eat(c) {
            Ok(())
        } else {
            self.syntax(what)
        }
    }

    /// A JSON string (escapes decoded as far as a field name needs).
    fn string(&mut self) -> Res<String> {
        self.expect(b'"', "'\"'")?;
        let mut out = Vec::new();
        loop {
            match self.peek() {
                None => return self.syntax("the end of the string"),
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(String::from_utf8_lossy(&out).into_owned());
                }
                Some(b'\\') => {
                    self.pos += 1;
                    match self.peek() {
                        Some(c @ (b'"' | b'\\' | b'/')) => out.push(c),
                        Some(b'b' | b'f' | b'n' | b'r' | b't') => out.push(b' '),
                        Some(b'u') => {
                            for _ in 0..4 {
                                self.pos += 1;
                                if !self.peek().is_some_and(|c| c.is_ascii_hexdigit()) {
                                    return self.syntax("4 hex digits after \\u");
                                }
                            }
                            out.push(b'?');
                        }
                        _ => return self.syntax("an escape character"),
                    }
                    self.pos += 1;
                }
                Some(c) if c < 0x20 => return self.syntax("no control character in a string"),
                Some(c) => {
                    out.push(c);
                    self.pos += 1;
                }
            }
        }
    }

    /// The text of a JSON number (validated against the JSON grammar).
    fn number(&mut self) -> Res<&'a str> {
        let start = self.pos;
        self.eat(b'-');
        let digits = |c: &mut Self| {
            let d = c.pos;
            while c.peek().is_some_and(|x| x.is_ascii_digit()) {
                c.pos += 1;
            }
            c.pos > d
        };
        if !digits(self) {
            return self.syntax("a digit");
        }
        if self.eat(b'.') && !digits(self) {
            return self.syntax("a digit after '.'");
        }
        if self.eat(b'e') || self.eat(b'E') {
            if !self.eat(b'+') {
                self.eat(b'-');
            }
            if !digits(self) {
                return self.syntax("an exponent");
            }
        }
        // Only ASCII was consumed.
        Ok(std::str::from_utf8(&self.s[start..self.pos]).unwrap_or("?"))
    }

    /// A non-negative integer for field `field`.
    fn integer(&mut self, field: &str) -> Res<u64> {
        if !self.peek().is_some_and(|c| c == b'-' || c.is_ascii_digit()) {
            return match self.peek() {
                None => self.syntax(&format!("a value for `{field}`")),
                Some(_) => Err(format!(
                    ": `{field}` must be a non-negative integer, found {}",
                    self.value_preview()
                )),
            };
        }
        let text = self.number()?;
        if text.starts_with('-') || text.contains(['.', 'e', 'E']) {
            return Err(format!(
                ": `{field}` must be a non-negative integer, found {text}"
            ));
        }
        text.parse::<u64>()
            .map_err(|_| format!(": `{field}` {text} is out of range (at most {})", u64::MAX))
    }

    /// `timestamp`: a non-negative number of milliseconds, as an integer (read exactly), a
    /// number with a fraction or an exponent (`27482.0`, `12.5`, `2.7482e4`: rounded to the
    /// nearest millisecond), or a string holding one of those (`"27482"`).
    fn millis(&mut self, field: &str) -> Res<u64> {
        let quoted = self.peek() == Some(b'"');
        let text = if quoted {
            self.string()?
        } else if self.peek().is_some_and(|c| c == b'-' || c.is_ascii_digit()) {
            self.number()?.to_string()
        } else {
            return match self.peek() {
                None => self.syntax(&format!("a value for `{field}`")),
                Some(_) => Err(format!(
                    ": `{field}` must be a non-negative number of milliseconds, found {}",
                    self.value_preview()
                )),
            };
        };
        let shown = if quoted {
            let mut t: String = text.chars().take(40).collect();
            if t.len() < text.len() {
                t.push_str("...");
            }
            format!("the string {t:?}")
        } else {
            text.clone()
        };
        let bad =
            || format!(": `{field}` must be a non-negative number of milliseconds, found {shown}");
        let t = text.trim();
        // The JSON number grammar, also for a number inside a string.
        let mut c = Cursor {
            s: t.as_bytes(),
            pos: 0,
        };
        if t.is_empty() || c.number().is_err() || c.pos != t.len() {
            return Err(bad());
        }
        if t.starts_with('-') {
            return Err(bad());
        }
        if !t.contains(['.', 'e', 'E']) {
            return t
                .parse::<u64>()
                .map_err(|_| format!(": `{field}` {t} is out of range (at most {})", u64::MAX));
        }
        let ms = t.parse::<f64>().map_err(|_| bad())?.round();
        // 2^64 is the first value that does not fit (`as` would saturate); the number grammar
        // rules out NaN, an exponent too large gives infinity.
        if ms >= 18_446_744_073_709_551_616.0 {
            return Err(format!(
                ": `{field}` {t} is out of range (at most {})",
                u64::MAX
            ));
        }
        Ok(ms as u64)
    }

    /// A short description of the value starting here (for type errors).
    fn value_preview(&self) -> String {
        match self.peek() {
            Some(b'"') => "a string".into(),
            Some(b'[') => "an array".into(),
            Some(b'{') => "an object".into(),
            Some(b't' | b'f') => "a boolean".into(),
            Some(b'n') => "null".into(),
            Some(c) => describe(c),
            None => "the end of the line".into(),
        }
    }

    fn literal(&mut self, word: &str) -> Res<()> {
        if self.s[self.pos..].starts_with(word.as_bytes()) {
            self.pos += word.len();
            Ok(())
        } else {
            self.syntax("a JSON value")
        }
    }

    /// Skips any JSON value (an unknown field's).
    fn skip_value(&mut self, depth: usize) -> Res<()> {
        if depth > MAX_DEPTH {
            return Err(format!(
                ", column {}: nested deeper than {MAX_DEPTH} levels",
                self.pos + 1
            ));
        }
        match self.peek() {
            Some(b'"') => self.string().map(drop),
            Some(b'{') => {
                self.pos += 1;
                self.ws();
                if self.eat(b'}') {
                    return Ok(());
                }
                loop {
                    self.ws();
                    self.string()?;
                    self.ws();
                    self.expect(b':', "':'")?;
                    self.ws();
                    self.skip_value(depth + 1)?;
                    self.ws();
                    if self.eat(b'}') {
                        return Ok(());
                    }
                    self.expect(b',', "',' or '}'")?;
                }
            }
            Some(b'[') => {
                self.pos += 1;
                self.ws();
                if self.eat(b']') {
                    return Ok(());
                }
                loop {
                    self.ws();
                    self.skip_value(depth + 1)?;
                    self.ws();
                    if self.eat(b']') {
                        return Ok(());
                    }
                    self.expect(b',', "',' or ']'")?;
                }
            }
            Some(b't') => self.literal("true"),
            Some(b'f') => self.literal("false"),
            Some(b'n') => self.literal("null"),
            _ => self.number().map(drop),
        }
    }

    /// `hash_ids`: an array of non-negative integers.
    fn ids(&mut self) -> Res<Vec<u64>> {
        if self.peek() != Some(b'[') {
            return match self.peek() {
                None => self.syntax("a value for `hash_ids`"),
                Some(_) => Err(format!(
                    ": `hash_ids` must be an array of non-negative integers, found {}",
                    self.value_preview()
                )),
            };
        }
        self.pos += 1;
        let mut out = Vec::new();
        self.ws();
        if self.eat(b']') {
            return Ok(out);
        }
        loop {
            self.ws();
            let i = out.len();
            let id = self
                .integer("hash_ids")
                .map_err(|e| e.replacen("`hash_ids`", &format!("`hash_ids[{i}]`"), 1))?;
            out.push(id);
            self.ws();
            if self.eat(b']') {
                return Ok(out);
            }
            self.expect(b',', "',' or ']'")?;
        }
    }
}

fn describe(c: u8) -> String {
    if c.is_ascii_graphic() {
        format!("'{}'", c as char)
    } else {
        format!("byte 0x{c:02x}")
    }
}

/// Parses one line; errors are suffixes of "line N".
fn parse_line(s: &[u8], block_tokens: usize) -> Res<TraceRecord> {
    let mut c = Cursor { s, pos: 0 };
    let (mut ts, mut input, mut output, mut ids) = (None, None, None, None);
    c.ws();
    c.expect(b'{', "'{' (a JSON object per line)")?;
    c.ws();
    if !c.eat(b'}') {
        loop {
            c.ws();
            let key = c.string()?;
            c.ws();
            c.expect(b':', "':'")?;
            c.ws();
            let dup = |seen: bool| -> Res<()> {
                if seen {
                    Err(format!(": duplicate field `{key}`"))
                } else {
                    Ok(())
                }
            };
            match key.as_str() {
                "timestamp" => {
                    dup(ts.is_some())?;
                    ts = Some(c.millis("timestamp")?);
                }
                "input_length" => {
                    dup(input.is_some())?;
                    input = Some(c.integer("input_length")?);
                }
                "output_length" => {
                    dup(output.is_some())?;
                    output = Some(c.integer("output_length")?);
                }
                "hash_ids" => {
                    dup(ids.is_some())?;
                    ids = Some(c.ids()?);
                }
                _ => c.skip_value(0)?,
            }
            c.ws();
            if c.eat(b'}') {
                break;
            }
            c.expect(b',', "',' or '}'")?;
        }
    }
    c.ws();
    if c.pos < s.len() {
        return c.syntax("the end of the line after the object");
    }
    let missing = |f: &str| format!(": missing field `{f}`");
    let len = |f: &str, v: u64| -> Res<usize> {
        usize::try_from(v)
            .ok()
            .filter(|&n| n <= MAX_TRACE_TOKENS)
            .ok_or_else(|| format!(": `{f}` {v} exceeds {MAX_TRACE_TOKENS} tokens"))
    };
    let rec = TraceRecord {
        timestamp_ms: ts.ok_or_else(|| missing("timestamp"))?,
        input_length: len(
            "input_length",
            input.ok_or_else(|| missing("input_length"))?,
        )?,
        output_length: len(
            "output_length",
            output.ok_or_else(|| missing("output_length"))?,
        )?,
        hash_ids: ids.ok_or_else(|| missing("hash_ids"))?,
    };
    rec.check_with(block_tokens).map_err(|e| format!(": {e}"))?;
    Ok(rec)
}

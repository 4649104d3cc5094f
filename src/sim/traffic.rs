//! [`Traffic`]: the requests of one run, with their tokens, text and block hashes; synthetic
//! multi-turn chat ([`Traffic::generate`]), replayed traces ([`Traffic::from_trace`]) and
//! hand-made streams ([`Traffic::from_streams`]).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::OnceLock;

use super::config::{ConfigError, MAX_SIM_TOKENS};
use super::trace::TraceRecord;
use super::{Micros, SimConfig, BLOCK_SIZE, CHARS_PER_TOKEN, VOCAB};
use crate::blocks::BlockHasher;
use crate::rng::SplitMix64;

/// A replayed request's response is cached (as an engine caches generated tokens) up to this
/// many tokens; the rest of a longer response only costs decode time.
pub const MAX_CACHED_OUTPUT_TOKENS: usize = 1 << 16;

/// Latest arrival a replayed trace may have: the largest time in µs an `f64` holds exactly.
const MAX_ARRIVAL_US: f64 = (1u64 << 53) as f64;

/// Salt of the token ids derived from trace block ids.
const TRACE_TOKEN_SALT: u64 = 0x7472_6163_6500_0001;
/// Salt of the response tokens of replayed requests.
const TRACE_OUTPUT_SALT: u64 = 0x7472_6163_6500_0002;

/// One request: a prompt that is a prefix of its stream (a conversation, or the request's own
/// prompt for a trace), followed in the stream by its response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Dense id, in arrival order (its index in [`Traffic::requests`]).
    pub id: u64,
    /// The stream (synthetic conversation, or trace line) it belongs to.
    pub stream: usize,
    /// Turn number within the conversation (0-based; 0 for trace requests).
    pub turn: usize,
    /// Arrival time.
    pub arrival_us: Micros,
    /// Prompt length in tokens (a prefix of the stream).
    pub prompt_tokens: usize,
    /// Response length in tokens.
    pub output_tokens: usize,
}

/// Where a stream's tokens come from.
#[derive(Clone, Debug)]
enum Content {
    /// Stored tokens (`tokens` range of the token arena), and their rendering.
    Stored {
        tokens: Range<usize>,
        text: Range<usize>,
    },
    /// Derived from trace block ids: `prompt` tokens from `ids` (a range of the id arena,
    /// one id per `block_tokens` tokens), then response tokens from `output_seed`.
    Trace {
        ids: Range<usize>,
        prompt: usize,
        output_seed: u64,
        block_tokens: usize,
    },
}

#[derive(Clone, Debug)]
struct Stream {
    /// Full blocks of the stream, a range of the hash arenas.
    blocks: Range<usize>,
    content: Content,
}

/// The whole traffic of a run; every policy is simulated on the same `Traffic`.
///
/// Requests are sorted by arrival time. For each request the traffic provides its prompt's
/// tokens ([`tokens`](Self::tokens)), their rendering as text ([`text`](Self::text)), and the
/// local and sequence hashes of its stream's full blocks ([`blocks`](Self::blocks)).
#[derive(Clone, Debug)]
pub struct Traffic {
    requests: Vec<Request>,
    streams: Vec<Stream>,
    seq: Vec<u64>,
    local: Vec<u64>,
    tokens: Vec<u32>,
    text: String,
    ids: Vec<u64>,
}

/// Renders one token as [`CHARS_PER_TOKEN`] lowercase letters, least significant base-26
/// digit first (fixed width, injective on `0..26⁴`, which holds `0..VOCAB`).
pub fn render_token(t: u32, out: &mut String) {
    if (t as u64) < VOCAB {
        let i = t as usize * CHARS_PER_TOKEN;
        out.push_str(&rendered_vocab()[i..i + CHARS_PER_TOKEN]);
        return;
    }
    let mut x = t;
    for _ in 0..CHARS_PER_TOKEN {
        out.push((b'a' + (x % 26) as u8) as char);
        x /= 26;
    }
}

/// Every token of `0..VOCAB` rendered, back to back (128 KB, built once).
fn rendered_vocab() -> &'static str {
    static TABLE: OnceLock<String> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut s = String::with_capacity(VOCAB as usize * CHARS_PER_TOKEN);
        for t in 0..VOCAB as u32 {
            let mut x = t;
            for _ in 0..CHARS_PER_TOKEN {
                s.push((b'a' + (x % 26) as u8) as char);
                x /= 26;
            }
        }
        s
    })
}

/// Renders a token sequence (see [`render_token`]).
///
/// ```
/// assert_eq!(kvtrie::sim::render(&[0, 1, 26]), "aaaabaaaabaa");
/// ```
pub fn render(tokens: &[u32]) -> String {
    let mut s = String::with_capacity(tokens.len() * CHARS_PER_TOKEN);
    for &t in tokens {
        render_token(t, &mut s);
    }
    s
}

/// A uniform `f64` in `[0, 1)`.
pub(super) fn unit(r: &mut SplitMix64) -> f64 {
    (r.next() >> 11) as f64 / (1u64 << 53) as f64
}

/// An exponential variate with the given mean.
fn exponential(r: &mut SplitMix64, mean: f64) -> f64 {
    -mean * (1.0 - unit(r)).ln()
}

fn uniform(r: &mut SplitMix64, (lo, hi): (usize, usize)) -> usize {
    lo + r.below((hi - lo) as u64 + 1) as usize
}

/// The token generator of trace block `id`: its `n`-th output is the token at position `n`
/// of the block.
fn block_tokens(id: u64) -> impl Iterator<Item = u32> {
    let mut r = SplitMix64::new(salted(id, TRACE_TOKEN_SALT));
    std::iter::repeat_with(move || (r.next() % VOCAB) as u32)
}

/// The response tokens of trace line `seed`.
fn output_tokens(seed: u64) -> impl Iterator<Item = u32> {
    let mut r = SplitMix64::new(salted(seed, TRACE_OUTPUT_SALT));
    std::iter::repeat_with(move || (r.next() % VOCAB) as u32)
}

/// The seed of token stream `n` of the family `salt`: `n` is mixed before the salt is added,
/// so streams of two families never coincide for small numbers (with `n ^ salt`, block id
/// `i ^ 3` had exactly the tokens of line `i`'s response, the salts differing by 3).
fn salted(n: u64, salt: u64) -> u64 {
    SplitMix64::new(SplitMix64::new(n).next().wrapping_add(salt)).next()
}

impl Traffic {
    /// Generates synthetic multi-turn chat traffic (deterministic in `cfg.seed`).
    ///
    /// Conversations start as a Poisson process of rate `rate / mean turns`, so requests
    /// arrive at about `rate` per second; each picks a system prompt uniformly and has
    /// `1..=max_turns` turns; a turn appends user text, and its response (generated here too,
    /// so every policy sees identical prompts) is appended after it; the next turn arrives a
    /// think time later.
    ///
    /// # Errors
    ///
    /// A configuration field out of range ([`SimConfig::validate_synthetic`]).
    pub fn generate(cfg: &SimConfig) -> Result<Self, ConfigError> {
        cfg.validate_synthetic()?;
        let mut r = SplitMix64::new(cfg.seed);
        let tokens = |r: &mut SplitMix64, n: usize| -> Vec<u32> {
            (0..n).map(|_| r.below(VOCAB) as u32).collect()
        };
        let system: Vec<Vec<u32>> = (0..cfg.system_prompts)
            .map(|_| tokens(&mut r, cfg.system_tokens))
            .collect();
        let mean_turns = (cfg.max_turns as f64 + 1.0) / 2.0;
        let mut start_s = 0.0f64;
        let mut streams = Vec::new();
        let mut requests = Vec::with_capacity(cfg.requests);
        while requests.len() < cfg.requests {
            start_s += exponential(&mut r, mean_turns / cfg.rate);
            let sys = r.below(cfg.system_prompts as u64) as usize;
            let turns = 1 + r.below(cfg.max_turns as u64) as usize;
            let conv = streams.len();
            let mut stream = system[sys].clone();
            let mut at = start_s;
            for turn in 0..turns {
                if requests.len() == cfg.requests {
                    break;
                }
                let n = uniform(&mut r, cfg.user_tokens);
                stream.extend(tokens(&mut r, n));
                let prompt_tokens = stream.len();
                let out = uniform(&mut r, cfg.output_tokens);
                stream.extend(tokens(&mut r, out));
                requests.push(Request {
                    id: 0,
                    stream: conv,
                    turn,
                    arrival_us: (at * 1e6).round() as Micros,
                    prompt_tokens,
                    output_tokens: out,
                });
                at += cfg.think_min_s + exponential(&mut r, cfg.think_mean_s);
            }
            streams.push(stream);
        }
        Ok(Self::build(streams, requests))
    }

    /// Traffic over hand-made streams: request `(stream, arrival µs, prompt tokens, output
    /// tokens)` has the first `prompt tokens` of `streams[stream]` as its prompt. Requests
    /// are sorted by arrival (stably) and numbered in that order.
    ///
    /// ```
    /// use kvtrie::sim::Traffic;
    /// let t = Traffic::from_streams(vec![(0..40).collect()], &[(0, 5, 32, 8), (0, 1, 16, 2)]).unwrap();
    /// assert_eq!(t.requests()[0].prompt_tokens, 16);
    /// assert_eq!(t.blocks(&t.requests()[1], 40).0.len(), 2);
    /// ```
    ///
    /// # Errors
    ///
    /// A request naming a missing stream, with an empty prompt, or longer (prompt + output)
    /// than its stream.
    pub fn from_streams(
        streams: Vec<Vec<u32>>,
        requests: &[(usize, Micros, usize, usize)],
    ) -> Result<Self, ConfigError> {
        let bad = |reason: String| ConfigError {
            field: "requests",
            reason,
        };
        let mut reqs = Vec::with_capacity(requests.len());
        for (i, &(stream, arrival_us, prompt_tokens, output_tokens)) in requests.iter().enumerate()
        {
            let len = streams
                .get(stream)
                .ok_or_else(|| bad(format!("request {i}: no stream {stream}")))?
                .len();
            if prompt_tokens == 0 || prompt_tokens.saturating_add(output_tokens) > len {
                return Err(bad(format!(
                    "request {i}: prompt {prompt_tokens} + output {output_tokens} tokens do not \
                     fit stream {stream} of {len} tokens (or the prompt is empty)"
                )));
            }
            reqs.push(Request {
                id: 0,
                stream,
                turn: 0,
                arrival_us,
                prompt_tokens,
                output_tokens,
            });
        }
        Ok(Self::build(streams, reqs))
    }

    /// Stores token streams and sorts the requests.
    fn build(streams: Vec<Vec<u32>>, requests: Vec<Request>) -> Self {
        let hasher = BlockHasher::new(BLOCK_SIZE);
        let mut t = Self::empty(requests);
        let mut local = Vec::new();
        for s in &streams {
            let tok = t.tokens.len()..t.tokens.len() + s.len();
            t.tokens.extend_from_slice(s);
            let start = t.text.len();
            for &x in s {
                render_token(x, &mut t.text);
            }
            hasher.local_hashes_into(s, &mut local);
            let blocks = t.push_blocks(&hasher, &local);
            t.streams.push(Stream {
                blocks,
                content: Content::Stored {
                    tokens: tok,
                    text: start..t.text.len(),
                },
            });
        }
        t.sort_requests();
        t
    }

    fn empty(requests: Vec<Request>) -> Self {
        Self {
            requests,
            streams: Vec::new(),
            seq: Vec::new(),
            local: Vec::new(),
            tokens: Vec::new(),
            text: String::new(),
            ids: Vec::new(),
        }
    }

    /// Appends a stream's local hashes and their chain to the arenas.
    fn push_blocks(&mut self, hasher: &BlockHasher, local: &[u64]) -> Range<usize> {
        let start = self.seq.len();
        let mut prev = None;
        for &l in local {
            let s = match prev {
                None => l,
                Some(p) => hasher.chain(p, l),
            };
            self.seq.push(s);
            self.local.push(l);
            prev = Some(s);
        }
        start..self.seq.len()
    }

    fn sort_requests(&mut self) {
        self.requests
            .sort_by_key(|q| (q.arrival_us, q.stream, q.turn));
        for (i, q) in self.requests.iter_mut().enumerate() {
            q.id = i as u64;
        }
    }

    /// Traffic replaying trace `records` (see [`parse_trace`](super::parse_trace)): record
    /// `i` becomes a request arriving at `timestamp × time_scale` whose prompt is
    /// `input_length` tokens derived from its block ids.
    ///
    /// Each trace block `id` (of `cfg.trace_block_tokens` tokens, by default Mooncake's
    /// [`TRACE_BLOCK_TOKENS`](super::TRACE_BLOCK_TOKENS)) holds the tokens a SplitMix64
    /// stream seeded from `id` yields, one per position, so the same id always means the
    /// same tokens and two prompts share a token prefix exactly as far as they share ids (a
    /// last, partial block holds the first tokens of its id). A trace block is
    /// `trace_block_tokens / BLOCK_SIZE` engine blocks of [`BLOCK_SIZE`] tokens (32 for
    /// Mooncake's). The response's tokens are derived from the record's index, so responses
    /// never match anything; up to [`MAX_CACHED_OUTPUT_TOKENS`] of them are cached at
    /// completion.
    ///
    /// Requests are sorted by arrival: by timestamp, ties in file order (a trace need not be
    /// sorted; two timestamps that the time scale rounds to the same microsecond keep their
    /// trace order).
    ///
    /// # Errors
    ///
    /// `cfg.time_scale` or `cfg.trace_block_tokens` out of range, a record whose counts do
    /// not fit that block size, or a timestamp that, scaled, lies beyond 2^53 µs.
    pub fn from_trace(records: &[TraceRecord], cfg: &SimConfig) -> Result<Self, ConfigError> {
        let all: Vec<usize> = (0..records.len()).collect();
        Self::from_trace_records(records, &all, cfg)
    }

    /// [`from_trace`](Self::from_trace) over only the `n` earliest requests of the trace:
    /// the `n` smallest timestamps, ties in file order, whatever order the file is in (the
    /// first `n` requests of `from_trace`'s replay). Each kept request is the same as in the
    /// whole trace's replay (tokens, response, arrival).
    ///
    /// ```
    /// use kvtrie::sim::{parse_trace_str, SimConfig, Traffic};
    /// let recs = parse_trace_str(
    ///     "{\"timestamp\": 30, \"input_length\": 16, \"output_length\": 1, \"hash_ids\": [1]}\n\
    ///      {\"timestamp\": 10, \"input_length\": 16, \"output_length\": 1, \"hash_ids\": [2]}",
    /// ).unwrap();
    /// let t = Traffic::from_trace_earliest(&recs, 1, &SimConfig::default()).unwrap();
    /// assert_eq!(t.requests()[0].arrival_us, 10_000);
    /// ```
    ///
    /// # Errors
    ///
    /// As [`from_trace`](Self::from_trace) (every record is checked, kept or not).
    pub fn from_trace_earliest(
        records: &[TraceRecord],
        n: usize,
        cfg: &SimConfig,
    ) -> Result<Self, ConfigError> {
        let mut keep: Vec<usize> = (0..records.len()).collect();
        keep.sort_by_key(|&i| (records[i].timestamp_ms, i));
        keep.truncate(n);
        keep.sort_unstable();
        Self::from_trace_records(records, &keep, cfg)
    }

    /// The replay of `records[i]` for each `i` of `keep` (increasing).
    fn from_trace_records(
        records: &[TraceRecord],
        keep: &[usize],
        cfg: &SimConfig,
    ) -> Result<Self, ConfigError> {
        cfg.validate()?;
        let trace_block = cfg.trace_block_tokens;
        for (i, rec) in records.iter().enumerate() {
            rec.check_with(trace_block).map_err(|e| ConfigError {
                field: "trace",
                reason: format!("record {i}: {e}"),
            })?;
        }
        // What the replay will generate and hash: each kept request's prompt and cached
        // response, and each distinct trace block id's whole block. A small file can ask for
        // far more than memory holds (16 M-token prompts, or huge trace blocks).
        let mut ids = std::collections::HashSet::new();
        let mut need = 0usize;
        for &i in keep {
            let rec = &records[i];
            need = need
                .saturating_add(rec.input_length)
                .saturating_add(rec.output_length.min(MAX_CACHED_OUTPUT_TOKENS));
            ids.extend(rec.hash_ids.iter().copied());
        }
        need = need.saturating_add(ids.len().saturating_mul(trace_block));
        if need > MAX_SIM_TOKENS {
            return Err(ConfigError {
                field: "trace",
                reason: format!(
                    "replaying {} requests needs {need} tokens (prompts, cached responses, and \
                     {} distinct trace blocks of {trace_block} tokens), more than the \
                     simulator's 2^29 (about 8 GB): replay fewer requests, or use smaller \
                     trace blocks",
                    keep.len(),
                    ids.len()
                ),
            });
        }
        drop(ids);
        let hasher = BlockHasher::new(BLOCK_SIZE);
        let per_trace_block = trace_block / BLOCK_SIZE;
        let mut t = Self::empty(Vec::with_capacity(keep.len()));
        // Each request's sort key: (timestamp, record index).
        let mut keys: Vec<(u64, usize)> = Vec::with_capacity(keep.len());
        // The engine blocks' local hashes of every trace block id, computed once per id.
        let mut id_locals: HashMap<u64, usize> = HashMap::new();
        let mut id_arena: Vec<u64> = Vec::new();
        let mut block = Vec::with_capacity(trace_block);
        let mut local = Vec::new();
        let mut tail = Vec::new();
        for &i in keep {
            let rec = &records[i];
            let ids = t.ids.len()..t.ids.len() + rec.hash_ids.len();
            t.ids.extend_from_slice(&rec.hash_ids);
            let prompt = rec.input_length;
            local.clear();
            let full = prompt / BLOCK_SIZE;
            for (j, &id) in rec.hash_ids.iter().enumerate() {
                let off = *id_locals.entry(id).or_insert_with(|| {
                    block.clear();
                    block.extend(block_tokens(id).take(trace_block));
                    let off = id_arena.len();
                    id_arena.extend(block.chunks_exact(BLOCK_SIZE).map(|b| hasher.hash_block(b)));
                    off
                });
                let n = (full - j * per_trace_block).min(per_trace_block);
                local.extend_from_slice(&id_arena[off..off + n]);
            }
            // The blocks after the prompt's full blocks: the prompt's partial block, then the
            // cached part of the response.
            tail.clear();
            let last = prompt / trace_block;
            let from = full * BLOCK_SIZE - last * trace_block;
            let to = prompt - last * trace_block;
            if let Some(&id) = rec.hash_ids.get(last) {
                tail.extend(block_tokens(id).take(to).skip(from));
            }
            let output = rec.output_length.min(MAX_CACHED_OUTPUT_TOKENS);
            tail.extend(output_tokens(i as u64).take(output));
            local.extend(tail.chunks_exact(BLOCK_SIZE).map(|b| hasher.hash_block(b)));
            let blocks = t.push_blocks(&hasher, &local);
            let stream = t.streams.len();
            t.streams.push(Stream {
                blocks,
                content: Content::Trace {
                    ids,
                    prompt,
                    output_seed: i as u64,
                    block_tokens: trace_block,
                },
            });
            let us = (rec.timestamp_ms as f64 * cfg.time_scale * 1e3).round();
            // Beyond 2^53 µs (285 years) an arrival is no longer exact, and near 2^64 it would
            // saturate and every time after it would read 0.
            if us.is_nan() || us > MAX_ARRIVAL_US {
                // A scale above 1 may be what pushed it there; else the timestamp itself.
                let field = if cfg.time_scale > 1.0 {
                    "time_scale"
                } else {
                    "trace"
                };
                return Err(ConfigError {
                    field,
                    reason: format!(
                        "record {i} (counting from 0, blank lines not counted): its timestamp \
                         ({} ms) × the time scale ({}) is beyond 2^53 µs (285 years)",
                        rec.timestamp_ms, cfg.time_scale
                    ),
                });
            }
            t.requests.push(Request {
                id: 0,
                stream,
                turn: 0,
                arrival_us: us as Micros,
                prompt_tokens: prompt,
                output_tokens: rec.output_length,
            });
            keys.push((rec.timestamp_ms, i));
        }
        // By timestamp, ties in file order: the scaled arrivals are non-decreasing in this
        // order, and two timestamps the scale rounds together keep their trace order.
        let mut order: Vec<usize> = (0..t.requests.len()).collect();
        order.sort_by_key(|&j| keys[j]);
        let mut requests: Vec<Request> = order.iter().map(|&j| t.requests[j].clone()).collect();
        for (id, q) in requests.iter_mut().enumerate() {
            q.id = id as u64;
        }
        t.requests = requests;
        Ok(t)
    }

    /// The requests, in arrival order (`requests()[i].id == i`).
    pub fn requests(&self) -> &[Request] {
        &self.requests
    }

    /// The number of streams (conversations, or trace records).
    pub fn streams(&self) -> usize {
        self.streams.len()
    }

    /// Sequence and local hashes of the full blocks among the first `tokens` tokens of
    /// `req`'s stream (at most the stream's full blocks).
    pub fn blocks(&self, req: &Request, tokens: usize) -> (&[u64], &[u64]) {
        let b = &self.streams[req.stream].blocks;
        let n = (tokens / BLOCK_SIZE).min(b.len());
        (
            &self.seq[b.start..b.start + n],
            &self.local[b.start..b.start + n],
        )
    }

    /// Calls `f` with each of the first `n` tokens of `req`'s stream.
    fn for_each_token(&self, req: &Request, n: usize, mut f: impl FnMut(u32)) {
        match &self.streams[req.stream].content {
            Content::Stored { tokens, .. } => {
                let n = n.min(tokens.len());
                self.tokens[tokens.start..tokens.start + n]
                    .iter()
                    .for_each(|&t| f(t));
            }
            Content::Trace {
                ids,
                prompt,
                output_seed,
                block_tokens: size,
            } => {
                let (mut left, mut prompt_left) = (n, *prompt);
                for &id in &self.ids[ids.clone()] {
                    let k = left.min(prompt_left).min(*size);
                    block_tokens(id).take(k).for_each(&mut f);
                    left -= k;
                    prompt_left -= k;
                }
                output_tokens(*output_seed).take(left).for_each(f);
            }
        }
    }

    /// The prompt of `req` as tokens: a slice of the stored stream, or derived into `buf`.
    pub fn tokens<'a>(&'a self, req: &Request, buf: &'a mut Vec<u32>) -> &'a [u32] {
        if let Content::Stored { tokens, .. } = &self.streams[req.stream].content {
            let n = req.prompt_tokens.min(tokens.len());
            return &self.tokens[tokens.start..tokens.start + n];
        }
        buf.clear();
        buf.reserve(req.prompt_tokens);
        self.for_each_token(req, req.prompt_tokens, |t| buf.push(t));
        buf
    }

    /// The prompt of `req` as text ([`render`] of its tokens): a slice of the stored
    /// rendering, or rendered into `buf`.
    pub fn text<'a>(&'a self, req: &Request, buf: &'a mut String) -> &'a str {
        if let Content::Stored { text, .. } = &self.streams[req.stream].content {
            let n = (req.prompt_tokens * CHARS_PER_TOKEN).min(text.len());
            return &self.text[text.start..text.start + n];
        }
        buf.clear();
        buf.reserve(req.prompt_tokens * CHARS_PER_TOKEN);
        self.for_each_token(req, req.prompt_tokens, |t| render_token(t, buf));
        buf
    }

    /// Total prompt tokens over all requests.
    pub fn prompt_tokens(&self) -> u64 {
        self.requests.iter().map(|q| q.prompt_tokens as u64).sum()
    }

    /// The first `n` requests (in arrival order) as traffic of their own.
    pub fn truncated(&self, n: usize) -> Self {
        let mut t = self.clone();
        t.requests.truncate(n);
        t
    }
}

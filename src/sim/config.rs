//! [`SimConfig`]: the cluster, the cost model, the synthetic traffic and the policies'
//! parameters of one simulation.

use std::fmt;

use super::Micros;

/// The largest cluster the simulator accepts.
pub const MAX_REPLICAS: usize = 4096;
/// The most requests (and prefill lanes) a replica may serve at once.
pub const MAX_RUNNING: usize = 1 << 16;
/// Most tokens a simulation may generate and hash (prompts, responses, and a trace's block
/// contents): 2^29, about 8 GB with the block hashes and caches built over them (a trace
/// replay used 15 bytes per token). Bounds what a small trace file or a large `requests` can
/// ask of memory; the shared Mooncake trace needs about 2 × 10^8.
pub const MAX_SIM_TOKENS: usize = 1 << 29;

/// Everything that defines one simulation (cluster, cost model, synthetic traffic, policy
/// parameters). [`validate`](Self::validate) reports a value out of range; every constructor
/// of the engine calls it, so a bad configuration is an error, never a panic.
///
/// ```
/// use kvtrie::sim::SimConfig;
/// let cfg = SimConfig { replicas: 0, ..SimConfig::default() };
/// assert_eq!(cfg.validate().unwrap_err().to_string(), "replicas: must be in 1..=4096 (got 0)");
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Number of replicas.
    pub replicas: usize,
    /// Requests a replica serves at once; the rest wait in its FIFO queue.
    pub max_running: usize,
    /// Prefix-cache capacity of each replica, in blocks of [`BLOCK_SIZE`](super::BLOCK_SIZE)
    /// tokens.
    pub cache_blocks: usize,
    /// Prefills a replica computes at once, each at full speed (the rest wait for a lane,
    /// first come first served); `max_running` or more: every running request prefills
    /// without waiting.
    pub prefill_lanes: usize,
    /// Fixed cost of a prefill, µs.
    pub prefill_overhead_us: f64,
    /// Prefill cost per uncached prompt token, µs.
    pub prefill_us_per_token: f64,
    /// Decode cost per output token, µs.
    pub decode_us_per_token: f64,
    /// Seed of the synthetic traffic and of the randomized policies.
    pub seed: u64,
    /// Synthetic traffic: number of requests (turns).
    pub requests: usize,
    /// Synthetic traffic: mean arrival rate, requests per simulated second.
    pub rate: f64,
    /// Synthetic traffic: number of distinct system prompts.
    pub system_prompts: usize,
    /// Synthetic traffic: tokens per system prompt.
    pub system_tokens: usize,
    /// Synthetic traffic: a conversation has `1..=max_turns` turns (uniform).
    pub max_turns: usize,
    /// Synthetic traffic: user text appended per turn, `min..=max` tokens (uniform).
    pub user_tokens: (usize, usize),
    /// Synthetic traffic: response tokens per turn, `min..=max` (uniform); they are part of
    /// the next turn's prompt.
    pub output_tokens: (usize, usize),
    /// Synthetic traffic: gap between two turns' arrivals is `think_min_s` + an exponential
    /// with mean `think_mean_s`.
    pub think_min_s: f64,
    /// Synthetic traffic: mean of the exponential part of the think time.
    pub think_mean_s: f64,
    /// Replayed traces: arrival times are multiplied by this (0.5 = twice as fast).
    pub time_scale: f64,
    /// Replayed traces: tokens per trace block, i.e. per `hash_ids` entry (default
    /// [`TRACE_BLOCK_TOKENS`](super::TRACE_BLOCK_TOKENS), Mooncake's 512; Dynamo's generator
    /// writes its `--block-size`). A multiple of [`BLOCK_SIZE`](super::BLOCK_SIZE); read the
    /// trace with the same size ([`parse_trace_with`](super::parse_trace_with)).
    pub trace_block_tokens: usize,
    /// KV-aware policy: weight of prefill blocks against active blocks
    /// ([`KvAwareConfig::overlap_weight`](crate::router::KvAwareConfig::overlap_weight)).
    pub kv_overlap_weight: f64,
    /// KV-aware policy: softmax temperature on Dynamo's scale, 0 = lowest cost wins
    /// ([`KvAwareConfig::temperature`](crate::router::KvAwareConfig::temperature)).
    pub kv_temperature: f64,
    /// Oracle policy: a replica is eligible when its queue length is at most the shortest
    /// queue + this many requests (see [`Oracle`](super::Oracle)).
    pub oracle_slack: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            replicas: 8,
            max_running: 8,
            cache_blocks: 2048,
            prefill_lanes: 1,
            prefill_overhead_us: 5_000.0,
            prefill_us_per_token: 100.0,
            decode_us_per_token: 10_000.0,
            seed: 7,
            requests: 4000,
            rate: 60.0,
            system_prompts: 32,
            system_tokens: 1024,
            max_turns: 8,
            user_tokens: (32, 288),
            output_tokens: (16, 128),
            think_min_s: 2.0,
            think_mean_s: 6.0,
            time_scale: 1.0,
            trace_block_tokens: super::TRACE_BLOCK_TOKENS,
            kv_overlap_weight: 64.0,
            kv_temperature: 0.0,
            oracle_slack: 8,
        }
    }
}

/// A configuration value out of range: the field and what it must be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The field of [`SimConfig`].
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

impl std::error::Error for ConfigError {}

fn err(field: &'static str, reason: String) -> ConfigError {
    ConfigError { field, reason }
}

fn at_least_one(field: &'static str, v: usize) -> Result<(), ConfigError> {
    if v == 0 {
        return Err(err(field, "must be at least 1 (got 0)".into()));
    }
    Ok(())
}

fn non_negative(field: &'static str, v: f64) -> Result<(), ConfigError> {
    if !(v.is_finite() && v >= 0.0) {
        return Err(err(field, format!("must be a finite number ≥ 0 (got {v})")));
    }
    Ok(())
}

fn positive(field: &'static str, v: f64) -> Result<(), ConfigError> {
    if !(v.is_finite() && v > 0.0) {
        return Err(err(field, format!("must be a finite number > 0 (got {v})")));
    }
    Ok(())
}

fn range(field: &'static str, (lo, hi): (usize, usize)) -> Result<(), ConfigError> {
    if lo > hi {
        return Err(err(field, format!("min {lo} > max {hi}")));
    }
    Ok(())
}

impl SimConfig {
    /// Checks every field the cluster and the policies use.
    ///
    /// # Errors
    ///
    /// The first field out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=MAX_REPLICAS).contains(&self.replicas) {
            return Err(err(
                "replicas",
                format!("must be in 1..={MAX_REPLICAS} (got {})", self.replicas),
            ));
        }
        for (field, v) in [
            ("max_running", self.max_running),
            ("prefill_lanes", self.prefill_lanes),
        ] {
            if !(1..=MAX_RUNNING).contains(&v) {
                return Err(err(
                    field,
                    format!("must be in 1..={MAX_RUNNING} (got {v})"),
                ));
            }
        }
        at_least_one("cache_blocks", self.cache_blocks)?;
        non_negative("prefill_overhead_us", self.prefill_overhead_us)?;
        non_negative("prefill_us_per_token", self.prefill_us_per_token)?;
        non_negative("decode_us_per_token", self.decode_us_per_token)?;
        positive("time_scale", self.time_scale)?;
        super::check_trace_block_tokens(self.trace_block_tokens)
            .map_err(|reason| err("trace_block_tokens", reason))?;
        non_negative("kv_overlap_weight", self.kv_overlap_weight)?;
        if self.kv_overlap_weight > crate::router::MAX_OVERLAP_WEIGHT {
            return Err(err(
                "kv_overlap_weight",
                format!(
                    "must be at most 1e15 (got {:e}): larger weights make the costs overflow",
                    self.kv_overlap_weight
                ),
            ));
        }
        non_negative("kv_temperature", self.kv_temperature)?;
        Ok(())
    }

    /// [`validate`](Self::validate) plus the synthetic traffic's fields.
    ///
    /// # Errors
    ///
    /// The first field out of range.
    pub fn validate_synthetic(&self) -> Result<(), ConfigError> {
        self.validate()?;
        at_least_one("requests", self.requests)?;
        positive("rate", self.rate)?;
        at_least_one("system_prompts", self.system_prompts)?;
        at_least_one("max_turns", self.max_turns)?;
        range("user_tokens", self.user_tokens)?;
        range("output_tokens", self.output_tokens)?;
        if self.system_tokens.saturating_add(self.user_tokens.0) == 0 {
            return Err(err(
                "system_tokens",
                "system_tokens + min user_tokens must be at least 1 (no empty prompts)".into(),
            ));
        }
        // Bound the generated stream so its token count cannot overflow.
        let per_turn = self
            .user_tokens
            .1
            .saturating_add(self.output_tokens.1)
            .saturating_mul(self.max_turns);
        if self.system_tokens.saturating_add(per_turn) > 1 << 24 {
            return Err(err(
                "system_tokens",
                "a conversation could exceed 16 M tokens (system + turns × (user + output))".into(),
            ));
        }
        // Every request adds at most its user and output tokens, and opens at most one
        // conversation (a copy of its system prompt).
        let per_request = self
            .system_tokens
            .saturating_add(self.user_tokens.1)
            .saturating_add(self.output_tokens.1);
        if self.requests.saturating_mul(per_request) > MAX_SIM_TOKENS {
            return Err(err(
                "requests",
                format!(
                    "{} requests of up to {per_request} tokens each could need more than 2^29 \
                     tokens (about 8 GB): simulate fewer or shorter requests",
                    self.requests
                ),
            ));
        }
        non_negative("think_min_s", self.think_min_s)?;
        non_negative("think_mean_s", self.think_mean_s)?;
        Ok(())
    }

    /// Prefill time for a prompt with `uncached` tokens to compute (saturating).
    pub fn prefill_us(&self, uncached: usize) -> Micros {
        (self.prefill_overhead_us + self.prefill_us_per_token * uncached as f64).round() as Micros
    }

    /// Decode time for `output` tokens (saturating).
    pub fn decode_us(&self, output: usize) -> Micros {
        (self.decode_us_per_token * output as f64).round() as Micros
    }
}

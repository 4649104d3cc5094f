//! [`simulate`]: one policy over one traffic on a fresh cluster; [`Report`];
//! [`infinite_cache_ceiling`].

use std::collections::HashSet;
use std::fmt;
use std::time::{Duration, Instant};

use super::cache::BlockKeys;
use super::config::ConfigError;
use super::policy::{CacheUpdate, ClusterView, Policy, PolicyError, RouteRequest};
use super::{EventQueue, Micros, Replica, SimConfig, Traffic, BLOCK_SIZE};

/// Why a simulation could not run.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SimError {
    /// The configuration is out of range.
    Config(ConfigError),
    /// The policy failed on a request.
    Policy {
        /// The request.
        request: u64,
        /// The policy's error.
        error: PolicyError,
    },
    /// The policy chose a replica that does not exist.
    BadReplica {
        /// The request.
        request: u64,
        /// The replica index it returned.
        replica: usize,
    },
}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SimError::Config(e) => write!(f, "configuration: {e}"),
            SimError::Policy { request, error } => write!(f, "request {request}: {error}"),
            SimError::BadReplica { request, replica } => {
                write!(
                    f,
                    "request {request}: the policy chose replica {replica}, which does not exist"
                )
            }
        }
    }
}

impl std::error::Error for SimError {}

impl From<ConfigError> for SimError {
    fn from(e: ConfigError) -> Self {
        SimError::Config(e)
    }
}

/// Per-policy results of one run.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// Policy name.
    pub policy: String,
    /// Requests completed.
    pub requests: u64,
    /// Prompt tokens over all requests.
    pub prompt_tokens: u64,
    /// Prompt tokens served from a replica's prefix cache.
    pub cached_tokens: u64,
    /// Mean time to first token, ms.
    pub ttft_mean_ms: f64,
    /// Median time to first token, ms.
    pub ttft_p50_ms: f64,
    /// 99th percentile time to first token, ms.
    pub ttft_p99_ms: f64,
    /// Requests routed to each replica.
    pub per_replica: Vec<u64>,
    /// Simulated time until the last request finished, s.
    pub makespan_s: f64,
    /// KV events published by all caches.
    pub kv_events: u64,
    /// Wall-clock time spent inside the policy's routing call.
    pub route_time: Duration,
    /// Time to first token of every request (by request id), ms.
    pub ttft_ms: Vec<f64>,
}

impl Report {
    /// Cached prompt tokens ÷ prompt tokens.
    pub fn hit_rate(&self) -> f64 {
        ratio(self.cached_tokens, self.prompt_tokens)
    }

    /// Max ÷ mean requests per replica (1.0 = perfectly balanced).
    pub fn load_balance(&self) -> f64 {
        let max = self.per_replica.iter().copied().max().unwrap_or(0) as f64;
        let n = self.per_replica.len().max(1) as f64;
        let mean = self.per_replica.iter().sum::<u64>() as f64 / n;
        if mean == 0.0 {
            0.0
        } else {
            max / mean
        }
    }

    /// Routing decisions per wall-clock second spent routing.
    pub fn decisions_per_sec(&self) -> f64 {
        let s = self.route_time.as_secs_f64();
        if s == 0.0 {
            f64::INFINITY
        } else {
            self.requests as f64 / s
        }
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// The prefix hit rate of one unbounded cache serving every request with no delay: requests
/// in arrival order, each finds its prompt's leading blocks if any earlier request's prompt or
/// response held them, then caches its own prompt and response.
///
/// It bounds the hit rate of every policy [`simulate`] runs: a request finds only blocks a
/// replica cached before the request's prefill started, and a replica starts its requests'
/// prefills in their arrival order (its queues are first come, first served), so those blocks
/// are blocks of the prompts and responses of requests that arrived before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ceiling {
    /// Prompt tokens over all requests.
    pub prompt_tokens: u64,
    /// Prompt tokens found cached.
    pub cached_tokens: u64,
}

impl Ceiling {
    /// Cached prompt tokens ÷ prompt tokens.
    pub fn hit_rate(&self) -> f64 {
        ratio(self.cached_tokens, self.prompt_tokens)
    }
}

/// Computes the [`Ceiling`] of `traffic`.
pub fn infinite_cache_ceiling(traffic: &Traffic) -> Ceiling {
    let mut cache: HashSet<u64, BlockKeys> = HashSet::default();
    let mut cached = 0u64;
    for q in traffic.requests() {
        let (seq, _) = traffic.blocks(q, q.prompt_tokens);
        let hit = seq.iter().take_while(|h| cache.contains(h)).count();
        cached += (hit * BLOCK_SIZE) as u64;
        let (all, _) = traffic.blocks(q, q.prompt_tokens.saturating_add(q.output_tokens));
        cache.extend(all);
    }
    Ceiling {
        prompt_tokens: traffic.prompt_tokens(),
        cached_tokens: cached,
    }
}

#[derive(Clone, Copy, Debug)]
enum Ev {
    Arrival(usize),
    PrefillDone(usize, usize),
    Complete(usize, usize),
}

/// Value at quantile `q` (nearest rank) of sorted `v`; 0 for an empty slice.
///
/// ```
/// assert_eq!(kvtrie::sim::quantile(&[1.0, 2.0, 3.0, 4.0], 0.5), 2.0);
/// ```
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The cluster's mutable state during a run.
struct Cluster<'t> {
    cfg: &'t SimConfig,
    traffic: &'t Traffic,
    replicas: Vec<Replica>,
    q: EventQueue<Ev>,
    ttft: Vec<f64>,
    cached_tokens: u64,
    kv_events: u64,
    events: Vec<crate::blocks::KvEvent>,
}

impl Cluster<'_> {
    /// Request `i` enters service on replica `r` now: its prefill starts at once if a lane
    /// is free, else when one frees (first come, first served).
    fn start(&mut self, i: usize, r: usize, now: Micros) {
        if let Some(i) = self.replicas[r].queue_prefill(i) {
            self.prefill(i, r, now);
        }
    }

    /// Request `i`'s prefill starts on replica `r` now: the prefix cache is looked up now
    /// (as vLLM's scheduler looks it up when it schedules a waiting request), so it finds
    /// the blocks of every prefill that completed before, including those of requests that
    /// were queued ahead of it on this replica.
    fn prefill(&mut self, i: usize, r: usize, now: Micros) {
        let req = &self.traffic.requests()[i];
        let (seq, _) = self.traffic.blocks(req, req.prompt_tokens);
        self.replicas[r].cache.set_clock(now);
        let hit = self.replicas[r].cache.lookup(seq) * BLOCK_SIZE;
        self.cached_tokens += hit as u64;
        let t = now.saturating_add(self.cfg.prefill_us(req.prompt_tokens - hit));
        self.ttft[i] = t.saturating_sub(req.arrival_us) as f64 / 1e3;
        self.q.push(t, Ev::PrefillDone(r, i));
    }

    /// Caches the first `tokens` tokens of request `i`'s stream on replica `r` and tells the
    /// policy.
    fn cache(
        &mut self,
        i: usize,
        r: usize,
        tokens: usize,
        now: Micros,
        policy: &mut dyn Policy,
    ) -> Result<(), SimError> {
        let req = &self.traffic.requests()[i];
        let (seq, local) = self.traffic.blocks(req, tokens);
        let cache = &mut self.replicas[r].cache;
        cache.set_clock(now);
        let n = seq.len().min(cache.capacity());
        self.events.clear();
        cache.insert(seq, local, &mut self.events);
        self.kv_events += self.events.len() as u64;
        policy
            .cache_update(&CacheUpdate {
                replica: r,
                request: req.id,
                seq_hashes: &seq[..n],
                local_hashes: &local[..n],
                events: &self.events,
            })
            .map_err(|error| SimError::Policy {
                request: req.id,
                error,
            })
    }
}

/// The latest simulated time a run may reach: 2^53 µs (285 years), the largest time an `f64`
/// holds exactly. Past it the engine would saturate its times, and every TTFT would read
/// 18,446,744,073,709,552 ms.
pub const MAX_CLOCK_US: f64 = (1u64 << 53) as f64;

/// Refuses a cost model or an arrival schedule under which the simulated clock could pass
/// [`MAX_CLOCK_US`] ([`simulate`] checks it first). The bound is the last arrival plus every
/// request's prefill (nothing cached) and decode, one after the other: no schedule ends later.
///
/// # Errors
///
/// Names `rate` (the synthetic arrivals and think times, or a trace's `time_scale`) when the
/// arrivals alone reach half the limit; otherwise the largest of the three cost terms.
///
/// ```
/// use kvtrie::sim::{check_clock, SimConfig, Traffic};
///
/// let ok = SimConfig { requests: 10, ..SimConfig::default() };
/// let traffic = Traffic::generate(&ok).unwrap();
/// assert!(check_clock(&ok, &traffic).is_ok());
/// let slow = SimConfig { prefill_overhead_us: 1e300, ..ok };
/// assert_eq!(check_clock(&slow, &traffic).unwrap_err().field, "prefill_overhead_us");
/// ```
pub fn check_clock(cfg: &SimConfig, traffic: &Traffic) -> Result<(), ConfigError> {
    let requests = traffic.requests();
    let last = requests.last().map_or(0, |q| q.arrival_us) as f64;
    let (mut overhead, mut prefill, mut decode) = (0.0, 0.0, 0.0);
    for q in requests {
        overhead += cfg.prefill_overhead_us;
        prefill += cfg.prefill_us_per_token * q.prompt_tokens as f64;
        decode += cfg.decode_us_per_token * q.output_tokens as f64;
    }
    if last + overhead + prefill + decode <= MAX_CLOCK_US {
        return Ok(());
    }
    if last > MAX_CLOCK_US / 2.0 {
        return Err(ConfigError {
            field: "rate",
            reason: format!(
                "the arrivals alone reach {:.0} years of simulated time (the last at {last:e} \
                 µs), past 2^53 µs: raise the rate or shorten the think times (or lower time_scale \
                 for a trace)",
                last / 1e6 / 3.156e7
            ),
        });
    }
    let field = if overhead >= prefill.max(decode) {
        "prefill_overhead_us"
    } else if prefill >= decode {
        "prefill_us_per_token"
    } else {
        "decode_us_per_token"
    };
    Err(ConfigError {
        field,
        reason: format!(
            "the cost model could run the simulated clock past 2^53 µs (285 years): {} \
             requests of {} prompt tokens at prefill_overhead_us {:e}, prefill_us_per_token \
             {:e}, decode_us_per_token {:e}; lower them",
            requests.len(),
            traffic.prompt_tokens(),
            cfg.prefill_overhead_us,
            cfg.prefill_us_per_token,
            cfg.decode_us_per_token
        ),
    })
}

/// Runs `traffic` through a fresh cluster of `cfg` routed by `policy`; `progress` is called
/// once per completed request.
///
/// # Errors
///
/// A configuration out of range (see also [`check_clock`]), a policy error, or a policy
/// choosing a replica that does not exist.
pub fn simulate(
    cfg: &SimConfig,
    traffic: &Traffic,
    policy: &mut dyn Policy,
    progress: &mut dyn FnMut(),
) -> Result<Report, SimError> {
    cfg.validate()?;
    check_clock(cfg, traffic)?;
    let requests = traffic.requests();
    let mut c = Cluster {
        cfg,
        traffic,
        replicas: (0..cfg.replicas)
            .map(|_| {
                Replica::with_prefill_lanes(cfg.cache_blocks, cfg.max_running, cfg.prefill_lanes)
            })
            .collect(),
        q: EventQueue::new(),
        ttft: vec![f64::NAN; requests.len()],
        cached_tokens: 0,
        kv_events: 0,
        events: Vec::new(),
    };
    for (i, r) in requests.iter().enumerate() {
        c.q.push(r.arrival_us, Ev::Arrival(i));
    }
    let needs = policy.needs();
    let mut loads = vec![0usize; cfg.replicas];
    let (mut token_buf, mut text_buf) = (Vec::new(), String::new());
    let mut route_time = Duration::ZERO;
    let (mut done, mut end) = (0u64, 0);

    while let Some((now, ev)) = c.q.pop() {
        match ev {
            Ev::Arrival(i) => {
                let req = &requests[i];
                let tokens = if needs.tokens {
                    traffic.tokens(req, &mut token_buf)
                } else {
                    &[]
                };
                let text = if needs.text {
                    traffic.text(req, &mut text_buf)
                } else {
                    ""
                };
                let view = RouteRequest {
                    id: req.id,
                    prompt_tokens: req.prompt_tokens,
                    tokens,
                    text,
                    seq_hashes: traffic.blocks(req, req.prompt_tokens).0,
                    output_tokens: req.output_tokens,
                };
                for (l, r) in loads.iter_mut().zip(&c.replicas) {
                    *l = r.load();
                }
                let cluster = ClusterView::new(&c.replicas, &loads);
                let t0 = Instant::now();
                let routed = policy.route(&view, &cluster);
                route_time += t0.elapsed();
                let r = routed.map_err(|error| SimError::Policy {
                    request: req.id,
                    error,
                })?;
                if r >= cfg.replicas {
                    return Err(SimError::BadReplica {
                        request: req.id,
                        replica: r,
                    });
                }
                if let Some(i) = c.replicas[r].submit(i) {
                    c.start(i, r, now);
                }
            }
            Ev::PrefillDone(r, i) => {
                let req = &requests[i];
                // The prompt's blocks are cached before the next prefill on this replica
                // starts and looks them up.
                c.cache(i, r, req.prompt_tokens, now, policy)?;
                policy.prefill_complete(req.id);
                let t = now.saturating_add(cfg.decode_us(req.output_tokens));
                c.q.push(t, Ev::Complete(r, i));
                if let Some(next) = c.replicas[r].prefill_finished() {
                    c.prefill(next, r, now);
                }
            }
            Ev::Complete(r, i) => {
                let req = &requests[i];
                let all = req.prompt_tokens.saturating_add(req.output_tokens);
                c.cache(i, r, all, now, policy)?;
                policy.request_complete(req.id);
                done += 1;
                end = now;
                progress();
                if let Some(next) = c.replicas[r].finish() {
                    c.start(next, r, now);
                }
            }
        }
    }
    let mut sorted = c.ttft.clone();
    sorted.sort_by(f64::total_cmp);
    Ok(Report {
        policy: policy.name().to_string(),
        requests: done,
        prompt_tokens: traffic.prompt_tokens(),
        cached_tokens: c.cached_tokens,
        ttft_mean_ms: if sorted.is_empty() {
            0.0
        } else {
            sorted.iter().sum::<f64>() / sorted.len() as f64
        },
        ttft_p50_ms: quantile(&sorted, 0.5),
        ttft_p99_ms: quantile(&sorted, 0.99),
        per_replica: c.replicas.iter().map(|r| r.assigned).collect(),
        makespan_s: end as f64 / 1e6,
        kv_events: c.kv_events,
        route_time,
        ttft_ms: c.ttft,
    })
}

//! A discrete-event simulation of an LLM serving cluster, for comparing routing policies on
//! identical traffic (feature `sim`; `examples/simulate` is its command line).
//!
//! The engine depends only on the public API of the routers and structures it drives
//! ([`PrefixAffinityRouter`](crate::router::PrefixAffinityRouter),
//! [`KvAwareRouter`](crate::router::KvAwareRouter), [`BlockIndex`](crate::blocks::BlockIndex)).
//! Everything is deterministic in the configuration and the traffic except the one wall-clock
//! figure, the time spent inside each policy's routing call.
//!
//! # The model
//!
//! **Traffic** is either synthetic ([`Traffic::generate`]: multi-turn conversations over shared
//! system prompts) or a replayed request trace ([`Traffic::from_trace`], Mooncake format, see
//! [`parse_trace`]; trace blocks of 512 tokens by default, any multiple of [`BLOCK_SIZE`] with
//! [`SimConfig::trace_block_tokens`] and [`parse_trace_with`]). A request is a prompt of tokens
//! and a response length. Prompts are cut into engine blocks of [`BLOCK_SIZE`] tokens hashed
//! as an engine would (local and chained sequence hashes,
//! [`BlockHasher`](crate::blocks::BlockHasher)); text-based policies see the tokens
//! rendered as text ([`render`], [`CHARS_PER_TOKEN`] letters per token), so every policy
//! routes the same traffic and two prompts share a text prefix exactly when they share a token
//! prefix.
//!
//! **Replicas** ([`Replica`]) serve at most `max_running` requests at once and queue the rest
//! (FIFO). A replica computes `prefill_lanes` prefills at a time (default 1, as an engine's
//! GPU does: a prefill queued behind another waits for it, first come first served, as vLLM's
//! scheduler serves waiting prefills). When a request's prefill **starts**, it looks up its
//! prompt's blocks in the replica's prefix cache ([`LruCache`], keyed by sequence hashes, so a
//! block is reusable only with its whole prefix): the leading cached blocks are a hit. The
//! lookup is made then, not when the request entered service, as vLLM's scheduler looks up
//! the prefix cache when it schedules a waiting request: a request queued behind the prefill
//! of the same prefix finds the blocks that prefill computed, and loses the blocks evicted
//! while it waited. The prefill takes `prefill_overhead + per-token cost × uncached tokens`
//! of compute. The time to first token (TTFT) is queueing + prefill wait + prefill. Decode
//! then takes `per-token cost × output tokens`, concurrently for the running requests. The
//! prompt's blocks are cached when the prefill completes (before the next prefill on the
//! replica starts), prompt + response blocks when the request completes; the cache publishes
//! the KV events an engine would (`Removed` for evictions, `Stored` chained to the parent
//! block), delivered to the policy at once. Blocks of running requests are not pinned, two
//! prefills computed at once (`prefill_lanes` > 1) do not share the blocks they compute, and
//! a replica's decode speed does not depend on its load (simplifications).
//!
//! **Policies** ([`Policy`]): round-robin, power of two choices, the prefix-affinity router
//! (Ray's and SGLang's presets, learning from their own routing decisions), the KV-aware router
//! (fed the caches' KV events and the requests' prefill/completion at simulated times), and an
//! [`Oracle`] that sees every cache and queue. [`RouterSetup`] runs a stateful policy as
//! several independent router instances, isolated or sharing state.
//! [`infinite_cache_ceiling`] bounds every policy's hit rate.
//!
//! ```
//! use kvtrie::sim::{simulate, standard_policies, RouterSetup, SimConfig, Traffic};
//!
//! let cfg = SimConfig { requests: 200, ..SimConfig::default() };
//! let traffic = Traffic::generate(&cfg).unwrap();
//! let mut reports = Vec::new();
//! for mut policy in standard_policies(&cfg, RouterSetup::single()) {
//!     reports.push(simulate(&cfg, &traffic, policy.as_mut(), &mut || {}).unwrap());
//! }
//! assert!(reports.iter().all(|r| r.requests == 200));
//! ```

mod cache;
mod clock;
mod config;
mod policy;
mod replica;
mod routers;
mod run;
mod trace;
mod traffic;

pub use cache::LruCache;
pub use clock::EventQueue;
pub use config::{ConfigError, SimConfig, MAX_REPLICAS, MAX_RUNNING, MAX_SIM_TOKENS};
pub use policy::{
    CacheUpdate, ClusterView, Needs, Oracle, Policy, PolicyError, PowerOfTwo, RoundRobin,
    RouteRequest,
};
pub use replica::Replica;
pub use routers::{
    kv_config, standard_policies, KvAware, PrefixAffinity, RouterSetup, MAX_ROUTER_INSTANCES,
};
pub use run::{
    check_clock, infinite_cache_ceiling, quantile, simulate, Ceiling, Report, SimError,
    MAX_CLOCK_US,
};
pub use trace::{
    check_trace_block_tokens, fitting_block_tokens, parse_trace, parse_trace_str,
    parse_trace_str_with, parse_trace_with, TraceError, TraceRecord, COMMON_TRACE_BLOCK_TOKENS,
    MAX_LINE_BYTES, MAX_TRACE_TOKENS, TRACE_BLOCK_TOKENS,
};
pub use traffic::{render, render_token, Request, Traffic, MAX_CACHED_OUTPUT_TOKENS};

/// Tokens per KV block (vLLM's and Dynamo's default).
pub const BLOCK_SIZE: usize = 16;
/// Token ids are in `0..VOCAB` (the W4 vocabulary).
pub const VOCAB: u64 = 32_000;
/// Every token is rendered as this many lowercase letters (base 26, fixed width), so two
/// prompts share a token prefix exactly when their texts share the rendered prefix. Four
/// characters per token is also about what English text averages under common tokenizers,
/// so character budgets of text routers read as token budgets × 4.
pub const CHARS_PER_TOKEN: usize = 4;

/// Simulated time, in microseconds.
pub type Micros = u64;

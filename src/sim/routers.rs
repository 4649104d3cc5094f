//! The crate's routers as simulated policies ([`PrefixAffinity`], [`KvAware`]), run as one or
//! several router instances ([`RouterSetup`]), and [`standard_policies`].

use std::collections::HashSet;
use std::sync::Arc;

use super::cache::BlockKeys;
use super::policy::{CacheUpdate, ClusterView, Needs, Oracle, Policy, PolicyError, PowerOfTwo};
use super::policy::{RoundRobin, RouteRequest};
use super::{SimConfig, BLOCK_SIZE};
use crate::blocks::{BlockIndex, KvEvent, StoredBlock, WorkerId};
use crate::router::{
    Candidate, KvAwareConfig, KvAwareRouter, PrefixAffinityConfig, PrefixAffinityRouter, ReplicaId,
};

/// The most router instances a policy creates ([`RouterSetup::instances`] is clamped to
/// `1..=MAX_ROUTER_INSTANCES`).
pub const MAX_ROUTER_INSTANCES: usize = 256;

/// How many router instances serve the traffic, and whether they share what they learn.
///
/// Request `id` goes to instance `id % instances` (each instance receives 1/K of the
/// requests, as behind a round-robin load balancer). Isolated instances learn only from the
/// requests they routed; shared instances learn from all of them:
///
/// - prefix-affinity instances share one tree (each applies the others' routing decisions
///   as they are made) or keep one tree each;
/// - KV-aware instances share one block index fed every engine's KV events (as each would
///   subscribe to every engine), or each index learns only the blocks its own requests left
///   in the caches (and their evictions). Load bookings stay per instance in both modes.
///
/// ```
/// use kvtrie::sim::RouterSetup;
/// assert_eq!(RouterSetup::single(), RouterSetup { instances: 1, shared: false });
/// assert_eq!(RouterSetup::shared(4).label(), "4 shared");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterSetup {
    /// Router instances (clamped to `1..=`[`MAX_ROUTER_INSTANCES`]).
    pub instances: usize,
    /// Whether the instances share state.
    pub shared: bool,
}

impl RouterSetup {
    /// One router.
    pub fn single() -> Self {
        Self {
            instances: 1,
            shared: false,
        }
    }

    /// `k` isolated routers.
    pub fn isolated(k: usize) -> Self {
        Self {
            instances: k,
            shared: false,
        }
    }

    /// `k` routers sharing state.
    pub fn shared(k: usize) -> Self {
        Self {
            instances: k,
            shared: true,
        }
    }

    /// The number of instances a policy creates.
    pub fn count(&self) -> usize {
        self.instances.clamp(1, MAX_ROUTER_INSTANCES)
    }

    /// `"1"`, `"4 isolated"`, `"4 shared"`.
    pub fn label(&self) -> String {
        match (self.count(), self.shared) {
            (1, _) => "1".into(),
            (k, true) => format!("{k} shared"),
            (k, false) => format!("{k} isolated"),
        }
    }

    fn instance(&self, request: u64) -> usize {
        (request % self.count() as u64) as usize
    }
}

/// [`PrefixAffinityRouter`] (Ray's policy, or SGLang's with [`PrefixAffinityConfig::sglang`]):
/// routes on the prompt text with the replicas' queue lengths; learns only from routing
/// decisions (it is not fed the caches' events, as in Ray and SGLang).
pub struct PrefixAffinity {
    name: String,
    setup: RouterSetup,
    routers: Vec<PrefixAffinityRouter>,
    /// The replicas' ids in each router's tree, by replica index.
    ids: Vec<Vec<ReplicaId>>,
    candidates: Vec<Candidate>,
}

impl PrefixAffinity {
    /// Routers over `replicas` replicas named `replica-0`...; instance `i` is seeded with
    /// `config.seed + i`.
    pub fn new(
        name: &str,
        config: PrefixAffinityConfig,
        replicas: usize,
        setup: RouterSetup,
    ) -> Self {
        let names: Vec<String> = (0..replicas).map(|i| format!("replica-{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut routers: Vec<PrefixAffinityRouter> = Vec::new();
        for i in 0..setup.count() {
            let config = PrefixAffinityConfig {
                seed: config.seed.wrapping_add(i as u64),
                ..config
            };
            let router = match routers.first() {
                Some(first) if setup.shared => {
                    PrefixAffinityRouter::with_tree(first.tree().clone(), config)
                }
                _ => PrefixAffinityRouter::new(config),
            };
            routers.push(router);
        }
        let ids = routers.iter().map(|r| r.update_replicas(&refs)).collect();
        Self {
            name: name.to_string(),
            setup,
            routers,
            ids,
            candidates: Vec::with_capacity(replicas),
        }
    }

    /// The router instances.
    pub fn routers(&self) -> &[PrefixAffinityRouter] {
        &self.routers
    }
}

impl Policy for PrefixAffinity {
    fn name(&self) -> &str {
        &self.name
    }
    fn needs(&self) -> Needs {
        Needs {
            tokens: false,
            text: true,
        }
    }
    fn route(&mut self, req: &RouteRequest<'_>, c: &ClusterView<'_>) -> Result<usize, PolicyError> {
        let i = self.setup.instance(req.id);
        let ids = &self.ids[i];
        self.candidates.clear();
        self.candidates.extend(
            ids.iter()
                .zip(c.loads())
                .map(|(&id, &l)| Candidate::new(id, l)),
        );
        let route = self.routers[i]
            .route(req.text, &self.candidates)
            .map_err(|e| PolicyError(format!("{}: {e}", self.name)))?;
        ids.iter()
            .position(|&id| id == route.replica)
            .ok_or_else(|| PolicyError(format!("{}: routed to an unknown replica", self.name)))
    }
}

/// [`KvAwareRouter`] (Dynamo's cost policy): its [`BlockIndex`] is fed the caches' KV
/// events as they happen; the booking is released by `prefill_complete` /
/// `request_complete` at the simulated times. The expected output length passed to it is the
/// true one (an oracle's knowledge).
pub struct KvAware {
    setup: RouterSetup,
    routers: Vec<KvAwareRouter>,
    workers: Vec<WorkerId>,
    /// Isolated instances only: the blocks instance `i` knows on replica `r`,
    /// `known[i][r]` (what its index holds for that worker).
    known: Vec<Vec<HashSet<u64, BlockKeys>>>,
    removed: Vec<u64>,
}

impl KvAware {
    /// Routers over workers `WorkerId(0)..WorkerId(replicas)` with `config` (its
    /// `block_size` must be [`BLOCK_SIZE`]); instance `i` is seeded with `config.seed + i`.
    pub fn new(config: KvAwareConfig, replicas: usize, setup: RouterSetup) -> Self {
        let k = setup.count();
        let isolated = !setup.shared && k > 1;
        let shared_index = Arc::new(BlockIndex::with_hasher(&config.hasher()));
        let routers = (0..k)
            .map(|i| {
                let config = KvAwareConfig {
                    seed: config.seed.wrapping_add(i as u64),
                    ..config.clone()
                };
                if isolated {
                    KvAwareRouter::new(config)
                } else {
                    KvAwareRouter::with_index(shared_index.clone(), config)
                }
            })
            .collect();
        let known = if isolated {
            vec![vec![HashSet::default(); replicas]; k]
        } else {
            Vec::new()
        };
        Self {
            setup,
            routers,
            workers: (0..replicas as u64).map(WorkerId).collect(),
            known,
            removed: Vec::new(),
        }
    }

    /// The router instances.
    pub fn routers(&self) -> &[KvAwareRouter] {
        &self.routers
    }

    fn apply(&self, i: usize, worker: WorkerId, e: KvEvent) -> Result<(), PolicyError> {
        self.routers[i]
            .index()
            .apply(worker, e)
            .map_err(|e| PolicyError(format!("kv-aware: event rejected: {e}")))
    }

    /// Isolated instances: evictions reach every instance that knew the block; the blocks
    /// the request cached reach the instance that routed it.
    fn isolated_update(&mut self, u: &CacheUpdate<'_>) -> Result<(), PolicyError> {
        let worker = self.workers[u.replica];
        for e in u.events {
            let KvEvent::Removed { engine_hashes } = e else {
                continue;
            };
            for i in 0..self.known.len() {
                let known = &mut self.known[i][u.replica];
                self.removed.clear();
                self.removed
                    .extend(engine_hashes.iter().filter(|h| known.remove(h)));
                if !self.removed.is_empty() {
                    let engine_hashes = std::mem::take(&mut self.removed);
                    self.apply(i, worker, KvEvent::Removed { engine_hashes })?;
                }
            }
        }
        // The known blocks of a sequence are a prefix of it: the cache evicts a block's
        // descendants before the block (they are less recently used).
        let owner = self.setup.instance(u.request);
        let known = &mut self.known[owner][u.replica];
        let m = u
            .seq_hashes
            .iter()
            .take_while(|h| known.contains(h))
            .count();
        if m == u.seq_hashes.len() {
            return Ok(());
        }
        known.extend(&u.seq_hashes[m..]);
        let blocks = u.seq_hashes[m..]
            .iter()
            .zip(&u.local_hashes[m..])
            .map(|(&engine_hash, &local_hash)| StoredBlock {
                engine_hash,
                local_hash,
            })
            .collect();
        let parent = m.checked_sub(1).map(|p| u.seq_hashes[p]);
        self.apply(owner, worker, KvEvent::Stored { parent, blocks })
    }
}

impl Policy for KvAware {
    fn name(&self) -> &str {
        "kv-aware"
    }
    fn needs(&self) -> Needs {
        Needs {
            tokens: true,
            text: false,
        }
    }
    fn route(
        &mut self,
        req: &RouteRequest<'_>,
        _c: &ClusterView<'_>,
    ) -> Result<usize, PolicyError> {
        let i = self.setup.instance(req.id);
        let s = self.routers[i]
            .select_and_reserve(req.id, req.tokens, &self.workers, req.output_tokens)
            .map_err(|e| PolicyError(format!("kv-aware: {e}")))?;
        Ok(s.worker.0 as usize)
    }
    fn cache_update(&mut self, u: &CacheUpdate<'_>) -> Result<(), PolicyError> {
        if !self.known.is_empty() {
            return self.isolated_update(u);
        }
        let worker = self.workers[u.replica];
        for e in u.events {
            self.apply(0, worker, e.clone())?;
        }
        Ok(())
    }
    fn prefill_complete(&mut self, id: u64) {
        self.routers[self.setup.instance(id)].prefill_complete(id);
    }
    fn request_complete(&mut self, id: u64) {
        self.routers[self.setup.instance(id)].request_complete(id);
    }
}

/// The KV-aware router's configuration for `cfg`: [`BLOCK_SIZE`]-token blocks, the overlap
/// weight and temperature of `cfg`, seeded with `cfg.seed`.
pub fn kv_config(cfg: &SimConfig) -> KvAwareConfig {
    KvAwareConfig {
        overlap_weight: cfg.kv_overlap_weight,
        temperature: cfg.kv_temperature,
        seed: cfg.seed,
        ..KvAwareConfig::new(BLOCK_SIZE)
    }
}

/// The policies compared by the simulator, in display order: round-robin, power of two
/// choices, prefix affinity (Ray, SGLang), KV-aware, and the oracle. The three routers run as
/// `setup` says; the others have no state worth sharing and run as one instance.
pub fn standard_policies(cfg: &SimConfig, setup: RouterSetup) -> Vec<Box<dyn Policy>> {
    vec![
        Box::new(RoundRobin::default()),
        Box::new(PowerOfTwo::new(cfg.seed ^ 0x5EED)),
        Box::new(PrefixAffinity::new(
            "prefix-affinity (ray)",
            PrefixAffinityConfig::default(),
            cfg.replicas,
            setup,
        )),
        Box::new(PrefixAffinity::new(
            "prefix-affinity (sglang)",
            // SGLang's eviction runs on wall-clock time, which a simulation does not follow
            // (a run replays hours in seconds): off, so results depend only on the traffic.
            PrefixAffinityConfig {
                eviction: None,
                ..PrefixAffinityConfig::sglang()
            },
            cfg.replicas,
            setup,
        )),
        Box::new(KvAware::new(kv_config(cfg), cfg.replicas, setup)),
        Box::new(Oracle::new(cfg.oracle_slack)),
    ]
}

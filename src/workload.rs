//! The standard benchmark workloads (W1–W6 of `WORKLOADS.md`), shared by the benches, the
//! examples (`report`, `scaling`, `soak`, `kv_soak`, `insert_cost`) and the tests, so every figure is measured on the same data.
//!
//! ```
//! use kvtrie::workload::SplitMix64;
//! let mut r = SplitMix64::new(42);
//! let t = r.text(8);
//! assert_eq!(t.len(), 8);
//! assert!(t.bytes().all(|b| b.is_ascii_lowercase()));
//! ```

pub use crate::rng::SplitMix64;

/// The 64 symbols of workload W3: 26 ASCII letters, 14 two-byte, 14 three-byte and 10
/// four-byte characters, in that order.
pub const UNICODE_ALPHABET: [char; 64] = [
    'a', 'b', 'c', 'd', 'e', 'f', 'g', 'h', 'i', 'j', 'k', 'l', 'm', 'n', 'o', 'p', 'q', 'r', 's',
    't', 'u', 'v', 'w', 'x', 'y', 'z', 'é', 'ж', 'ß', 'ğ', 'ø', 'ł', 'ñ', 'ç', 'ü', 'ö', 'ä', 'å',
    'π', 'λ', '中', '文', '字', '日', '本', '語', '한', '국', '어', '→', '∑', '∞', '€', '₹', '🙂',
    '🚀', '🎉', '🔥', '💡', '🌍', '🍕', '🎵', '🧠', '🐍',
];

impl SplitMix64 {
    /// `len` ASCII lowercase letters (the W1 alphabet).
    pub fn text(&mut self, len: usize) -> String {
        (0..len)
            .map(|_| (b'a' + self.below(26) as u8) as char)
            .collect()
    }

    /// `len` chars from [`UNICODE_ALPHABET`] (the W3 alphabet).
    pub fn unicode_text(&mut self, len: usize) -> String {
        (0..len)
            .map(|_| UNICODE_ALPHABET[self.below(64) as usize])
            .collect()
    }

    /// `len` tokens in `0..32000` (the W4 vocabulary).
    pub fn tokens(&mut self, len: usize) -> Vec<u32> {
        (0..len).map(|_| self.below(32_000) as u32).collect()
    }
}

/// Workload W1 (`chat`, seed 42) or, with `unicode`, W3 (`unicode`, seed 42).
#[derive(Clone, Debug)]
pub struct ChatWorkload {
    /// Tenant names `r0`..`r15`.
    pub tenants: Vec<String>,
    /// The 10,000 prompts; prompt `i` is inserted for tenant `i % 16`.
    pub prompts: Vec<String>,
    /// The query prompts, generated the same way after the prompts.
    pub queries: Vec<String>,
    /// The 100 system prompts.
    pub system: Vec<String>,
    /// Index into `system` of each query's system prompt.
    pub query_system: Vec<usize>,
}

impl ChatWorkload {
    /// W1 with the standard sizes (10,000 prompts, `queries` queries; the standard is 200,000).
    pub fn w1(queries: usize) -> Self {
        Self::generate(false, 10_000, queries)
    }

    /// W3: W1 over the 64-symbol mixed alphabet.
    pub fn w3(queries: usize) -> Self {
        Self::generate(true, 10_000, queries)
    }

    /// The generator with explicit sizes (smaller sizes are prefixes of the standard stream
    /// only for the system prompts; use the standard sizes for published figures).
    pub fn generate(unicode: bool, prompts: usize, queries: usize) -> Self {
        let mut r = SplitMix64::new(42);
        let text = |r: &mut SplitMix64, n: usize| {
            if unicode {
                r.unicode_text(n)
            } else {
                r.text(n)
            }
        };
        let system: Vec<String> = (0..100).map(|_| text(&mut r, 2000)).collect();
        let prompt = |r: &mut SplitMix64| {
            let k = r.below(100) as usize;
            let n = 50 + r.below(451) as usize;
            let mut p = system[k].clone();
            p.push_str(&text(r, n));
            (k, p)
        };
        let prompts = (0..prompts).map(|_| prompt(&mut r).1).collect();
        let (query_system, queries) = (0..queries).map(|_| prompt(&mut r)).unzip();
        Self {
            tenants: (0..16).map(|i| format!("r{i}")).collect(),
            prompts,
            queries,
            system,
            query_system,
        }
    }
}

/// Workload W2 (`multiturn`, seed 7): 1,000 conversations of 8 turns over 20 system prompts.
#[derive(Clone, Debug)]
pub struct MultiturnWorkload {
    /// Tenant names `r0`..`r15`.
    pub tenants: Vec<String>,
    /// `(conversation, whole prompt at this turn)` in routing order (turn-major).
    pub requests: Vec<(usize, String)>,
}

impl MultiturnWorkload {
    /// The standard W2.
    pub fn w2() -> Self {
        Self::generate(1000, 8)
    }

    /// W2 with explicit sizes.
    pub fn generate(conversations: usize, turns: usize) -> Self {
        let mut r = SplitMix64::new(7);
        let system: Vec<String> = (0..20).map(|_| r.text(4000)).collect();
        let mut convs: Vec<String> = (0..conversations)
            .map(|_| system[r.below(20) as usize].clone())
            .collect();
        let mut requests = Vec::with_capacity(conversations * turns);
        for _ in 0..turns {
            for (c, conv) in convs.iter_mut().enumerate() {
                let n = 100 + r.below(901) as usize;
                conv.push_str(&r.text(n));
                requests.push((c, conv.clone()));
            }
        }
        Self {
            tenants: (0..16).map(|i| format!("r{i}")).collect(),
            requests,
        }
    }
}

/// Workload W4 (`kv`, seed 1337): token sequences stored on 16 workers, and queries.
#[derive(Clone, Debug)]
pub struct KvWorkload {
    /// Block size in tokens (16).
    pub block_size: usize,
    /// The 10,000 stored requests; request `i` is stored on worker `i % 16`.
    pub requests: Vec<Vec<u32>>,
    /// The query requests.
    pub queries: Vec<Vec<u32>>,
}

impl KvWorkload {
    /// The standard W4 with `queries` queries (the standard is 200,000).
    pub fn w4(queries: usize) -> Self {
        Self::generate(10_000, queries)
    }

    /// W4 with explicit sizes.
    pub fn generate(requests: usize, queries: usize) -> Self {
        let mut r = SplitMix64::new(1337);
        let system: Vec<Vec<u32>> = (0..100).map(|_| r.tokens(2048)).collect();
        let req = |r: &mut SplitMix64| {
            let mut v = system[r.below(100) as usize].clone();
            let n = 64 + r.below(961) as usize;
            v.extend(r.tokens(n));
            v
        };
        let requests = (0..requests).map(|_| req(&mut r)).collect();
        let queries = (0..queries).map(|_| req(&mut r)).collect();
        Self {
            block_size: 16,
            requests,
            queries,
        }
    }
}

/// The W6 (`churn`) alphabet: chars whose UTF-8 encodings share lead bytes (é/è, 🙂/🙃), a
/// NUL and a three-byte char.
pub const CHURN_ALPHABET: [char; 8] = ['a', 'b', 'é', 'è', '🙂', '🙃', '\0', '中'];

/// Tenants of workload W6.
pub const CHURN_TENANTS: usize = 6;

/// One operation of workload W6 (`churn`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChurnOp {
    /// Text routed with `match_and_insert` (1–40 chars of [`CHURN_ALPHABET`]).
    pub text: String,
    /// Index of the tenant (in `0..CHURN_TENANTS`) it is inserted for.
    pub tenant: usize,
    /// Timestamp of the insert.
    pub ts: u64,
    /// `Some(n)` (1 op in 11): then evict `n` chars (1–200) of that tenant by LRU.
    pub evict: Option<usize>,
    /// `Some(i)` (5 ops in 100,000, on a stream made with `replaces`): replace tenant `i`
    /// (`remove_tenant`, then `add_tenant` under a fresh name).
    pub replace: Option<usize>,
}

/// Workload W6 (`churn`, sustained write churn): an endless stream of [`ChurnOp`]s.
///
/// ```
/// let mut w = kvtrie::workload::ChurnWorkload::new(1, true);
/// let op = w.next_op();
/// assert!((1..=40).contains(&op.text.chars().count()));
/// ```
#[derive(Clone, Debug)]
pub struct ChurnWorkload {
    rng: SplitMix64,
    replaces: bool,
}

impl ChurnWorkload {
    /// A stream seeded with `seed`; `replaces`: whether it replaces tenants (one thread of a
    /// multi-threaded run does).
    pub fn new(seed: u64, replaces: bool) -> Self {
        Self {
            rng: SplitMix64::new(seed),
            replaces,
        }
    }

    /// The next operation.
    pub fn next_op(&mut self) -> ChurnOp {
        let r = &mut self.rng;
        let len = 1 + r.below(40) as usize;
        let text = (0..len)
            .map(|_| CHURN_ALPHABET[r.below(CHURN_ALPHABET.len() as u64) as usize])
            .collect();
        let tenant = r.below(CHURN_TENANTS as u64) as usize;
        let ts = r.below(1 << 20);
        let evict = (r.below(11) == 0).then(|| 1 + r.below(200) as usize);
        let replace =
            (self.replaces && r.below(100_000) < 5).then(|| r.below(CHURN_TENANTS as u64) as usize);
        ChurnOp {
            text,
            tenant,
            ts,
            evict,
            replace,
        }
    }
}

/// Applies W6 operations to a shared tree from any number of threads (the soak example and the
/// churn tests drive it).
pub struct ChurnDriver {
    tree: std::sync::Arc<crate::tree::PrefixTree>,
    /// The current tenant of each of the W6 tenant positions, packed `slot << 32 | generation`.
    tenants: [crate::sync::AtomicU64; CHURN_TENANTS],
    renamed: crate::sync::AtomicU64,
}

impl ChurnDriver {
    /// Registers the W6 tenants `t0`..`t5` on `tree`.
    pub fn new(tree: std::sync::Arc<crate::tree::PrefixTree>) -> Self {
        let tenants = std::array::from_fn(|i| {
            crate::sync::AtomicU64::new(Self::pack(tree.add_tenant(&format!("t{i}"))))
        });
        Self {
            tree,
            tenants,
            renamed: crate::sync::AtomicU64::new(0),
        }
    }

    fn pack(t: crate::tenant::TenantId) -> u64 {
        (t.slot() as u64) << 32 | u64::from(t.generation())
    }

    fn tenant(&self, i: usize) -> crate::tenant::TenantId {
        let v = self.tenants[i].load(crate::sync::Ordering::Relaxed);
        crate::tenant::TenantId::new((v >> 32) as u32, v as u32)
    }

    /// The tree.
    pub fn tree(&self) -> &std::sync::Arc<crate::tree::PrefixTree> {
        &self.tree
    }

    /// Applies one operation; with `evict_inline`, its LRU eviction too (otherwise a
    /// background eviction thread is expected to do the freeing). An insert for a tenant that
    /// another thread replaced meanwhile is rejected by the tree and ignored here.
    pub fn apply(&self, op: &ChurnOp, out: &mut crate::tree::PrefixMatch, evict_inline: bool) {
        let t = self.tenant(op.tenant);
        let _ = self
            .tree
            .match_and_insert(&op.text, None, op.ts, out, |_| Some(t));
        if let (true, Some(n)) = (evict_inline, op.evict) {
            self.tree.evict_tenant_by_lru(t, n);
        }
        if let Some(i) = op.replace {
            self.tree.remove_tenant(self.tenant(i));
            let k = self.renamed.fetch_add(1, crate::sync::Ordering::Relaxed);
            let new = self.tree.add_tenant(&format!("t{i}-{k}"));
            self.tenants[i].store(Self::pack(new), crate::sync::Ordering::Relaxed);
        }
    }
}

/// The process's resident set in bytes (Linux `/proc/self/status`, `VmRSS`: what an operator
/// sees, the allocator's free lists and fragmentation included); `None` where it cannot be
/// read. The soaks print it next to the live heap.
pub fn resident_set_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// A global allocator that counts live heap bytes (the soak example and the churn tests install
/// it to measure the live heap against the structures' own figures).
///
/// ```
/// #[global_allocator]
/// static ALLOC: kvtrie::workload::CountingAlloc = kvtrie::workload::CountingAlloc::new();
///
/// fn main() {
///     let before = ALLOC.live();
///     let block = vec![1u8; 1 << 20];
///     assert!(ALLOC.live() >= before + (1 << 20));
///     drop(block);
///     assert!(ALLOC.live() < before + (1 << 20));
/// }
/// ```
#[derive(Debug)]
pub struct CountingAlloc {
    live: crate::sync::os::atomic::AtomicUsize,
}

impl CountingAlloc {
    /// A counter at zero.
    pub const fn new() -> Self {
        Self {
            live: crate::sync::os::atomic::AtomicUsize::new(0),
        }
    }

    /// Bytes allocated and not yet freed through this allocator.
    pub fn live(&self) -> usize {
        self.live.load(crate::sync::os::atomic::Ordering::Relaxed)
    }
}

impl Default for CountingAlloc {
    fn default() -> Self {
        Self::new()
    }
}

// Safety: every call is forwarded to `System` with the caller's arguments; the counter is
// only bookkeeping.
unsafe impl std::alloc::GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        // Safety: forwarded with the caller's layout (the caller upholds `alloc`'s contract).
        let p = unsafe { std::alloc::System.alloc(l) };
        if !p.is_null() {
            self.live
                .fetch_add(l.size(), crate::sync::os::atomic::Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        // Safety: forwarded: `p` was allocated by `System` with `l` (through `alloc`).
        unsafe { std::alloc::System.dealloc(p, l) };
        self.live
            .fetch_sub(l.size(), crate::sync::os::atomic::Ordering::Relaxed);
    }

    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, new: usize) -> *mut u8 {
        // Safety: forwarded with the caller's arguments.
        let q = unsafe { std::alloc::System.realloc(p, l, new) };
        if !q.is_null() {
            self.live
                .fetch_add(new, crate::sync::os::atomic::Ordering::Relaxed);
            self.live
                .fetch_sub(l.size(), crate::sync::os::atomic::Ordering::Relaxed);
        }
        q
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_known_values() {
        // Reference values of SplitMix64 with seed 0 (Vigna's reference implementation).
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next(), 0x6E78_9E6A_A1B9_65F4);
    }

    /// W1 as `WORKLOADS.md` writes it, with the generator spelled out: `below(n)` is
    /// `next() % n`; 100 system prompts of `text(2000)`, then each prompt is
    /// `system[below(100)] + text(50 + below(451))`.
    #[test]
    fn w1_follows_the_recipe_of_workloads_md() {
        fn text(below: &mut impl FnMut(u64) -> u64, len: u64) -> String {
            (0..len).map(|_| (b'a' + below(26) as u8) as char).collect()
        }
        fn prompt(below: &mut impl FnMut(u64) -> u64, system: &[String]) -> (usize, String) {
            let k = below(100) as usize;
            let n = 50 + below(451);
            (k, system[k].clone() + &text(below, n))
        }
        let mut r = SplitMix64::new(42);
        let mut below = |n: u64| r.next() % n;
        let system: Vec<String> = (0..100).map(|_| text(&mut below, 2000)).collect();
        let prompts: Vec<String> = (0..300).map(|_| prompt(&mut below, &system).1).collect();
        let queries: Vec<(usize, String)> = (0..20).map(|_| prompt(&mut below, &system)).collect();
        let w = ChatWorkload::generate(false, 300, 20);
        assert_eq!(w.system, system);
        assert_eq!(w.prompts, prompts);
        assert_eq!(
            w.query_system,
            queries.iter().map(|q| q.0).collect::<Vec<_>>()
        );
        assert_eq!(
            w.queries,
            queries.into_iter().map(|q| q.1).collect::<Vec<_>>()
        );
        assert_eq!(w.tenants.len(), 16);
    }

    #[test]
    fn unicode_alphabet_widths() {
        let widths: Vec<usize> = UNICODE_ALPHABET.iter().map(|c| c.len_utf8()).collect();
        assert!(widths[..26].iter().all(|&w| w == 1));
        assert!(widths[26..40].iter().all(|&w| w == 2));
        assert!(widths[40..54].iter().all(|&w| w == 3));
        assert!(widths[54..].iter().all(|&w| w == 4));
    }
}

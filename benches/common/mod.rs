//! Competitors shared by the benches and the `report` example: a plain single-threaded radix
//! tree (the "unsynchronized" yardstick of WORKLOADS.md) and the same tree behind an `RwLock`
//! (the lock-based design of today's routers).
#![allow(dead_code)]

use kvtrie::{PrefixMatch, TenantId};
use std::sync::RwLock;

/// The route cycles' choice for query `i`: an owner of the longest match (the `i`-th,
/// cyclically), or tenant `i` round-robin on a miss.
pub fn w1_choice(m: &PrefixMatch, i: usize, ids: &[TenantId]) -> TenantId {
    let k = m.tenants.len();
    if k > 0 && m.matched_chars > 0 {
        m.tenants.as_slice()[i % k]
    } else {
        ids[i % ids.len()]
    }
}

/// A straightforward sequential radix tree: byte edges split at char boundaries, sorted child
/// vectors, a 64-bit owner mask and per-owner timestamps. No eviction, no accounting.
#[derive(Default)]
pub struct SeqTree {
    nodes: Vec<SeqNode>,
}

struct SeqNode {
    text: Box<[u8]>,
    children: Vec<(u32, u32)>,
    owners: u64,
    ts: Vec<(u8, u64)>,
}

fn key(s: &[u8]) -> u32 {
    let w = match s[0] {
        0x00..=0x7F => 1,
        0xC0..=0xDF => 2,
        0xE0..=0xEF => 3,
        _ => 4,
    }
    .min(s.len());
    s[..w]
        .iter()
        .enumerate()
        .fold(0u32, |k, (i, &b)| k | (b as u32) << (24 - 8 * i))
}

/// Common prefix snapped to a char boundary, with the same fast paths as kvtrie's (a `memcmp`
/// for whole edges, 32-byte blocks otherwise), so the comparison is about the tree, not memcmp.
fn lcp(a: &[u8], b: &[u8]) -> usize {
    if b.len() >= a.len() && &b[..a.len()] == a {
        return a.len();
    }
    let m = a.len().min(b.len());
    let mut n = 0;
    while n + 32 <= m && a[n..n + 32] == b[n..n + 32] {
        n += 32;
    }
    while n < m && a[n] == b[n] {
        n += 1;
    }
    if n < a.len() && n < b.len() {
        while n > 0 && (a[n] as i8) < -0x40 {
            n -= 1;
        }
    }
    n
}

impl SeqTree {
    pub fn new() -> Self {
        Self {
            nodes: vec![SeqNode {
                text: Box::new([]),
                children: Vec::new(),
                owners: 0,
                ts: Vec::new(),
            }],
        }
    }

    fn child(&self, n: usize, k: u32) -> Option<usize> {
        let c = &self.nodes[n].children;
        c.binary_search_by_key(&k, |x| x.0)
            .ok()
            .map(|i| c[i].1 as usize)
    }

    fn touch(&mut self, n: usize, t: u8, ts: u64) {
        let node = &mut self.nodes[n];
        node.owners |= 1 << t;
        match node.ts.iter_mut().find(|x| x.0 == t) {
            Some(x) => x.1 = x.1.max(ts),
            None => node.ts.push((t, ts)),
        }
    }

    pub fn insert(&mut self, text: &str, t: u8, ts: u64) {
        let b = text.as_bytes();
        let mut n = 0;
        let mut off = 0;
        self.touch(0, t, ts);
        while off < b.len() {
            let rest = &b[off..];
            let k = key(rest);
            let Some(c) = self.child(n, k) else {
                let id = self.nodes.len() as u32;
                self.nodes.push(SeqNode {
                    text: rest.into(),
                    children: Vec::new(),
                    owners: 0,
                    ts: Vec::new(),
                });
                self.touch(id as usize, t, ts);
                let ch = &mut self.nodes[n].children;
                let i = ch.partition_point(|x| x.0 < k);
                ch.insert(i, (k, id));
                return;
            };
            let l = lcp(&self.nodes[c].text, rest);
            if l < self.nodes[c].text.len() {
                // Split: `c` keeps the suffix, a new node takes the prefix.
                let id = self.nodes.len() as u32;
                let suffix: Box<[u8]> = self.nodes[c].text[l..].into();
                let prefix: Box<[u8]> = self.nodes[c].text[..l].into();
                let (owners, ts_) = (self.nodes[c].owners, self.nodes[c].ts.clone());
                self.nodes[c].text = suffix;
                let sk = key(&self.nodes[c].text);
                self.nodes.push(SeqNode {
                    text: prefix,
                    children: vec![(sk, c as u32)],
                    owners,
                    ts: ts_,
                });
                let ch = &mut self.nodes[n].children;
                let i = ch.binary_search_by_key(&k, |x| x.0).unwrap();
                ch[i].1 = id;
                self.touch(id as usize, t, ts);
                n = id as usize;
            } else {
                self.touch(c, t, ts);
                n = c;
            }
            off += l;
        }
    }

    /// `(matched bytes, owner mask of the deepest node)`; all tenants available.
    pub fn prefix_match(&self, text: &str) -> (usize, u64) {
        let b = text.as_bytes();
        let mut n = 0;
        let mut off = 0;
        while off < b.len() {
            let rest = &b[off..];
            let Some(c) = self.child(n, key(rest)) else {
                break;
            };
            let e = &self.nodes[c].text;
            let l = lcp(e, rest);
            off += l;
            n = c;
            if l < e.len() {
                break;
            }
        }
        (off, self.nodes[n].owners)
    }

    pub fn heap_bytes(&self) -> usize {
        self.nodes.capacity() * std::mem::size_of::<SeqNode>()
            + self
                .nodes
                .iter()
                .map(|n| n.text.len() + n.children.capacity() * 8 + n.ts.capacity() * 16)
                .sum::<usize>()
    }
}

/// The lock-based design: one `RwLock` around a sequential tree.
#[derive(Default)]
pub struct RwLockTree(pub RwLock<SeqTree>);

impl RwLockTree {
    pub fn new() -> Self {
        Self(RwLock::new(SeqTree::new()))
    }
    pub fn insert(&self, text: &str, t: u8, ts: u64) {
        self.0.write().unwrap().insert(text, t, ts)
    }
    pub fn prefix_match(&self, text: &str) -> (usize, u64) {
        self.0.read().unwrap().prefix_match(text)
    }
}

/// This thread's CPU time in seconds, where the OS reports it (`CLOCK_THREAD_CPUTIME_ID`; on
/// Linux it excludes time the hypervisor stole where the kernel accounts steal). Not
/// `/proc/thread-self/schedstat`: a running thread's own reading there lags by up to a
/// scheduler tick (a 3 ms busy loop read 0.04–3.9 ms), which inflated short measurements.
#[cfg(unix)]
pub fn thread_cpu() -> Option<f64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // Safety: `ts` is a valid, writable `timespec` for the duration of the call, and
    // `CLOCK_THREAD_CPUTIME_ID` is a clock id every supported Unix accepts.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9)
}

/// This thread's CPU time in seconds: not known on this platform.
#[cfg(not(unix))]
pub fn thread_cpu() -> Option<f64> {
    None
}

/// Whether a bench's own figures (its table and JSON lines) are wanted: yes unless the
/// command line gives criterion a benchmark filter (`cargo bench --bench tree -- w1_`), which
/// selects criterion benchmarks only; the filter `figures` selects the figures only.
pub fn figures_wanted() -> bool {
    criterion_filter().is_none_or(|f| f == "figures")
}

/// Criterion's positional filter argument, if any: the first argument that is not an option
/// and not the value of one of criterion's options that take a value.
pub fn criterion_filter() -> Option<String> {
    const WITH_VALUE: [&str; 17] = [
        "--save-baseline",
        "-s",
        "--baseline",
        "-b",
        "--baseline-lenient",
        "--load-baseline",
        "--sample-size",
        "--warm-up-time",
        "--measurement-time",
        "--nresamples",
        "--noise-threshold",
        "--confidence-level",
        "--significance-level",
        "--profile-time",
        "--plotting-backend",
        "--color",
        "-c",
    ];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if WITH_VALUE.contains(&a.as_str()) || a == "--output-format" || a == "--format" {
            args.next();
        } else if !a.starts_with('-') {
            return Some(a);
        }
    }
    None
}

/// The count in environment variable `name` (`default` when it is not set). A value that is not
/// a whole number of at least `min` ends the program with a message and exit code 2: a
/// benchmark never runs on a silently substituted size.
pub fn env_count(name: &str, default: usize, min: usize) -> usize {
    let Some(v) = std::env::var_os(name) else {
        return default;
    };
    let n = v.to_str().and_then(|s| s.trim().parse().ok());
    n.filter(|&n| n >= min).unwrap_or_else(|| {
        eprintln!("{name}={v:?}: expected a whole number of at least {min}");
        std::process::exit(2)
    })
}

/// Prints one figure as a table row and as a JSON line. A value that is not a number (a rate
/// over no time, a ratio to zero) prints as `n/a` and JSON `null`: never as a figure.
pub fn figure(name: &str, value: f64, unit: &str) {
    if value.is_finite() {
        println!("{name:<48} {value:>16.3} {unit}");
        println!("{{\"figure\":\"{name}\",\"value\":{value},\"unit\":\"{unit}\"}}");
    } else {
        println!("{name:<48} {:>16} {unit}", "n/a");
        println!("{{\"figure\":\"{name}\",\"value\":null,\"unit\":\"{unit}\"}}");
    }
}

pub mod figures;
pub mod router_figures;

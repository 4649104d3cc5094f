//! Differential fuzzing of `PrefixTree` against the sequential reference model
//! (`kvtrie::model::run_differential`, the driver `tests/model.rs` uses too).
//!
//! The fuzz input is decoded with `arbitrary` into a sequence of operations over five tenant
//! names and an alphabet of chars that share UTF-8 lead bytes pairwise (`é`/`è`, `🙂`/`🙃`,
//! `中`/`丰`) plus ASCII. Every operation is applied to the real tree and to the model and
//! every result is compared; after each operation the tree's invariants are checked
//! (`check_invariants()`), every tenant's char count, the live tenants and the node count are
//! compared, and at the end the whole snapshot (texts, owners, timestamps) is compared.
//!
//! Run: `cd fuzz && cargo +nightly fuzz run tree_ops -- -max_total_time=60` (one hour:
//! `-max_total_time=3600`). Seeds live in `fuzz/corpus/tree_ops/`.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use kvtrie::model::{run_differential, DiffOp};
use libfuzzer_sys::fuzz_target;

/// Chars that share lead bytes pairwise, plus ASCII.
const ALPHABET: &[char] = &['a', 'b', 'c', 'é', 'è', '🙂', '🙃', '中', '丰'];
const NAMES: u8 = 5;
const MAX_OPS: usize = 64;

/// A short text over [`ALPHABET`].
#[derive(Debug)]
struct Text(String);

impl<'a> Arbitrary<'a> for Text {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let n = u.int_in_range(0..=10)?;
        let mut s = String::new();
        for _ in 0..n {
            s.push(ALPHABET[u.choose_index(ALPHABET.len())?]);
        }
        Ok(Text(s))
    }
}

#[derive(Arbitrary, Debug)]
enum Op {
    Add(u8),
    Insert(Text, u8, u8),
    Match(Text, Option<Vec<u8>>),
    Remove(u8),
    RemoveMany(Vec<u8>),
    Evict(u8, u8),
    Smallest(Option<Vec<u8>>),
    /// `match_and_insert(text, available, ts, choose)`: `choose` picks the `pick`-th tenant of
    /// the match (modulo its size), or declines when the match has no tenant and `fallback`
    /// names nobody; with `fallback` it picks that name's id (possibly removed).
    MatchAndInsert(Text, Option<Vec<u8>>, u8, u8, Option<u8>),
}

impl Op {
    /// The operation for `kvtrie::model::run_differential`: names modulo [`NAMES`], at most
    /// 4 available names, timestamps modulo 8 (ties), eviction amounts modulo 16.
    fn diff(&self) -> DiffOp {
        let list = |v: &Option<Vec<u8>>| {
            v.as_ref()
                .map(|n| n.iter().take(4).map(|x| x % NAMES).collect())
        };
        match self {
            Op::Add(n) => DiffOp::Add(n % NAMES),
            Op::Insert(Text(t), n, ts) => DiffOp::Insert(t.clone(), n % NAMES, u64::from(ts % 8)),
            Op::Match(Text(t), a) => DiffOp::Match(t.clone(), list(a)),
            Op::Remove(n) => DiffOp::Remove(n % NAMES),
            Op::RemoveMany(v) => DiffOp::RemoveMany(v.iter().take(4).map(|n| n % NAMES).collect()),
            Op::Evict(n, c) => DiffOp::Evict(n % NAMES, usize::from(c % 16)),
            Op::Smallest(a) => DiffOp::Smallest(list(a)),
            Op::MatchAndInsert(Text(t), a, ts, pick, fb) => DiffOp::MatchAndInsert(
                t.clone(),
                list(a),
                u64::from(ts % 8),
                usize::from(*pick),
                fb.map(|f| f % NAMES),
            ),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let mut ops = Vec::new();
    while ops.len() < MAX_OPS && !u.is_empty() {
        match Op::arbitrary(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    let ops: Vec<DiffOp> = ops.iter().map(Op::diff).collect();
    run_differential(&ops);
});

"""The benchmark's W1 generator (bench/w1.py) produces the crate's W1: the same system
prompts, prompts and queries (tests/data/vectors.json, checked against the crate by
tests/vectors.rs), so the Python and Rust figures of bench_w1.py are measured on one
workload."""

from __future__ import annotations

import importlib.util

from conftest import HERE


def load_w1():
    path = HERE.parent / "bench" / "w1.py"
    spec = importlib.util.spec_from_file_location("kvtrie_bench_w1", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_w1_equals_the_crates_w1(vectors):
    want = vectors["w1"]
    w = load_w1().W1(queries=want["queries"])
    assert w.system[0][:40] == want["system0_head"]
    assert [len(p) for p in w.prompts[:5]] == want["prompt_lengths_first5"]
    assert sum(len(p) for p in w.prompts) == want["total_prompt_chars"]
    assert w.prompts[9999][-40:] == want["prompt9999_tail"]
    assert w.query_system[:10] == want["query_system_first10"]
    assert w.queries[999][-40:] == want["query999_tail"]
    # Skipping unbuilt queries keeps the stream where building them would leave it.
    skipped = load_w1().W1(queries=want["queries"], materialize=10)
    assert skipped.query_system == w.query_system
    assert skipped.queries == w.queries[:10]

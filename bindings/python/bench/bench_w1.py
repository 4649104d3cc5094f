#!/usr/bin/env python3
"""W1 from Python: kvtrie.PrefixTree against Ray 2.60.0's PrefixTree in the same process.

Figures (one JSON line each, then a table):

* inserts/s of the 10,000 W1 prompts (``insert(prompt, "r{i % 16}", i)``), 1 thread;
* hot lookups/s (``prefix_match(query)``, every tenant available, cycling over the first
  1,000 queries) with 1 and 2 Python threads, and cold lookups/s (each query once);
* the same for Ray's PrefixTree (on a sample of the lookups: it runs ~10 k/s);
* kvtrie ÷ Ray, 2 threads ÷ 1 thread, and the Python-call overhead: kvtrie from Python ÷
  kvtrie from Rust on the same lookups (``examples/w1_rust.rs``, run by this script through
  cargo unless ``--rust-json FILE`` gives its output or ``--no-rust`` skips it).

Usage: ``python bench/bench_w1.py [--queries N] [--hot N] [--ray-lookups N] [--repeat R]``
(defaults: 200,000 queries, 200,000 hot lookups, 10,000 Ray lookups; every kvtrie figure is
the best of 5 runs, Ray's of 2, inserts are one build of the tree each). Ratios are meaningful
within one run; absolute numbers drift with machine load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvtrie  # noqa: E402
from w1 import W1  # noqa: E402

BATCH = 250  # lookups per prefix_match_many call

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def ray_tree_class():
    try:
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import (
            PrefixTree,
        )
    except ImportError:
        return None
    return PrefixTree


def run_threads(threads: int, work: Callable[[int], int]) -> float:
    """Seconds for ``threads`` threads running ``work(t)`` from a common start."""
    barrier = threading.Barrier(threads + 1)
    done: List[int] = [0] * threads

    def body(t: int) -> None:
        barrier.wait()
        done[t] = work(t)

    ts = [threading.Thread(target=body, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - start


def best_per_s(
    match: Callable[[str], object],
    queries: Sequence[str],
    total: int,
    thread_counts: Sequence[int],
    repeat: int,
) -> Dict[int, float]:
    """Lookups/s for each thread count, best of ``repeat`` rounds; the thread counts
    alternate within a round, so they are measured under the same machine conditions."""
    n = len(queries)
    best: Dict[int, float] = {t: 0.0 for t in thread_counts}
    for _ in range(repeat):
        for threads in thread_counts:
            per = total // threads

            def work(t: int, per=per) -> int:
                base = t * per
                for i in range(per):
                    match(queries[(base + i) % n])
                return per

            best[threads] = max(best[threads], per * threads / run_threads(threads, work))
    return best


def inserts_per_s(make_tree: Callable[[], object], w: W1, add_tenants: bool) -> (float, object):
    tree = make_tree()
    tree.add_tenants(w.tenants, 0.0)  # type: ignore[attr-defined]
    ins = tree.insert  # type: ignore[attr-defined]
    names = w.tenants
    start = time.perf_counter()
    for i, p in enumerate(w.prompts):
        ins(p, names[i % 16], float(i + 1))
    return len(w.prompts) / (time.perf_counter() - start), tree


def rust_figures(args) -> Optional[Dict[str, float]]:
    if args.no_rust:
        return None
    if args.rust_json:
        text = open(args.rust_json).read()
    else:
        cmd = [
            "cargo", "run", "--quiet", "--release", "-p", "kvtrie-python", "--example",
            "w1_rust", "--", str(args.queries), str(args.hot),
        ]
        try:
            text = subprocess.run(
                cmd, cwd=ROOT, check=True, capture_output=True, text=True
            ).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"(no Rust figures: {e})", file=sys.stderr)
            return None
    out = {}
    for line in text.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            out[f"{d['figure']}@{d['threads']}"] = d["value"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--queries", type=int, default=200_000)
    ap.add_argument("--hot", type=int, default=200_000)
    ap.add_argument("--ray-lookups", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rust-json", help="output of examples/w1_rust.rs instead of running it")
    ap.add_argument("--no-rust", action="store_true", help="skip the Rust figures")
    args = ap.parse_args()

    t0 = time.perf_counter()
    w = W1(args.queries)
    print(
        f"W1: {len(w.prompts)} prompts, {len(w.queries)} queries "
        f"(generated in {time.perf_counter() - t0:.1f} s); kvtrie {kvtrie.__version__}",
        file=sys.stderr,
    )
    hot = w.queries[:1000]
    figures: List[dict] = []

    def fig(name: str, impl: str, threads: int, value: float) -> None:
        figures.append({"figure": name, "impl": impl, "threads": threads, "value": round(value, 1)})

    # kvtrie
    ins, tree = inserts_per_s(kvtrie.PrefixTree, w, True)
    fig("w1_inserts_per_s", "kvtrie", 1, ins)
    pm = tree.prefix_match
    for threads, v in best_per_s(pm, hot, args.hot, (1, 2), args.repeat).items():
        fig("w1_hot_lookups_per_s", "kvtrie", threads, v)
    for threads, v in best_per_s(pm, w.queries, len(w.queries), (1, 2), args.repeat).items():
        fig("w1_cold_lookups_per_s", "kvtrie", threads, v)
    # The batch form: one GIL release per BATCH lookups.
    many = tree.prefix_match_many
    hot_batches = [hot[i:i + BATCH] for i in range(0, len(hot), BATCH)]
    cold_batches = [w.queries[i:i + BATCH] for i in range(0, len(w.queries), BATCH)]
    for threads, v in best_per_s(many, hot_batches, args.hot // BATCH, (1, 2), args.repeat).items():
        fig("w1_hot_lookups_per_s_batched", "kvtrie", threads, BATCH * v)
    for threads, v in best_per_s(many, cold_batches, len(cold_batches), (1, 2), args.repeat).items():
        fig("w1_cold_lookups_per_s_batched", "kvtrie", threads, BATCH * v)

    # Ray, in the same process
    ray_cls = ray_tree_class()
    if ray_cls is not None:
        rins, rtree = inserts_per_s(ray_cls, w, True)
        fig("w1_inserts_per_s", "ray", 1, rins)
        rpm = rtree.prefix_match
        for threads, v in best_per_s(rpm, hot, args.ray_lookups, (1, 2), 2).items():
            fig("w1_hot_lookups_per_s", "ray", threads, v)
        # Both trees hold the same text: the same answers.
        for q in hot[:50]:
            assert tree.prefix_match(q) == rtree.prefix_match(q), q
    else:
        print("(Ray not installed: no Ray figures)", file=sys.stderr)

    rust = rust_figures(args)
    if rust:
        for key, value in rust.items():
            name, threads = key.split("@")
            fig(name, "kvtrie-rust", int(threads), value)

    get = {(f["figure"], f["impl"], f["threads"]): f["value"] for f in figures}
    ratios = []

    def ratio(name: str, num, den) -> None:
        if num in get and den in get and get[den] > 0:
            ratios.append({"figure": name, "value": round(get[num] / get[den], 3)})

    for kind in ("hot", "cold"):
        ratio(f"w1_{kind}_lookups_2_threads_over_1_kvtrie",
              (f"w1_{kind}_lookups_per_s", "kvtrie", 2), (f"w1_{kind}_lookups_per_s", "kvtrie", 1))
        ratio(f"w1_{kind}_lookups_2_threads_over_1_kvtrie_batched",
              (f"w1_{kind}_lookups_per_s_batched", "kvtrie", 2),
              (f"w1_{kind}_lookups_per_s_batched", "kvtrie", 1))
    # Control: the same ratio for the Rust tree, which needs no GIL (≈ 2 on two free cores).
    # Far below 2, the machine did not give the run two cores and no thread ratio is meaningful.
    for kind in ("hot", "cold"):
        ratio(f"w1_{kind}_lookups_2_threads_over_1_rust_control",
              (f"w1_{kind}_lookups_per_s", "kvtrie-rust", 2),
              (f"w1_{kind}_lookups_per_s", "kvtrie-rust", 1))
    ratio("w1_hot_lookups_kvtrie_over_ray",
          ("w1_hot_lookups_per_s", "kvtrie", 1), ("w1_hot_lookups_per_s", "ray", 1))
    ratio("w1_hot_lookups_kvtrie_over_ray_2_threads",
          ("w1_hot_lookups_per_s", "kvtrie", 2), ("w1_hot_lookups_per_s", "ray", 2))
    ratio("w1_inserts_kvtrie_over_ray",
          ("w1_inserts_per_s", "kvtrie", 1), ("w1_inserts_per_s", "ray", 1))
    ratio("w1_hot_lookups_2_threads_over_1_ray",
          ("w1_hot_lookups_per_s", "ray", 2), ("w1_hot_lookups_per_s", "ray", 1))
    for kind in ("hot", "cold"):
        ratio(f"w1_{kind}_lookups_python_over_rust",
              (f"w1_{kind}_lookups_per_s", "kvtrie", 1),
              (f"w1_{kind}_lookups_per_s", "kvtrie-rust", 1))
    ratio("w1_inserts_python_over_rust",
          ("w1_inserts_per_s", "kvtrie", 1), ("w1_inserts_per_s", "kvtrie-rust", 1))

    print(f"{'figure':<44} {'impl':<12} {'threads':>7} {'value':>14}")
    for f in figures:
        print(f"{f['figure']:<44} {f['impl']:<12} {f['threads']:>7} {f['value']:>14,.1f}")
    for r in ratios:
        print(f"{r['figure']:<64} {r['value']:>14.3f}")
    for f in figures + ratios:
        print(json.dumps(f))


if __name__ == "__main__":
    main()

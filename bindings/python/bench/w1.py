"""Workload W1 (``chat``, seed 42) of the project's WORKLOADS.md, generated in Python with the
same SplitMix64 stream as the Rust crate (``kvtrie::workload::ChatWorkload::w1``), so the
Python and Rust figures are measured on identical text.

* 16 tenants ``r0``..``r15``; 100 system prompts of ``text(2000)``;
* 10,000 prompts ``system[below(100)] + text(50 + below(451))``; prompt ``i`` is inserted for
  tenant ``r(i % 16)``;
* the queries are generated the same way, continuing the stream.

SplitMix64's ``k``-th output depends only on ``k`` (``state_k = seed + k * golden``), so a
text of ``n`` letters is one vectorized computation with numpy (if installed; pure Python
otherwise, about 20 times slower).
"""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

# numpy's BLAS thread pool would otherwise spin on the cores the benchmark measures.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB

try:
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * M1) & MASK
    z = ((z ^ (z >> 27)) * M2) & MASK
    return z ^ (z >> 31)


class SplitMix64:
    """The project's random source (WORKLOADS.md): ``next``, ``below``, ``text``."""

    def __init__(self, seed: int) -> None:
        self.seed = seed & MASK
        self.count = 0  # outputs drawn so far

    def next(self) -> int:
        self.count += 1
        return _mix((self.seed + self.count * GOLDEN) & MASK)

    def below(self, n: int) -> int:
        return self.next() % n

    def text(self, n: int) -> str:
        """``n`` letters, each ``'a' + below(26)``."""
        start = self.count + 1
        self.count += n
        if _np is not None and n >= 64:
            k = _np.arange(start, start + n, dtype=_np.uint64)
            with _np.errstate(over="ignore"):
                z = _np.uint64(self.seed) + k * _np.uint64(GOLDEN)
                z = (z ^ (z >> _np.uint64(30))) * _np.uint64(M1)
                z = (z ^ (z >> _np.uint64(27))) * _np.uint64(M2)
                z = z ^ (z >> _np.uint64(31))
            return (z % _np.uint64(26) + _np.uint64(97)).astype(_np.uint8).tobytes().decode()
        return bytes(
            97 + _mix((self.seed + (start + i) * GOLDEN) & MASK) % 26 for i in range(n)
        ).decode()

    def skip(self, n: int) -> None:
        """Advances the stream by ``n`` outputs without computing them."""
        self.count += n


class W1:
    """W1 with ``queries`` queries (the standard is 200,000). Only the first ``materialize``
    queries are built as strings (all if ``None``); the others are skipped in the stream."""

    def __init__(self, queries: int = 200_000, materialize: Optional[int] = None) -> None:
        r = SplitMix64(42)
        self.tenants: List[str] = [f"r{i}" for i in range(16)]
        self.system: List[str] = [r.text(2000) for _ in range(100)]

        def prompt(build: bool) -> Tuple[int, Optional[str]]:
            k = r.below(100)
            n = 50 + r.below(451)
            if not build:
                r.skip(n)
                return k, None
            return k, self.system[k] + r.text(n)

        self.prompts: List[str] = [prompt(True)[1] for _ in range(10_000)]  # type: ignore[misc]
        limit = queries if materialize is None else min(materialize, queries)
        self.query_system: List[int] = []
        self.queries: List[str] = []
        for i in range(queries):
            k, q = prompt(i < limit)
            self.query_system.append(k)
            if q is not None:
                self.queries.append(q)

"""Shared fixtures of the kvtrie Python suite.

Every test runs against the installed ``kvtrie`` module (``ci/test`` builds it into a
virtualenv first). Tests that need Ray Serve (``ray[serve]==2.60.0``), pyzmq or msgspec fail
with an install hint when those are missing; ``ci/test`` installs them.
"""

from __future__ import annotations

import json
import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent.parent
VLLM_DATA = REPO / "tests" / "data" / "vllm"
SHARED_VLLM_DATA = REPO.parent / "shared" / "testdata" / "vllm"


@pytest.fixture(scope="session")
def vectors() -> dict:
    """Reference vectors computed by the Rust crate (tests/vectors.rs keeps them current)."""
    return json.loads((HERE / "data" / "vectors.json").read_text())


def require(module: str, hint: str):
    """Imports ``module`` or fails the test with an install hint (never skips)."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:  # pragma: no cover - only without the test dependencies
        pytest.fail(f"{module} is needed for this test: {hint} ({e})", pytrace=False)


def ray_prefix_tree_class():
    """Ray 2.60.0's PrefixTree class (the reference implementation)."""
    mod = require(
        "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree",
        "pip install 'ray[serve]==2.60.0'",
    )
    return mod.PrefixTree

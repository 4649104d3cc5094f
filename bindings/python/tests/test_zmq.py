"""The ZMQ subscriber against a vLLM-style publisher in this process (pyzmq PUB socket,
msgspec-encoded batches, as vLLM's ZmqEventPublisher sends them)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

import kvtrie
from conftest import require


def encode(msgspec, ts, events, rank=None):
    return msgspec.msgpack.encode([ts, events, rank])


def stored(hashes, tokens, parent=None):
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
    }


def test_subscriber_feeds_an_index():
    zmq = require("zmq", "pip install pyzmq")
    msgspec = require("msgspec", "pip install msgspec")
    assert kvtrie.HAS_ZMQ
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
    h = kvtrie.BlockHasher(4)
    index = kvtrie.BlockIndex(h)
    engine = kvtrie.zmq.EngineConfig(endpoint, worker=11, block_size=4, name="engine-0", mapping="add_rank")
    assert (engine.name, engine.worker, engine.pub_endpoint) == ("engine-0", 11, endpoint)
    seq = 0

    def send(events):
        nonlocal seq
        pub.send_multipart([b"", seq.to_bytes(8, "big"), encode(msgspec, time.time(), events, 1)])
        seq += 1

    def wait(cond):
        # Bounded wait for the background thread (publishing again meanwhile: PUB/SUB drops
        # what is sent before the subscription arrives).
        end = time.monotonic() + 60
        while not cond():
            assert time.monotonic() < end, sub.stats()
            time.sleep(0.02)

    try:
        with kvtrie.zmq.Subscriber(index, [engine]) as sub:
            assert sub.running
            tokens = list(range(1, 9))
            local = h.local_hashes(tokens)
            end = time.monotonic() + 60
            while index.find_matches(local) != {12: 2}:  # worker 11 + rank 1
                assert time.monotonic() < end, sub.stats()
                send([stored([101, 102], tokens)])
                time.sleep(0.05)
            send([{"type": "BlockRemoved", "block_hashes": [102], "medium": "GPU"}])
            wait(lambda: index.find_matches(local) == {12: 1})
            send([{"type": "AllBlocksCleared"}])
            wait(lambda: index.find_matches(local) == {})
            stats = sub.stats()[0]
            assert stats["name"] == "engine-0"
            assert stats["decode_errors"] == 0 and stats["last_seq"] == seq - 1
            assert stats["batches"] >= 3
            # Garbage payloads are counted, never fatal.
            pub.send_multipart([b"", seq.to_bytes(8, "big"), b"\xc1garbage"])
            seq += 1
            wait(lambda: sub.stats()[0]["decode_errors"] == 1)
        assert not sub.running
        final = sub.stop()  # idempotent
        assert final[0]["decode_errors"] == 1
    finally:
        pub.close(0)
        ctx.term()


@pytest.mark.parametrize("separate", [False, True])
def test_ranks_merged_into_one_worker_clear_only_their_own_blocks(separate):
    """Two data-parallel ranks publish on their own sockets and the default mapping
    ("fixed") merges them into one worker: one rank's AllBlocksCleared takes away its own
    blocks, not the other rank's. The ranks are fed by one Subscriber, or by one each
    (``separate``, told with ``shared_worker=True``)."""
    zmq = require("zmq", "pip install pyzmq")
    msgspec = require("msgspec", "pip install msgspec")
    ctx = zmq.Context()
    pubs, engines = [], []
    h = kvtrie.BlockHasher(4)
    index = kvtrie.BlockIndex(h)
    for rank in range(2):
        pub = ctx.socket(zmq.PUB)
        pub.bind("tcp://127.0.0.1:*")
        endpoint = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        pubs.append(pub)
        engines.append(
            kvtrie.zmq.EngineConfig(
                endpoint, worker=7, block_size=4, name=f"rank-{rank}", shared_worker=separate
            )
        )
    seqs = [0, 0]

    def send(rank, events):
        payload = encode(msgspec, time.time(), events, rank)
        pubs[rank].send_multipart([b"", seqs[rank].to_bytes(8, "big"), payload])
        seqs[rank] += 1

    prompts = [list(range(1, 9)), list(range(101, 109))]
    local = [h.local_hashes(p) for p in prompts]
    try:
        with contextlib.ExitStack() as stack:
            groups = [[e] for e in engines] if separate else [engines]
            subs = [stack.enter_context(kvtrie.zmq.Subscriber(index, g)) for g in groups]

            def stats():
                return [s for sub in subs for s in sub.stats()]

            end = time.monotonic() + 60
            # (PUB/SUB drops what is sent before the subscription arrives: send until held)
            while [index.find_matches(lh) for lh in local] != [{7: 2}, {7: 2}]:
                assert time.monotonic() < end, stats()
                for rank in range(2):
                    send(rank, [stored([10 * rank + 1, 10 * rank + 2], prompts[rank])])
                time.sleep(0.05)
            send(0, [{"type": "AllBlocksCleared"}])
            while index.find_matches(local[0]) != {}:
                assert time.monotonic() < end, stats()
                time.sleep(0.02)
            assert index.find_matches(local[1]) == {7: 2}
            final = stats()
            assert [s["apply_errors"] for s in final] == [0, 0], final
    finally:
        for pub in pubs:
            pub.close(0)
        ctx.term()


def test_engines_must_decode_into_the_index_blocks():
    # Decoded into 16-token blocks, the events of an index that hashes requests in blocks of
    # 32 never matched a request: refused, before any thread starts.
    require("zmq", "pip install pyzmq")
    index = kvtrie.BlockIndex(kvtrie.BlockHasher(32))
    engines = [
        kvtrie.zmq.EngineConfig("tcp://127.0.0.1:1", worker=0, block_size=32),
        kvtrie.zmq.EngineConfig("tcp://127.0.0.1:2", worker=1, name="small"),
    ]
    with pytest.raises(ValueError, match=r'engine 1 \("small"\).*blocks of 16.*blocks of 32'):
        kvtrie.zmq.Subscriber(index, engines)
    kvtrie.zmq.Subscriber(index, engines[:1]).stop()


def test_rcvhwm_zero_means_unbounded_and_negative_is_refused():
    # libzmq's high-water mark: 0 is no limit (accepted), a negative one is refused here.
    engine = kvtrie.zmq.EngineConfig("tcp://127.0.0.1:5557", worker=3, rcvhwm=0)
    assert (engine.pub_endpoint, engine.worker) == ("tcp://127.0.0.1:5557", 3)
    index = kvtrie.BlockIndex(kvtrie.BlockHasher(16))
    with kvtrie.zmq.Subscriber(index, [engine]) as sub:
        assert sub.running
    assert not sub.running
    with pytest.raises(ValueError, match="rcvhwm must be >= 0"):
        kvtrie.zmq.EngineConfig("tcp://127.0.0.1:5557", worker=3, rcvhwm=-1)


def test_stats_and_a_second_stop_during_a_stop_show_every_engine():
    # While one thread stops the subscriber (its threads take about 50 ms to join), stats()
    # gives one dict per engine (the last ones taken before the stop), and a second stop()
    # waits for the first and returns the same final stats (both gave [] until the join).
    index = kvtrie.BlockIndex(kvtrie.BlockHasher(16))
    engines = [
        kvtrie.zmq.EngineConfig("tcp://127.0.0.1:9", worker=w, initial_replay=False)
        for w in (1, 2)
    ]
    sub = kvtrie.zmq.Subscriber(index, engines)
    results = {}
    stoppers = [
        threading.Thread(target=lambda k=k: results.setdefault(k, sub.stop())) for k in (0, 1)
    ]
    for t in stoppers:
        t.start()
    lengths = []
    while True:
        lengths.append(len(sub.stats()))
        if not any(t.is_alive() for t in stoppers):
            break
    for t in stoppers:
        t.join()
    assert set(lengths) == {2}, sorted(set(lengths))
    assert len(results[0]) == 2 and results[0] == results[1]
    assert sub.stats() == results[0]
    assert not sub.running

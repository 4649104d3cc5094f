"""vLLM KV-event decoding: the repository's test payloads (tests/data/vllm, copies of
../shared/testdata/vllm) decode to the documented batch; malformed input raises
KvEventDecodeError and never crashes."""

from __future__ import annotations

import random

import pytest

import kvtrie
from conftest import SHARED_VLLM_DATA, VLLM_DATA, require
from kvtrie import vllm

NAMES = ["batch_map_events.msgpack", "batch_array_events.msgpack", "batch_all_maps.msgpack"]
H1 = 2164874634404590027
H2 = 17270480062156288726


def payload(name):
    return (VLLM_DATA / name).read_bytes()


def test_repo_payloads_equal_the_shared_copies():
    for name in NAMES:
        shared = SHARED_VLLM_DATA / name
        if shared.exists():  # beside the clone in CI and on the dev machine
            assert shared.read_bytes() == payload(name), name


@pytest.mark.parametrize("name", NAMES)
def test_payloads_decode_to_the_documented_batch(name):
    local = kvtrie.BlockHasher(4).local_hashes([1, 2, 3, 4, 5, 6, 7, 8])
    for data in (payload(name), bytearray(payload(name))):
        batch = vllm.decode_batch(data, block_size=4)
        assert batch.ts == 1_700_000_000.5
        assert batch.data_parallel_rank == 0
        assert (batch.skipped_groups, batch.skipped_unknown) == (0, 0)
        ev = batch.events
        assert len(ev) == 3
        assert ev[0].event == kvtrie.KvEvent.Stored(
            parent=None,
            blocks=[kvtrie.StoredBlock(H1, local[0]), kvtrie.StoredBlock(H2, local[1])],
        )
        assert (ev[0].medium, ev[0].group_idx) == ("GPU", 0)
        assert ev[1].event == kvtrie.KvEvent.Removed(engine_hashes=[H2])
        assert (ev[1].medium, ev[1].group_idx) == ("GPU", 0)
        assert ev[2].event == kvtrie.KvEvent.Cleared()
        assert (ev[2].medium, ev[2].group_idx) == (None, None)


def test_decoded_events_feed_an_index():
    h = kvtrie.BlockHasher(4)
    index = kvtrie.BlockIndex(h)
    local = h.local_hashes([1, 2, 3, 4, 5, 6, 7, 8])
    ev = vllm.decode_batch(payload(NAMES[0]), block_size=4).events
    index.apply(3, ev[0])  # a DecodedEvent is accepted as is
    assert index.find_matches(local) == {3: 2}
    index.apply(3, ev[1].event)
    assert index.find_matches(local) == {3: 1}
    index.apply(3, ev[2])
    assert index.find_matches(local) == {}


def test_namespace_salts_local_hashes():
    ev = vllm.decode_batch(payload(NAMES[0]), block_size=4, namespace="ns").events[0].event
    salted = kvtrie.BlockHasher(4).with_salt("", "ns").local_hashes(range(1, 9))
    assert [b.local_hash for b in ev.blocks] == salted


def test_router_blocks_smaller_than_engine_blocks():
    batch = vllm.decode_batch(payload(NAMES[0]), block_size=2)
    blocks = batch.events[0].event.blocks
    assert len(blocks) == 4  # each 4-token engine block is split in two router blocks
    assert [b.engine_hash for b in blocks][1::2] == [H1, H2]
    assert len(batch.events[1].event.engine_hashes) == 2


def test_stateful_decoder():
    d = vllm.Decoder(block_size=4)
    for name in NAMES:
        assert len(d.decode(payload(name)).events) == 3


def test_malformed_input_is_an_error_never_a_crash():
    data = payload(NAMES[0])
    for k in range(len(data)):
        with pytest.raises(vllm.DecodeError):
            vllm.decode_batch(data[:k], block_size=4)
    with pytest.raises(vllm.DecodeError):
        vllm.decode_batch(data + b"\x00", block_size=4)
    rng = random.Random(7)
    for _ in range(2000):
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
        try:
            vllm.decode_batch(junk, block_size=4)
        except vllm.DecodeError as e:
            assert isinstance(e, ValueError) and str(e)
    # Flipping bytes of a valid payload.
    for _ in range(2000):
        b = bytearray(data)
        b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            vllm.decode_batch(bytes(b), block_size=4)
        except vllm.DecodeError:
            pass
    with pytest.raises(TypeError):
        vllm.decode_batch("not bytes", block_size=4)


def test_a_malformed_event_is_dropped_alone_and_a_cut_one_is_an_error():
    # The second store has 3 token ids for one block of 4, the third a token id past 32 bits
    # (LMCache has published 64-bit hashes there): each is dropped alone, with the first
    # one's reason, and the batch's other events are kept.
    msgspec = require("msgspec", "pip install msgspec")

    def stored(tokens):
        return {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": tokens,
            "block_size": 4,
            "lora_id": None,
            "medium": "GPU",
        }

    events = [stored([1, 2, 3, 4]), stored([1, 2, 3]), stored([1, 2, 3, 2**40])]
    data = msgspec.msgpack.encode([1.0, events, None])
    batch = vllm.decode_batch(data, block_size=4)
    assert (len(batch.events), batch.skipped_malformed) == (1, 2)
    assert "event 1" in batch.malformed and "3 token ids" in batch.malformed
    assert "skipped_malformed=2" in repr(batch)
    # A payload that ends inside an event is an error naming the event.
    with pytest.raises(vllm.DecodeError) as e:
        vllm.decode_batch(data[:-3], block_size=4)
    assert e.value.event_index == 2
    # One raised by hand has the attribute too (the stub's `int | None`).
    assert vllm.DecodeError("x").event_index is None


def test_stores_of_block_sizes_the_router_cannot_split_are_skipped():
    # 4-token engine blocks for 3-token router blocks: the store is skipped and counted, the
    # removal and the clear of the same batch still apply.
    batch = vllm.decode_batch(payload(NAMES[0]), block_size=3)
    assert batch.skipped_block_sizes == 1
    assert [type(e.event).__name__ for e in batch.events] == [
        type(e.event).__name__ for e in vllm.decode_batch(payload(NAMES[0]), block_size=4).events
    ][1:]
    assert "skipped_block_sizes=1" in repr(batch)


def test_copies_in_remote_storage_are_skipped():
    msgspec = require("msgspec", "pip install msgspec")
    store = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 4,
        "lora_id": None,
        "medium": "STORAGE",
    }
    data = msgspec.msgpack.encode(
        [1.0, [dict(store, locality="REMOTE"), dict(store, locality="LOCAL")], None]
    )
    batch = vllm.decode_batch(data, block_size=4)
    assert (len(batch.events), batch.skipped_remote) == (1, 1)
    assert batch.events[0].medium == "STORAGE"


def test_sglang_events_decode():
    # SGLang's array layout: a salted store carries a `metadata` map where vLLM has
    # `lora_name`; EAGLE's bigram keys send token pairs; its EXTERNAL tier is a shared pool.
    msgspec = require("msgspec", "pip install msgspec")
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    salted = ["BlockStored", [1, 2], None, toks, 4, None, "GPU", {"cache_salt": "tenant-a"}]
    plain = ["BlockStored", [1, 2], None, toks, 4, None, "GPU"]
    bigram = ["BlockStored", [1, 2], None, [[t, t + 1] for t in toks], 4, None, "GPU"]
    external = ["BlockStored", [3], None, toks[:4], 4, None, "EXTERNAL"]
    removal = ["BlockRemoved", [9], "GPU"]
    data = msgspec.msgpack.encode([1.0, [salted, plain, bigram, external, removal], 2])
    batch = vllm.decode_batch(data, block_size=4)
    assert (len(batch.events), batch.skipped_remote, batch.data_parallel_rank) == (4, 1, 2)
    hashes = [[b.local_hash for b in e.event.blocks] for e in batch.events[:3]]
    local = kvtrie.BlockHasher(4).local_hashes(toks)
    assert hashes[1] == hashes[2] == local
    # The salt changes block 0 only (the rest inherit it through the chain).
    assert hashes[0][0] != local[0] and hashes[0][1] == local[1]
    assert batch.events[3].event == kvtrie.KvEvent.Removed(engine_hashes=[9])


def test_salted_requests_match_salted_stores_from_python():
    # A salted request (cache_salt=...) matches the blocks a salted SGLang store put in the
    # index, through the index, the hasher and the KV-aware router; an unsalted one does not.
    msgspec = require("msgspec", "pip install msgspec")
    toks = list(range(40, 56))
    salted = ["BlockStored", [1, 2, 3, 4], None, toks, 4, None, "GPU", {"cache_salt": "t-a"}]
    batch = vllm.decode_batch(msgspec.msgpack.encode([1.0, [salted], None]), block_size=4)
    router = kvtrie.KvAwareRouter(kvtrie.KvAwareConfig(4))
    router.index.apply(7, batch.events[0])
    assert router.index.find_matches_tokens(toks, cache_salt="t-a") == {7: 4}
    assert router.index.find_matches_tokens(toks) == {}
    assert router.index.find_matches_tokens(toks, cache_salt="t-b") == {}
    h = kvtrie.BlockHasher(4)
    assert h.local_hashes(toks, cache_salt="t-a") == [b.local_hash for b in batch.events[0].event.blocks]
    assert h.local_hashes(toks, cache_salt=None, lora_name=None, mm_inputs=[]) == h.local_hashes(toks)
    assert router.select_and_reserve(1, toks, [7, 8], cache_salt="t-a").overlap_blocks == 4
    assert router.select_and_reserve(2, toks, [7, 8]).overlap_blocks == 0
    # Images shift the hashes of the blocks they overlap, as vLLM's extra keys do.
    image = h.local_hashes(toks, mm_inputs=[("img", 5, 2)])
    plain = h.local_hashes(toks)
    assert (image[0], image[2:]) == (plain[0], plain[2:]) and image[1] != plain[1]
    for bad in ("img", [("img", -1, 2)], [("img", 1)], [(3, 1, 2)]):
        with pytest.raises(TypeError):
            h.local_hashes(toks, mm_inputs=bad)
    with pytest.raises(TypeError):
        router.select_and_reserve(3, toks, [7], cache_salt=5)


def test_a_store_that_carries_only_a_lora_id_is_matched_with_lora_id():
    """Older vLLM releases name a request's adapter in events by ``lora_id`` only: the
    decoder salts those blocks with the id, and a request is hashed into the same partition
    with ``lora_id=`` (there was no way to from Python: ``lora_name`` is another partition)."""
    msgspec = require("msgspec", "pip install msgspec")
    toks = list(range(1, 9))
    store = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": toks,
        "block_size": 4,
        "lora_id": 7,
        "medium": "GPU",
    }
    batch = vllm.decode_batch(msgspec.msgpack.encode([1.0, [store], None]), block_size=4)
    index = kvtrie.BlockIndex(kvtrie.BlockHasher(4))
    index.apply(5, batch.events[0])
    assert index.find_matches_tokens(toks) == {}
    assert index.find_matches_tokens(toks, lora_name="7") == {}
    assert index.find_matches_tokens(toks, lora_id=7) == {5: 2}
    assert index.find_matches_tokens(toks, lora_id=8) == {}
    h = kvtrie.BlockHasher(4)
    assert h.local_hashes(toks, lora_id=7) == [b.local_hash for b in batch.events[0].event.blocks]
    # A name, when given, is the partition (as the decoder does for events carrying both).
    assert h.local_hashes(toks, lora_name="x", lora_id=7) == h.local_hashes(toks, lora_name="x")
    router = kvtrie.KvAwareRouter(kvtrie.KvAwareConfig(4))
    router.index.apply(5, batch.events[0])
    s = router.select_and_reserve(1, toks, [4, 5], lora_id=7)
    assert (s.worker, s.overlap_blocks) == (5, 2)


def test_a_str_payload_is_a_type_error_that_says_bytes():
    for call in (
        lambda p: vllm.decode_batch(p, block_size=4),
        lambda p: vllm.Decoder(4).decode(p),
    ):
        with pytest.raises(TypeError, match="payload must be bytes .*, not str"):
            call("abc")
        with pytest.raises(TypeError, match="payload must be bytes .*, not float"):
            call(1.5)
        # Bytes-like values still decode.
        empty = bytes([0x93, 0xCB] + [0] * 8 + [0x90, 0xC0])  # [0.0, [], None]
        for p in (empty, bytearray(empty), memoryview(empty)):
            assert call(p).events == []


def test_an_event_decoded_for_another_block_size_is_refused_by_the_index():
    """Local hashes of 4-token blocks never match an index of 8-token blocks: ``apply``
    said nothing and the blocks were stored in vain."""
    batch = vllm.decode_batch(payload(NAMES[0]), block_size=4)
    assert batch.events[0].block_size == 4
    index = kvtrie.BlockIndex(kvtrie.BlockHasher(8))
    with pytest.raises(ValueError, match="decoded for blocks of 4 tokens.*blocks of 8"):
        index.apply(3, batch.events[0])
    assert index.workers() == []
    ok = kvtrie.BlockIndex(kvtrie.BlockHasher(4))
    ok.apply(3, batch.events[0])
    assert ok.workers() == [3]
    assert vllm.Decoder(4).decode(payload(NAMES[0])).events[0].block_size == 4

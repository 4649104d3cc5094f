"""Block hashing identical to the Rust crate (tests/data/vectors.json, checked against the
crate by tests/vectors.rs) and the BlockIndex's behaviour."""

from __future__ import annotations

import kvtrie


def hasher_for(case):
    h = kvtrie.BlockHasher(case["block_size"])
    if case["salt"] is not None:
        h = h.with_salt(*case["salt"])
    return h


def test_hashes_equal_the_rust_crates(vectors):
    cases = vectors["hashing"]
    assert len(cases) >= 10
    for case in cases:
        h = hasher_for(case)
        assert h.seed == case["seed"]
        assert h.block_size == case["block_size"]
        tokens = case["tokens"]
        assert h.local_hashes(tokens) == case["local"]
        assert h.sequence_hashes(tokens) == case["sequence"]
        assert h.local_hashes(iter(tokens)) == case["local"]  # any iterable
        assert h.chain_local(case["local"]) == case["sequence"]
        bs = case["block_size"]
        if case["local"]:
            assert h.hash_block(tokens[:bs]) == case["local"][0]
        for i in range(1, len(case["sequence"])):
            assert h.chain(case["sequence"][i - 1], case["local"][i]) == case["sequence"][i]
        # A salt changes every hash; an empty salt changes nothing.
        assert kvtrie.BlockHasher(bs).with_salt("", "").seed == 1337


def test_hasher_basics():
    h = kvtrie.BlockHasher(4)
    assert len(h.local_hashes(range(10))) == 2  # the partial block is ignored
    assert h.local_hashes(range(3)) == []
    assert h == kvtrie.BlockHasher(4, seed=1337) and h != kvtrie.BlockHasher(4, seed=1)
    assert hash(h) == hash(kvtrie.BlockHasher(4))
    assert repr(h) == "kvtrie.BlockHasher(block_size=4, seed=1337)"


def test_index_semantics():
    h = kvtrie.BlockHasher(4)
    index = kvtrie.BlockIndex(h)
    prompt = list(range(12))  # three blocks
    local = h.local_hashes(prompt)
    seq = h.sequence_hashes(prompt)

    def stored(ids):
        return [kvtrie.StoredBlock(engine_hash=seq[i], local_hash=local[i]) for i in ids]

    # Worker 0 stores the first two blocks, then the third under its parent.
    index.apply(0, kvtrie.KvEvent.Stored(parent=None, blocks=stored([0, 1])))
    index.apply(0, kvtrie.KvEvent.Stored(parent=seq[1], blocks=stored([2])))
    index.store_blocks(1, None, stored([0]))
    assert index.find_matches(local) == {0: 3, 1: 1}
    assert index.find_matches_seq(seq) == {0: 3, 1: 1}
    assert index.find_matches_tokens(prompt) == {0: 3, 1: 1}
    assert index.find_matches(local[1:]) == {}
    assert (index.total_blocks, index.distinct_blocks, index.workers()) == (4, 3, [0, 1])
    assert index.block_count(0) == 3
    index.apply(0, kvtrie.KvEvent.Removed(engine_hashes=[seq[1], 999]))
    assert index.find_matches(local) == {0: 1, 1: 1}
    st = index.stats()
    assert (st["blocks_stored"], st["blocks_removed"], st["unknown_removes"]) == (4, 1, 1)
    index.apply(1, kvtrie.KvEvent.Cleared())
    assert index.find_matches(local) == {0: 1}
    assert index.remove_worker(0) == 2
    assert index.find_matches(local) == {} and index.workers() == [1]
    assert index.heap_bytes() > 0
    assert repr(index) == "kvtrie.BlockIndex(workers=1, blocks=0)"
    # An engine's data-parallel ranks leave together (worker = engine | rank << 48).
    for rank in (0, 1):
        w = 9 | rank << 48
        index.apply(w, kvtrie.KvEvent.Stored(None, [kvtrie.StoredBlock(seq[0], local[0])]))
    assert index.remove_engine(9) == 2 and index.workers() == [1]


def test_full_reports_of_reused_blocks_are_not_copies():
    # With vLLM's kv_cache_report_mode "full", every reused block is stored again and removed
    # once: as reports they leave with that removal; as copies (the default) they stayed.
    import pytest

    store = kvtrie.KvEvent.Stored(None, [kvtrie.StoredBlock(7, 70)])
    left = {}
    for mode in ("copies", "reports"):
        index = kvtrie.BlockIndex()
        assert index.duplicate_stores == "copies"
        index.set_duplicate_stores(mode)
        assert index.duplicate_stores == mode
        for _ in range(3):
            index.apply(1, store)
        index.apply(1, kvtrie.KvEvent.Removed([7]))
        left[mode] = index.block_count(1)
    assert left == {"copies": 1, "reports": 0}
    with pytest.raises(ValueError, match="copies"):
        kvtrie.BlockIndex().set_duplicate_stores("sets")


def test_events_are_values():
    a = kvtrie.KvEvent.Stored(parent=None, blocks=[kvtrie.StoredBlock(1, 2)])
    assert a == kvtrie.KvEvent.Stored(None, [kvtrie.StoredBlock(1, 2)])
    assert a != kvtrie.KvEvent.Cleared()
    assert isinstance(a, kvtrie.KvEvent) and isinstance(a, kvtrie.KvEvent.Stored)
    assert repr(a) == "KvEvent.Stored(parent=None, blocks=[StoredBlock(engine_hash=1, local_hash=2)])"
    assert repr(kvtrie.KvEvent.Removed([5])) == "KvEvent.Removed(engine_hashes=[5])"
    match kvtrie.KvEvent.Removed([5, 6]):
        case kvtrie.KvEvent.Removed(engine_hashes=hs):
            assert hs == [5, 6]
        case _:
            raise AssertionError("no match")
    b = kvtrie.StoredBlock(engine_hash=7, local_hash=42)
    assert (b.engine_hash, b.local_hash) == (7, 42) and {b, kvtrie.StoredBlock(7, 42)} == {b}

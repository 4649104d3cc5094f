"""Bad input from Python: a clear exception and no change, never a crash.

* non-``str`` text or tenant: ``TypeError``;
* strings that are not valid Unicode for UTF-8 (lone surrogates): ``ValueError``, nothing
  changed;
* unknown tenants: as Ray (no change, no exception; 0 / ``None`` results);
* very long prompts (10 MB) work;
* bad numbers (NaN, negative or huge counts, bad durations): ``ValueError`` or saturation.
"""

from __future__ import annotations

import math
import threading

import pytest

import kvtrie

SURROGATE = "abc\ud800def"


@pytest.fixture
def tree():
    t = kvtrie.PrefixTree()
    t.add_tenants(["a", "b"], 0.0)
    t.insert("hello world", "a", 1.0)
    return t


def unchanged(tree):
    assert tree.tenant_to_char_count == {"a": 11, "b": 0}
    assert tree.snapshot()["children"][0]["text"] == "hello world"
    tree.check_invariants()


@pytest.mark.parametrize("bad", [None, 3, 3.5, b"hello", ["hello"], object()])
def test_non_str_text_and_tenant_are_type_errors(tree, bad):
    with pytest.raises(TypeError):
        tree.insert(bad, "a", 2.0)
    with pytest.raises(TypeError):
        tree.insert("hello", bad, 2.0)
    with pytest.raises(TypeError):
        tree.prefix_match(bad)
    with pytest.raises(TypeError):
        tree.match_and_insert(bad, "a", 2.0)
    with pytest.raises(TypeError):
        tree.evict_tenant_by_lru(bad, 1)
    if bad is not None:
        with pytest.raises(TypeError):
            tree.prefix_match("hello", [bad])
        with pytest.raises(TypeError):
            tree.add_tenants([bad], 0.0)
        with pytest.raises(TypeError):
            tree.remove_tenants([bad])
    unchanged(tree)


def test_a_single_str_is_not_a_tenant_list(tree):
    with pytest.raises(TypeError):
        tree.add_tenants("abc", 0.0)
    with pytest.raises(TypeError):
        tree.remove_tenants("a")
    with pytest.raises(TypeError):
        tree.prefix_match("hello", "a")
    with pytest.raises(TypeError):
        tree.prefix_match_many("hello")
    unchanged(tree)


def test_an_endless_iterable_of_non_texts_fails_at_its_first_element(tree):
    # Read to the end before checking, `itertools.repeat(1)` filled memory until the process
    # died.
    import itertools

    with pytest.raises(TypeError):
        tree.prefix_match_many(itertools.repeat(1))
    with pytest.raises(TypeError):
        tree.prefix_match_many(itertools.chain(["hello"], itertools.repeat(None)))
    unchanged(tree)


def test_lone_surrogates_are_value_errors_and_change_nothing(tree):
    for call in (
        lambda: tree.insert(SURROGATE, "a", 2.0),
        lambda: tree.insert("x", SURROGATE, 2.0),
        lambda: tree.add_tenants(["c", SURROGATE], 2.0),
        lambda: tree.remove_tenants(["a", SURROGATE]),
        lambda: tree.prefix_match(SURROGATE),
        lambda: tree.prefix_match("hello", ["a", SURROGATE]),
        lambda: tree.prefix_match_many(["hello", SURROGATE]),
        lambda: tree.match_and_insert(SURROGATE, "a", 2.0),
        lambda: tree.evict_tenant_by_lru(SURROGATE, 1),
    ):
        with pytest.raises(ValueError, match="surrogate"):
            call()
    # The whole call is rejected before anything happens: "c" was not added, "a" is intact.
    unchanged(tree)
    # Valid astral characters (surrogate pairs in UTF-16) are fine.
    tree.insert("🙂", "b", 3.0)
    assert tree.tenant_to_char_count["b"] == 1


def test_unknown_tenants_behave_as_in_ray(tree):
    assert tree.insert("zzz", "ghost", 2.0) is None
    assert tree.prefix_match("hello", ["ghost"]) == ("", None)
    assert tree.remove_tenants(["ghost"]) == {"ghost": 0}
    assert tree.evict_tenant_by_lru("ghost", 5) == 0
    assert tree.match_and_insert("hello", "ghost", 2.0) == ("hello", ["a"], None)
    assert "ghost" not in tree.tenant_to_char_count
    unchanged(tree)


def test_bad_numbers(tree):
    with pytest.raises(ValueError):
        tree.insert("x", "a", math.nan)
    with pytest.raises(TypeError):
        tree.insert("x", "a", "1.0")
    with pytest.raises(ValueError):
        tree.evict_tenant_by_lru("a", math.nan)
    with pytest.raises(TypeError):
        tree.evict_tenant_by_lru("a", "5")
    with pytest.raises(ValueError):
        tree.start_eviction_loop(10, 5, -1.0)
    with pytest.raises(ValueError):
        tree.start_eviction_loop(10, 5, math.inf)
    with pytest.raises(ValueError):
        tree.start_eviction_loop(10, 5, math.nan)
    unchanged(tree)
    # Counts saturate instead of overflowing.
    assert tree.evict_tenant_by_lru("a", -5) == 0
    assert tree.evict_tenant_by_lru("b", 10**40) == 0
    assert tree.start_eviction_loop(10**40, -3, 1000.0) is True
    tree.stop_eviction_loop()
    # Infinite and huge times are valid.
    tree.insert("late", "b", math.inf)
    tree.insert("early", "b", -math.inf)
    assert tree.evict_tenant_by_lru("b", 1) == 5  # "early" is the oldest
    assert tree.evict_tenant_by_lru("a", 10**40) == 11


def test_ten_megabyte_prompt(tree):
    big = "x" * 10_000_000
    tree.insert(big, "b", 2.0)
    assert tree.tenant_to_char_count["b"] == 10_000_000
    text, owners = tree.prefix_match(big + "y")
    assert text == big and owners == ["b"]
    # A non-ASCII 10 MB prompt (UTF-8 is longer than the code-point count).
    wide = "é" * 5_000_000
    tree.insert(wide, "a", 3.0)
    assert tree.prefix_match(wide)[0] == wide
    assert tree.tenant_to_char_count["a"] == 11 + 5_000_000
    assert tree.evict_tenant_by_lru("b", 1) == 10_000_000
    tree.check_invariants()


def test_deep_tree_snapshot_does_not_overflow_the_stack():
    tree = kvtrie.PrefixTree()
    tree.add_tenants(["a"], 0.0)
    # 20,000 nested one-char nodes: every prefix of a long text, longest first (each insert
    # splits the deepest node).
    text = "ab" * 10_000
    for i in range(len(text), 0, -1):
        tree.insert(text[:i], "a", float(len(text) - i))
    result = {}

    def walk():
        # On a thread with a 512 KiB stack, a recursive walk over 20,000 levels would crash.
        depth, node = 0, tree.snapshot()
        while node["children"]:
            node = node["children"][0]
            depth += 1
        tree.check_invariants()
        result["depth"] = depth

    old = threading.stack_size(512 * 1024)
    try:
        t = threading.Thread(target=walk)
        t.start()
        t.join()
    finally:
        threading.stack_size(old)
    assert result["depth"] == len(text)


def test_router_and_block_bad_input():
    router = kvtrie.PrefixAffinityRouter()
    router.update_replicas(["r0"])
    with pytest.raises(TypeError):
        router.route(5, ["r0"])
    with pytest.raises(ValueError):
        router.route(SURROGATE, ["r0"])
    with pytest.raises(kvtrie.RouteError):
        router.route("hi", [])
    with pytest.raises(kvtrie.RouteError):
        router.route("hi", ["ghost"])
    with pytest.raises(TypeError):
        router.route("hi", "r0")
    with pytest.raises(TypeError):
        router.route("hi", [("r0", 1, 2)])
    # Ray's text of a chat made of a number is empty: routed as an empty prompt.
    assert router.route_chat([5], ["r0"]).reason == "no_text"
    with pytest.raises(ValueError):
        kvtrie.PrefixAffinityConfig(imbalanced_choice="random")
    for ratio in (math.nan, -math.inf):
        with pytest.raises(ValueError, match="imbalanced_ratio"):
            kvtrie.PrefixAffinityConfig(imbalanced_ratio=ratio)
    assert kvtrie.PrefixAffinityConfig(imbalanced_ratio=math.inf).imbalanced_ratio == math.inf
    with pytest.raises(TypeError):
        kvtrie.PrefixAffinityConfig(bogus=1)
    with pytest.raises(ValueError):
        kvtrie.PrefixAffinityConfig(match_rate_threshold=math.nan)
    assert router.route("hi", {"r0": -4}).replica == "r0"  # negative queue saturates to 0
    router.check_invariants()

    with pytest.raises(ValueError):
        kvtrie.BlockHasher(0)
    with pytest.raises(ValueError):
        kvtrie.KvAwareConfig(block_size=0)
    with pytest.raises(ValueError):
        kvtrie.KvAwareConfig(temperature=-1.0)
    with pytest.raises(ValueError):
        kvtrie.KvAwareConfig(reservation_ttl=math.nan)
    with pytest.raises(ValueError):
        kvtrie.KvAwareRouter(kvtrie.KvAwareConfig(4), kvtrie.BlockIndex(kvtrie.BlockHasher(4, seed=7)))
    # Blocks of another size never match the router's: refused, not silently misrouted.
    with pytest.raises(ValueError, match="blocks of 4 tokens"):
        kvtrie.KvAwareRouter(kvtrie.KvAwareConfig(16), kvtrie.BlockIndex(kvtrie.BlockHasher(4)))
    h = kvtrie.BlockHasher(4)
    with pytest.raises(OverflowError):
        h.local_hashes([1, 2, 3, -1])
    with pytest.raises(OverflowError):
        h.local_hashes([2**32])
    with pytest.raises(TypeError):
        h.local_hashes("abcd")
    kv = kvtrie.KvAwareRouter(kvtrie.KvAwareConfig(4))
    with pytest.raises(kvtrie.RouteError):
        kv.select_and_reserve(1, [], [0])
    with pytest.raises(kvtrie.RouteError):
        kv.select_and_reserve(1, [1, 2], [])
    with pytest.raises(OverflowError):
        kv.select_and_reserve(-1, [1, 2], [0])
    index = kvtrie.BlockIndex(h)
    with pytest.raises(kvtrie.UnknownParentError):
        index.apply(0, kvtrie.KvEvent.Stored(parent=42, blocks=[kvtrie.StoredBlock(1, 2)]))
    assert index.total_blocks == 0
    with pytest.raises(TypeError):
        index.apply(0, "Cleared")
    with pytest.raises(ValueError):
        kvtrie.vllm.decode_batch(b"", block_size=0)
    with pytest.raises(ValueError):
        kvtrie.vllm.decode_batch(b"", block_size=16, engine_block_size=24)


def test_hash_and_worker_lists_name_the_argument_when_they_are_not_lists_of_int():
    """A ``str`` where a list of ids or hashes goes is a ``TypeError`` that names the argument
    (PyO3's text was "Can't extract `str` to `Vec`"), and changes nothing."""
    index = kvtrie.BlockIndex()
    index.store_blocks(0, None, [kvtrie.StoredBlock(1, 10), kvtrie.StoredBlock(2, 20)])
    before = index.find_matches([10, 20])
    with pytest.raises(TypeError, match="engine_hashes must be a list of int, not str"):
        index.remove_blocks(0, "12")
    with pytest.raises(TypeError, match="local_hashes must be a list of int, not bytes"):
        index.find_matches(b"\x0a")
    with pytest.raises(TypeError, match="seq_hashes must hold only int, not str"):
        index.find_matches_seq([10, "20"])
    with pytest.raises(TypeError, match="local must be a list of int, not float"):
        kvtrie.BlockHasher(16).chain_local(1.5)
    kr = kvtrie.KvAwareRouter(kvtrie.KvAwareConfig(4))
    with pytest.raises(TypeError, match="allowed_workers must be a list of int, not str"):
        kr.select_and_reserve(1, [1, 2, 3, 4], "0")
    assert kr.loads() == {}
    with pytest.raises(OverflowError):
        index.remove_blocks(0, [-1])
    assert index.find_matches([10, 20]) == before
    # Any iterable of ints still works.
    assert index.find_matches(iter([10, 20])) == before

    class Index:  # as numpy's integers: not `int`, but `__index__`
        def __init__(self, v):
            self.v = v

        def __index__(self):
            return self.v

    assert index.find_matches([Index(10), Index(20)]) == before
    assert index.find_matches_tokens(iter(range(4))) == index.find_matches_tokens([0, 1, 2, 3])
    with pytest.raises(TypeError, match="tokens must hold only int, not float"):
        index.find_matches_tokens([1, 2.5])
    with pytest.raises(TypeError, match="tokens must be a list of int, not str"):
        index.find_matches_tokens("abcd")
    assert index.find_matches_seq(range(0)) == {}
    index.remove_blocks(0, (h for h in [1, 2]))
    assert index.find_matches([10, 20]) == {}


def test_small_consistencies_from_the_python_probe():
    # An empty tree is truthy, as Ray's (which has no length) is.
    assert kvtrie.PrefixTree() and len(kvtrie.PrefixTree()) == 0
    # A callable tenant gets its own owners list: emptying it changes nothing returned.
    t = kvtrie.PrefixTree()
    t.add_tenants(["a", "b"], 0.0)
    t.insert("hi there", "a", 1.0)
    got = t.match_and_insert("hi", lambda m, owners: (owners.clear(), "b")[1], 2.0)
    assert got == ("hi", ["a"], "b")
    # with_global_budget reads its numbers as the constructor's global_budget does.
    base = kvtrie.EvictionConfig(10, 5, 1.0)
    assert base.with_global_budget(-1, 1.5) == kvtrie.EvictionConfig(
        10, 5, 1.0, global_budget=(-1, 1.5)
    )
    assert base.with_global_budget(2**70, 7.9).global_budget == (2**64 - 1, 7)
    with pytest.raises(ValueError, match="max_total_chars"):
        base.with_global_budget(math.nan, 0)

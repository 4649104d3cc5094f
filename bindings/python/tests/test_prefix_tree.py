"""Ray's documented PrefixTree behaviours, with exact return values.

Every test in ``TestRaySemantics`` runs twice: against ``kvtrie.PrefixTree`` and against Ray
2.60.0's own ``PrefixTree`` (the reference), so the expected values below are Ray's actual
behaviour and kvtrie is checked to reproduce them. kvtrie's deliberate deviations are tested
separately (``TestDeviations``).
"""

from __future__ import annotations

import collections.abc
import time

import pytest

import kvtrie
from conftest import ray_prefix_tree_class


@pytest.fixture(params=["kvtrie", "ray"])
def make(request):
    if request.param == "kvtrie":
        return kvtrie.PrefixTree
    return ray_prefix_tree_class()


def docstring_tree(make):
    """Ray's class docstring example: helloworld@1 by t1, hellothere@2 and hellothomas@3
    by t2."""
    tree = make()
    tree.add_tenants(["tenant_1", "tenant_2"], 0)
    tree.insert("helloworld", "tenant_1", 1)
    tree.insert("hellothere", "tenant_2", 2)
    tree.insert("hellothomas", "tenant_2", 3)
    return tree


def wait_until(cond, timeout=30.0):
    """Polls ``cond`` until it holds (a bounded wait for a background thread, not timing)."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


class TestRaySemantics:
    def test_empty_tree(self, make):
        tree = make()
        assert tree.tenant_to_char_count == {}
        assert tree.get_smallest_tenants() is None
        assert tree.prefix_match("hello") == ("", None)
        assert tree.prefix_match("hello", ["a"]) == ("", None)
        assert tree.remove_tenants(["a"]) == {"a": 0}
        assert tree.evict_tenant_by_lru("a", 10) == 0

    def test_add_tenants_skips_existing(self, make):
        tree = make()
        tree.add_tenants(["a", "b"], 0)
        tree.add_tenants(["b", "c"], 1)
        assert tree.tenant_to_char_count == {"a": 0, "b": 0, "c": 0}
        assert list(tree.tenant_to_char_count) == ["a", "b", "c"]
        assert tree.prefix_match("hello") == ("", ["a", "b", "c"])

    def test_docstring_example_counts_and_matches(self, make):
        tree = docstring_tree(make)
        assert tree.tenant_to_char_count == {"tenant_1": 10, "tenant_2": 14}
        assert tree.prefix_match("hellothomas") == ("hellothomas", ["tenant_2"])
        assert tree.prefix_match("helloworld!") == ("helloworld", ["tenant_1"])
        assert tree.prefix_match("hello") == ("hello", ["tenant_1", "tenant_2"])
        # A partial match inside a node counts; its owners are returned.
        assert tree.prefix_match("hel") == ("hel", ["tenant_1", "tenant_2"])
        assert tree.prefix_match("hellotx") == ("hellot", ["tenant_2"])
        assert tree.prefix_match("xyz") == ("", ["tenant_1", "tenant_2"])
        assert tree.prefix_match("") == ("", ["tenant_1", "tenant_2"])

    def test_available_tenants(self, make):
        tree = docstring_tree(make)
        # The walk stops before a node none of the available tenants owns.
        assert tree.prefix_match("hellothere", ["tenant_1"]) == ("hello", ["tenant_1"])
        assert tree.prefix_match("helloworld", ["tenant_2"]) == ("hello", ["tenant_2"])
        # Results follow the order of available_tenants, duplicates included.
        assert tree.prefix_match("hello", ["tenant_2", "tenant_1"]) == (
            "hello",
            ["tenant_2", "tenant_1"],
        )
        assert tree.prefix_match("hello", ["tenant_2", "tenant_2"]) == (
            "hello",
            ["tenant_2", "tenant_2"],
        )
        # Unknown names are dropped; only unknown names: ("", None).
        assert tree.prefix_match("hello", ["nobody", "tenant_2"]) == ("hello", ["tenant_2"])
        assert tree.prefix_match("hello", ["nobody"]) == ("", None)
        # An empty list means every tenant (Ray's `if available_tenants:`).
        assert tree.prefix_match("hellothomas", []) == ("hellothomas", ["tenant_2"])
        assert tree.prefix_match("hello", None) == ("hello", ["tenant_1", "tenant_2"])

    def test_insert_unknown_tenant_changes_nothing(self, make):
        tree = docstring_tree(make)
        assert tree.insert("zebra", "nobody", 4) is None
        assert tree.tenant_to_char_count == {"tenant_1": 10, "tenant_2": 14}
        assert tree.prefix_match("zebra") == ("", ["tenant_1", "tenant_2"])

    def test_insert_counts_each_node_once(self, make):
        tree = make()
        tree.add_tenants(["a"], 0)
        tree.insert("hello", "a", 1)
        tree.insert("hello", "a", 2)
        tree.insert("help", "a", 3)
        assert tree.tenant_to_char_count == {"a": 6}  # "hel" + "lo" + "p"
        tree.insert("he", "a", 4)
        assert tree.tenant_to_char_count == {"a": 6}

    def test_remove_tenants(self, make):
        tree = docstring_tree(make)
        assert tree.remove_tenants(["tenant_2", "nobody"]) == {"tenant_2": 14, "nobody": 0}
        assert tree.tenant_to_char_count == {"tenant_1": 10}
        assert tree.prefix_match("hellothomas") == ("hello", ["tenant_1"])
        assert tree.prefix_match("hello", ["tenant_2"]) == ("", None)
        assert tree.remove_tenants(["tenant_2"]) == {"tenant_2": 0}
        assert tree.remove_tenants(["tenant_1"]) == {"tenant_1": 10}
        assert tree.tenant_to_char_count == {}
        assert tree.prefix_match("hello") == ("", None)

    def test_readded_tenant_starts_empty_and_goes_last(self, make):
        tree = docstring_tree(make)
        tree.remove_tenants(["tenant_1"])
        tree.add_tenants(["tenant_1"], 5)
        assert list(tree.tenant_to_char_count.items()) == [("tenant_2", 14), ("tenant_1", 0)]
        assert tree.get_smallest_tenants() == ["tenant_1"]
        assert tree.prefix_match("helloworld") == ("hello", ["tenant_2"])

    def test_evict_oldest_first(self, make):
        tree = make()
        tree.add_tenants(["a"], 0)
        tree.insert("a", "a", 1)
        tree.insert("b", "a", 2)
        tree.insert("c", "a", 3)
        assert tree.evict_tenant_by_lru("a", 1) == 1
        assert tree.prefix_match("a") == ("", ["a"])
        assert tree.evict_tenant_by_lru("a", 2) == 2
        assert tree.tenant_to_char_count == {"a": 0}

    def test_evict_removes_whole_timestamp_groups(self, make):
        tree = make()
        tree.add_tenants(["a"], 0)
        tree.insert("ab", "a", 1)
        tree.insert("cd", "a", 1)
        tree.insert("ef", "a", 2)
        # Both nodes of the oldest group go, though one would have been enough.
        assert tree.evict_tenant_by_lru("a", 1) == 4
        assert tree.tenant_to_char_count == {"a": 2}
        assert tree.prefix_match("ef") == ("ef", ["a"])

    def test_negative_zero_time_is_the_same_timestamp_as_zero(self, make):
        # -0.0 == 0.0 in Python: nodes touched at either are one LRU group.
        tree = make()
        tree.add_tenants(["a"], 0)
        tree.insert("ab", "a", -0.0)
        tree.insert("cd", "a", 0.0)
        tree.insert("ef", "a", 1.0)
        assert tree.evict_tenant_by_lru("a", 1) == 4
        assert tree.tenant_to_char_count == {"a": 2}
        assert tree.prefix_match("ef") == ("ef", ["a"])

    def test_evict_splits_keep_lru_order(self, make):
        tree = make()
        tree.add_tenants(["a"], 0)
        tree.insert("hello", "a", 1)
        tree.insert("help", "a", 2)  # "hel"@2, "lo"@1, "p"@2
        assert tree.evict_tenant_by_lru("a", 1) == 2  # "lo"
        assert tree.prefix_match("hello") == ("help"[:3], ["a"])
        assert tree.evict_tenant_by_lru("a", 1) == 4  # "p" and "hel"
        assert tree.tenant_to_char_count == {"a": 0}

    def test_evict_more_than_held_and_edge_cases(self, make):
        tree = docstring_tree(make)
        assert tree.evict_tenant_by_lru("tenant_2", 10**9) == 14
        assert tree.tenant_to_char_count == {"tenant_1": 10, "tenant_2": 0}
        assert tree.evict_tenant_by_lru("tenant_1", 0) == 0
        assert tree.evict_tenant_by_lru("nobody", 5) == 0
        # Shared nodes survive for their other owner.
        assert tree.prefix_match("helloworld") == ("helloworld", ["tenant_1"])

    def test_evict_shared_prefix_keeps_other_owner(self, make):
        tree = make()
        tree.add_tenants(["a", "b"], 0)
        tree.insert("hello world", "a", 1)
        tree.insert("hello there", "b", 2)
        assert tree.evict_tenant_by_lru("a", 1) == 11
        assert tree.tenant_to_char_count == {"a": 0, "b": 11}
        assert tree.prefix_match("hello wor") == ("hello ", ["b"])

    def test_smallest_tenants(self, make):
        tree = make()
        tree.add_tenants(["a", "b", "c"], 0)
        assert tree.get_smallest_tenants() == ["a", "b", "c"]
        tree.insert("xx", "b", 1)
        assert tree.get_smallest_tenants() == ["a", "c"]
        tree.insert("yyy", "a", 2)
        tree.insert("z", "c", 3)
        assert tree.get_smallest_tenants() == ["c"]
        tree.remove_tenants(["c"])
        assert tree.get_smallest_tenants() == ["b"]

    def test_eviction_loop(self, make):
        tree = make()
        tree.add_tenants(["a"], 0)
        for i, word in enumerate(["alpha", "beta", "gamma", "delta", "epsilon"]):
            tree.insert(word, "a", i + 1)
        assert tree.tenant_to_char_count["a"] == 26
        assert tree.start_eviction_loop(10, 5, 0.01) is True
        assert tree.start_eviction_loop(10, 5, 0.01) is False
        try:
            wait_until(lambda: tree.tenant_to_char_count["a"] <= 5)
            # Oldest first: only the newest word can be left.
            assert tree.prefix_match("epsilon")[0] in ("epsilon", "")
            assert tree.prefix_match("alpha")[0] == ""
        finally:
            tree.stop_eviction_loop()
        # Restartable after a stop.
        assert tree.start_eviction_loop(10, 5, 1.0) is True
        tree.stop_eviction_loop()

    @pytest.mark.parametrize("threshold, target", [(10.5, 5), (10, 5.5)])
    def test_eviction_loop_fractional_bounds(self, make, threshold, target):
        # Ray compares the counts with the float bounds themselves: 11 chars exceed 10.5, and
        # evicting down to 5.5 leaves at most 5 (a bound rounds down, not up).
        tree = make()
        tree.add_tenants(["a"], 0)
        for i in range(11):
            tree.insert(chr(ord("a") + i), "a", i + 1)
        assert tree.start_eviction_loop(threshold, target, 0.01) is True
        try:
            wait_until(lambda: tree.tenant_to_char_count["a"] <= 5)
        finally:
            tree.stop_eviction_loop()
        # One char per timestamp group: exactly the six oldest went.
        assert tree.tenant_to_char_count["a"] == 5
        assert tree.prefix_match("k")[0] == "k"
        assert tree.prefix_match("f")[0] == ""

    def test_eviction_loop_target_above_threshold(self, make):
        # Ray evicts `count - target` chars from a tenant over the threshold: nothing while the
        # count is at most the target, even though it exceeds the threshold.
        tree = make()
        tree.add_tenants(["a", "b"], 0)
        tree.insert("aaaaaaaa", "a", 1)  # 8 chars: above the threshold, below the target
        tree.insert("bbbbbbbbbbbb", "b", 1)  # 12 chars: above both
        assert tree.start_eviction_loop(5, 10, 0.01) is True
        try:
            wait_until(lambda: tree.tenant_to_char_count["b"] == 0)
            # A second eviction of b comes from a later pass, so a full pass has seen a.
            tree.insert("cccccccccccc", "b", 2)
            wait_until(lambda: tree.tenant_to_char_count["b"] == 0)
        finally:
            tree.stop_eviction_loop()
        assert tree.tenant_to_char_count["a"] == 8

    def test_char_counts_copy_and_pickle_as_a_dict(self, make):
        # Ray's attribute is a dict: copies and pickles (e.g. a Ray actor returning it) are
        # plain dicts with the counts at that moment.
        import copy
        import pickle

        tree = docstring_tree(make)
        counts = tree.tenant_to_char_count
        for snapshot in (
            copy.copy(counts),
            copy.deepcopy(counts),
            pickle.loads(pickle.dumps(counts)),
        ):
            assert type(snapshot) is dict
            assert snapshot == {"tenant_1": 10, "tenant_2": 14}
            assert list(snapshot) == ["tenant_1", "tenant_2"]
        assert counts | {"x": 1} == {"tenant_1": 10, "tenant_2": 14, "x": 1}
        assert {"tenant_1": 0, "x": 1} | counts == {"tenant_1": 10, "x": 1, "tenant_2": 14}
        assert type(counts | {}) is dict

    def test_unicode_lengths_are_code_points(self, make):
        tree = make()
        tree.add_tenants(["a"], 0)
        tree.insert("héllo 🙂 wörld", "a", 1)
        tree.insert("héllo 🙃", "a", 2)
        assert tree.tenant_to_char_count == {"a": 14}
        assert tree.prefix_match("héllo 🙂!") == ("héllo 🙂", ["a"])
        assert tree.prefix_match("héllo 😀") == ("héllo ", ["a"])
        assert tree.prefix_match("hè") == ("h", ["a"])


class TestExtras:
    def test_eviction_totals_count_what_the_loop_evicted(self):
        tree = kvtrie.PrefixTree()
        assert tree.eviction_totals() is None
        tree.add_tenants(["a", "b"], 0)
        # a: 5 words of 10 chars at times 1..5 (50 chars); b: 8 chars, under the threshold.
        for i in range(5):
            tree.insert(f"{i}" * 10, "a", i + 1)
        tree.insert("bbbbbbbb", "b", 1)
        assert tree.start_eviction_loop(25, 20, 0.01) is True
        try:
            # The first pass evicts a's three oldest words; the second finds nothing to do.
            wait_until(lambda: tree.eviction_totals()["passes"] >= 2)
            assert tree.eviction_totals() | {"passes": 0} == {
                "passes": 0,
                "tenants_evicted": 1,
                "chars_evicted": 30,
                "global_chars_evicted": 0,
            }
            assert tree.tenant_to_char_count == {"a": 20, "b": 8}
        finally:
            tree.stop_eviction_loop()
        # The stopped loop's final totals stay readable.
        assert tree.eviction_totals() | {"passes": 0} == {
            "passes": 0,
            "tenants_evicted": 1,
            "chars_evicted": 30,
            "global_chars_evicted": 0,
        }
        # A new loop counts from zero.
        assert tree.start_eviction_loop(25, 20, 3600.0) is True
        assert tree.eviction_totals() == {
            "passes": 0,
            "tenants_evicted": 0,
            "chars_evicted": 0,
            "global_chars_evicted": 0,
        }
        tree.stop_eviction_loop()

    def test_tenant_to_char_count_is_a_live_read_only_mapping(self):
        tree = docstring_tree(kvtrie.PrefixTree)
        view = tree.tenant_to_char_count
        assert isinstance(view, collections.abc.Mapping)
        assert view == {"tenant_1": 10, "tenant_2": 14}
        assert {"tenant_1": 10, "tenant_2": 14} == view
        assert view != {"tenant_1": 10}
        assert view["tenant_2"] == 14 and view.get("nobody") is None and view.get("x", 7) == 7
        assert "tenant_1" in view and "nobody" not in view and 3 not in view
        assert len(view) == 2 and list(view.keys()) == ["tenant_1", "tenant_2"]
        assert list(view.values()) == [10, 14] and dict(view.items()) == view.copy()
        with pytest.raises(KeyError):
            view["nobody"]
        with pytest.raises(TypeError):
            view["tenant_1"] = 3  # read-only
        tree.insert("zzzz", "tenant_1", 4)
        assert view["tenant_1"] == 14  # live
        assert repr(view) == "{'tenant_1': 14, 'tenant_2': 14}"

    def test_snapshot_is_rays_tree(self):
        tree = docstring_tree(kvtrie.PrefixTree)
        assert tree.snapshot() == {
            "text": "",
            "tenants": {"tenant_1": 1.0, "tenant_2": 3.0},
            "children": [
                {
                    "text": "hello",
                    "tenants": {"tenant_1": 1.0, "tenant_2": 3.0},
                    "children": [
                        {
                            "text": "th",
                            "tenants": {"tenant_2": 3.0},
                            "children": [
                                {"text": "ere", "tenants": {"tenant_2": 2.0}, "children": []},
                                {"text": "omas", "tenants": {"tenant_2": 3.0}, "children": []},
                            ],
                        },
                        {"text": "world", "tenants": {"tenant_1": 1.0}, "children": []},
                    ],
                }
            ],
        }
        assert len(tree) == 5
        assert repr(tree) == "kvtrie.PrefixTree(tenants=2, nodes=5, chars=19)"
        assert tree.stats()["nodes"] == 5 and tree.distinct_chars == 19
        tree.check_invariants()

    def test_timestamps_round_trip_exactly(self):
        tree = kvtrie.PrefixTree()
        tree.add_tenants(["a"], 0.0)
        times = [-1e300, -2.5, 0.0, 1e-300, 1.0, 1.0000000000000002, 1.7e9 + 0.123, 1e300]
        for i, t in enumerate(times):
            tree.insert(chr(ord("a") + i), "a", t)
        kids = tree.snapshot()["children"]
        assert [c["tenants"]["a"] for c in kids] == times
        # Order is kept exactly: the most negative time is the oldest.
        assert tree.evict_tenant_by_lru("a", 1) == 1
        assert [c["text"] for c in tree.snapshot()["children"]][0] == "b"

    def test_match_and_insert_with_a_name(self):
        tree = kvtrie.PrefixTree()
        tree.add_tenants(["a", "b"], 0.0)
        assert tree.match_and_insert("hello world", "a", 1.0) == ("", ["a", "b"], "a")
        assert tree.match_and_insert("hello there", "b", 2.0) == ("hello ", ["a"], "b")
        assert tree.tenant_to_char_count == {"a": 11, "b": 11}
        assert tree.match_and_insert("hello", "nobody", 3.0) == ("hello", ["a", "b"], None)
        assert tree.match_and_insert("hello x", "b", available_tenants=["a"]) == (
            "hello ",
            ["a"],
            "b",
        )

    def test_match_and_insert_with_a_chooser(self):
        tree = kvtrie.PrefixTree()
        tree.add_tenants(["a", "b"], 0.0)
        seen = []

        def choose(text, owners):
            seen.append((text, owners))
            return owners[-1]

        assert tree.match_and_insert("hello", choose, 1.0) == ("", ["a", "b"], "b")
        assert tree.match_and_insert("help", choose, 2.0) == ("hel", ["b"], "b")
        assert seen == [("", ["a", "b"]), ("hel", ["b"])]
        assert tree.match_and_insert("zz", lambda t, o: None, 3.0) == ("", ["a", "b"], None)
        assert tree.tenant_to_char_count == {"a": 0, "b": 6}

        def boom(text, owners):
            raise RuntimeError("chooser failed")

        with pytest.raises(RuntimeError, match="chooser failed"):
            tree.match_and_insert("qq", boom, 4.0)
        with pytest.raises(TypeError):
            tree.match_and_insert("qq", lambda t, o: 5, 4.0)
        assert tree.tenant_to_char_count == {"a": 0, "b": 6}
        tree.check_invariants()

    def test_prefix_match_many_equals_prefix_match(self):
        tree = docstring_tree(kvtrie.PrefixTree)
        texts = ["hello", "hellothomas", "xyz", "", "helloworld!", "hel"]
        for avail in (None, [], ["tenant_2"], ["nobody"], ["tenant_2", "tenant_1"]):
            assert tree.prefix_match_many(texts, avail) == [
                tree.prefix_match(t, avail) for t in texts
            ]
        assert tree.prefix_match_many([]) == []
        assert tree.prefix_match_many(iter(["hel"])) == [("hel", ["tenant_1", "tenant_2"])]

    def test_eviction_running_flag(self):
        tree = kvtrie.PrefixTree()
        assert not tree.eviction_running
        assert tree.start_eviction_loop(1, 1, 60.0)
        assert tree.eviction_running
        tree.stop_eviction_loop()
        assert not tree.eviction_running
        tree.stop_eviction_loop()  # idempotent


class TestDeviations:
    """kvtrie's documented deviations from Ray (README, PrefixTree docstring)."""

    def test_timestamps_are_monotone(self):
        tree = kvtrie.PrefixTree()
        tree.add_tenants(["a"], 0.0)
        tree.insert("hello", "a", 5.0)
        tree.insert("hello", "a", 2.0)  # Ray would overwrite with 2.0
        assert tree.snapshot()["children"][0]["tenants"] == {"a": 5.0}

    def test_duplicate_removal_reports_chars_once(self):
        tree = kvtrie.PrefixTree()
        tree.add_tenants(["a"], 0.0)
        tree.insert("hello", "a", 1.0)
        assert tree.remove_tenants(["a", "a"]) == {"a": 5}  # Ray: {"a": 0}

    def test_inserting_empty_text_touches_nothing(self):
        tree = kvtrie.PrefixTree()
        tree.add_tenants(["a"], 3.0)
        tree.insert("", "a", 9.0)
        assert tree.snapshot() == {"text": "", "tenants": {"a": 3.0}, "children": []}

    def test_nan_time_is_rejected(self):
        tree = kvtrie.PrefixTree()
        tree.add_tenants(["a"], 0.0)
        with pytest.raises(ValueError):
            tree.insert("x", "a", float("nan"))
        with pytest.raises(ValueError):
            tree.add_tenants(["b"], float("nan"))
        assert tree.tenant_to_char_count == {"a": 0}

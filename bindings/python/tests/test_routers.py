"""The routers' decisions: PrefixAffinityRouter (Ray and SGLang policies) and KvAwareRouter
(Dynamo's cost), with the configuration names of the Rust API."""

from __future__ import annotations

import copy
import pickle
import time

import pytest

import kvtrie

SYSTEM = "You are a terse assistant. "


@pytest.fixture
def router():
    r = kvtrie.PrefixAffinityRouter()
    r.update_replicas(["r0", "r1"])
    return r


class TestPrefixAffinityRouter:
    def test_ray_policy(self, router):
        idle = {"r0": 0, "r1": 0}
        first = router.route(SYSTEM + "What is Rust?", idle)
        assert first.reason == "smallest_tenants" and first.matched_chars == 0
        # The same system prompt follows its cache...
        again = router.route(SYSTEM + "And Go?", idle)
        assert (again.replica, again.reason) == (first.replica, "prefix_match")
        assert again.matched_chars == len(SYSTEM)
        # ... and an unrelated prompt goes to the other, smaller replica.
        other = router.route("Translate: bonjour", idle)
        assert other.replica != first.replica and other.reason == "smallest_tenants"
        # A removed replica is never chosen again, even for its own prefix.
        router.update_replicas([other.replica])
        assert router.replicas() == [other.replica]
        r = router.route(SYSTEM + "Hi", idle)
        assert r.replica == other.replica
        router.check_invariants()

    def test_match_rate_threshold_and_least_loaded_holder(self):
        cfg = kvtrie.PrefixAffinityConfig(match_rate_threshold=0.5)
        router = kvtrie.PrefixAffinityRouter(cfg)
        router.update_replicas(["a", "b", "c"])
        router.route("abcdefgh", {"a": 0})
        router.route("abcdefgh", {"b": 0})
        # Both a and b hold it: the less loaded wins.
        r = router.route("abcdefgh!", {"a": 5, "b": 1, "c": 0})
        assert (r.replica, r.reason, r.matched_chars) == ("b", "prefix_match", 8)
        # 4 of 10 chars cached: below 0.5, so the smallest cache (c) wins.
        r = router.route("abcdXXXXXX", {"a": 0, "b": 0, "c": 9})
        assert (r.replica, r.reason, r.matched_chars) == ("c", "smallest_tenants", 4)

    def test_candidate_forms_and_unknown_names(self, router):
        assert router.route("x", ["r0"]).replica == "r0"
        assert router.route("y", [("r1", 3)]).replica == "r1"
        assert router.route("z", {"ghost": 0, "r1": 2}).replica == "r1"

    def test_any_mapping_gives_queue_lengths(self, router):
        # Not only a dict: the values of any Mapping are the queue lengths (they were read as
        # names with queue 0, so the loaded replica could win).
        import collections
        import types

        def routes(queues):
            r = kvtrie.PrefixAffinityRouter()
            r.update_replicas(["r0", "r1"])
            return [r.route(p, queues).replica for p in ("text", "another", "text 2", "more")]

        expected = routes({"r0": 100, "r1": 0})
        assert expected[0] == "r1"  # both caches empty: the idle one
        for queues in (
            types.MappingProxyType({"r0": 100, "r1": 0}),
            collections.ChainMap({"r0": 100}, {"r1": 0}),
            collections.OrderedDict(r0=100, r1=0),
        ):
            assert routes(queues) == expected, type(queues)
        with pytest.raises(TypeError):
            router.route("x", types.MappingProxyType({"r0": "busy"}))

    def test_routes_are_equal_only_with_equal_fields(self, router):
        router.route("hello world", ["r0"])
        short = router.route("hello there", ["r0"])
        long = router.route("hello world!", ["r0"])
        assert (short.replica, short.reason, short.matched_chars) == ("r0", "prefix_match", 6)
        assert (long.replica, long.reason, long.matched_chars) == ("r0", "prefix_match", 11)
        assert short != long
        assert short == router.choose("hello xyz", ["r0"])
        assert repr(long) == "Route(replica='r0', reason='prefix_match', matched_chars=11)"

    def test_empty_prompt_goes_to_least_loaded(self, router):
        r = router.route("", {"r0": 3, "r1": 1})
        assert (r.replica, r.reason, r.matched_chars) == ("r1", "no_text", 0)

    def test_imbalance(self):
        router = kvtrie.PrefixAffinityRouter(
            kvtrie.PrefixAffinityConfig(imbalanced_threshold=2.0, imbalanced_choice="least_loaded")
        )
        router.update_replicas(["a", "b"])
        router.route(SYSTEM + "one", {"a": 0})
        r = router.route(SYSTEM + "two", {"a": 10, "b": 0})
        assert (r.replica, r.reason) == ("b", "imbalanced")
        # Balanced again: the longest cached prefix wins, even on the busier replica...
        r = router.route(SYSTEM + "onerous", {"a": 1, "b": 0})
        assert (r.replica, r.reason, r.matched_chars) == ("a", "prefix_match", len(SYSTEM) + 3)
        # ... and among its holders the less loaded one.
        r = router.route(SYSTEM + "xyz", {"a": 1, "b": 0})
        assert (r.replica, r.reason, r.matched_chars) == ("b", "prefix_match", len(SYSTEM))

    def test_sglang_preset(self):
        cfg = kvtrie.PrefixAffinityConfig.sglang()
        assert (cfg.match_rate_threshold, cfg.imbalanced_threshold, cfg.imbalanced_ratio) == (
            0.3,
            64.0,
            1.5,
        )
        assert (cfg.imbalanced_choice, cfg.miss_policy) == ("least_loaded", "least_loaded")
        # SGLang always evicts: its router's defaults, 2**26 chars per replica every 120 s.
        e = cfg.eviction
        assert (e.threshold_chars, e.target_chars, e.interval) == (1 << 26, 1 << 26, 120.0)
        assert kvtrie.PrefixAffinityConfig.sglang(eviction=None).eviction is None
        router = kvtrie.PrefixAffinityRouter(cfg)
        router.update_replicas(["a", "b"])
        router.route("aaaaaaaaaa", {"a": 0})
        # A miss goes to the least-loaded candidate, not the smallest cache.
        r = router.route("zzzz", {"a": 0, "b": 5})
        assert (r.replica, r.reason) == ("a", "least_loaded")

    def test_route_chat_uses_rays_prompt_text(self, router):
        msgs = [
            {"role": "system", "content": "Be kind. "},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]},
            {"role": "assistant", "content": None},
        ]
        r = router.route_chat(msgs, ["r0"])
        assert r.replica == "r0"
        assert router.matched_chars("Be kind. Hi") == len("Be kind. Hi")
        r = router.route_chat(["Be kind. ", "Hi there"], ["r0", "r1"])
        assert (r.replica, r.reason, r.matched_chars) == ("r0", "prefix_match", 11)

    @pytest.mark.parametrize(
        "messages, text",
        [
            ("plain prompt", "plain prompt"),
            ([{"content": {"type": "text", "text": "hello"}}], "hello"),
            ([{"content": {"content": "hello"}}], "hello"),
            ([{"content": [{"content": "inner"}, {"text": 5, "content": "x"}]}], "innerx"),
            ([["a", "b"], "c"], "abc"),
            ([None, 5, ["d", ["e"]]], "de"),
            ([{"role": "user"}, {"content": None}, "f"], "f"),
            ([("t", "u")], ""),
            (("not", "a", "list"), ""),
            ([[[[[[[[[["deep"]]]]]]]]]], "deep"),
        ],
    )
    def test_route_chat_text_is_rays_normalization(self, messages, text):
        # Ray's _normalize_prompt_to_string / _coerce_to_text, case by case.
        router = kvtrie.PrefixAffinityRouter()
        router.update_replicas(["r0"])
        router.route_chat(messages, ["r0"])
        assert router.char_counts() == {"r0": len(text)}
        if text:
            assert router.matched_chars(text + "#") == len(text)

    def test_route_chat_survives_very_deep_nesting(self):
        deep = "x"
        for _ in range(200_000):
            deep = [deep]
        router = kvtrie.PrefixAffinityRouter()
        router.update_replicas(["r0"])
        router.route_chat([deep], ["r0"])
        assert router.char_counts() == {"r0": 1}

    def test_route_chat_refuses_messages_that_contain_themselves(self):
        router = kvtrie.PrefixAffinityRouter()
        router.update_replicas(["r0"])
        loop = []
        loop.append(loop)
        with pytest.raises(ValueError, match="contain themselves"):
            router.route_chat([loop], ["r0"])
        d = {}
        d["content"] = d
        with pytest.raises(ValueError, match="contain themselves"):
            router.route_chat([d], ["r0"])
        assert router.char_counts() == {"r0": 0}

    def test_replica_admin(self, router):
        router.add_replica("r2")
        router.add_replica("r2")
        assert router.replicas() == ["r0", "r1", "r2"]
        router.route("hello", ["r2"])
        assert router.char_counts() == {"r0": 0, "r1": 0, "r2": 5}
        assert router.remove_replica("r2") == 5
        assert router.remove_replica("r2") == 0
        assert router.replicas() == ["r0", "r1"]

    def test_update_replicas_with_a_repeated_name_lists_it_once(self, router):
        router.update_replicas(["r2", "r0", "r2"])
        assert router.replicas() == ["r2", "r0"]
        assert repr(router) == "kvtrie.PrefixAffinityRouter(replicas=2, nodes=0)"
        assert router.route("hello", {"r2": 0, "r0": 1}).replica == "r2"
        assert router.remove_replica("r2") == 5
        assert router.replicas() == ["r0"]

    def test_configs(self):
        assert kvtrie.PrefixAffinityConfig() == kvtrie.PrefixAffinityConfig.ray()
        c = kvtrie.PrefixAffinityConfig.ray(seed=7).with_eviction()
        assert c.seed == 7 and c.eviction == kvtrie.EvictionConfig.ray()
        e = c.eviction
        assert (e.threshold_chars, e.target_chars, e.interval) == (400_000, 360_000, 10.0)
        assert e.with_global_budget(100, 50).global_budget == (100, 50)
        # The keyword takes the same (max_total_chars, target_total_chars) pair.
        g = kvtrie.EvictionConfig(400_000, 360_000, 10.0, global_budget=(100, 50))
        assert g.global_budget == (100, 50)
        assert g == e.with_global_budget(100, 50)
        assert c.replace(seed=1).seed == 1 and c.seed == 7
        assert repr(kvtrie.PrefixAffinityConfig()) == (
            "PrefixAffinityConfig(imbalanced_threshold=inf, imbalanced_ratio=None, "
            "imbalanced_choice='power_of_two', match_rate_threshold=0.1, "
            "miss_policy='smallest_tenants', eviction=None, seed=0)"
        )
        router = kvtrie.PrefixAffinityRouter(
            kvtrie.PrefixAffinityConfig(eviction=kvtrie.EvictionConfig(10, 5, 0.01))
        )
        assert router.is_evicting
        assert router.config.eviction.threshold_chars == 10
        assert not kvtrie.PrefixAffinityRouter().is_evicting

    def test_eviction_totals(self):
        assert kvtrie.PrefixAffinityRouter().eviction_totals() is None
        router = kvtrie.PrefixAffinityRouter(
            kvtrie.PrefixAffinityConfig(eviction=kvtrie.EvictionConfig(10, 5, 0.01))
        )
        router.update_replicas(["a"])
        # One route inserts one 26-char prompt, one timestamp group: a pass evicts all of it.
        router.route("abcdefghijklmnopqrstuvwxyz", {"a": 0})
        end = time.monotonic() + 30
        while router.eviction_totals()["chars_evicted"] < 26:
            assert time.monotonic() < end, router.eviction_totals()
            time.sleep(0.01)
        totals = router.eviction_totals()
        assert (totals["tenants_evicted"], totals["chars_evicted"]) == (1, 26)
        assert totals["global_chars_evicted"] == 0 and totals["passes"] >= 1
        assert router.char_counts() == {"a": 0}
        # Stopping returns the final totals, which the router keeps for its metrics.
        last = router.stop_eviction()
        assert (last["tenants_evicted"], last["chars_evicted"]) == (1, 26), last
        assert last["passes"] >= totals["passes"] and not router.is_evicting
        assert router.eviction_totals() == last and router.stop_eviction() == last
        assert kvtrie.PrefixAffinityRouter().stop_eviction() is None


class TestKvAwareRouter:
    def test_cost_on_an_empty_index(self):
        router = kvtrie.KvAwareRouter(kvtrie.KvAwareConfig(4))
        s = router.select_and_reserve(1, [1, 2, 3, 4, 5], [0], 8)
        # 5 tokens = 2 blocks (ceil), none cached: prefill 2; decode 2 + 8/4 = 4.
        assert (s.worker, s.overlap_blocks, s.prefill_blocks, s.decode_blocks) == (0, 0, 2, 4)
        assert s.cost == 2.0
        assert router.load(0) == (2, 4)

    def test_overlap_wins_and_bookings_release(self):
        config = kvtrie.KvAwareConfig(block_size=4)
        index = kvtrie.BlockIndex(config.hasher())
        router = kvtrie.KvAwareRouter(config, index)
        assert router.index is index
        prompt = list(range(16))
        local = router.hasher.local_hashes(prompt)
        index.apply(1, kvtrie.KvEvent.Stored(None, [kvtrie.StoredBlock(h, h) for h in local[:3]]))
        s = router.select_and_reserve(7, prompt, [0, 1], 16)
        assert (s.worker, s.overlap_blocks, s.cost) == (1, 3, 1.0)
        # Booked: one new prompt block to prefill; the 4 prompt and 4 output blocks active.
        assert router.load(1) == (1, 8)
        assert router.prefill_complete(7) and not router.prefill_complete(7)
        assert router.load(1) == (0, 8)
        assert router.request_complete(7) and not router.request_complete(7)
        assert router.load(1) == (0, 0)
        st = router.stats()
        assert (st["selections"], st["requests_completed"], st["unknown_ids"]) == (1, 1, 2)

    def test_load_spreads_ties_and_ttl(self):
        router = kvtrie.KvAwareRouter(kvtrie.KvAwareConfig(4, reservation_ttl=300.0))
        chosen = {router.select_and_reserve(i, [9] * 8, [0, 1], 0).worker for i in range(2)}
        assert chosen == {0, 1}  # the first booking makes worker 0 costlier
        assert router.expire_stale() == 0
        assert router.expire_stale(after=301.0) == 2
        assert router.stats()["expired"] == 2
        assert router.loads() == {0: (0, 0), 1: (0, 0)}
        router.select_and_reserve(5, [1], [3])
        assert router.remove_worker(3) == 1
        st = router.stats()
        assert (st["selections"], st["removed"], st["active_requests"]) == (3, 1, 0)
        # An engine's ranks leave together (worker = engine | rank << 48).
        for rank in (0, 1):
            router.select_and_reserve(10 + rank, [1, 2, 3, 4], [7 | rank << 48])
        assert router.remove_engine(7) == 2 and router.loads() == {0: (0, 0), 1: (0, 0)}

    def test_config(self):
        c = kvtrie.KvAwareConfig(32)
        assert (c.block_size, c.overlap_weight, c.temperature, c.reservation_ttl) == (
            32,
            1.0,
            0.0,
            3600.0,
        )
        assert kvtrie.KvAwareConfig().block_size == 16
        salted = kvtrie.KvAwareConfig(32, salt=("my-lora", "ns"))
        assert salted.hasher().seed != c.hasher().seed
        assert salted.hasher() == kvtrie.BlockHasher(32).with_salt("my-lora", "ns")
        # Softmax sampling is seeded: the same seed picks the same workers.
        picks = []
        for _ in range(2):
            r = kvtrie.KvAwareRouter(kvtrie.KvAwareConfig(4, temperature=5.0, seed=3))
            picks.append([r.select_and_reserve(i, [i] * 8, [0, 1, 2], 0).worker for i in range(20)])
        assert picks[0] == picks[1] and len(set(picks[0])) > 1


@pytest.mark.parametrize(
    "config",
    [
        kvtrie.EvictionConfig.ray(),
        kvtrie.EvictionConfig(10, 5, 0.1, global_budget=(100, 50), batch_groups=3),
        # Clamped by the constructor (target to threshold, interval to 1 ms, budget target).
        kvtrie.EvictionConfig(5, 10, 1e-9, global_budget=(1, 10)),
        kvtrie.EvictionConfig(1, 1, 1 / 3),
        kvtrie.PrefixAffinityConfig(),
        kvtrie.PrefixAffinityConfig.sglang(seed=7),
        kvtrie.PrefixAffinityConfig.ray().with_eviction(),
        kvtrie.KvAwareConfig(),
        kvtrie.KvAwareConfig(
            32, overlap_weight=2.5, temperature=0.7, salt=("ns", "k"), seed=9, reservation_ttl=1.5
        ),
        kvtrie.BlockHasher(32),
        kvtrie.BlockHasher(16).with_salt("lora", "ns"),
        kvtrie.StoredBlock(1, 2**64 - 1),
        kvtrie.KvEvent.Stored(None, [kvtrie.StoredBlock(1, 10), kvtrie.StoredBlock(2, 12)]),
        kvtrie.KvEvent.Stored(7, []),
        kvtrie.KvEvent.Removed([1, 2]),
        kvtrie.KvEvent.Cleared(),
    ],
    ids=repr,
)
def test_values_survive_pickle_and_copy(config):
    # Ray passes a deployment's arguments and a task's values by pickle: a configuration, a
    # hasher or an event built in one process arrives equal (they raised TypeError: cannot
    # pickle).
    for back in (pickle.loads(pickle.dumps(config)), copy.copy(config), copy.deepcopy(config)):
        assert type(back) is type(config)
        assert back == config
        assert repr(back) == repr(config)
    if isinstance(config, kvtrie.BlockHasher):
        tokens = list(range(64))
        assert pickle.loads(pickle.dumps(config)).local_hashes(tokens) == config.local_hashes(tokens)


def test_decisions_and_decoded_batches_survive_pickle_and_copy():
    # A Ray actor that routes returns its decision by pickle; one that decodes engine events
    # returns the batches so (they raised TypeError: cannot pickle).
    r = kvtrie.PrefixAffinityRouter()
    r.update_replicas(["r0", "r1"])
    route = r.route(SYSTEM + "What is Rust?", {"r0": 0, "r1": 1})
    kv = kvtrie.KvAwareRouter(kvtrie.KvAwareConfig(block_size=4))
    selection = kv.select_and_reserve(1, list(range(10)), [0, 1], 3)
    event = kvtrie.vllm.DecodedEvent(
        kvtrie.KvEvent.Stored(None, [kvtrie.StoredBlock(7, 70)]), 4, "GPU", 2
    )
    batch = kvtrie.vllm.DecodedBatch(
        1.5, [event, kvtrie.vllm.DecodedEvent(kvtrie.KvEvent.Cleared(), 4)], 3,
        skipped_groups=1, skipped_unknown=2, skipped_block_sizes=3, skipped_remote=4,
        skipped_malformed=5, malformed="event 2: why",
    )
    for value in (route, selection, event, batch):
        for back in (pickle.loads(pickle.dumps(value)), copy.copy(value), copy.deepcopy(value)):
            assert type(back) is type(value)
            assert back == value
            assert repr(back) == repr(value)
    back = pickle.loads(pickle.dumps(batch))
    assert [e.event for e in back.events] == [e.event for e in batch.events]
    assert (back.events[0].medium, back.events[0].group_idx, back.events[0].block_size) == (
        "GPU", 2, 4,
    )
    assert (back.ts, back.data_parallel_rank, back.skipped_remote) == (1.5, 3, 4)
    assert (back.skipped_malformed, back.malformed) == (5, "event 2: why")
    assert pickle.loads(pickle.dumps(selection)).engine == selection.engine
    # Hashable consistently with ==: routes and selections can be counted.
    assert hash(pickle.loads(pickle.dumps(route))) == hash(route)
    assert hash(copy.copy(selection)) == hash(selection)
    assert len({route, kvtrie.Route(route.replica, route.reason, route.matched_chars)}) == 1
    assert kvtrie.Selection(1, 0, 0.0, 1.0, 0, 0) == kvtrie.Selection(1, 0, -0.0, 1.0, 0, 0)
    assert hash(kvtrie.Selection(1, 0, 0.0, 1.0, 0, 0)) == hash(kvtrie.Selection(1, 0, -0.0, 1.0, 0, 0))
    # Equality looks at every field.
    assert route != kvtrie.Route(route.replica, route.reason, route.matched_chars + 1)
    assert selection != kvtrie.Selection(
        selection.worker, selection.overlap_blocks, selection.weighted_overlap,
        selection.cost + 1, selection.prefill_blocks, selection.decode_blocks,
    )
    assert event != kvtrie.vllm.DecodedEvent(event.event, 8, "GPU", 2)
    assert batch != kvtrie.vllm.DecodedBatch(1.5, batch.events[:1], 3)


def test_decision_and_batch_constructors_check_their_arguments():
    assert kvtrie.Route("r0", "prefix_match", 5).matched_chars == 5
    with pytest.raises(ValueError, match="reason must be one of prefix_match"):
        kvtrie.Route("r0", "lucky", 5)
    with pytest.raises(ValueError, match="reason must be one of"):
        kvtrie.Route("r0", "other", 5)
    with pytest.raises(TypeError):
        kvtrie.Route(0, "prefix_match", 5)
    with pytest.raises(OverflowError):
        kvtrie.Route("r0", "prefix_match", -1)
    with pytest.raises(ValueError, match="block_size"):
        kvtrie.vllm.DecodedEvent(kvtrie.KvEvent.Cleared(), 0)
    with pytest.raises(TypeError):
        kvtrie.vllm.DecodedBatch(0.0, [kvtrie.KvEvent.Cleared()])
    # A DecodedEvent says the block size its hashes are for, and an index of another block
    # size refuses it as it refuses a decoder's.
    index = kvtrie.BlockIndex(kvtrie.BlockHasher(4))
    with pytest.raises(ValueError, match="block"):
        index.apply(0, kvtrie.vllm.DecodedEvent(kvtrie.KvEvent.Removed([1]), 16))
    index.apply(0, kvtrie.vllm.DecodedEvent(kvtrie.KvEvent.Removed([1]), 4))

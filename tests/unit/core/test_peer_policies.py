"""The peers' policies behave as the peers were measured to behave."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvroute.core.errors import ConfigError
from kvroute.core.index import PrefixMatch
from kvroute.core.load import ReplicaLoad
from kvroute.core.peer_policies import POLICY_NAMES, make_policy, policy_parameters
from kvroute.core.policy import Candidate, PolicyInput
from kvroute.core.text_prefix import CharRadixTree, ChunkHashTrie, common_prefix_len
from kvroute.core.types import ReplicaId

WORKERS = [ReplicaId(f"w{i}") for i in range(4)]


def fleet(in_flight: dict[str, int] | None = None, *, gpu: dict[str, int] | None = None,
          waiting: dict[str, int] | None = None) -> list[Candidate]:
    in_flight = in_flight or {}
    gpu = gpu or {}
    waiting = waiting or {}
    return [
        Candidate(w, ReplicaLoad(num_in_flight=in_flight.get(w, 0), prefill_rate_tps=1e4,
                                 engine_waiting=waiting.get(w, 0), kv_usage=0.0),
                  PrefixMatch(num_gpu_blocks=gpu.get(w, 0)))
        for w in WORKERS
    ]


def req(text: str = "", *, n: int = 100, session: str | None = None, hashes: int = 0,
        now: float = 0.0) -> PolicyInput:
    return PolicyInput("r", num_prompt_tokens=n, block_size=16, routing_text=text,
                       session_id=session, block_hashes=tuple(range(hashes)), now_s=now)


def test_cache_aware_reproduces_the_48_0_0_0_hot_spot() -> None:
    """48 concurrent requests sharing a 2.3k-char system prompt all go to one worker."""
    policy = make_policy("cache_aware", random.Random(0))
    system = "You are a helpful assistant. " * 80  # ~2.3k chars
    in_flight = {w: 0 for w in WORKERS}
    for i in range(48):
        sel = policy.select(req(system + f"question {i}?"), fleet(in_flight))
        in_flight[sel.replica] += 1  # concurrent: nothing completes
    assert sorted(in_flight.values()) == [0, 0, 0, 48]


def test_kvroute_spreads_the_same_burst() -> None:
    """kvroute's cost model spreads a hot prefix once queues make others faster."""
    policy = make_policy("kvroute", random.Random(0))
    queue = {w: 0 for w in WORKERS}
    held = {w: 0 for w in WORKERS}
    counts: Counter[str] = Counter()
    for _ in range(48):
        cands = [Candidate(w, ReplicaLoad(outstanding_prefill_tokens=queue[w],
                                          prefill_rate_tps=1e4), PrefixMatch(num_predicted_blocks=held[w]))
                 for w in WORKERS]
        sel = policy.select(PolicyInput("r", num_prompt_tokens=640, block_size=16), cands)
        w = sel.replica
        queue[w] += 640 - held[w] * 16
        held[w] = 36  # 576 shared tokens now predicted there
        counts[w] += 1
    assert min(counts.values()) >= 8, counts


def test_cache_aware_cold_sequential_requests_all_go_to_the_first_worker() -> None:
    policy = make_policy("cache_aware", random.Random(0))
    chosen = {policy.select(req(f"unique prompt number {i} " * 3), fleet()).replica
              for i in range(10)}
    assert chosen == {"w0"}


def test_cache_aware_leaves_affinity_only_past_both_thresholds() -> None:
    policy = make_policy("cache_aware", random.Random(0))
    text = "shared prefix " * 20
    policy.select(req(text), fleet())  # records w0
    assert policy.select(req(text), fleet({"w0": 60})).replica == "w0"
    assert policy.select(req(text), fleet({"w0": 70, "w1": 5, "w2": 5, "w3": 5})).replica == "w1"


def test_cache_aware_threshold_is_a_matched_fraction_above_0_3() -> None:
    """0.3.2's default ``cache_threshold`` 0.3: 31 of 100 characters matched is affinity,
    30 of 100 is not (the least-loaded worker, w0 being busier)."""
    policy = make_policy("cache_aware", random.Random(0))
    policy.select(req("t" * 100), fleet())  # recorded for w0
    busy = {"w0": 1}
    assert policy.select(req("t" * 31 + "v" * 69), fleet(busy)).replica == "w0"
    assert policy.select(req("t" * 30 + "u" * 70), fleet(busy)).replica == "w1"


def test_prefixaware_matches_whole_128_character_chunks() -> None:
    """production-stack's chunk of 128 characters: sharing 127 leading characters is no
    match (a random endpoint), sharing 128 is (the holder)."""
    policy = make_policy("prefixaware", random.Random(2))
    holder = policy.select(req("a" * 128 + "X" * 60), fleet()).replica
    near = Counter(policy.select(req("a" * 127 + chr(0x4E00 + i) + "Y" * 60), fleet()).replica
                   for i in range(40))
    assert len(near) == 4, near  # 127 shared characters are not a chunk: spread at random
    assert all(policy.select(req("a" * 128 + f"Z{i}" * 30), fleet()).replica == holder
               for i in range(20))


def test_prefixaware_random_among_holders_and_random_when_cold() -> None:
    policy = make_policy("prefixaware", random.Random(1))
    text = "x" * 300
    first = policy.select(req(text), fleet()).replica
    assert all(policy.select(req(text), fleet()).replica == first for _ in range(20))
    cold = Counter(policy.select(req(f"{i}" * 200), fleet()).replica for i in range(100, 300))
    assert len(cold) == 4


def test_session_affinity_is_stable_and_moves_only_the_leavers_sessions() -> None:
    policy = make_policy("session", random.Random(0))
    owners = {s: policy.select(req(session=s), fleet()).replica for s in map(str, range(200))}
    assert len(set(owners.values())) == 4
    without_w3 = [c for c in fleet() if c.replica != "w3"]
    for s, owner in owners.items():
        again = policy.select(req(session=s), without_w3).replica
        if owner != "w3":
            assert again == owner


def test_dynamo_worked_example() -> None:
    """Dynamo docs: W1 raw 10, overlap 2, decode 10 -> 18; W2 -> 10 (chosen); W3 -> 11."""
    policy = make_policy("dynamo", random.Random(0))
    bs = 16
    # raw_prefill = active/B + ISL/B = 10 blocks with ISL = 5 blocks and active = 5 blocks;
    # decode = active_kv/B + ISL/B.
    def c(name: str, overlap: int, decode_blocks: int) -> Candidate:
        return Candidate(ReplicaId(name), ReplicaLoad(outstanding_prefill_tokens=5 * bs,
                         active_kv_tokens=(decode_blocks - 5) * bs, prefill_rate_tps=1.0),
                         PrefixMatch(num_gpu_blocks=overlap))
    sel = policy.select(PolicyInput("r", num_prompt_tokens=5 * bs, block_size=bs),
                        [c("W1", 2, 10), c("W2", 5, 5), c("W3", 8, 9)])
    assert sel.scores == {"W1": 18.0, "W2": 10.0, "W3": 11.0}
    assert sel.replica == "W2"


def test_llmd_weighted_scorers() -> None:
    policy = make_policy("llmd", random.Random(0))
    sel = policy.select(req(hashes=10), fleet(gpu={"w0": 10}, waiting={"w0": 4, "w1": 0}))
    # w0: prefix 3*1 + queue 2*0 + kv 2 = 5; others: 0 + 2*1 + 2 = 4
    assert sel.replica == "w0"
    assert sel.scores["w0"] == pytest.approx(5.0)
    sel = policy.select(req(hashes=10), fleet(gpu={"w0": 2}, waiting={"w0": 4}))
    assert sel.replica != "w0"


def test_round_robin_random_least_loaded_power_of_two() -> None:
    rr = make_policy("round_robin", random.Random(0))
    assert [rr.select(req(), fleet()).replica for _ in range(5)] == ["w0", "w1", "w2", "w3", "w0"]
    ll = make_policy("least_loaded", random.Random(0))
    assert ll.select(req(), fleet({"w0": 3, "w1": 1, "w2": 2, "w3": 5})).replica == "w1"
    p2 = make_policy("power_of_two", random.Random(0))
    picks = Counter(p2.select(req(), fleet({"w0": 9, "w1": 9, "w2": 9, "w3": 0})).replica
                    for _ in range(200))
    assert picks["w3"] > 80  # w3 wins whenever it is one of the two sampled
    rnd = make_policy("random", random.Random(0))
    assert len({rnd.select(req(), fleet()).replica for _ in range(100)}) == 4


def test_every_policy_ranks_every_candidate() -> None:
    for name in POLICY_NAMES:
        policy = make_policy(name, random.Random(0))
        sel = policy.select(req("some text", session="s"), fleet())
        assert sorted(sel.ranking) == sorted(WORKERS), name
        policy.forget_replica(WORKERS[0])


def test_make_policy_errors() -> None:
    with pytest.raises(ConfigError, match="unknown policy 'nope'; choose one of: kvroute"):
        make_policy("nope", random.Random(0))
    with pytest.raises(ConfigError, match="policy 'random' has no parameter 'bogus'; it takes "
                       "no parameters"):
        make_policy("random", random.Random(0), bogus=1)
    with pytest.raises(ConfigError, match="policy 'llmd' has no parameter 'work_weight'; it "
                       "takes prefix_weight, queue_weight, kv_weight"):
        make_policy("llmd", random.Random(0), work_weight=0.3)
    with pytest.raises(ConfigError, match="policy 'kvroute' refused parameters"):
        make_policy("kvroute", random.Random(0), work_weight=-1.0)


def test_policy_parameters_name_each_constructor_option_with_its_type() -> None:
    assert policy_parameters("dynamo")["predicted"] == "bool"
    assert policy_parameters("prefixaware") == {"chunk_chars": "int", "min_match_chunks": "int"}
    assert policy_parameters("round_robin") == {}
    assert "work_weight" in policy_parameters("kvroute")
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        policy_parameters("nope")


def test_common_prefix_len() -> None:
    assert common_prefix_len("abcdef", "abcxyz") == 3
    assert common_prefix_len("", "abc") == 0
    assert common_prefix_len("abc", "abc") == 3
    assert common_prefix_len("abc", "abcd") == 3


def test_char_radix_tree_match_insert_split_evict() -> None:
    tree = CharRadixTree()
    tree.insert("hello world", ReplicaId("a"), 1.0)
    tree.insert("hello there", ReplicaId("b"), 2.0)
    assert tree.match("hello world!") == (11, "a")
    assert tree.match("hello th") == (8, "b")
    assert tree.match("help") == (3, "b")  # the shared "hel" node's last tenant is b
    assert tree.match("xyz") == (0, None)
    assert tree.chars_of(ReplicaId("a")) == 11
    tree.evict(max_chars_per_tenant=6)
    assert tree.chars_of(ReplicaId("a")) <= 6
    # a's least recent leaf ("world") went; the shared "hello " node is still a's and b's.
    assert tree.match("hello world") == (6, "b")
    tree.remove_tenant(ReplicaId("b"))
    assert tree.match("hello there") == (6, "a")


def test_chunk_hash_trie() -> None:
    trie = ChunkHashTrie(chunk_chars=4)
    trie.insert("aaaabbbbcccc", ReplicaId("a"))
    trie.insert("aaaabbbbdddd", ReplicaId("b"))
    live = {ReplicaId("a"), ReplicaId("b")}
    assert trie.longest_match("aaaabbbbcccc", live) == (3, {"a"})
    assert trie.longest_match("aaaabbbbzzzz", live) == (2, {"a", "b"})
    assert trie.longest_match("aaaabbbbcccc", {ReplicaId("b")}) == (2, {"b"})
    trie.remove_endpoint(ReplicaId("a"))
    assert trie.longest_match("aaaabbbbcccc", live) == (2, {"b"})


def test_session_policy_follows_a_live_pin() -> None:
    policy = make_policy("session", random.Random(0))
    natural = policy.select(req(session="s1"), fleet()).replica
    other = next(w for w in WORKERS if w != natural)
    pinned = PolicyInput("r", num_prompt_tokens=10, block_size=16, session_id="s1",
                         preferred_replica=other)
    sel = policy.select(pinned, fleet())
    assert sel.replica == other and sel.reason == "pinned"

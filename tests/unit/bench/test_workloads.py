"""Workload generators (``kvroute.bench.workloads``) and their request record (``sim.workload``)."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from itertools import pairwise
from typing import Any

import pytest

from kvroute.bench.traces import BlockTokens, load_trace, mooncake_tokens
from kvroute.bench.workloads import (
    VOCAB_MAX,
    VOCAB_MIN,
    WORKLOADS,
    generated_shared_prefix,
    growing_sessions,
    hot_prefix_bursts,
    mooncake,
    release_time,
    sibling_fanout,
    unique_prompts,
)
from kvroute.core.errors import ConfigError
from kvroute.sim.workload import WorkloadRequest
from kvroute.tokenize.words import from_text

# Small instances of every generator, for the properties all of them share.
SMALL: dict[str, dict[str, Any]] = {
    "generated_shared_prefix": {
        "num_groups": 4,
        "prompts_per_group": 5,
        "system_prompt_len": 64,
        "question_len": 8,
        "output_len": 4,
        "rate": 2.0,
    },
    "unique_prompts": {"num_requests": 40},
    "hot_prefix_bursts": {
        "num_bursts": 3,
        "burst_size": 6,
        "system_prompt_tokens": 40,
        "suffix_tokens": 4,
    },
    "sibling_fanout": {"num_prompts": 4, "fanout": 3, "prompt_tokens": 50},
    "growing_sessions": {
        "num_sessions": 3,
        "window_tokens": 400,
        "system_prompt_tokens": 32,
        "user_tokens": 40,
        "output_tokens": 40,
    },
    "mooncake": {"trace": "mooncake_synthetic", "limit": 30, "jitter_s": 1.0},
}


def _materialize(requests: list[WorkloadRequest]) -> list[tuple[Any, ...]]:
    return [
        (
            r.arrival_s,
            r.request_id,
            tuple(r.prompt_token_ids),
            r.output_tokens,
            r.session_id,
            r.group,
            r.turn,
            r.think_time_s,
            r.depends_on,
        )
        for r in requests
    ]


def _in_vocab(tokens: Any) -> bool:
    return all(VOCAB_MIN <= t < VOCAB_MAX for t in tokens)


# ---------------------------------------------------------------------------------------------
# Shared properties


@pytest.mark.parametrize("name", sorted(SMALL))
def test_every_workload_is_seeded_sorted_and_uniquely_named(name: str) -> None:
    make = WORKLOADS[name]
    state = random.getstate()
    a = make(**SMALL[name], seed=1)
    b = make(**SMALL[name], seed=1)
    c = make(**SMALL[name], seed=2)
    assert random.getstate() == state, "the global RNG must not be used"
    assert _materialize(a) == _materialize(b)
    assert _materialize(a) != _materialize(c)
    arrivals = [r.arrival_s for r in a]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert len({r.request_id for r in a}) == len(a)
    assert all(r.output_tokens >= 0 and r.num_prompt_tokens >= 1 for r in a)


def test_registry_lists_every_generator() -> None:
    assert set(WORKLOADS) == set(SMALL)


def test_request_record_defaults() -> None:
    r = WorkloadRequest(1.5, "r", (100, 101), 8)
    assert (r.session_id, r.tenant, r.group, r.turn, r.messages) == (None,) * 5
    assert (r.think_time_s, r.depends_on, r.num_prompt_tokens) == (None, None, 2)
    assert release_time(r, {}) == 1.5


# ---------------------------------------------------------------------------------------------
# generated_shared_prefix


def test_gsp_defaults_match_sglang_shape() -> None:
    requests = generated_shared_prefix()
    assert len(requests) == 64 * 16
    assert all(r.arrival_s == 0.0 for r in requests)  # rate=inf: all at once, like SGLang
    by_group: dict[str | None, list[WorkloadRequest]] = defaultdict(list)
    for r in requests:
        by_group[r.group].append(r)
    assert len(by_group) == 64 and all(len(v) == 16 for v in by_group.values())
    assert all(len(r.prompt_token_ids) == 2048 + 128 and r.output_tokens == 256 for r in requests)
    systems = {}
    for group, members in by_group.items():
        heads = {tuple(m.prompt_token_ids[:2048]) for m in members}
        assert len(heads) == 1, "a group shares one system prompt"
        systems[group] = heads.pop()
        questions = {tuple(m.prompt_token_ids[2048:]) for m in members}
        assert len(questions) == 16, "every question is its own"
    assert len({s[0] for s in systems.values()}) == 64, "groups differ from the first token"
    assert all(_in_vocab(r.prompt_token_ids) for r in requests)
    order = [r.group for r in requests]
    assert order != sorted(order, key=lambda g: int(g[1:])), "groups arrive shuffled"


def test_gsp_poisson_arrivals() -> None:
    requests = generated_shared_prefix(
        num_groups=8,
        prompts_per_group=125,
        system_prompt_len=4,
        question_len=2,
        output_len=1,
        rate=20.0,
        seed=3,
    )
    gaps = [b.arrival_s - a.arrival_s for a, b in pairwise(requests)]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(1 / 20.0, rel=0.15)
    # Exponential gaps: about 1 - e^-1 = 63% are shorter than the mean.
    assert 0.55 < sum(g < mean for g in gaps) / len(gaps) < 0.71


def test_gsp_messages_spell_the_prompt() -> None:
    (r, *_) = generated_shared_prefix(
        num_groups=2,
        prompts_per_group=2,
        system_prompt_len=10,
        question_len=3,
        output_len=2,
        with_messages=True,
    )
    assert r.messages is not None and [m["role"] for m in r.messages] == ["system", "user"]
    assert from_text(" ".join(m["content"] for m in r.messages)) == tuple(r.prompt_token_ids)


def test_gsp_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="num_groups"):
        generated_shared_prefix(num_groups=0)
    with pytest.raises(ConfigError, match="rate"):
        generated_shared_prefix(rate=0.0)


# ---------------------------------------------------------------------------------------------
# unique_prompts


def test_unique_prompts_follow_the_azure_trace() -> None:
    trace = load_trace("azure_conv", limit=300, rate_scale=2.0)
    requests = unique_prompts(300, rate_scale=2.0, seed=5)
    assert [r.arrival_s for r in requests] == [rec.arrival_s for rec in trace.records]
    assert [r.num_prompt_tokens for r in requests] == [rec.input_length for rec in trace.records]
    assert [r.output_tokens for r in requests] == [rec.output_length for rec in trace.records]
    assert len({r.prompt_token_ids[0] for r in requests}) == 300, "no shared first token"
    assert all(_in_vocab(r.prompt_token_ids) for r in requests)
    assert all(r.group is None and r.session_id is None for r in requests)


def test_unique_prompts_code_trace_and_cap() -> None:
    requests = unique_prompts(50, trace="azure_code", max_input_tokens=1000)
    lengths = [rec.input_length for rec in load_trace("azure_code", limit=50).records]
    assert [r.num_prompt_tokens for r in requests] == [min(n, 1000) for n in lengths]
    assert max(lengths) > 1000  # the cap was exercised


def test_unique_prompts_errors() -> None:
    with pytest.raises(ConfigError, match="only 8819 requests"):
        unique_prompts(9000, trace="azure_code")
    with pytest.raises(ConfigError, match="Azure-format"):
        unique_prompts(5, trace="mooncake_synthetic")


# ---------------------------------------------------------------------------------------------
# hot_prefix_bursts and sibling_fanout


def test_hot_prefix_bursts_shape() -> None:
    requests = hot_prefix_bursts(num_bursts=3, burst_size=48, burst_interval_s=10.0)
    sizes = Counter(r.arrival_s for r in requests)
    assert sizes == {0.0: 48, 10.0: 48, 20.0: 48}
    system = tuple(requests[0].prompt_token_ids[:600])
    assert all(tuple(r.prompt_token_ids[:600]) == system for r in requests)
    assert len({r.prompt_token_ids[600] for r in requests}) == len(requests)
    assert all(r.group == "hot" and r.num_prompt_tokens == 632 for r in requests)


def test_hot_prefix_messages_split_system_and_suffix() -> None:
    (r, *_) = hot_prefix_bursts(num_bursts=1, burst_size=2, with_messages=True)
    assert r.messages is not None
    assert from_text(r.messages[0]["content"]) == tuple(r.prompt_token_ids[:600])
    assert len(r.messages[0]["content"]) > 2300  # at least the 2.3k characters of the scenario


def test_sibling_fanout_shape() -> None:
    requests = sibling_fanout(num_prompts=5, fanout=7, prompt_tokens=300, interval_s=2.0)
    by_group: dict[str | None, list[WorkloadRequest]] = defaultdict(list)
    for r in requests:
        by_group[r.group].append(r)
    assert len(by_group) == 5
    for p in range(5):
        siblings = by_group[f"fan{p}"]
        assert len(siblings) == 7
        assert {r.arrival_s for r in siblings} == {2.0 * p}
        assert len({tuple(r.prompt_token_ids) for r in siblings}) == 1
    assert len({r.prompt_token_ids[0] for r in requests}) == 5


# ---------------------------------------------------------------------------------------------
# growing_sessions


def _sessions(requests: list[WorkloadRequest]) -> dict[str | None, list[WorkloadRequest]]:
    sessions: dict[str | None, list[WorkloadRequest]] = defaultdict(list)
    for r in requests:
        sessions[r.session_id].append(r)
    for turns in sessions.values():
        turns.sort(key=lambda r: r.turn or 0)
    return sessions


@pytest.mark.parametrize("window", [2048, 16384])
def test_sessions_grow_until_they_cross_the_window(window: int) -> None:
    requests = growing_sessions(
        num_sessions=4,
        window_tokens=window,
        user_tokens=max(128, window // 16),
        output_tokens=max(128, window // 16),
        seed=7,
    )
    sessions = _sessions(requests)
    assert len(sessions) == 4
    for turns in sessions.values():
        assert [t.turn for t in turns] == list(range(len(turns)))
        assert len(turns) >= 3
        assert turns[-1].num_prompt_tokens > window
        assert all(t.num_prompt_tokens <= window for t in turns[:-1])
        for prev, nxt in pairwise(turns):
            grown = tuple(nxt.prompt_token_ids)
            assert grown[: prev.num_prompt_tokens] == tuple(prev.prompt_token_ids)
            assert nxt.num_prompt_tokens > prev.num_prompt_tokens + prev.output_tokens
            assert nxt.depends_on == prev.request_id
            assert nxt.think_time_s == 5.0
            assert nxt.arrival_s == prev.arrival_s + 5.0
        assert turns[0].depends_on is None and turns[0].think_time_s is None
    firsts = [turns[0] for turns in sessions.values()]
    assert len({tuple(t.prompt_token_ids[:256]) for t in firsts}) == 1, "one shared system prompt"
    assert len({t.prompt_token_ids[256] for t in firsts}) == 4, (
        "users differ from their first token"
    )
    assert sorted(t.arrival_s for t in firsts) == [0.0, 2.0, 4.0, 6.0]


def test_session_messages_replay_the_assistant_turns() -> None:
    requests = growing_sessions(
        num_sessions=1,
        window_tokens=300,
        system_prompt_tokens=20,
        user_tokens=30,
        output_tokens=30,
        with_messages=True,
    )
    turns = _sessions(requests)["sess0"]
    for prev, nxt in pairwise(turns):
        assert nxt.messages is not None and prev.messages is not None
        roles = [m["role"] for m in nxt.messages]
        assert roles[0] == "system" and roles[1:] == ["user", "assistant"] * nxt.turn + ["user"]  # type: ignore[operator]
        assert from_text(" ".join(m["content"] for m in nxt.messages)) == tuple(
            nxt.prompt_token_ids
        )
        answer = from_text(nxt.messages[-2]["content"])
        assert len(answer) == prev.output_tokens


def test_session_without_shared_system_prompt() -> None:
    requests = growing_sessions(num_sessions=3, window_tokens=500, shared_system_prompt=False)
    firsts = [r for r in requests if r.turn == 0]
    assert len({r.prompt_token_ids[0] for r in firsts}) == 3


def test_session_errors() -> None:
    with pytest.raises(ConfigError, match="max_turns"):
        growing_sessions(window_tokens=100_000, max_turns=3)
    with pytest.raises(ConfigError, match="length_jitter"):
        growing_sessions(length_jitter=1.0)


def test_release_time_for_closed_loop_drivers() -> None:
    turns = _sessions(growing_sessions(num_sessions=1, window_tokens=600))["sess0"]
    first, second = turns[0], turns[1]
    assert release_time(first, {}) == first.arrival_s
    assert release_time(second, {}) is None  # still waiting for turn 0
    assert release_time(second, {first.request_id: 12.0}) == 12.0 + 5.0


# ---------------------------------------------------------------------------------------------
# mooncake


def test_mooncake_workload_wraps_the_trace() -> None:
    requests = mooncake(limit=40)
    trace = load_trace("mooncake_conversation", limit=40)
    assert len(requests) == 40
    for r, rec in zip(requests, trace.records):
        assert r.request_id == f"mooncake_conversation-{rec.line}"
        assert r.arrival_s == rec.arrival_s and r.output_tokens == rec.output_length
        assert isinstance(r.prompt_token_ids, BlockTokens)
        assert r.prompt_token_ids == mooncake_tokens(rec.hash_ids or (), rec.input_length, 512)
        assert r.session_id is None
    # Every conversation request starts with hash id 0: its first 512 tokens are token 0.
    assert all(r.prompt_token_ids[:512] == (0,) * 512 for r in requests)


def test_mooncake_workload_options() -> None:
    requests = mooncake(
        "mooncake_synthetic", limit=10, rate_scale=2.0, block_tokens=64, token_offset=100
    )
    trace = load_trace("mooncake_synthetic", limit=10)
    assert [r.arrival_s for r in requests] == [rec.arrival_s / 2.0 for rec in trace.records]
    assert requests[0].prompt_token_ids[0] == 100 and requests[0].prompt_token_ids[64] == 101
    with pytest.raises(ConfigError, match="Mooncake-format"):
        mooncake("azure_code")

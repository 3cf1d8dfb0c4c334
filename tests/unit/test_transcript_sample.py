"""The live transcript sample's decisions (``core/transcript_sample.py``) and its config."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

import pytest

from kvroute.config import ConfigError, parse_config
from kvroute.core.shadow_replay import MAX_TURNS, parse_transcripts
from kvroute.core.transcript_sample import (
    SampleSettings,
    TranscriptSampler,
    conversation_of,
)


def chat(*turns: str, system: str | None = "Be brief.") -> list[dict[str, Any]]:
    """A history of ``turns`` user messages, each answered but the last."""
    messages: list[dict[str, Any]] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(turns) - 1:
            messages.append({"role": "assistant", "content": f"answer {i}"})
    return messages


def settings(**kw: Any) -> SampleSettings:
    return SampleSettings(**{"tenants": ("acme",), "rate": 1.0, "idle_s": 10.0,
                             **kw})


def test_a_history_becomes_system_and_user_turns() -> None:
    c = conversation_of(chat("one", "two"), "s1", 64)
    assert c is not None
    assert (c.system, c.turns, c.max_tokens) == ("Be brief.", ("one", "two"), 64)
    later = conversation_of(chat("one", "two", "three"), "s1", 64)
    assert later is not None and later.key == c.key and c.key.startswith("s:s1:")
    # One session id (e.g. a user name) with another opening: another conversation.
    other_opening = conversation_of(chat("uno", "two"), "s1", 64)
    assert other_opening is not None and other_opening.key != c.key
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    assert conversation_of(parts, None, None).turns == ("ab",)  # type: ignore[union-attr]
    # Without a session id the key is a hash of the system prompt and first turn: later
    # turns of the same conversation find it, another first turn does not.
    a = conversation_of(chat("one"), None, None)
    b = conversation_of(chat("one", "two", "three"), None, None)
    other = conversation_of(chat("uno", "two"), None, None)
    assert a is not None and b is not None and other is not None
    assert a.key == b.key != other.key and a.key.startswith("h:")


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}],
    [{"role": "system", "content": "only"}],
    [{"role": "user", "content": ""}],
    [{"role": "narrator", "content": "a"}],
])
def test_what_is_not_a_text_conversation_is_not_kept(messages: list[dict[str, Any]]) -> None:
    assert conversation_of(messages, "s", None) is None


def test_only_the_first_turns_a_replay_can_take_are_kept() -> None:
    c = conversation_of(chat(*(f"t{i}" for i in range(MAX_TURNS + 5))), "s", None)
    assert c is not None and len(c.turns) == MAX_TURNS and c.turns[0] == "t0"


def test_a_finished_conversation_is_one_line_the_replay_loader_accepts() -> None:
    sampler = TranscriptSampler(settings(max_tokens=8))
    for n in (1, 2, 3):  # three turns of one session, each answered
        conversation = conversation_of(chat(*(f"turn {i}" for i in range(n))), "s1", 100)
        assert conversation is not None
        assert sampler.offer("acme", "assistant", conversation, now=float(n))
    assert sampler.due(12.9) == []  # idle 9.9 s < 10 s: not finished
    ((tenant, line),) = sampler.due(13.0)
    assert tenant == "acme" and sampler.open == 0
    (transcript,) = parse_transcripts(line, "sample")
    assert transcript.workload == "assistant" and transcript.system == "Be brief."
    assert transcript.turns == ("turn 0", "turn 1", "turn 2")
    assert transcript.max_tokens == 8  # the request's 100, capped
    assert transcript.id.startswith("acme-") and "s1" not in transcript.id
    assert sampler.counts.written == 1


def test_only_opted_in_tenants_are_sampled_and_tenants_never_merge() -> None:
    sampler = TranscriptSampler(settings(tenants=frozenset({"acme", "beta"})))
    c = conversation_of(chat("a", "b"), "same-session", None)
    assert c is not None
    assert not sampler.offer("gamma", "r", c, 0.0)  # not opted in
    assert sampler.offer("acme", "r", c, 0.0) and sampler.offer("beta", "r", c, 0.0)
    lines = sampler.due(0.0, everything=True)
    assert sorted(t for t, _ in lines) == ["acme", "beta"]  # one line each, own tenant
    ids = {json.loads(line)["id"] for _, line in lines}
    assert len(ids) == 2


def test_the_rate_picks_a_stable_share_of_conversations() -> None:
    sampler = TranscriptSampler(settings(rate=0.25))
    chosen = [sampler.chosen("acme", f"s:{i}") for i in range(2000)]
    assert 400 <= sum(chosen) <= 600  # a seeded hash: deterministic, about a quarter
    assert chosen == [sampler.chosen("acme", f"s:{i}") for i in range(2000)]
    other = TranscriptSampler(settings(rate=0.25, seed="other"))
    assert chosen != [other.chosen("acme", f"s:{i}") for i in range(2000)]


def test_one_turn_is_not_written_and_open_conversations_are_bounded() -> None:
    sampler = TranscriptSampler(settings(max_open=2))
    for i in range(3):
        c = conversation_of(chat("only one"), f"s{i}", None)
        assert c is not None
        assert sampler.offer("acme", "r", c, 0.0) == (i < 2)
    assert sampler.counts.dropped_open == 1
    assert sampler.due(100.0) == [] and sampler.counts.too_short == 2


def test_lines_per_minute_per_file_and_bytes_per_file_are_bounded() -> None:
    def run(sampler: TranscriptSampler, count: int, now: float) -> int:
        for i in range(count):
            c = conversation_of(chat("x" * 50, f"y{i}"), f"{now}-{i}", None)
            assert c is not None
            sampler.offer("acme", "r", c, now)
        return len(sampler.due(now, everything=True))

    per_minute = TranscriptSampler(settings(max_per_minute=3))
    assert run(per_minute, 5, 0.0) == 3 and per_minute.counts.dropped_rate == 2
    assert run(per_minute, 5, 20.0) == 1  # 20 s refill one line
    assert run(per_minute, 5, 200.0) == 3  # never more than a minute's worth
    per_file = TranscriptSampler(settings(max_per_tenant=4))
    assert run(per_file, 6, 0.0) == 4 and per_file.counts.dropped_full == 2
    by_bytes = TranscriptSampler(settings(max_bytes_per_tenant=300))
    written = run(by_bytes, 6, 0.0)
    assert 1 <= written < 6 and by_bytes.counts.dropped_full == 6 - written
    # A restarted router counts what the file holds and never repeats an id.
    c = conversation_of(chat("a", "b"), "s", None)
    assert c is not None
    first = TranscriptSampler(settings())
    first.offer("acme", "r", c, 0.0)
    ((_, line),) = first.due(0.0, everything=True)
    again = TranscriptSampler(settings())
    again.existing("acme", [json.loads(line)["id"]], len(line) + 1)
    again.offer("acme", "r", c, 0.0)
    assert again.due(0.0, everything=True) == [] and again.counts.duplicate == 1


def test_the_config_is_opt_in_and_names_known_tenants() -> None:
    base: dict[str, Any] = {"pools": {"p": {"model": "m", "replicas": [
        {"name": "r0", "url": "http://127.0.0.1:9"}]}}, "routes": {"chat": {"pools": ["p"]}}}
    assert parse_config(base, env={}).gate.sample is None
    cfg = parse_config({**base, "gate": {"sample": {"directory": "/tmp/t", "tenants": ["default"],
                                                    "rate": 0.5}}}, env={})
    assert cfg.gate.sample is not None and cfg.gate.sample.tenants == ("default",)
    with pytest.raises(ConfigError, match="not a configured tenant"):
        parse_config({**base, "gate": {"sample": {"directory": "/t", "tenants": ["x"]}}},
                      env={})
    with pytest.raises(ConfigError, match="non-empty list"):
        parse_config({**base, "gate": {"sample": {"directory": "/t"}}}, env={})
    with pytest.raises(ConfigError, match="must be <= 1"):
        parse_config({**base, "gate": {"sample": {"directory": "/t", "tenants": ["default"],
                                                  "rate": 2}}}, env={})


def test_the_config_is_the_samplers_settings_with_their_defaults_and_key_names() -> None:
    base: dict[str, Any] = {"pools": {"p": {"model": "m", "replicas": [
        {"name": "r0", "url": "http://127.0.0.1:9"}]}}, "routes": {"chat": {"pools": ["p"]}}}
    cfg = parse_config({**base, "gate": {"sample": {"directory": "/tmp/t",
                                                    "tenants": ["default"]}}}, env={})
    sample = cfg.gate.sample
    assert sample is not None and sample.directory == "/tmp/t"
    defaults = SampleSettings(tenants=("default",))
    assert TranscriptSampler(sample).settings.max_per_minute == defaults.max_per_minute
    assert {f.name: getattr(sample, f.name) for f in fields(SampleSettings)} == {
        f.name: getattr(defaults, f.name) for f in fields(SampleSettings)}
    with pytest.raises(ConfigError, match=r"gate\.sample\.rte: unknown key 'rte'\. did you "
                       r"mean 'rate'\? Allowed keys here: directory, tenants, rate, idle_s, "
                       r"min_turns, max_open, max_per_minute, max_per_tenant, "
                       r"max_bytes_per_tenant, max_tokens, seed\."):
        parse_config({**base, "gate": {"sample": {"directory": "/t", "tenants": ["default"],
                                                  "rte": 0.5}}}, env={})

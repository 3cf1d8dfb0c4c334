"""A route's reasoning settings on a chat body: the switch, the default budget, the ceiling."""

from __future__ import annotations

import json

import pytest

from kvroute.config import ConfigError, parse_config
from kvroute.shell.forward import walk_route
from kvroute.wire.openai import parse_request
from kvroute.wire.reasoning import ReasoningSettings, expected_thinking, reasoning_fields
from kvroute.wire.relay import forward_body

CHAT = {"model": "m", "messages": [{"role": "user", "content": "2+2?"}]}


def test_the_switch_and_the_default_budget() -> None:
    on = ReasoningSettings("qwen3", thinking=True, budget=2048, max_budget=8192)
    assert reasoning_fields(CHAT, on) == {"chat_template_kwargs": {"enable_thinking": True},
                                          "thinking_token_budget": 2048}
    off = ReasoningSettings("deepseek-v3.1", thinking=False, budget=2048)
    assert reasoning_fields(CHAT, off) == {"chat_template_kwargs": {"thinking": False}}
    assert reasoning_fields(CHAT, ReasoningSettings()) == {}


def test_the_clients_choices_win_up_to_the_ceiling() -> None:
    on = ReasoningSettings("qwen3", thinking=True, budget=2048, max_budget=8192)
    own_off = {**CHAT, "chat_template_kwargs": {"enable_thinking": False, "x": 1}}
    assert reasoning_fields(own_off, on) == {}
    assert reasoning_fields({**CHAT, "thinking_token_budget": 500}, on) == {
        "chat_template_kwargs": {"enable_thinking": True}}
    for asked in (-1, 50_000):
        assert reasoning_fields({**CHAT, "thinking_token_budget": asked}, on)[
            "thinking_token_budget"] == 8192


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="switch"):
        ReasoningSettings("llama")
    with pytest.raises(ValueError, match="above max_budget"):
        ReasoningSettings(budget=10, max_budget=5)


def _config(reasoning: object) -> object:
    return parse_config({
        "pools": {"p": {"model": "m", "replicas": [{"name": "r", "url": "http://127.0.0.1:1"}]}},
        "routes": {"think": {"pools": ["p"], "reasoning": reasoning}},
    }, env={})


def test_the_route_config_and_the_output_floor() -> None:
    cfg = _config({"switch": "qwen3", "thinking": True, "budget": 1024, "max_budget": 4096})
    route = cfg.routes["think"]  # type: ignore[attr-defined]
    assert route.reasoning == ReasoningSettings("qwen3", True, 1024, 4096)
    assert walk_route(route).output_floor == 256 + 1024  # the thinking counts in max_tokens
    with pytest.raises(ConfigError, match="not a valid reasoning setting"):
        _config({"switch": "qwen2"})
    with pytest.raises(ConfigError, match="budgets"):
        _config({"budgets": 3})


def test_the_fields_reach_the_forwarded_body() -> None:
    raw = json.dumps(CHAT).encode()
    sent = json.loads(forward_body(raw, parse_request(raw, "chat"), max_tokens=None, model="m",
                                   cache_salt=None, set_fields={"thinking_token_budget": 64}))
    assert sent["thinking_token_budget"] == 64 and sent["messages"] == CHAT["messages"]


def _ask(text: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "system", "content": "prove everything"},
                                       {"role": "user", "content": text}]}


def test_the_rules_classifier_reads_the_last_user_message() -> None:
    from kvroute.wire.reasoning import needs_thinking

    for hard in ("Prove that sqrt(2) is irrational.", "why does this crash?\n```py\nx()\n```",
                 "what is 37 * 41?", "Solve x^2 - 4 = 0 step by step", "a" * 2500):
        assert needs_thinking(_ask(hard)), hard
    for easy in ("hello!", "What is the capital of France?", "thanks, that helps"):
        assert not needs_thinking(_ask(easy)), easy


def test_auto_lets_the_classifier_set_the_switch_unless_the_client_did() -> None:
    auto = ReasoningSettings("deepseek-v3.1", auto=True, budget=1024)
    assert reasoning_fields(_ask("Prove it."), auto) == {
        "chat_template_kwargs": {"thinking": True}, "thinking_token_budget": 1024}
    assert reasoning_fields(_ask("hi"), auto) == {"chat_template_kwargs": {"thinking": False}}
    mine = {**_ask("hi"), "chat_template_kwargs": {"thinking": True}}
    assert reasoning_fields(mine, auto) == {"thinking_token_budget": 1024}
    with pytest.raises(ValueError, match="choose one"):
        ReasoningSettings(thinking=True, auto=True)
    with pytest.raises(ValueError, match="classifier"):
        ReasoningSettings(auto=True, classifier="llm")
    cfg = _config({"thinking": "auto", "budget": 64})
    assert cfg.routes["think"].reasoning.auto  # type: ignore[attr-defined]


def test_the_thinking_a_request_is_allowed() -> None:
    on = ReasoningSettings("qwen3", thinking=True, budget=2048, max_budget=8192)
    assert expected_thinking(CHAT, on) == 2048
    assert expected_thinking({**CHAT, "thinking_token_budget": 500}, on) == 500
    assert expected_thinking({**CHAT, "thinking_token_budget": -1}, on) == 8192  # the ceiling
    off = {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    assert expected_thinking(off, on) == 0  # the client's switch wins
    assert expected_thinking(CHAT, ReasoningSettings("qwen3", thinking=False, budget=9)) == 0
    unbounded = ReasoningSettings("qwen3", thinking=True)
    assert expected_thinking({**CHAT, "thinking_token_budget": -1}, unbounded) == 0
    assert expected_thinking(CHAT, None) == 0


def test_structured_output_passes_through_a_thinking_route() -> None:
    """A thinking route sets its switch and budget and nothing else: the client's structured
    output request (``response_format`` with a JSON schema, vLLM's ``structured_outputs``)
    reaches the engine byte-for-byte equal, beside the route's fields."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"]}
    body = {**CHAT, "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "a", "schema": schema}},
            "structured_outputs": {"json": schema}}
    on = ReasoningSettings("qwen3", thinking=True, budget=512, max_budget=None)
    fields = reasoning_fields(body, on)
    assert set(fields) == {"chat_template_kwargs", "thinking_token_budget"}
    raw = json.dumps(body).encode()
    sent = json.loads(forward_body(raw, parse_request(raw, "chat"), max_tokens=None, model="m",
                                   cache_salt=None, set_fields=fields))
    assert sent["response_format"] == body["response_format"]
    assert sent["structured_outputs"] == body["structured_outputs"]
    assert sent["chat_template_kwargs"] == {"enable_thinking": True}
    assert sent["thinking_token_budget"] == 512

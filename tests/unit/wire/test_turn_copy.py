"""The spread-ahead copy's body: the session's prompt plus its answer, as the next turn
resends it (wire/turn_copy.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvroute.tokenize.sim_vocab import BuiltinTokenizer
from kvroute.wire.openai import RequestError, parse_request
from kvroute.wire.turn_copy import AnswerText, answer_of, turn_copy_body

MESSAGES = [{"role": "system", "content": "you are terse"},
            {"role": "user", "content": "list the files"}]


def chat(**extra: Any) -> Any:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 300, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    return parse_request(json.dumps(body).encode(), "chat")


def completion(prompt: Any, **extra: Any) -> Any:
    body = {"model": "m", "prompt": prompt, "max_tokens": 50, **extra}
    return parse_request(json.dumps(body).encode(), "completions")


def sse(*docs: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(d).encode() + b"\n\n" for d in docs) + \
        b"data: [DONE]\n\n"


def delta(content: str | None, index: int = 0, **more: Any) -> dict[str, Any]:
    return {"choices": [{"index": index, "delta": {"content": content, **more},
                         "finish_reason": None}]}


def test_chat_copy_renders_as_a_prefix_of_the_next_turn() -> None:
    answer = "a.py b.py"
    body = json.loads(turn_copy_body(chat(), answer, model="served", cache_salt=None))
    assert body["messages"] == [*MESSAGES, {"role": "assistant", "content": answer}]
    assert body["add_generation_prompt"] is False
    assert body["max_tokens"] == 1 and body["stream"] is False
    assert "stream_options" not in body and body["model"] == "served"
    tok = BuiltinTokenizer()
    copy_ids = tok.encode(tok.render_chat(body["messages"], add_generation_prompt=False),
                          add_special_tokens=False)
    next_turn = [*body["messages"], {"role": "user", "content": "now delete them"}]
    next_ids = tok.encode(tok.render_chat(next_turn), add_special_tokens=False)
    assert list(next_ids[:len(copy_ids)]) == list(copy_ids)
    prompt_ids = tok.encode(tok.render_chat(MESSAGES), add_special_tokens=False)
    assert len(copy_ids) > len(prompt_ids)  # the answer's tokens are in the copy


def test_the_sessions_salt_tools_and_template_kwargs_are_kept() -> None:
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {}}}]
    parsed = chat(tools=tools, chat_template_kwargs={"enable_thinking": False},
                  cache_salt="client-salt")
    body = json.loads(turn_copy_body(parsed, "ok", model=None, cache_salt="tenant-salt"))
    assert body["cache_salt"] == "tenant-salt"
    assert body["tools"] == tools and body["chat_template_kwargs"] == {"enable_thinking": False}
    kept = json.loads(turn_copy_body(parsed, "ok", model=None, cache_salt=None))
    assert kept["cache_salt"] == "client-salt"


def test_an_invalid_salt_is_refused() -> None:
    with pytest.raises(RequestError):
        turn_copy_body(chat(), "ok", model=None, cache_salt="")


def test_no_answer_copies_the_prompt_alone() -> None:
    body = json.loads(turn_copy_body(chat(), None, model=None, cache_salt=None))
    assert body["messages"] == MESSAGES and "add_generation_prompt" not in body
    assert body["max_tokens"] == 1


def test_a_continued_final_message_copies_the_prompt_alone() -> None:
    parsed = chat(add_generation_prompt=False, continue_final_message=True)
    body = json.loads(turn_copy_body(parsed, "more", model=None, cache_salt=None))
    assert body["messages"] == MESSAGES


def test_completions_append_the_text_to_a_text_prompt_only() -> None:
    body = json.loads(turn_copy_body(completion("once upon"), " a time", model=None,
                                     cache_salt=None))
    assert body["prompt"] == "once upon a time" and body["max_tokens"] == 1
    ids = json.loads(turn_copy_body(completion([5, 6, 7]), " a time", model=None,
                                    cache_salt=None))
    assert ids["prompt"] == [5, 6, 7]
    echoed = json.loads(turn_copy_body(completion("once", echo=True), " upon", model=None,
                                       cache_salt=None))
    assert echoed["prompt"] == "once"


def test_stream_text_is_joined_across_any_split() -> None:
    stream = sse(delta(None, role="assistant"), delta("a.py"), delta(" b.py"),
                 {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                 {"choices": [], "usage": {"completion_tokens": 3}})
    for cut in range(0, len(stream), 7):
        reader = AnswerText("chat")
        reader.feed(stream[:cut])
        reader.feed(stream[cut:])
        assert reader.text == "a.py b.py", cut


def test_completion_stream_reads_text() -> None:
    reader = AnswerText("completions")
    reader.feed(sse({"choices": [{"index": 0, "text": "a"}]},
                    {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}))
    assert reader.text == "ab"


@pytest.mark.parametrize("docs", [
    (delta("x"), delta(None, tool_calls=[{"index": 0, "id": "c"}])),
    (delta("x"), delta("y", index=1)),
    (delta("x" * 40), delta("y" * 30)),
])
def test_stream_gives_up_on_what_a_plain_message_cannot_replay(
        docs: tuple[dict[str, Any], ...]) -> None:
    reader = AnswerText("chat", cap=64)
    reader.feed(sse(*docs))
    assert reader.text is None
    reader.feed(sse(delta("z")))  # nothing more is kept once it gave up
    assert reader.text is None


def test_over_the_cap_keeps_nothing() -> None:
    reader = AnswerText("chat", cap=10)
    for _ in range(100):
        reader.feed(sse(delta("0123456789")))
    assert reader.text is None and not reader._parts


def test_whole_answers() -> None:
    doc = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                        "finish_reason": "stop"}], "usage": {"completion_tokens": 1}}
    assert answer_of(json.dumps(doc).encode(), "chat") == "hi"
    assert answer_of(json.dumps(doc).encode(), "chat", cap=1) is None
    calls = {"choices": [{"index": 0, "message": {"content": None, "tool_calls": [{}]}}]}
    assert answer_of(json.dumps(calls).encode(), "chat") is None
    two = {"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]}
    assert answer_of(json.dumps(two).encode(), "completions") is None
    one = {"choices": [{"index": 0, "text": " there"}]}
    assert answer_of(json.dumps(one).encode(), "completions") == " there"
    assert answer_of(b"not json", "chat") is None

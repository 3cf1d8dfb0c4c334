"""Spread-ahead's answer capture (shell/answer_capture.py): the relayed answer is kept for
the session's copy only when it is kept at all and its first choice finished."""

from __future__ import annotations

import json
from typing import Any

from kvroute.shell.answer_capture import AnswerCapture
from kvroute.wire.openai import parse_request
from kvroute.wire.relay import StreamWatcher

MESSAGES = [{"role": "user", "content": "list the files"}]


def chat() -> Any:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 30, "stream": True}
    return parse_request(json.dumps(body).encode(), "chat")


def stream(finish: str | None) -> bytes:
    docs = [{"choices": [{"index": 0, "delta": {"content": "a.py"}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}]
    return b"".join(b"data: " + json.dumps(d).encode() + b"\n\n" for d in docs)


def relay(capture: AnswerCapture, body: bytes) -> StreamWatcher:
    watcher = StreamWatcher()
    capture.on_chunk(watcher)(body)
    capture.streamed(watcher.finish_reasons)
    return watcher


def test_a_finished_stream_sets_the_turns_answer_and_still_feeds_the_watcher() -> None:
    capture = AnswerCapture(chat(), keep=True)
    watcher = relay(capture, stream("stop"))
    assert watcher.finish_reasons == ["stop"]
    assert capture.turn.answer == "a.py"
    assert capture.turn.request.messages == MESSAGES


def test_an_unfinished_or_unkept_answer_stays_none() -> None:
    cut = AnswerCapture(chat(), keep=True)
    relay(cut, stream(None))
    assert cut.turn.answer is None
    unkept = AnswerCapture(chat(), keep=False)
    watcher = relay(unkept, stream("stop"))
    assert watcher.finish_reasons == ["stop"] and unkept.turn.answer is None


def test_a_whole_answer_is_read_when_it_finished() -> None:
    doc = json.dumps({"choices": [{"index": 0, "message": {"content": "hi"},
                                   "finish_reason": "stop"}]}).encode()
    kept = AnswerCapture(chat(), keep=True)
    kept.whole(doc, ["stop"])
    assert kept.turn.answer == "hi"
    unfinished = AnswerCapture(chat(), keep=True)
    unfinished.whole(doc, [None])
    assert unfinished.turn.answer is None
    unkept = AnswerCapture(chat(), keep=False)
    unkept.whole(doc, ["stop"])
    assert unkept.turn.answer is None

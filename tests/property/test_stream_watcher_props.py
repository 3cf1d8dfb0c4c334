"""``wire.relay.StreamWatcher``: any split of a relayed stream reads the same ends and usage."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.wire.relay import StreamWatcher


def stream(reasons: list[str], usage: dict[str, int] | None, crlf: bool) -> bytes:
    nl = "\r\n" if crlf else "\n"
    events = [{"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
              for _ in range(3)]
    for i, reason in enumerate(reasons):
        events.append({"choices": [{"index": i, "delta": {}, "finish_reason": reason}]})
    if usage is not None:
        events.append({"choices": [], "usage": usage})
    text = "".join(f"data: {json.dumps(e)}{nl}{nl}" for e in events) + f"data: [DONE]{nl}{nl}"
    return text.encode()


def read(chunks: list[bytes]) -> tuple[list[str | None], object]:
    watcher = StreamWatcher()
    for chunk in chunks:
        watcher.feed(chunk)
    return watcher.finish_reasons, watcher.usage


@settings(max_examples=200, deadline=None)
@given(
    reasons=st.lists(st.sampled_from(["stop", "length", "tool_calls"]), max_size=3),
    usage=st.one_of(st.none(), st.fixed_dictionaries(
        {"prompt_tokens": st.integers(0, 10**6), "completion_tokens": st.integers(0, 10**5)})),
    crlf=st.booleans(),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
    drop_last_newlines=st.booleans(),
)
def test_any_split_of_a_stream_reads_the_same(reasons: list[str], usage: dict[str, int] | None,
                                              crlf: bool, cuts: list[int],
                                              drop_last_newlines: bool) -> None:
    whole = stream(reasons, usage, crlf)
    if drop_last_newlines:  # an engine that ends without the final blank line
        whole = whole.rstrip(b"\r\n")
    points = sorted({c % (len(whole) + 1) for c in cuts})
    chunks = [whole[a:b] for a, b in zip([0, *points], [*points, len(whole)], strict=True)]
    assert read(chunks) == read([whole])
    assert read([whole]) == (list(reasons), usage)


def test_an_ending_line_cut_in_the_middle_of_its_key_is_still_read() -> None:
    whole = stream(["length"], {"prompt_tokens": 7, "completion_tokens": 3}, crlf=False)
    cut = whole.index(b'"finish_reason": "length"') + 5
    assert read([whole[:cut], whole[cut:]]) == (["length"], {"prompt_tokens": 7,
                                                             "completion_tokens": 3})

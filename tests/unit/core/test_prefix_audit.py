"""``kvroute audit``'s analysis and its reader: what breaks prefix reuse in a sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.commands.audit import read_sample
from kvroute.core.prefix_audit import AuditRequest, audit, canonical_text

BODY = "You are a careful assistant. Answer in English. Cite the policy you apply. " * 8


def req(text: str, *, session: str | None = None, tools: tuple[str, ...] = (),
        messages: tuple[str, ...] = (), system: str | None = None) -> AuditRequest:
    return AuditRequest(route="assistant", text=text, tools_sorted_text=text, system=system,
                        tool_names=tools, messages=messages, session=session)


def test_volatile_values_are_found_and_replaced() -> None:
    text = ("at 2026-12-01T10:00:05Z id 3f2b1c9e-4d5a-4b6c-8d7e-9f0a1b2c3d4e on 2026-12-01 "
            "epoch 1796162748 call req_8f7a6b5c4d nonce 9f86d081884c7d659a2feaa0c55ad015 ok")
    canonical, found = canonical_text(text)
    assert [name for name, _, _ in found] == ["timestamp", "uuid", "date", "unix_time",
                                              "request_id", "nonce"]
    assert canonical == "at \x00 id \x00 on \x00 epoch \x00 call \x00 nonce \x00 ok"
    assert canonical_text("plain words, version 3.11, 42 apples")[1] == []


def test_a_timestamp_in_the_first_block_costs_the_whole_shared_prompt() -> None:
    stamped = [req(f"Now: 2026-12-01T10:0{i}:00Z. {BODY} question {i}") for i in range(5)]
    report = audit(stamped, block_size=16)
    assert report.reused_tokens == 0
    assert report.lost_share > 0.5
    (finding,) = report.findings
    assert finding.kind == "volatile:timestamp"
    assert (finding.requests, finding.first_block) == (4, 0)
    assert report.divergence_blocks[0] == 5
    stable = audit([req(f"{BODY} question {i}") for i in range(5)], block_size=16)
    assert stable.lost_share == 0.0 and stable.reused_share > 0.5 and stable.findings == []


def test_reordered_tools_and_rewritten_history_between_turns() -> None:
    turn1 = req("tools a,b " + BODY, session="s", tools=("a", "b"), messages=("user: hi",))
    turn2 = AuditRequest(route="assistant", text="tools b,a " + BODY,
                         tools_sorted_text="tools a,b " + BODY, tool_names=("b", "a"),
                         messages=("user: hi", "assistant: yo", "user: more"), session="s")
    turn3 = req("tools b,a " + BODY, session="s", tools=("b", "a"),
                messages=("user: hello", "assistant: yo", "user: more", "user: again"))
    report = audit([turn1, turn2, turn3], block_size=16)
    kinds = {f.kind: f for f in report.findings}
    assert kinds["tools_reordered"].requests == 1
    assert kinds["tools_reordered"].lost_tokens > 0
    assert kinds["history_rewritten"].requests == 1
    assert "message 0" in kinds["history_rewritten"].example


def test_system_prompts_differing_only_in_volatile_values() -> None:
    requests = [req(f"{BODY} q{i}", system=f"Session req_{i:08d}abc. {BODY}") for i in range(3)]
    (finding,) = [f for f in audit(requests).findings if f.kind == "per_request_system_prompt"]
    assert finding.requests == 3 and "differ only in volatile values" in finding.example


def test_the_reader_takes_bare_and_wrapped_bodies_and_names_a_bad_line(tmp_path: Path) -> None:
    chat = {"model": "assistant", "messages": [{"role": "system", "content": "sys"},
                                               {"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "zeta"}},
                      {"type": "function", "function": {"name": "alpha"}}]}
    sample = tmp_path / "sample.jsonl"
    sample.write_text(json.dumps(chat) + "\n\n" + json.dumps({"body": {
        "model": "assistant", "prompt": "hello"}, "session": "s9"}) + "\n")
    first, second = read_sample(sample)
    assert first.tool_names == ("zeta", "alpha") and first.system == "sys"
    assert first.text.index("zeta") < first.text.index("alpha")
    assert first.tools_sorted_text.index("alpha") < first.tools_sorted_text.index("zeta")
    assert first.session == "hi" and second.session == "s9" and second.text == "hello"
    sample.write_text(json.dumps(chat) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"sample.jsonl:2 is not JSON"):
        list(read_sample(sample))

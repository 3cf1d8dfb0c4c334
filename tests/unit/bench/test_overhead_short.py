"""Short unique prompts for ``kvroute bench overhead``'s ``u`` phases
(``bench/overhead_short.py``): ~600 real tokens each, counted exactly; no two requests, of one
run or of two, share a block beyond the system prompt's; the ``u`` phases parse as closed
loops and each router and pass is sent prompts of its own."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence

import pytest

from kvroute.bench.live_client import LiveRequest
from kvroute.bench.overhead import (
    OverheadSpec,
    _unique_schedule,
    parse_overhead_routers,
    parse_phases,
)
from kvroute.bench.overhead_short import SHORT_SYSTEM, short_unique_requests
from kvroute.core.errors import ConfigError

pytest.importorskip("tokenizers", reason="real token counts need kvroute[hf]")

from kvroute.tokenize.hf import HFTokenizer, bundled_tokenizer_dir

BLOCK = 16


def _ids(tok: HFTokenizer, req: LiveRequest) -> list[int]:
    text = tok.render_chat(json.loads(req.body)["messages"])
    return list(tok.encode(text, add_special_tokens=False))


def _longest_shared_prefix(prompts: Sequence[Sequence[int]]) -> int:
    ordered = sorted(tuple(p) for p in prompts)  # the longest shared prefix is between neighbours
    best = 0
    for a, b in itertools.pairwise(ordered):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        best = max(best, n)
    return best


def test_prompts_are_short_chats_with_real_token_counts() -> None:
    reqs = short_unique_requests(40, model="m", label="a")
    tok = HFTokenizer.from_dir(bundled_tokenizer_dir())
    for req in reqs:
        body = json.loads(req.body)
        assert body["stream"] is False and body["max_tokens"] == 8 and body["model"] == "m"
        assert body["messages"][0] == {"role": "system", "content": SHORT_SYSTEM}
        assert req.prompt_tokens == len(_ids(tok, req)) and req.arrival_s == 0.0
    mean = sum(r.prompt_tokens for r in reqs) / len(reqs)
    assert 550 <= mean <= 650


def test_no_two_prompts_share_a_block_beyond_the_system_prompts() -> None:
    tok = HFTokenizer.from_dir(bundled_tokenizer_dir())
    first = short_unique_requests(60, model="m", label="a")
    other = short_unique_requests(60, model="m", label="b")
    prompts = [_ids(tok, r) for r in (*first, *other)]
    text = tok.render_chat(json.loads(first[0].body)["messages"])
    shared = len(tok.encode(text[: text.index("[a-0-0]")], add_special_tokens=False))
    assert all(p[:shared] == prompts[0][:shared] for p in prompts)  # the system prompt
    assert _longest_shared_prefix(prompts) < shared + BLOCK  # nothing further, not one block
    assert short_unique_requests(3, model="m", label="a")[1].body == first[1].body  # repeatable


def test_u_phases_are_closed_loops_of_prompts_each_run_its_own() -> None:
    (u8,) = parse_phases("u8")
    assert not u8.fixed_rate and not u8.stream and u8.value == 8
    with pytest.raises(ConfigError, match="u<workers>"):
        parse_phases("u2.5")
    spec = OverheadSpec(routers=parse_overhead_routers("direct"), phases=(u8,), phase_s=0.01)
    one = _unique_schedule(u8, spec, "kvroute-p1")
    two = _unique_schedule(u8, spec, "kvroute-p2")
    assert len(one) == len(two) == 15  # 1,500 a second of phase
    assert not {r.body for r in one} & {r.body for r in two}
    assert len({r.request_id for r in (*one, *two)}) == 30


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ConfigError, match="count=0"):
        short_unique_requests(0, model="m", label="a")
    with pytest.raises(ConfigError, match="label"):
        short_unique_requests(1, model="m", label="")

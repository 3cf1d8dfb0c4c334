"""Growing agentic sessions for ``kvroute bench overhead`` (``bench/overhead_long.py``): real
token counts, each turn extending the last, several sessions interleaved; the ``g`` phases and
the sweep's options parse and validate."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

from kvroute.bench.overhead import OverheadSpec, parse_overhead_routers, parse_phases
from kvroute.bench.overhead_long import long_session_requests, tree_cpu_ns
from kvroute.core.errors import ConfigError

pytest.importorskip("tokenizers", reason="real token counts need kvroute[hf]")

from kvroute.tokenize.hf import HFTokenizer, bundled_tokenizer_dir


def test_sessions_grow_turn_by_turn_to_the_target_with_real_counts() -> None:
    reqs = long_session_requests(3, model="m", seed=1, rate=4.0, target_tokens=20_000,
                                 turn_chars=3_000)
    tok = HFTokenizer.from_dir(bundled_tokenizer_dir())
    by_session: dict[str, list[dict[str, object]]] = {}
    for i, req in enumerate(reqs):
        assert req.arrival_s == pytest.approx(i / 4.0)
        body = json.loads(req.body)
        assert body["stream"] is True and body["max_tokens"] == 8
        text = tok.render_chat(body["messages"])
        assert req.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
        by_session.setdefault(body["user"], []).append(body)
    assert len(by_session) == 3
    firsts = [json.loads(r.body)["user"] for r in reqs[:3]]
    assert len(set(firsts)) == 3  # turn-major: every session's first turn comes first
    for turns in by_session.values():
        for before, after in itertools.pairwise(turns):
            assert after["messages"][: len(before["messages"])] == before["messages"]
    last = {json.loads(r.body)["user"]: r.prompt_tokens for r in reqs}
    assert all(20_000 <= n < 20_000 + 4_000 for n in last.values())


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ConfigError, match="sessions=0"):
        long_session_requests(0, model="m")


def test_g_phases_parse_and_the_sweep_options_validate(tmp_path: Path) -> None:
    (g4,) = parse_phases("g4")
    assert g4.stream and g4.fixed_rate and g4.value == 4
    with pytest.raises(ConfigError, match="g<sessions>"):
        parse_phases("g1.5")
    routers = parse_overhead_routers("direct")
    with pytest.raises(ConfigError, match="--long-sweep"):
        OverheadSpec(routers=routers, plot=tmp_path / "p.png").validate()
    with pytest.raises(ConfigError, match="long_target_tokens"):
        OverheadSpec(routers=routers, phases=(g4,), long_target_tokens=10**6).validate()
    OverheadSpec(routers=routers, phases=(g4,), long_sweep=True,
                 plot=tmp_path / "p.png").validate()


def test_cpu_is_read_from_every_thread_in_nanoseconds() -> None:
    before = tree_cpu_ns(os.getpid())
    sum(i * i for i in range(200_000))
    assert tree_cpu_ns(os.getpid()) > before

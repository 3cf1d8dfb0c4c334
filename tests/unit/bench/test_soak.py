"""The soak's stream and its window arithmetic (``kvroute.bench.soak``), without processes."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest

from kvroute.bench.live_client import ClientRun, RequestResult
from kvroute.bench.soak import SoakSpec, soak_requests, soak_windows
from kvroute.core.errors import ConfigError


def test_the_stream_mixes_kinds_exactly_and_sessions_grow_turn_by_turn() -> None:
    spec = SoakSpec(seconds=20, rate=50, seed=3)
    stream = soak_requests(spec)
    assert len(stream) == 1000
    assert [r.arrival_s for r in stream[:3]] == [0.0, 0.02, 0.04]
    kinds = Counter(("shared" if (r.group or "").startswith("shared-") else r.group)
                    for r in stream)
    assert kinds == {"shared": 500, "session": 300, "unique": 200}
    bodies = [json.loads(r.body) for r in stream]
    assert all(b["stream"] is False and b["model"] == "sim-model" for b in bodies)
    turns: dict[str, list[list[dict[str, str]]]] = {}
    for r, body in zip(stream, bodies, strict=True):
        if r.group == "session":
            turns.setdefault(body["user"], []).append(body["messages"])
        else:
            assert "user" not in body
    assert len(turns) > 64  # new sessions keep arriving (each under a new id)
    for history in turns.values():
        assert 1 <= len(history) <= 4
        for before, after in itertools.pairwise(history):
            assert after[: len(before)] == before and len(after) == len(before) + 2
    uniques = [json.dumps(b["messages"]) for r, b in zip(stream, bodies, strict=True)
               if r.group == "unique"]
    assert len(set(uniques)) == len(uniques)
    assert soak_requests(spec) == stream  # deterministic for a seed
    assert soak_requests(SoakSpec(seconds=20, rate=50, seed=4)) != stream


def test_windows_count_what_finished_in_each_and_the_cost_per_decision() -> None:
    def done(start: float, e2e: float, error: str | None = None) -> RequestResult:
        return RequestResult("r", start_s=start, e2e_s=e2e, error=error)

    # The last request ends at 4.01 s, past the last sample's 4.0 s (two clocks, one
    # rounding): it still counts, in the last window.
    run = ClientRun([done(0.5, 0.01), done(1.2, 0.02), done(1.5, 0.6, "http_503"),
                     done(2.5, 0.04), done(3.99, 0.02)], wall_s=4.0, tcp_nodelay=True)
    samples = [{"t_s": 0.0, "rss_mb": 80.0, "cpu_s": 1.0, "decisions": 0.0,
                "engines_cpu_s": 5.0},
               {"t_s": 2.0, "rss_mb": 82.5, "cpu_s": 1.3, "decisions": 3.0,
                "index_entries": 10.0, "engines_cpu_s": 6.0, "own_p99_ms": 1.5},
               {"t_s": 4.0, "rss_mb": 83.0, "cpu_s": 1.4, "decisions": 4.0,
                "engines_cpu_s": 9.0}]
    first, second = soak_windows(run, samples)
    assert (first["finished"], first["errors"], first["rps"]) == (2, 0, 1.0)
    assert first["p99_ms"] == 20.0 and first["rss_mb"] == 82.5
    assert first["cpu_ms_per_decision"] == 100.0 and first["index_entries"] == 10.0
    assert first["engines_cores"] == 0.5 and first["own_p99_ms"] == 1.5
    assert first["max_ms"] == 20.0
    # The failed request finished at 2.1 s: counted in the second window, not in its latency.
    assert (second["finished"], second["errors"]) == (3, 1)
    assert second["p50_ms"] == 20.0 and second["max_ms"] == 40.0
    assert second["cpu_ms_per_decision"] == 100.0
    assert second["engines_cores"] == 1.5


@pytest.mark.parametrize("bad, says", [
    ({"seconds": 0}, "seconds=0"),
    ({"rate": -1}, "rate=-1"),
    ({"sample_s": 100, "seconds": 10}, "sample_s=100"),
    ({"num_gpu_blocks": 100}, "num_gpu_blocks=100 must be > 512"),
    ({"max_pins": 0}, "max_pins=0"),
])
def test_a_bad_spec_says_what_is_wrong(bad: dict[str, float], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        soak_requests(SoakSpec(**bad))  # type: ignore[arg-type]


def test_long_sessions_join_the_mix_and_need_a_window_for_them() -> None:
    spec = SoakSpec(seconds=12, rate=10, sample_s=4, num_gpu_blocks=16_500, long_sessions=2,
                    long_rate=2.0, long_target_tokens=12_000)
    reqs = soak_requests(spec)
    long = [r for r in reqs if r.request_id.startswith("soak-long-")]
    short = [r for r in reqs if not r.request_id.startswith("soak-long-")]
    assert len(short) == 120 and len(long) == 24  # 2 turns a second for 12 s
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    assert max(r.prompt_tokens for r in long) >= 12_000
    # Sessions of a later batch start once the batch before has sent its last turn.
    assert len({r.request_id.rsplit("-t", 1)[0] for r in long}) > 2
    with pytest.raises(ConfigError, match="num_gpu_blocks=4096 must be > 16384"):
        soak_requests(SoakSpec(long_sessions=1))

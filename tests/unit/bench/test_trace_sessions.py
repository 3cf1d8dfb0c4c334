"""Sessions recovered from session-numbered hash ids (``kvroute.bench.trace_sessions``)."""

from __future__ import annotations

from collections import Counter

import pytest

from kvroute.bench import traces
from kvroute.bench.trace_sessions import SessionRecoveryError, sessions_from_local_ids
from kvroute.bench.traces import TraceError, load_trace
from kvroute.bench.workloads import mooncake

STRIDE = 100


def test_the_tag_after_the_positional_prefix_names_the_session() -> None:
    rows = [
        (1, [0, 1, 2, 703, 704]),  # shared prefix 0..2, then session 7
        (2, [0, 1, 2, 703, 704, 705]),  # the same session one turn later
        (3, [0, 1, 301]),  # a shorter shared prefix (another tool set), session 3
        (4, [0, 1, 2, 740]),  # a sub-agent chain of session 7: new ids, same tag
    ]
    assert sessions_from_local_ids(rows, stride=STRIDE) == ["s7", "s7", "s3", "s7"]


def test_a_row_with_only_shared_ids_stays_unmarked() -> None:
    assert sessions_from_local_ids([(1, [0, 1, 2]), (2, [0])], stride=STRIDE) == [None, None]


def test_a_shared_id_out_of_place_counts_as_local_and_is_refused() -> None:
    # id 5 at position 3 is not positional: it would be tag 0, which no session has.
    with pytest.raises(SessionRecoveryError, match=r"line 9: .*tags \[0\]"):
        sessions_from_local_ids([(9, [0, 1, 2, 5])], stride=STRIDE)


def test_a_row_mixing_two_sessions_is_refused_with_its_line() -> None:
    with pytest.raises(SessionRecoveryError, match=r"line 4: .*\[3, 7\].*exactly one tag"):
        sessions_from_local_ids([(4, [0, 301, 702])], stride=STRIDE)


def test_the_bundled_agentic_trace_has_its_sixty_sessions() -> None:
    trace = load_trace("claude_code_agentic_64")
    counts = Counter(r.session_id for r in trace.records)
    assert counts.pop(None) == 30
    assert len(counts) == 60
    assert all(s is not None and s.startswith("claude_code_agentic_64-s") for s in counts)


def test_session_recovery_can_be_turned_off_and_never_touches_mooncake() -> None:
    assert all(
        r.session_id is None for r in load_trace("claude_code_agentic_64", sessions=False).records
    )
    assert all(r.session_id is None for r in load_trace("mooncake_synthetic", limit=200).records)
    assert mooncake("claude_code_agentic_64", limit=2)[0].session_id == "claude_code_agentic_64-s77"


def test_a_trace_not_numbered_per_session_fails_to_load_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(traces, "_SESSIONS_FROM_LOCAL_IDS", frozenset({"mooncake_synthetic"}))
    with pytest.raises(TraceError, match=r"mooncake_synthetic: line \d+: .*tags \[0\]"):
        load_trace("mooncake_synthetic")
    assert load_trace("mooncake_synthetic", sessions=False, limit=1).records[0].session_id is None


def test_a_stride_below_one_is_refused() -> None:
    with pytest.raises(SessionRecoveryError, match="stride must be >= 1"):
        sessions_from_local_ids([(1, [1])], stride=0)

"""vLLM's data-parallel conventions: per-rank event endpoints and the rank header."""

from __future__ import annotations

import pytest

from kvroute.wire.dp_rank import DpRankError, offset_endpoint_port, parse_dp_rank


@pytest.mark.parametrize(("endpoint", "rank", "expected"), [
    ("tcp://10.0.0.5:5557", 0, "tcp://10.0.0.5:5557"),
    ("tcp://10.0.0.5:5557", 3, "tcp://10.0.0.5:5560"),
    ("tcp://*:5557", 1, "tcp://*:5558"),
    ("tcp://127.0.0.1:0", 2, "tcp://127.0.0.1:0"),  # port 0: every rank binds a free one
    ("inproc://kv", 2, "inproc://kv_dp2"),
    ("ipc:///tmp/kv", 0, "ipc:///tmp/kv"),
])
def test_rank_r_publishes_where_vllm_offsets_it(endpoint: str, rank: int, expected: str) -> None:
    assert offset_endpoint_port(endpoint, rank) == expected


def test_an_ipc_endpoint_cannot_serve_a_rank_above_zero() -> None:
    with pytest.raises(DpRankError, match="only tcp and inproc"):
        offset_endpoint_port("ipc:///tmp/kv", 1)


def test_the_rank_header_is_an_integer_in_range() -> None:
    assert parse_dp_rank(" 1 ", 2) == 1
    with pytest.raises(DpRankError, match=r"out of range \[0, 2\)"):
        parse_dp_rank("2", 2)
    with pytest.raises(DpRankError, match="must be an integer"):
        parse_dp_rank("one", 2)

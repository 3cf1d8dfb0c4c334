"""Trace readers, token synthesis and replay options (``kvroute.bench.traces``)."""

from __future__ import annotations

import hashlib
import lzma
import math
from importlib import resources
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.bench.traces import (
    BUNDLED_TRACES,
    BlockTokens,
    TraceError,
    bundled_trace_path,
    load_trace,
    mooncake_tokens,
    read_azure_csv,
    read_mooncake_jsonl,
    trace_stats,
    verify_bundled_checksums,
)
from kvroute.core.errors import RouterError


@pytest.fixture(scope="module")
def conversation():
    return load_trace("mooncake_conversation")


@pytest.fixture(scope="module")
def synthetic():
    return load_trace("mooncake_synthetic")


@pytest.fixture(scope="module")
def agentic():
    return load_trace("claude_code_agentic_64")


@pytest.fixture(scope="module")
def azure_conv():
    return load_trace("azure_conv")


# ---------------------------------------------------------------------------------------------
# Bundled files


def test_bundled_checksums_match_sha256sums() -> None:
    result = verify_bundled_checksums()
    assert set(result) == {filename for filename, _ in BUNDLED_TRACES.values()}
    assert all(result.values()), result


def test_checksum_file_is_recomputed_not_trusted() -> None:
    # Independent recomputation of one digest, so the helper cannot pass by comparing a file
    # with itself.
    data = bundled_trace_path("azure_code").read_bytes()
    assert hashlib.sha256(data).hexdigest() == (
        "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6"
    )


def test_licences_and_readme_are_bundled() -> None:
    folder = resources.files("kvroute").joinpath("data", "traces")
    for name in ("LICENSE-mooncake.txt", "LICENSE-azure-public-dataset.txt",
                 "LICENSE-kv-cache-tester.txt", "README.md"):
        assert folder.joinpath(name).is_file(), name


def test_mooncake_conversation_counts_and_ends(conversation) -> None:
    assert conversation.format == "mooncake" and conversation.block_tokens == 512
    assert len(conversation) == 12_031
    first, last = conversation.records[0], conversation.records[-1]
    assert (first.line, first.arrival_s, first.input_length, first.output_length) == (
        1,
        0.0,
        6758,
        500,
    )
    assert first.hash_ids == tuple(range(14))
    assert last.line == 12_031 and last.arrival_s == pytest.approx(3536.999)
    assert (last.input_length, last.output_length) == (20_774, 508)
    assert last.hash_ids is not None and len(last.hash_ids) == 41
    assert last.hash_ids[0] == 0 and last.hash_ids[-1] == 182_789


def test_mooncake_synthetic_counts_and_ends(synthetic) -> None:
    assert len(synthetic) == 3_993
    first, last = synthetic.records[0], synthetic.records[-1]
    assert (first.input_length, first.output_length, first.hash_ids) == (
        40_160,
        6,
        tuple(range(79)),
    )
    assert last.arrival_s == pytest.approx(1022.025)
    assert (last.input_length, last.output_length) == (18_440, 83)
    # It reuses a 36-block chain from earlier and ends with a block of its own (the newest id).
    assert last.hash_ids == (*range(17_915, 17_915 + 36), 43_923)


def test_mooncake_stats_match_reference_numbers(conversation, synthetic) -> None:
    conv, synth = trace_stats(conversation), trace_stats(synthetic)
    assert (conv.total_input_tokens, conv.total_output_tokens) == (144_793_823, 4_122_048)
    assert (synth.total_input_tokens, synth.total_output_tokens) == (61_194_628, 595_432)
    assert round(conv.block_repeat_fraction or 0, 4) == 0.3664
    assert round(synth.block_repeat_fraction or 0, 4) == 0.6396
    assert conv.num_uncovered == synth.num_uncovered == 0
    assert conv.mean_rate_rps == pytest.approx(3.40, abs=0.01)


def test_mooncake_rows_have_ceil_block_counts(conversation, synthetic) -> None:
    # The documented invariant behind "the last id is a partial block".
    for trace in (conversation, synthetic):
        assert all(len(r.hash_ids or ()) == math.ceil(r.input_length / 512) for r in trace.records)


def test_azure_counts_and_ends(azure_conv) -> None:
    assert azure_conv.format == "azure" and azure_conv.block_tokens is None
    assert len(azure_conv) == 19_366
    first, second, last = azure_conv.records[0], azure_conv.records[1], azure_conv.records[-1]
    assert (first.line, first.arrival_s, first.input_length, first.output_length) == (
        2,
        0.0,
        374,
        44,
    )
    assert second.arrival_s == pytest.approx(4.314579, abs=1e-9)
    assert last.arrival_s == pytest.approx(3501.721937, abs=1e-6)
    assert (last.input_length, last.output_length) == (197, 183)
    code = load_trace("azure_code")
    assert len(code) == 8_819
    assert (code.records[0].input_length, code.records[0].output_length) == (4808, 10)
    assert (code.records[-1].input_length, code.records[-1].output_length) == (549, 173)
    assert code.records[-1].arrival_s == pytest.approx(3435.948056, abs=1e-6)
    assert trace_stats(code).block_repeat_fraction is None


def test_azure_has_no_tokens(azure_conv) -> None:
    with pytest.raises(TraceError, match="no hash ids"):
        azure_conv.tokens(azure_conv.records[0])


# ---------------------------------------------------------------------------------------------
# Validation

GOOD = '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}'


@pytest.mark.parametrize(
    ("bad_line", "field"),
    [
        ("{not json", "not valid JSON"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 2}', "hash_ids"),
        (
            '{"timestamp": 0, "input_length": 0, "output_length": 2, "hash_ids": [0]}',
            "input_length",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": "2", "hash_ids": [0]}',
            "output_length",
        ),
        ('{"timestamp": -1, "input_length": 5, "output_length": 2, "hash_ids": [0]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": []}', "hash_ids"),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [1, -2]}',
            "hash_ids",
        ),
        (
            '{"timestamp": 0, "input_length": true, "output_length": 2, "hash_ids": [0]}',
            "input_length",
        ),
        ("[1, 2, 3]", "object"),
    ],
)
def test_mooncake_validation_names_line_and_field(bad_line: str, field: str) -> None:
    with pytest.raises(TraceError) as info:
        read_mooncake_jsonl([GOOD, "", bad_line], source="t.jsonl")
    message = str(info.value)
    assert "t.jsonl line 3" in message
    assert field in message


def test_mooncake_blank_lines_are_skipped_but_counted() -> None:
    records = read_mooncake_jsonl(
        ["", GOOD, "   ", GOOD.replace('"timestamp": 0', '"timestamp": 1500')]
    )
    assert [r.line for r in records] == [2, 4]
    assert records[1].arrival_s == 1.5


def test_mooncake_keeps_session_id_and_ignores_extra_keys() -> None:
    row = GOOD[:-1] + ', "session_id": "s1", "delay": 3}'
    (record,) = read_mooncake_jsonl([row])
    assert record.session_id == "s1"


def test_empty_traces_are_errors() -> None:
    with pytest.raises(TraceError, match="no requests"):
        read_mooncake_jsonl(["", " "])
    with pytest.raises(TraceError, match="no data rows"):
        read_azure_csv(["TIMESTAMP,ContextTokens,GeneratedTokens"])


AZ_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
AZ_ROW = "2023-11-16 18:15:46.6805900,374,44"


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (["TIME,Ctx,Gen", AZ_ROW], "line 1: header"),
        ([AZ_HEADER, AZ_ROW, "2023-11-16 18:15:47.0,374"], "line 3: 2 columns"),
        ([AZ_HEADER, AZ_ROW, "yesterday,374,44"], "line 3: TIMESTAMP"),
        ([AZ_HEADER, AZ_ROW, "2023-11-16 18:15:47.0,lots,44"], "line 3: ContextTokens"),
        ([AZ_HEADER, AZ_ROW, "2023-11-16 18:15:47.0,0,44"], "line 3: ContextTokens"),
        ([AZ_HEADER, AZ_ROW, "2023-11-16 18:15:47.0,5,-1"], "line 3: GeneratedTokens"),
        ([AZ_HEADER, AZ_ROW, "2023-11-16 18:15:47.x1,5,1"], "line 3: TIMESTAMP"),
    ],
)
def test_azure_validation_names_line_and_column(lines: list[str], expected: str) -> None:
    with pytest.raises(TraceError, match=expected):
        read_azure_csv(lines, source="a.csv")


def test_azure_accepts_bom_and_whole_seconds() -> None:
    records = read_azure_csv(
        ["\ufeff" + AZ_HEADER, "2023-11-16 23:59:59,5,1", "2023-11-17 00:00:01.5,6,0"]
    )
    assert [r.arrival_s for r in records] == [0.0, 2.5]  # crosses midnight


def test_agentic_trace_loads_by_name_with_64_token_ids_and_floor_rows(agentic) -> None:
    assert agentic.format == "mooncake" and agentic.block_tokens == 64
    assert len(agentic) == 1_924
    assert all(len(r.hash_ids or ()) == r.input_length // 64 for r in agentic.records)
    stats = trace_stats(agentic)
    assert (stats.total_input_tokens, stats.total_output_tokens) == (85_533_369, 709_090)
    assert stats.num_uncovered == 1_900
    assert round(stats.block_repeat_fraction or 0, 3) == 0.933
    assert agentic.records[-1].arrival_s == pytest.approx(3070.167)


def test_agentic_prompts_keep_their_input_length_with_a_tail_of_their_own(agentic) -> None:
    first, second = agentic.records[0], agentic.records[1]
    a, b = agentic.tokens(first), agentic.tokens(second)
    assert (len(a), len(b)) == (first.input_length, second.input_length) == (11_745, 12_192)
    covered = 64 * len(first.hash_ids or ())
    assert a[covered - 1] == (first.hash_ids or ())[-1]
    tail_a, tail_b = a[covered], b[64 * len(second.hash_ids or ())]
    assert a[covered:] == (tail_a,) * (11_745 - covered)
    every_id = {h for r in agentic.records for h in r.hash_ids or ()}
    assert tail_a != tail_b and not {tail_a, tail_b} & every_id


def test_trace_error_is_a_router_error() -> None:
    assert issubclass(TraceError, RouterError)


# ---------------------------------------------------------------------------------------------
# Loading by name or path, rate scaling, limit, offset, jitter


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def _row(ts: int, n: int = 10, ids: str = "[0]") -> str:
    return f'{{"timestamp": {ts}, "input_length": {n}, "output_length": 1, "hash_ids": {ids}}}'


def test_load_by_path_offsets_sorts_and_limits(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [_row(9000), _row(5000), _row(7000), _row(5000, 11)])
    trace = load_trace(path)
    assert trace.name == "t"
    assert [r.arrival_s for r in trace.records] == [0.0, 0.0, 2.0, 4.0]
    assert [r.line for r in trace.records] == [2, 4, 3, 1]  # stable sort keeps file order on ties
    limited = load_trace(str(path), limit=3)
    assert [r.line for r in limited.records] == [2, 4, 3]


def test_rate_scale_divides_gaps(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [_row(1000), _row(2000), _row(5000)])
    assert [r.arrival_s for r in load_trace(path, rate_scale=2.0).records] == [0.0, 0.5, 2.0]
    assert [r.arrival_s for r in load_trace(path, rate_scale=0.5).records] == [0.0, 2.0, 8.0]


def test_rate_scale_on_bundled_trace(conversation) -> None:
    fast = load_trace("mooncake_conversation", rate_scale=4.0, limit=500)
    for a, b in zip(fast.records, conversation.records[:500]):
        assert a.arrival_s == pytest.approx(b.arrival_s / 4.0)
        assert a.line == b.line
    assert trace_stats(fast).mean_rate_rps == pytest.approx(
        4 * trace_stats(load_trace("mooncake_conversation", limit=500)).mean_rate_rps
    )


def test_jitter_is_seeded_bounded_and_sorted(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [_row(0)] * 30 + [_row(3000)] * 30)
    a = load_trace(path, jitter_s=3.0, seed=1)
    b = load_trace(path, jitter_s=3.0, seed=1)
    c = load_trace(path, jitter_s=3.0, seed=2)
    assert a == b and a != c
    arrivals = [r.arrival_s for r in a.records]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert len(set(arrivals)) == 60 and max(arrivals) < 6.0


def test_an_xz_compressed_jsonl_reads_like_the_plain_file(tmp_path: Path) -> None:
    lines = [_row(2000, 9, "[0, 1]"), _row(1000, 5, "[0]")]
    plain = _write(tmp_path / "t.jsonl", lines)
    packed = tmp_path / "t.jsonl.xz"
    packed.write_bytes(lzma.compress(plain.read_bytes()))
    trace = load_trace(packed)
    assert trace.name == "t" and trace.format == "mooncake"
    assert trace.records == load_trace(plain).records
    assert [r.line for r in trace.records] == [2, 1]


def test_an_unreadable_xz_file_says_so(tmp_path: Path) -> None:
    broken = tmp_path / "t.jsonl.xz"
    broken.write_bytes(b"not xz at all")
    with pytest.raises(TraceError, match=r"t.jsonl.xz: not a readable .xz file"):
        load_trace(broken)


def test_a_path_to_a_floor_semantics_trace_keeps_every_prompt_token(tmp_path: Path) -> None:
    path = _write(tmp_path / "floor.jsonl", [_row(0, 10, "[3, 4]"), _row(1000, 11, "[3, 4]")])
    trace = load_trace(path, block_tokens=4)
    a, b = (trace.tokens(r) for r in trace.records)
    assert tuple(a) == (3, 3, 3, 3, 4, 4, 4, 4, 6, 6)  # tail id: max id + 1 + line 1
    assert tuple(b) == (3, 3, 3, 3, 4, 4, 4, 4, 7, 7, 7)
    assert trace_stats(trace).num_uncovered == 2


def test_format_is_detected_or_explicit(tmp_path: Path) -> None:
    csv_path = _write(tmp_path / "a.csv", [AZ_HEADER, AZ_ROW])
    assert load_trace(csv_path).format == "azure"
    odd = _write(tmp_path / "a.trace", [AZ_HEADER, AZ_ROW])
    with pytest.raises(TraceError, match="format="):
        load_trace(odd)
    assert load_trace(odd, format="azure").format == "azure"


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"rate_scale": 0.0}, "rate_scale"),
        ({"rate_scale": math.inf}, "rate_scale"),
        ({"limit": 0}, "limit"),
        ({"jitter_s": -1.0}, "jitter_s"),
        ({"block_tokens": 0}, "block_tokens"),
    ],
)
def test_bad_load_options(kwargs: dict[str, float], expected: str) -> None:
    with pytest.raises(TraceError, match=expected):
        load_trace("mooncake_synthetic", **kwargs)  # type: ignore[arg-type]


def test_unknown_trace_names_the_bundled_ones() -> None:
    with pytest.raises(TraceError, match="mooncake_conversation"):
        load_trace("no_such_trace")
    with pytest.raises(TraceError, match="azure_code"):
        bundled_trace_path("no_such_trace")
    with pytest.raises(TraceError, match="Azure has no hash ids"):
        load_trace("azure_code", block_tokens=512)


# ---------------------------------------------------------------------------------------------
# Token synthesis


def test_synthesis_is_hash_id_repeated_then_truncated() -> None:
    tokens = mooncake_tokens([7, 9, 11], 10, 4)
    assert tuple(tokens) == (7, 7, 7, 7, 9, 9, 9, 9, 11, 11)
    assert tokens.block_token_ids == (7, 9, 11)


def test_synthesis_clamps_to_capacity_like_dynamo() -> None:
    assert len(mooncake_tokens([1, 2], 100, 4)) == 8


def test_synthesis_with_a_tail_token_keeps_the_input_length() -> None:
    assert tuple(mooncake_tokens([1, 2], 10, 4, tail_token=50)) == (1,) * 4 + (2,) * 4 + (50, 50)
    tail = mooncake_tokens([1], 11, 4, tail_token=2**32 - 1, token_offset=2)
    assert tuple(tail) == (3,) * 4 + (1,) * 7  # the tail spans two blocks, offset mod 2**32
    assert tuple(mooncake_tokens([1, 2], 6, 4, tail_token=50)) == (1, 1, 1, 1, 2, 2)


def test_synthesis_ignores_ids_past_input_length() -> None:
    assert tuple(mooncake_tokens([1, 2, 3], 5, 4)) == (1, 1, 1, 1, 2)


def test_synthesis_offset_is_one_to_one_mod_2_32() -> None:
    assert tuple(mooncake_tokens([0, 5], 2, 1, token_offset=100)) == (100, 105)
    assert tuple(mooncake_tokens([2**32 - 1, 2**32], 2, 1, token_offset=1)) == (0, 1)


def test_bundled_record_tokens(conversation) -> None:
    record = conversation.records[0]
    tokens = conversation.tokens(record)
    assert len(tokens) == 6758
    assert tokens[0] == tokens[511] == 0 and tokens[512] == 1
    assert tokens[13 * 512] == tokens[-1] == 13
    assert tuple(tokens) == tuple(h for h in range(14) for _ in range(512))[:6758]


@given(
    ids=st.lists(st.integers(0, 2**40), min_size=1, max_size=12),
    block=st.integers(1, 9),
    extra=st.integers(-120, 20),
    offset=st.integers(0, 2**33),
)
def test_block_tokens_behaves_like_the_list(
    ids: list[int], block: int, extra: int, offset: int
) -> None:
    length = max(0, len(ids) * block + extra)
    lazy = mooncake_tokens(ids, length, block, token_offset=offset)
    expected = [(h + offset) % 2**32 for h in ids for _ in range(block)][:length]
    assert len(lazy) == len(expected)
    assert list(lazy) == expected
    assert lazy == tuple(expected) and lazy == expected
    assert hash(lazy) == hash(tuple(expected))
    if expected:
        assert lazy[-1] == expected[-1] and lazy[len(expected) // 2] == expected[len(expected) // 2]
    assert lazy[1:-1] == tuple(expected[1:-1])
    assert lazy[::3] == tuple(expected[::3])
    assert [t for chunk in lazy.chunks(5) for t in chunk] == expected
    assert all(len(c) == 5 for c in list(lazy.chunks(5))[:-1])


def test_block_tokens_bounds() -> None:
    tokens = BlockTokens([1, 2], 3, 5)
    with pytest.raises(IndexError):
        tokens[5]
    with pytest.raises(IndexError):
        tokens[-6]
    assert tokens[-5] == 1
    with pytest.raises(TraceError, match="outside 0..6"):
        BlockTokens([1, 2], 3, 7)
    with pytest.raises(TraceError, match="block_tokens"):
        mooncake_tokens([1], 1, 0)
    assert tokens != (1, 1, 1, 2)
    assert tokens == BlockTokens([1, 2, 9], 3, 5)

"""Readers for the public request traces the benchmarks replay, and Dynamo-style token synthesis.

Two formats are understood:

* **Mooncake FAST'25 JSONL** (``kvcache-ai/Mooncake`` ``FAST25-release/traces``): one JSON object
  per line with ``timestamp`` (milliseconds since the trace start), ``input_length``,
  ``output_length`` and ``hash_ids`` (chained prefix-block ids, 512 tokens per id). An optional
  ``session_id`` string (the Dynamo extension for multi-turn rows) is kept; other extra keys are
  ignored so that traces converted by other tools still load. A ``.jsonl.xz`` file is read
  through ``lzma``. The bundled agentic trace (``claude_code_agentic_64``, Claude Code sessions
  from kv-cache-tester) has the same four keys with **64** tokens per id
  (:data:`BUNDLED_BLOCK_TOKENS`), and its sessions are recovered from its ids
  (:mod:`kvroute.bench.trace_sessions`).
* **Azure LLM inference 2023 CSV** (``Azure/AzurePublicDataset``): ``TIMESTAMP,ContextTokens,
  GeneratedTokens``. Arrivals and lengths only; there is no prefix identity.

Both become :class:`TraceRecord` values. :func:`load_trace` adds what every replay needs: a stable
sort by arrival, ``limit`` (the first N arrivals), an offset so the first kept request arrives at
0 s, rate scaling and optional seeded jitter.

**Token synthesis** (:func:`mooncake_tokens`) follows Dynamo's mocker exactly
(``ai-dynamo/dynamo`` ``lib/mocker/src/loadgen/trace.rs``, ``TurnTrace::synthesize_tokens`` and
``Trace::from_mooncake``): hash id ``h`` becomes ``block_tokens`` copies of the token id
``h as u32`` (here ``(h + token_offset) mod 2**32``; Dynamo's offset is 0), the blocks are
concatenated and the list is truncated to ``input_length``. Two edge cases, handled as Dynamo does:

* the last id covers a partial block (every row of the bundled Mooncake traces has
  ``len(hash_ids) == ceil(input_length / 512)``): it contributes only the remaining tokens;
* ``input_length > len(hash_ids) * block_tokens`` (floor semantics: kv-cache-tester gives the
  tokens after the last whole block no id, so every agentic row has ``len(hash_ids) ==
  input_length // 64``): Dynamo clamps ``input_length`` to the ids' capacity. A replay here
  keeps the whole prompt instead: :meth:`Trace.tokens` gives the uncovered tokens one token id
  of the request's own (``tail_token``: above every hash id of the file, one per line), so the
  prompt is as long as the trace says and its tail never hits another request's cache.
  :func:`mooncake_tokens` without ``tail_token`` still clamps as Dynamo does;
  :func:`trace_stats` counts such rows in ``num_uncovered``.
  Ids beyond ``ceil(input_length / block_tokens)`` contribute nothing.

Token ids are therefore *not* drawn from the 100..32000 vocabulary the generators use: they are
the hash ids themselves, which keeps the map from trace block to token content one-to-one (the
conversation trace has 182,790 distinct ids; folding them into a 32k vocabulary would make
sibling blocks collide and invent cache hits). Engines re-hash these tokens at their own block
size; with an engine block size dividing 512, one shared trace block is exactly
``512 / engine_block_size`` engine-block hits.

Memory: the conversation trace is 145 M prompt tokens, so tokens are never materialised for a
whole trace. :class:`BlockTokens` is a lazy, immutable ``Sequence[int]`` of one request's tokens
(O(number of hash ids) memory, O(1) indexing).
"""

from __future__ import annotations

import csv
import hashlib
import lzma
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from importlib import resources
from importlib.resources.abc import Traversable
from itertools import chain, repeat
from pathlib import Path
from typing import Annotated, Final, Literal, overload

import msgspec

from kvroute.bench.trace_sessions import SessionRecoveryError, sessions_from_local_ids
from kvroute.core.errors import RouterError

__all__ = [
    "BUNDLED_BLOCK_TOKENS",
    "BUNDLED_TRACES",
    "MOONCAKE_BLOCK_TOKENS",
    "BlockTokens",
    "Trace",
    "TraceError",
    "TraceFormat",
    "TraceRecord",
    "TraceStats",
    "bundled_trace_path",
    "load_trace",
    "mooncake_tokens",
    "read_azure_csv",
    "read_mooncake_jsonl",
    "trace_block_tokens",
    "trace_stats",
    "verify_bundled_checksums",
]

TraceFormat = Literal["mooncake", "azure"]

MOONCAKE_BLOCK_TOKENS: Final = 512
"""Tokens per hash id in the Mooncake FAST'25 traces (paper appendix A.2)."""

BUNDLED_TRACES: Final[dict[str, tuple[str, TraceFormat]]] = {
    "mooncake_conversation": ("mooncake_conversation_trace.jsonl", "mooncake"),
    "mooncake_synthetic": ("mooncake_synthetic_trace.jsonl", "mooncake"),
    "azure_conv": ("azure_llm_2023_conv.csv", "azure"),
    "azure_code": ("azure_llm_2023_code.csv", "azure"),
    "claude_code_agentic_64": ("claude_code_agentic_64.jsonl.xz", "mooncake"),
}
"""Trace name -> (file in ``kvroute/data/traces``, format)."""

BUNDLED_BLOCK_TOKENS: Final[dict[str, int]] = {"claude_code_agentic_64": 64}
"""Bundled Mooncake-format traces whose ids are not 512 tokens: name -> tokens per id."""

_SESSIONS_FROM_LOCAL_IDS: Final = frozenset({"claude_code_agentic_64"})
"""Bundled traces whose ids are numbered per session (``bench.trace_sessions``)."""

_AZURE_HEADER: Final = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_U32: Final = 1 << 32
_EPOCH_ORDINAL: Final = datetime(1970, 1, 1).toordinal()


class TraceError(RouterError):
    """A trace is missing, unreadable or malformed, or a replay option is invalid.

    The message names the source, the 1-based line number and the field where that applies.
    """


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace.

    ``arrival_s`` is in seconds: as read, it is the file's own time base (Mooncake: ms / 1000;
    Azure: seconds since the file's first row); after :func:`load_trace` it is shifted so the
    first kept request is at 0 and divided by ``rate_scale``. ``hash_ids`` is ``None`` for
    formats without prefix identity. ``line`` is the 1-based line in the source file.
    """

    line: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None = None
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class Trace:
    """A loaded trace: records sorted by arrival, first arrival at 0 s."""

    name: str
    format: TraceFormat
    records: tuple[TraceRecord, ...]
    block_tokens: int | None
    """Tokens per hash id (Mooncake), ``None`` for formats without hash ids."""
    rate_scale: float = 1.0
    tail_token_base: int | None = None
    """One above every hash id of the whole file (``None`` without hash ids): the record of
    line ``L`` gives the tokens its ids do not cover the id ``tail_token_base + L``."""

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[TraceRecord]:
        return iter(self.records)

    def tokens(self, record: TraceRecord, *, token_offset: int = 0) -> BlockTokens:
        """The synthesized prompt tokens of one record (see :func:`mooncake_tokens`):
        ``input_length`` tokens, the tail its ids do not cover in a token of its own."""
        if record.hash_ids is None or self.block_tokens is None:
            raise TraceError(
                f"trace {self.name!r} ({self.format}) has no hash ids, so no tokens can be "
                "synthesized from it; generate prompts instead (bench.workloads.unique_prompts)"
            )
        tail = None if self.tail_token_base is None else self.tail_token_base + record.line
        return mooncake_tokens(
            record.hash_ids,
            record.input_length,
            self.block_tokens,
            token_offset=token_offset,
            tail_token=tail,
        )


# --------------------------------------------------------------------------------------------
# Lazy tokens


class BlockTokens(Sequence[int]):
    """The tokens ``[t0]*B + [t1]*B + ...`` truncated to ``length``: lazy and immutable.

    Invariant: ``0 <= length <= len(block_token_ids) * block_tokens``. Equality is element-wise
    against any sequence of ints (so ``BlockTokens(...) == tuple(...)`` works in tests) and the
    hash equals the hash of the equivalent tuple.
    """

    __slots__ = ("_block_tokens", "_blocks", "_length")

    def __init__(self, block_token_ids: Sequence[int], block_tokens: int, length: int) -> None:
        if block_tokens < 1:
            raise TraceError(f"block_tokens must be >= 1, got {block_tokens}")
        capacity = len(block_token_ids) * block_tokens
        if not 0 <= length <= capacity:
            raise TraceError(
                f"length {length} is outside 0..{capacity} "
                f"({len(block_token_ids)} blocks of {block_tokens} tokens)"
            )
        self._blocks = tuple(block_token_ids)
        self._block_tokens = block_tokens
        self._length = length

    @property
    def block_token_ids(self) -> tuple[int, ...]:
        """One token id per source block (including blocks the truncation left unused)."""
        return self._blocks

    @property
    def block_tokens(self) -> int:
        return self._block_tokens

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...
    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step == 1:
                return self._span(start, stop)
            blocks, size = self._blocks, self._block_tokens
            return tuple(blocks[i // size] for i in range(start, stop, step))
        i = index + self._length if index < 0 else index
        if not 0 <= i < self._length:
            raise IndexError(f"token index {index} out of range for {self._length} tokens")
        return self._blocks[i // self._block_tokens]

    def _span(self, start: int, stop: int) -> tuple[int, ...]:
        out: list[int] = []
        size = self._block_tokens
        pos = start
        while pos < stop:
            block = pos // size
            end = min(stop, (block + 1) * size)
            out.extend([self._blocks[block]] * (end - pos))
            pos = end
        return tuple(out)

    def __iter__(self) -> Iterator[int]:
        # Built from C-level iterators: list(tokens) of a 100k-token prompt must not run a
        # Python-level loop per token (the simulator copies every prompt once).
        size = self._block_tokens
        full, rest = divmod(self._length, size)
        blocks = self._blocks
        runs: Iterator[int] = chain.from_iterable(map(repeat, blocks[:full], repeat(size, full)))
        if rest:
            runs = chain(runs, repeat(blocks[full], rest))
        return runs

    def chunks(self, size: int) -> Iterator[tuple[int, ...]]:
        """Consecutive ``size``-token chunks; the last may be shorter. Faster than slicing."""
        if size < 1:
            raise TraceError(f"chunk size must be >= 1, got {size}")
        for start in range(0, self._length, size):
            yield self._span(start, min(start + size, self._length))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockTokens):
            if len(other) != self._length:
                return False
            if (other._blocks, other._block_tokens) == (self._blocks, self._block_tokens):
                return True
            return all(a == b for a, b in zip(self, other))
        if isinstance(other, (tuple, list)):
            return len(other) == self._length and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return (
            f"BlockTokens({len(self._blocks)} blocks x {self._block_tokens}, length={self._length})"
        )


def mooncake_tokens(
    hash_ids: Sequence[int],
    input_length: int,
    block_tokens: int,
    *,
    token_offset: int = 0,
    tail_token: int | None = None,
) -> BlockTokens:
    """Synthesize a Mooncake request's prompt as Dynamo's mocker does (see the module docstring).

    Each hash id becomes ``block_tokens`` copies of ``(h + token_offset) mod 2**32``, truncated to
    ``min(input_length, len(hash_ids) * block_tokens)`` tokens. ``token_offset`` (0 in Dynamo)
    can move the ids clear of an engine's special tokens while staying one-to-one.

    With ``tail_token``, the prompt is ``input_length`` tokens whatever the ids cover: the
    tokens beyond the ids are ``(tail_token + token_offset) mod 2**32`` (give each request its
    own, outside the trace's ids, so that the tail is never a cache hit).
    """
    if block_tokens < 1:
        raise TraceError(f"block_tokens must be >= 1 (512 for Mooncake), got {block_tokens}")
    if input_length < 0:
        raise TraceError(f"input_length must be >= 0, got {input_length}")
    ids = [(h + token_offset) % _U32 for h in hash_ids]
    covered = len(ids) * block_tokens
    if tail_token is None or input_length <= covered:
        return BlockTokens(ids, block_tokens, min(input_length, covered))
    tail_blocks = -(-(input_length - covered) // block_tokens)
    ids.extend(repeat((tail_token + token_offset) % _U32, tail_blocks))
    return BlockTokens(ids, block_tokens, input_length)


# --------------------------------------------------------------------------------------------
# Readers


class _MooncakeRow(msgspec.Struct):
    timestamp: Annotated[float, msgspec.Meta(ge=0)]
    input_length: Annotated[int, msgspec.Meta(ge=1)]
    output_length: Annotated[int, msgspec.Meta(ge=0)]
    hash_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=1)]
    session_id: str | None = None


_MOONCAKE_DECODER = msgspec.json.Decoder(_MooncakeRow)
_MOONCAKE_HINT = (
    "each line must be one JSON object with timestamp (ms, >= 0), input_length (int >= 1), "
    "output_length (int >= 0) and hash_ids (non-empty list of ints >= 0)"
)


def read_mooncake_jsonl(lines: Iterable[str], *, source: str = "<mooncake>") -> list[TraceRecord]:
    """Parse Mooncake JSONL lines into records (file order, ``arrival_s = timestamp / 1000``).

    Blank lines are skipped. Any malformed line raises :class:`TraceError` naming ``source``,
    the 1-based line number and the offending field; nothing is silently dropped.
    """
    records: list[TraceRecord] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = _MOONCAKE_DECODER.decode(line)
        except msgspec.ValidationError as exc:
            raise TraceError(f"{source} line {number}: {exc}; {_MOONCAKE_HINT}") from exc
        except msgspec.DecodeError as exc:
            raise TraceError(
                f"{source} line {number}: not valid JSON ({exc}); {_MOONCAKE_HINT}"
            ) from exc
        if not math.isfinite(row.timestamp):
            raise TraceError(f"{source} line {number}: timestamp must be finite; {_MOONCAKE_HINT}")
        records.append(
            TraceRecord(
                line=number,
                arrival_s=row.timestamp / 1000.0,
                input_length=row.input_length,
                output_length=row.output_length,
                hash_ids=tuple(row.hash_ids),
                session_id=row.session_id,
            )
        )
    if not records:
        raise TraceError(f"{source}: no requests found; {_MOONCAKE_HINT}")
    return records


def _parse_azure_time(text: str) -> tuple[int, float]:
    """``2023-11-16 18:17:03.9799600`` -> (whole seconds since the epoch, fraction).

    Parsed in two parts so that the 100 ns digits survive (a float of epoch seconds keeps only
    ~0.2 us); the time zone is irrelevant because only differences are used.
    """
    whole, _, frac = text.strip().partition(".")
    if len(whole) != 19:
        raise ValueError("expected 19 characters before the fraction")
    stamp = datetime.fromisoformat(whole)
    if frac and not frac.isdigit():
        raise ValueError(f"fractional seconds {frac!r} are not digits")
    seconds = (stamp.toordinal() - _EPOCH_ORDINAL) * 86400 + (
        stamp.hour * 3600 + stamp.minute * 60 + stamp.second
    )
    return seconds, (int(frac) / 10 ** len(frac) if frac else 0.0)


def read_azure_csv(lines: Iterable[str], *, source: str = "<azure>") -> list[TraceRecord]:
    """Parse an Azure LLM inference 2023 CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    ``arrival_s`` is seconds since the first data row (file order). ``ContextTokens`` must be an
    int >= 1 and ``GeneratedTokens`` an int >= 0; any other value raises :class:`TraceError`
    naming the line and column.
    """
    reader = csv.reader(lines)
    header = next(reader, None)
    if header is None or tuple(h.strip().lstrip("\ufeff") for h in header) != _AZURE_HEADER:
        raise TraceError(
            f"{source} line 1: header is {header!r}, expected {','.join(_AZURE_HEADER)} "
            "(the Azure LLM inference 2023/2024 schema)"
        )
    records: list[TraceRecord] = []
    base: tuple[int, float] | None = None
    for row in reader:
        number = reader.line_num
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) != 3:
            raise TraceError(
                f"{source} line {number}: {len(row)} columns, expected 3 "
                f"({','.join(_AZURE_HEADER)})"
            )
        try:
            stamp = _parse_azure_time(row[0])
        except ValueError as exc:
            raise TraceError(
                f"{source} line {number}: TIMESTAMP {row[0]!r} is not "
                f"'YYYY-MM-DD HH:MM:SS[.fraction]' ({exc})"
            ) from exc
        values: list[int] = []
        for column, cell, minimum in ((1, row[1], 1), (2, row[2], 0)):
            try:
                value = int(cell)
            except ValueError:
                value = minimum - 1
            if value < minimum:
                raise TraceError(
                    f"{source} line {number}: {_AZURE_HEADER[column]} {cell!r} must be an "
                    f"integer >= {minimum}"
                )
            values.append(value)
        if base is None:
            base = stamp
        arrival = (stamp[0] - base[0]) + (stamp[1] - base[1])
        records.append(TraceRecord(number, arrival, values[0], values[1]))
    if not records:
        raise TraceError(f"{source}: no data rows after the header")
    return records


# --------------------------------------------------------------------------------------------
# Locating and loading


def bundled_trace_path(name: str) -> Traversable:
    """The packaged file of a bundled trace (see :data:`BUNDLED_TRACES`)."""
    try:
        filename, _ = BUNDLED_TRACES[name]
    except KeyError:
        raise TraceError(
            f"unknown trace {name!r}; bundled traces are {sorted(BUNDLED_TRACES)}, "
            "or pass a path to a .jsonl or .jsonl.xz (Mooncake) or .csv (Azure) file"
        ) from None
    return resources.files("kvroute").joinpath("data", "traces", filename)


def trace_block_tokens(source: str | Path) -> int:
    """Tokens per hash id a Mooncake-format trace has unless told otherwise: the bundled
    trace's own (:data:`BUNDLED_BLOCK_TOKENS`), else Mooncake's 512."""
    if isinstance(source, str):
        return BUNDLED_BLOCK_TOKENS.get(source, MOONCAKE_BLOCK_TOKENS)
    return MOONCAKE_BLOCK_TOKENS


def verify_bundled_checksums() -> dict[str, bool]:
    """Check every bundled file against ``SHA256SUMS``: ``{filename: matches}``."""
    folder = resources.files("kvroute").joinpath("data", "traces")
    result: dict[str, bool] = {}
    for line in folder.joinpath("SHA256SUMS").read_text(encoding="ascii").splitlines():
        if not line.strip():
            continue
        digest, _, filename = line.strip().partition("  ")
        actual = hashlib.sha256(folder.joinpath(filename).read_bytes()).hexdigest()
        result[filename] = actual == digest
    return result


def _decode(data: bytes, *, compressed: bool, source: str) -> str:
    """A trace file's text: ``lzma``-decompressed first when its name ends in ``.xz``."""
    if compressed:
        try:
            data = lzma.decompress(data)
        except lzma.LZMAError as exc:
            raise TraceError(
                f"{source}: not a readable .xz file ({exc}); decompress it with xz -d and pass "
                "the .jsonl, or re-download it"
            ) from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{source}: not UTF-8 text ({exc})") from exc


def _resolve(source: str | Path, fmt: TraceFormat | None) -> tuple[str, TraceFormat, str]:
    """(name, format, text) for a bundled trace name or a file path (``.xz`` decompressed)."""
    if isinstance(source, str) and source in BUNDLED_TRACES:
        filename, bundled_format = BUNDLED_TRACES[source]
        text = _decode(
            bundled_trace_path(source).read_bytes(),
            compressed=filename.endswith(".xz"),
            source=source,
        )
        return source, fmt or bundled_format, text
    path = Path(source)
    if not path.is_file():
        raise TraceError(
            f"trace {str(source)!r} is neither a bundled trace {sorted(BUNDLED_TRACES)} "
            "nor an existing file"
        )
    compressed = path.suffix.lower() == ".xz"
    inner = path.with_suffix("") if compressed else path
    if fmt is None:
        suffix = inner.suffix.lower()
        if suffix in (".jsonl", ".json"):
            fmt = "mooncake"
        elif suffix == ".csv":
            fmt = "azure"
        else:
            raise TraceError(
                f"cannot tell the format of {str(path)!r} from its suffix (.jsonl, .jsonl.xz, "
                ".csv); pass format='mooncake' or format='azure'"
            )
    return inner.stem, fmt, _decode(path.read_bytes(), compressed=compressed, source=str(path))


def load_trace(
    source: str | Path,
    *,
    format: TraceFormat | None = None,
    rate_scale: float = 1.0,
    limit: int | None = None,
    block_tokens: int | None = None,
    jitter_s: float = 0.0,
    seed: int = 0,
    sessions: bool = True,
) -> Trace:
    """Load a bundled trace by name or a trace file by path, ready to replay.

    Steps, in order: parse (validating every line); recover sessions when the bundled trace's
    ids carry them and ``sessions`` is on (``claude_code_agentic_64``, see
    :mod:`kvroute.bench.trace_sessions`; rows that name their own session keep it); add
    seeded uniform jitter in ``[0, jitter_s)`` to each arrival if asked (the conversation trace
    quantises arrivals to 3-s buckets, up to 28 at once); stable-sort by arrival; keep the
    first ``limit`` requests; shift so the first arrival is 0; divide every arrival by
    ``rate_scale`` (2.0 = twice the request rate). ``block_tokens`` defaults to the trace's own
    (:func:`trace_block_tokens`: 64 for the agentic trace, else 512) and must be ``None`` for
    Azure.
    """
    if not (math.isfinite(rate_scale) and rate_scale > 0):
        raise TraceError(f"rate_scale must be a finite number > 0, got {rate_scale}")
    if limit is not None and limit < 1:
        raise TraceError(f"limit must be >= 1 or None, got {limit}")
    if not (math.isfinite(jitter_s) and jitter_s >= 0):
        raise TraceError(f"jitter_s must be a finite number >= 0, got {jitter_s}")
    name, fmt, text = _resolve(source, format)
    lines = text.splitlines()
    tail_base: int | None = None
    if fmt == "mooncake":
        records = read_mooncake_jsonl(lines, source=name)
        if block_tokens is not None and block_tokens < 1:
            raise TraceError(f"block_tokens must be >= 1 (512 for Mooncake), got {block_tokens}")
        tokens_per_id: int | None = block_tokens or trace_block_tokens(source)
        tail_base = 1 + max(max(r.hash_ids or (0,)) for r in records)
        if (
            sessions
            and source in _SESSIONS_FROM_LOCAL_IDS
            and all(r.session_id is None for r in records)
        ):
            records = _with_sessions(records, name)
    elif fmt == "azure":
        if block_tokens is not None:
            raise TraceError("block_tokens applies to Mooncake traces only; Azure has no hash ids")
        records = read_azure_csv(lines, source=name)
        tokens_per_id = None
    else:
        raise TraceError(f"unknown trace format {fmt!r}; use 'mooncake' or 'azure'")
    if jitter_s > 0:
        rng = random.Random(seed)
        records = [replace(r, arrival_s=r.arrival_s + rng.random() * jitter_s) for r in records]
    records.sort(key=lambda r: r.arrival_s)
    if limit is not None:
        records = records[:limit]
    start = records[0].arrival_s
    shifted = tuple(replace(r, arrival_s=(r.arrival_s - start) / rate_scale) for r in records)
    return Trace(name, fmt, shifted, tokens_per_id, rate_scale, tail_base)


def _with_sessions(records: list[TraceRecord], name: str) -> list[TraceRecord]:
    """``records`` with the sessions their ids carry (``bench.trace_sessions``)."""
    try:
        found = sessions_from_local_ids(
            [(r.line, r.hash_ids or ()) for r in records], prefix=f"{name}-s"
        )
    except SessionRecoveryError as exc:
        raise TraceError(f"{name}: {exc}") from exc
    return [replace(r, session_id=s) for r, s in zip(records, found)]


# --------------------------------------------------------------------------------------------
# Statistics


@dataclass(frozen=True, slots=True)
class TraceStats:
    """Summary of a trace, in the units of ``shared/reference/traces.md``.

    ``block_repeat_fraction`` is the share of hash-id occurrences already seen in an earlier
    request (file order): for chained ids, the block hit-rate bound of one infinite cache.
    ``num_uncovered`` counts the rows whose ids cover fewer than ``input_length`` tokens (their
    tail gets a token of its own, module docstring). Both are ``None`` for formats without
    hash ids.
    """

    num_requests: int
    duration_s: float
    mean_rate_rps: float
    total_input_tokens: int
    total_output_tokens: int
    block_repeat_fraction: float | None
    num_uncovered: int | None


def trace_stats(trace: Trace) -> TraceStats:
    records = trace.records
    duration = records[-1].arrival_s - records[0].arrival_s
    repeat: float | None = None
    uncovered: int | None = None
    if trace.block_tokens is not None:
        seen: set[int] = set()
        total = hits = uncovered = 0
        for r in sorted(records, key=lambda r: r.line):
            ids = r.hash_ids or ()
            total += len(ids)
            hits += sum(1 for h in ids if h in seen)
            seen.update(ids)
            if r.input_length > len(ids) * trace.block_tokens:
                uncovered += 1
        repeat = hits / total if total else 0.0
    return TraceStats(
        num_requests=len(records),
        duration_s=duration,
        mean_rate_rps=(len(records) - 1) / duration if duration > 0 else math.inf,
        total_input_tokens=sum(r.input_length for r in records),
        total_output_tokens=sum(r.output_length for r in records),
        block_repeat_fraction=repeat,
        num_uncovered=uncovered,
    )

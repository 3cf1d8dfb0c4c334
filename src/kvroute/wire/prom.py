"""Prometheus text exposition: a tolerant parser, the vLLM metrics kvroute reads, and a writer.

Owns three things:

* ``parse_exposition`` / ``parse_samples``: the Prometheus text format (version 0.0.4, as
  ``prometheus_client`` writes it, plus the OpenMetrics bits an engine may add: ``# EOF``,
  exemplars after ``#``). HELP/TYPE lines, label values with ``\\\\``, ``\\"`` and ``\\n``
  escapes, ``NaN``/``+Inf``/``-Inf``, optional millisecond timestamps.
* ``parse_vllm_metrics``: the handful of vLLM series the router uses for load and cache
  configuration (``vllm:num_requests_running`` ...), summed over the ``engine`` label
  (data-parallel ranks behind one API server) and filtered by ``model_name``.
* ``render_vllm_metrics``: the exposition the simulated engine serves on ``/metrics``, with
  vLLM's metric names, HELP strings, types, labels and bucket bounds, formatted exactly as
  ``prometheus_client`` formats them (labels sorted by name, Go-style float formatting).

Pure: no I/O, no clock. Timestamps such as ``_created`` values are passed in by the caller.

Malformed input policy
----------------------
A router must not stop routing because one engine's exposition has an odd line. Each line
that cannot be parsed is *skipped and counted*: ``Exposition.num_malformed`` and the first
``MAX_RECORDED_MALFORMED`` offending lines (with line number and reason) are returned so the
shell can log and export them. Nothing in this module raises on bad exposition text; the
caller decides whether "no usable vLLM series at all" is an error (``VllmMetrics.found``).

Names follow vLLM 0.32 (``vllm/v1/metrics/loggers.py``). Counters are declared without the
``_total`` suffix there and exposed with it; ``prometheus_client`` adds ``_created`` series
next to every counter and histogram unless created series are disabled.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "CACHE_CONFIG_INFO",
    "E2E_REQUEST_LATENCY_BUCKETS",
    "INTER_TOKEN_LATENCY_BUCKETS",
    "LORA_REQUESTS_INFO",
    "MAX_RECORDED_MALFORMED",
    "TIME_TO_FIRST_TOKEN_BUCKETS",
    "EngineStats",
    "Exposition",
    "HistogramValues",
    "MalformedLine",
    "Sample",
    "VllmMetrics",
    "format_float",
    "parse_exposition",
    "parse_samples",
    "parse_vllm_metrics",
    "render_vllm_metrics",
    "wanted_samples",
]

MAX_RECORDED_MALFORMED: Final = 20
"""How many malformed lines are kept verbatim (all of them are counted)."""

NUM_REQUESTS_RUNNING: Final = "vllm:num_requests_running"
NUM_REQUESTS_WAITING: Final = "vllm:num_requests_waiting"
KV_CACHE_USAGE_PERC: Final = "vllm:kv_cache_usage_perc"
GPU_CACHE_USAGE_PERC_LEGACY: Final = "vllm:gpu_cache_usage_perc"
PREFIX_CACHE_QUERIES_TOTAL: Final = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS_TOTAL: Final = "vllm:prefix_cache_hits_total"
NUM_PREEMPTIONS_TOTAL: Final = "vllm:num_preemptions_total"
CACHE_CONFIG_INFO: Final = "vllm:cache_config_info"
LORA_REQUESTS_INFO: Final = "vllm:lora_requests_info"

TIME_TO_FIRST_TOKEN_BUCKETS: Final[tuple[float, ...]] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
E2E_REQUEST_LATENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample line: ``name{labels} value [timestamp_ms]``."""

    name: str
    labels: Mapping[str, str]
    value: float
    timestamp_ms: int | None = None


@dataclass(frozen=True, slots=True)
class MalformedLine:
    """A line the parser skipped: 1-based line number, the text (cut to 200 chars), why."""

    line_number: int
    text: str
    reason: str


@dataclass(frozen=True, slots=True)
class Exposition:
    """A parsed exposition.

    Attributes:
        samples: every well-formed sample, in input order.
        types: metric family name → declared type (``counter``, ``gauge``, ``histogram``...).
        helps: metric family name → HELP text with escapes resolved.
        num_malformed: how many lines were skipped.
        malformed: the first ``MAX_RECORDED_MALFORMED`` skipped lines.
    """

    samples: tuple[Sample, ...]
    types: Mapping[str, str]
    helps: Mapping[str, str]
    num_malformed: int
    malformed: tuple[MalformedLine, ...]


_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|\})')
_LABEL_VALUE_ESCAPE = re.compile(r"\\(.)")
_FLOAT_RE = re.compile(r"[+-]?(?:\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)")
_SPECIAL_FLOATS: Final = {
    "NaN": math.nan, "nan": math.nan, "+Inf": math.inf, "Inf": math.inf, "inf": math.inf,
    "+inf": math.inf, "-Inf": -math.inf, "-inf": -math.inf,
}  # fmt: skip
_ESCAPES: Final = {"\\": "\\", '"': '"', "n": "\n"}


class _LineError(Exception):
    """Internal: why one line could not be parsed (never escapes this module)."""


def _unescape(text: str) -> str:
    if "\\" not in text:
        return text
    return _LABEL_VALUE_ESCAPE.sub(lambda m: _ESCAPES.get(m.group(1), "\\" + m.group(1)), text)


def _parse_float(text: str) -> float:
    special = _SPECIAL_FLOATS.get(text)
    if special is not None:
        return special
    if _FLOAT_RE.fullmatch(text) is None:
        raise _LineError(f"value {text!r} is not a number")
    return float(text)


def _parse_sample_line(line: str) -> Sample:
    match = _NAME_RE.match(line)
    if match is None:
        raise _LineError("does not start with a metric name")
    name = match.group(0)
    pos = match.end()
    labels: dict[str, str] = {}
    if pos < len(line) and line[pos] == "{":
        pos += 1
        rest = line[pos:].lstrip()
        if rest.startswith("}"):
            pos = len(line) - len(rest) + 1
        else:
            while True:
                lm = _LABEL_RE.match(line, pos)
                if lm is None:
                    raise _LineError('bad label set (expected name="value" pairs in {})')
                labels[lm.group(1)] = _unescape(lm.group(2))
                pos = lm.end()
                if lm.group(3) == "}":
                    break
                # A trailing comma before "}" is allowed.
                tail = line[pos:].lstrip()
                if tail.startswith("}"):
                    pos = len(line) - len(tail) + 1
                    break
    rest_text = line[pos:]
    if rest_text and not rest_text[0].isspace():
        raise _LineError("no whitespace between the metric and its value")
    fields = rest_text.split()
    if "#" in fields:  # OpenMetrics exemplar: "value [ts] # {labels} value [ts]"
        fields = fields[: fields.index("#")]
    if not fields:
        raise _LineError("missing value")
    if len(fields) > 2:
        raise _LineError("unexpected text after the value and timestamp")
    value = _parse_float(fields[0])
    timestamp_ms: int | None = None
    if len(fields) == 2:
        ts = fields[1]
        try:
            timestamp_ms = int(ts)
        except ValueError:
            raise _LineError(f"timestamp {ts!r} is not an integer") from None
    return Sample(name, labels, value, timestamp_ms)


def _iter_lines(text: str) -> Iterable[tuple[int, str]]:
    for number, raw in enumerate(text.split("\n"), start=1):
        yield number, raw.rstrip("\r")


def parse_exposition(text: str, *, names: Iterable[str] | None = None) -> Exposition:
    """Parse Prometheus text exposition, skipping and counting malformed lines.

    Args:
        text: the body of a ``/metrics`` response.
        names: if given, only samples whose name starts with one of these strings are parsed
            (a cheap prefix test per line; other lines are not even validated). HELP and TYPE
            lines are always read.

    Returns:
        The samples, declared types and HELP texts, and the malformed lines.
    """
    prefixes = tuple(names) if names is not None else None
    samples: list[Sample] = []
    types: dict[str, str] = {}
    helps: dict[str, str] = {}
    malformed: list[MalformedLine] = []
    num_malformed = 0
    for number, line in _iter_lines(text):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped[0] == "#":
            parts = stripped.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                if parts[1] == "TYPE":
                    types[parts[2]] = parts[3].strip() if len(parts) == 4 else "untyped"
                else:
                    helps[parts[2]] = _unescape(parts[3]) if len(parts) == 4 else ""
            continue  # other comments, "# EOF", "# UNIT"
        if prefixes is not None and not stripped.startswith(prefixes):
            continue
        try:
            samples.append(_parse_sample_line(stripped))
        except _LineError as exc:
            num_malformed += 1
            if len(malformed) < MAX_RECORDED_MALFORMED:
                malformed.append(MalformedLine(number, stripped[:200], str(exc)))
    return Exposition(tuple(samples), types, helps, num_malformed, tuple(malformed))


@functools.cache
def _name_matcher(prefixes: tuple[str, ...]) -> re.Pattern[str]:
    """Occurrences of any of ``prefixes`` and the rest of their line.

    The alternatives are written behind their common leading text (``vllm:``), so the
    regular expression engine scans for that literal in C instead of trying every position;
    ``wanted_samples`` keeps the occurrences that start a line.
    """
    lo, hi = min(prefixes), max(prefixes)  # the common prefix of all is theirs
    size = 0
    while size < min(len(lo), len(hi)) and lo[size] == hi[size]:
        size += 1
    common = lo[:size]
    rest = "|".join(re.escape(p[len(common):]) for p in prefixes)
    return re.compile(rf"{re.escape(common)}(?:{rest})[^\n]*")


def wanted_samples(text: str, names: tuple[str, ...]) -> tuple[list[Sample], int]:
    """The samples ``parse_exposition(text, names=names)`` gives, and its ``num_malformed``,
    without walking the other lines in Python.

    A real vLLM ``/metrics`` is hundreds of lines (histograms, process series) of which the
    router reads a handful, every ``metrics_interval_s`` for every replica; a regular
    expression finds those names in C, and only the lines they start are parsed (an
    occurrence inside a comment or a label value is not at a line's start, after blanks).
    HELP and TYPE lines are not read (use ``parse_exposition`` for them). A test checks the
    two agree on generated expositions.
    """
    samples: list[Sample] = []
    num_malformed = 0
    for match in _name_matcher(names).finditer(text):
        start = match.start()
        line_start = text.rfind("\n", 0, start) + 1
        if line_start != start and not text[line_start:start].isspace():
            continue  # inside a line: a comment, a label value, a longer name's tail
        try:
            samples.append(_parse_sample_line(match.group().strip()))
        except _LineError:
            num_malformed += 1
    return samples, num_malformed


def parse_samples(text: str) -> list[Sample]:
    """Every well-formed sample of an exposition, in order (malformed lines skipped)."""
    return list(parse_exposition(text).samples)


@dataclass(frozen=True, slots=True)
class VllmMetrics:
    """What kvroute reads from one vLLM API server's ``/metrics``.

    Gauges and counters are summed over the ``engine`` label (data-parallel ranks), except
    ``kv_cache_usage_perc``: each rank has its own equally sized KV pool, so the server-wide
    usage is the *mean* over ranks (a sum could exceed 1). A field is None when the server
    exposed no matching series, so "absent" is never confused with 0.

    Attributes:
        num_requests_running: requests in the running batch, summed over engines.
        num_requests_waiting: requests waiting, summed over engines.
        kv_cache_usage_perc: mean KV-cache usage, 0..1 (falls back to the pre-0.10 name
            ``vllm:gpu_cache_usage_perc``).
        kv_cache_usage_by_engine: usage per ``engine`` label value.
        prefix_cache_queries_total: queried tokens, summed over engines (a counter).
        prefix_cache_hits_total: cached (hit) tokens, summed over engines (a counter).
        num_preemptions_total: preemptions, summed over engines (a counter).
        block_size: from ``vllm:cache_config_info``; None if absent or not an integer.
        prefix_caching_hash_algo: e.g. ``"sha256"``, from ``vllm:cache_config_info``.
        enable_prefix_caching: from ``vllm:cache_config_info`` (``"True"``/``"False"``).
        cache_config: all labels of the first ``vllm:cache_config_info`` series.
        engines: the ``engine`` label values seen, sorted.
        model_names: the ``model_name`` label values seen (before filtering), sorted.
        num_malformed: malformed lines skipped while parsing.
        lora_max: ``max_lora`` of ``vllm:lora_requests_info`` (adapters one batch can hold);
            None when the engine runs without ``--enable-lora``.
        lora_running / lora_waiting: the adapters of the running and the waiting requests
            in that series' newest label set (vLLM sets a new label set to the current time
            at every step and never removes the old ones, so the newest value wins).
    """

    num_requests_running: float | None = None
    num_requests_waiting: float | None = None
    kv_cache_usage_perc: float | None = None
    kv_cache_usage_by_engine: Mapping[str, float] = field(default_factory=dict)
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None
    num_preemptions_total: float | None = None
    block_size: int | None = None
    prefix_caching_hash_algo: str | None = None
    enable_prefix_caching: bool | None = None
    cache_config: Mapping[str, str] = field(default_factory=dict)
    engines: tuple[str, ...] = ()
    model_names: tuple[str, ...] = ()
    num_malformed: int = 0
    lora_max: int | None = None
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()

    @property
    def found(self) -> bool:
        """True if at least one load series (running or waiting) was present."""
        return self.num_requests_running is not None or self.num_requests_waiting is not None


_VLLM_WANTED: Final = (
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    KV_CACHE_USAGE_PERC,
    GPU_CACHE_USAGE_PERC_LEGACY,
    PREFIX_CACHE_QUERIES_TOTAL,
    PREFIX_CACHE_HITS_TOTAL,
    NUM_PREEMPTIONS_TOTAL,
    CACHE_CONFIG_INFO,
    LORA_REQUESTS_INFO,
)
_SUMMED: Final = {
    NUM_REQUESTS_RUNNING: "num_requests_running",
    NUM_REQUESTS_WAITING: "num_requests_waiting",
    PREFIX_CACHE_QUERIES_TOTAL: "prefix_cache_queries_total",
    PREFIX_CACHE_HITS_TOTAL: "prefix_cache_hits_total",
    NUM_PREEMPTIONS_TOTAL: "num_preemptions_total",
}


def _parse_bool(text: str | None) -> bool | None:
    if text is None:
        return None
    lowered = text.strip().lower()
    if lowered in ("true", "1"):
        return True
    if lowered in ("false", "0"):
        return False
    return None


def parse_vllm_metrics(text: str, model_name: str | None = None,
                       engine: str | None = None) -> VllmMetrics:
    """Read the vLLM series kvroute uses out of a ``/metrics`` body.

    Args:
        text: the exposition text.
        model_name: keep only series whose ``model_name`` label equals this (series without
            a ``model_name`` label, such as ``vllm:cache_config_info``, always match). None
            keeps every model's series and sums them.
        engine: keep only series whose ``engine`` label (the data-parallel rank) equals this
            (series without the label always match): one rank's load out of a DP server's
            exposition. None sums every rank.

    Returns:
        The metrics; see ``VllmMetrics`` for how engines are combined. Never raises on odd
        exposition text: malformed lines are counted in ``num_malformed``.
    """
    samples, num_malformed = wanted_samples(text, _VLLM_WANTED)
    sums: dict[str, float] = {}
    usage: dict[str, float] = {}
    legacy_usage: dict[str, float] = {}
    engines: set[str] = set()
    models: set[str] = set()
    cache_config: dict[str, str] | None = None
    lora: tuple[float, Mapping[str, str]] | None = None
    for sample in samples:
        name = sample.name
        if name not in _VLLM_WANTED:  # a longer name that shares a wanted prefix
            continue
        labels = sample.labels
        sample_model = labels.get("model_name")
        if sample_model is not None:
            models.add(sample_model)
            if model_name is not None and sample_model != model_name:
                continue
        rank = labels.get("engine", "")
        if "engine" in labels:
            engines.add(rank)
            if engine is not None and rank != engine:
                continue
        if name == CACHE_CONFIG_INFO:
            if cache_config is None:
                cache_config = dict(labels)
        elif name == LORA_REQUESTS_INFO:
            if lora is None or sample.value > lora[0]:
                lora = (sample.value, labels)
        elif name == KV_CACHE_USAGE_PERC:
            usage[rank] = usage.get(rank, 0.0) + sample.value
        elif name == GPU_CACHE_USAGE_PERC_LEGACY:
            legacy_usage[rank] = legacy_usage.get(rank, 0.0) + sample.value
        else:
            key = _SUMMED[name]
            sums[key] = sums.get(key, 0.0) + sample.value
    by_engine = usage or legacy_usage
    mean_usage = sum(by_engine.values()) / len(by_engine) if by_engine else None
    config = cache_config or {}
    block_size_text = config.get("block_size")
    block_size = int(block_size_text) if block_size_text and block_size_text.isdigit() else None
    return VllmMetrics(
        num_requests_running=sums.get("num_requests_running"),
        num_requests_waiting=sums.get("num_requests_waiting"),
        kv_cache_usage_perc=mean_usage,
        kv_cache_usage_by_engine=dict(by_engine),
        prefix_cache_queries_total=sums.get("prefix_cache_queries_total"),
        prefix_cache_hits_total=sums.get("prefix_cache_hits_total"),
        num_preemptions_total=sums.get("num_preemptions_total"),
        block_size=block_size,
        prefix_caching_hash_algo=config.get("prefix_caching_hash_algo"),
        enable_prefix_caching=_parse_bool(config.get("enable_prefix_caching")),
        cache_config=config,
        engines=tuple(sorted(engines)),
        model_names=tuple(sorted(models)),
        num_malformed=num_malformed,
        **_lora_fields(lora[1] if lora is not None else None),
    )


def _lora_fields(labels: Mapping[str, str] | None) -> dict[str, Any]:
    """``vllm:lora_requests_info``'s labels as ``VllmMetrics`` fields (comma-joined names)."""
    if labels is None:
        return {}
    max_text = labels.get("max_lora", "")
    return {
        "lora_max": int(max_text) if max_text.isdigit() else None,
        "lora_running": tuple(n for n in labels.get("running_lora_adapters", "").split(",") if n),
        "lora_waiting": tuple(n for n in labels.get("waiting_lora_adapters", "").split(",") if n),
    }


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def format_float(value: float) -> str:
    """Format a sample value the way ``prometheus_client`` does (Go's formatting rules).

    ``5.0`` stays ``5.0``; ``+Inf``/``-Inf``/``NaN`` are spelled out; large positive numbers
    switch to an exponent sooner than Python's ``repr`` (``1795949116.8`` → ``1.7959491168e+09``).
    """
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(float(value))
    dot = text.find(".")
    if value > 0 and dot > 6 and "e" not in text:
        digits = (text[:dot] + text[dot + 1 :]).rstrip("0")
        mantissa = (digits[0] + "." + digits[1:]).rstrip(".")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def _escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels_text(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape_label_value(v)}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


@dataclass(slots=True)
class HistogramValues:
    """A histogram's state: per-bucket counts (not cumulative), sum and count.

    Invariant: ``len(counts) == len(bounds) + 1``; the last slot is the ``+Inf`` bucket, and
    ``count == sum(counts)``.
    """

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(self.bounds):
            raise ValueError(f"histogram bounds must be increasing, got {self.bounds}")
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        elif len(self.counts) != len(self.bounds) + 1:
            raise ValueError(
                f"histogram needs {len(self.bounds) + 1} counts (one per bound plus +Inf), "
                f"got {len(self.counts)}"
            )

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float) -> None:
        """Record one observation (a value equal to a bound falls in that bound's bucket)."""
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.total += value


def _ttft() -> HistogramValues:
    return HistogramValues(TIME_TO_FIRST_TOKEN_BUCKETS)


def _itl() -> HistogramValues:
    return HistogramValues(INTER_TOKEN_LATENCY_BUCKETS)


def _e2e() -> HistogramValues:
    return HistogramValues(E2E_REQUEST_LATENCY_BUCKETS)


@dataclass(slots=True)
class EngineStats:
    """What the simulated engine reports for one ``engine`` label (one data-parallel rank).

    Counters are cumulative since the engine started. ``request_success`` maps vLLM's
    ``finished_reason`` label values (``stop``, ``length``, ``abort``, ``error``) to counts.
    """

    engine: int = 0
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_requests_waiting_deferred: int = 0
    kv_cache_usage_perc: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    generation_tokens: int = 0
    request_success: dict[str, int] = field(default_factory=dict)
    time_to_first_token_seconds: HistogramValues = field(default_factory=_ttft)
    inter_token_latency_seconds: HistogramValues = field(default_factory=_itl)
    e2e_request_latency_seconds: HistogramValues = field(default_factory=_e2e)


_FINISH_REASONS: Final = ("stop", "length", "abort", "error")

# (name as declared in vLLM, type, HELP) in vLLM's registration order.
_HELP: Final = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:num_requests_waiting_by_reason": (
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
        "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
        "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting."
    ),
    "vllm:engine_sleep_state": (
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
        "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2."
    ),
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:num_preemptions": "Cumulative number of preemption from the engine.",
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:prompt_tokens_cached": "Number of cached prompt tokens (local + external).",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:request_success": "Count of successfully processed requests.",
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "vllm:cache_config_info": "Information of the LLMEngine CacheConfig",
}


class _Writer:
    __slots__ = ("created_s", "lines")

    def __init__(self, created_s: float | None) -> None:
        self.lines: list[str] = []
        self.created_s = created_s

    def header(self, name: str, kind: str, help_name: str) -> None:
        self.lines.append(f"# HELP {name} {_escape_help(_HELP[help_name])}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: Mapping[str, str], value: float) -> None:
        self.lines.append(f"{name}{_labels_text(labels)} {format_float(value)}")

    def gauge(self, name: str, rows: Sequence[tuple[Mapping[str, str], float]]) -> None:
        self.header(name, "gauge", name)
        for labels, value in rows:
            self.sample(name, labels, value)

    def counter(self, name: str, rows: Sequence[tuple[Mapping[str, str], float]]) -> None:
        self.header(name + "_total", "counter", name)
        for labels, value in rows:
            self.sample(name + "_total", labels, value)
        self._created(name, [labels for labels, _ in rows])

    def histogram(
        self, name: str, rows: Sequence[tuple[Mapping[str, str], HistogramValues]]
    ) -> None:
        self.header(name, "histogram", name)
        for labels, hist in rows:
            cumulative = 0
            for bound, count in zip(hist.bounds, hist.counts, strict=False):
                cumulative += count
                le = {**labels, "le": format_float(bound)}
                self.sample(name + "_bucket", le, cumulative)
            self.sample(name + "_bucket", {**labels, "le": "+Inf"}, hist.count)
            self.sample(name + "_count", labels, hist.count)
            self.sample(name + "_sum", labels, hist.total)
        self._created(name, [labels for labels, _ in rows])

    def _created(self, name: str, label_sets: Sequence[Mapping[str, str]]) -> None:
        if self.created_s is None:
            return
        self.lines.append(f"# HELP {name}_created {_escape_help(_HELP[name])}")
        self.lines.append(f"# TYPE {name}_created gauge")
        for labels in label_sets:
            self.sample(name + "_created", labels, self.created_s)


def render_vllm_metrics(
    engines: Sequence[EngineStats],
    *,
    model_name: str,
    cache_config: Mapping[str, str],
    created_s: float | None = None,
) -> str:
    """Render a ``/metrics`` body as a vLLM 0.32 API server would serve it.

    Args:
        engines: one entry per data-parallel rank (``engine`` label ``"0"``, ``"1"``...).
        model_name: the served model name (``model_name`` label).
        cache_config: labels of ``vllm:cache_config_info`` (vLLM emits every ``CacheConfig``
            field as a string, e.g. ``block_size="16"``, ``enable_prefix_caching="True"``,
            ``prefix_caching_hash_algo="sha256"``); an ``engine`` label is added per rank, and
            no ``model_name`` label, as vLLM does.
        created_s: if given, the ``_created`` series ``prometheus_client`` adds for counters
            and histograms, with this Unix time; None leaves them out.

    Returns:
        The exposition text, ending with a newline.
    """
    w = _Writer(created_s)

    def per_engine(value_of: str) -> list[tuple[Mapping[str, str], float]]:
        return [(_base(e), float(getattr(e, value_of))) for e in engines]

    def _base(e: EngineStats) -> dict[str, str]:
        return {"engine": str(e.engine), "model_name": model_name}

    w.gauge("vllm:num_requests_running", per_engine("num_requests_running"))
    w.gauge("vllm:num_requests_waiting", per_engine("num_requests_waiting"))
    by_reason: list[tuple[Mapping[str, str], float]] = []
    for e in engines:
        capacity = max(e.num_requests_waiting - e.num_requests_waiting_deferred, 0)
        by_reason.append(({**_base(e), "reason": "capacity"}, float(capacity)))
        by_reason.append(
            ({**_base(e), "reason": "deferred"}, float(e.num_requests_waiting_deferred))
        )
    w.gauge("vllm:num_requests_waiting_by_reason", by_reason)
    sleep_rows: list[tuple[Mapping[str, str], float]] = []
    for state, value in (("awake", 1.0), ("weights_offloaded", 0.0), ("discard_all", 0.0)):
        sleep_rows.extend(({**_base(e), "sleep_state": state}, value) for e in engines)
    w.gauge("vllm:engine_sleep_state", sleep_rows)
    w.gauge("vllm:kv_cache_usage_perc", per_engine("kv_cache_usage_perc"))
    w.counter("vllm:prefix_cache_queries", per_engine("prefix_cache_queries"))
    w.counter("vllm:prefix_cache_hits", per_engine("prefix_cache_hits"))
    w.counter("vllm:num_preemptions", per_engine("num_preemptions"))
    w.counter("vllm:prompt_tokens", per_engine("prompt_tokens"))
    w.counter("vllm:prompt_tokens_cached", per_engine("prompt_tokens_cached"))
    w.counter("vllm:generation_tokens", per_engine("generation_tokens"))
    success_rows: list[tuple[Mapping[str, str], float]] = []
    for reason in _FINISH_REASONS:
        success_rows.extend(
            ({**_base(e), "finished_reason": reason}, float(e.request_success.get(reason, 0)))
            for e in engines
        )
    w.counter("vllm:request_success", success_rows)
    w.histogram(
        "vllm:time_to_first_token_seconds",
        [(_base(e), e.time_to_first_token_seconds) for e in engines],
    )
    w.histogram(
        "vllm:inter_token_latency_seconds",
        [(_base(e), e.inter_token_latency_seconds) for e in engines],
    )
    w.histogram(
        "vllm:e2e_request_latency_seconds",
        [(_base(e), e.e2e_request_latency_seconds) for e in engines],
    )
    w.gauge(
        "vllm:cache_config_info",
        [({**cache_config, "engine": str(e.engine)}, 1.0) for e in engines],
    )
    return "\n".join(w.lines) + "\n"

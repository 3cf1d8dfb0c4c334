"""The gate's shadow replay, scored: transcripts, per-token comparison, per-class verdicts.

A pair passes the transfer-fidelity gate (``core/gate.py``) only when the candidate path
(a prefix-cache hit, another engine's weights, a shared store, a lossy KV setting) answers
as the native path (recompute on the serving weights, cache bypassed) does. The shell
(``shell/shadow_replay.py``) replays multi-turn transcripts through both at temperature 0;
this module holds everything that is not I/O:

* :class:`Transcript` and :func:`parse_transcripts`: the JSONL file format (one transcript a
  line: ``id``, workload ``class``, optional ``system``, ``turns`` of user messages,
  optional ``max_tokens``), read with errors that name the line and the fix;
* :func:`compare_turn`: one turn's greedy continuations token by token: exact match, the
  first divergence, top-1 agreement and the largest ``|Δ logprob|`` over the tokens both
  sides list in their top-k, compared only while both sides have seen the same tokens (after
  a divergence the contexts differ and the logprobs say nothing about the path);
* :func:`score_classes`: every turn weighted toward late turns (turn ``i`` of ``n`` weighs
  ``i + 1``: a transferred cache matters most deep in a conversation, where it holds the
  most state), summed **per workload class**, each class judged against the thresholds;
  the verdict passes only when every class does, and is never reported as one aggregate;
* :func:`policy_changes`: the cache-policy audit's comparison (a run whose engines' cache
  settings or weights changed is void: it records no verdict).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "CACHE_POLICY_KEYS",
    "CLASS_METRICS",
    "ClassScore",
    "Thresholds",
    "TokenStep",
    "Transcript",
    "TranscriptError",
    "TurnComparison",
    "compare_turn",
    "parse_thresholds",
    "parse_transcripts",
    "policy_changes",
    "score_classes",
    "turn_weight",
    "verdict_scores",
]

DEFAULT_MAX_TOKENS: Final = 16
MAX_TURNS: Final = 64
CLASS_METRICS: Final = ("exact_match", "top1_agreement", "max_dlogprob", "mean_dlogprob",
                        "turns")
"""The scores kept per class in a verdict (``<class>.<metric>``)."""
CACHE_POLICY_KEYS: Final = (
    "block_size", "cache_dtype", "kv_cache_dtype", "enable_prefix_caching",
    "prefix_caching_hash_algo", "calculate_kv_scales", "sliding_window",
    "kv_offloading_backend", "kv_offloading_size", "cpu_offload_gb", "mamba_cache_dtype")
"""The ``vllm:cache_config_info`` labels that change what a cached block holds or whether it
is reused (memory sizes and block counts are left out: they change nothing in a block). The
cache-policy audit records them per side with a verdict (``<side>.<key>``)."""


class TranscriptError(ValueError):
    """A transcript file line is not a transcript (the message names the line and the fix)."""


@dataclass(frozen=True, slots=True)
class Transcript:
    """One multi-turn conversation to replay.

    Attributes:
        id: unique name within the file.
        workload: its workload class (``extraction``, ``code``, ``reasoning``...): scores
            are reported per class.
        system: the system prompt, if any.
        turns: the user messages, in order; each turn's answer (the native path's) joins the
            conversation before the next.
        max_tokens: the greedy continuation's length per turn.
    """

    id: str
    workload: str
    system: str | None
    turns: tuple[str, ...]
    max_tokens: int = DEFAULT_MAX_TOKENS


def parse_transcripts(text: str, source: str = "transcripts") -> list[Transcript]:
    """Transcripts from JSONL text (blank lines and lines starting with ``#`` skipped).

    Raises:
        TranscriptError: a line is not JSON, misses a field, repeats an id, or the file
            holds no transcript.
    """
    out: list[Transcript] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"{source} line {number}"
        try:
            item = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise TranscriptError(f"{where}: not JSON ({exc}); one transcript object a line")
        transcript = _transcript(item, where)
        if transcript.id in seen:
            raise TranscriptError(f"{where}: id {transcript.id!r} repeats; ids must be unique")
        seen.add(transcript.id)
        out.append(transcript)
    if not out:
        raise TranscriptError(f"{source} holds no transcript; write one JSON object a line: "
                              '{"id": ..., "class": ..., "turns": ["...", ...]}')
    return out


def _transcript(item: Any, where: str) -> Transcript:
    if not isinstance(item, dict):
        raise TranscriptError(f"{where}: a transcript is a JSON object, got "
                              f"{type(item).__name__}")
    unknown = set(item) - {"id", "class", "system", "turns", "max_tokens"}
    if unknown:
        raise TranscriptError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; "
                              "use id, class, system, turns, max_tokens")
    for name in ("id", "class"):
        if not isinstance(item.get(name), str) or not item[name]:
            raise TranscriptError(f"{where}: {name!r} must be a non-empty string")
    system = item.get("system")
    if system is not None and not isinstance(system, str):
        raise TranscriptError(f"{where}: 'system' must be a string when given")
    turns = item.get("turns")
    if (not isinstance(turns, list) or not turns or len(turns) > MAX_TURNS
            or not all(isinstance(t, str) and t for t in turns)):
        raise TranscriptError(f"{where}: 'turns' must be a list of 1 to {MAX_TURNS} "
                              "non-empty user messages")
    max_tokens = item.get("max_tokens", DEFAULT_MAX_TOKENS)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not (
            1 <= max_tokens <= 4096):
        raise TranscriptError(f"{where}: 'max_tokens' must be an integer from 1 to 4096")
    return Transcript(item["id"], item["class"], system, tuple(turns), max_tokens)


@dataclass(frozen=True, slots=True)
class TokenStep:
    """One generated token with its logprob and the top-k alternatives (token → logprob)."""

    token: str
    logprob: float
    top: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TurnComparison:
    """One turn of one transcript, native against candidate.

    Attributes:
        transcript / workload / turn / num_turns: which turn (``turn`` counts from 0).
        exact: the two greedy continuations are the same tokens.
        first_divergence: the position of the first differing token (a continuation that
            ends earlier differs there), None when exact.
        compared: positions compared (up to and including the first divergence).
        top1_agree: of those, positions whose chosen tokens agree.
        max_dlogprob: the largest ``|Δ logprob|`` over tokens both top-k lists hold at a
            compared position (0.0 when nothing was shared).
        sum_dlogprob / num_dlogprob: for the mean.
        candidate_cached_tokens: prompt tokens the candidate served from cache (None when
            the engine did not say), so a report shows the path was really taken.
    """

    transcript: str
    workload: str
    turn: int
    num_turns: int
    exact: bool
    first_divergence: int | None
    compared: int
    top1_agree: int
    max_dlogprob: float
    sum_dlogprob: float
    num_dlogprob: int
    candidate_cached_tokens: int | None = None


def compare_turn(transcript: Transcript, turn: int, native: Sequence[TokenStep],
                 candidate: Sequence[TokenStep], *,
                 candidate_cached_tokens: int | None = None) -> TurnComparison:
    """Compare one turn's continuations (module docstring)."""
    first: int | None = None
    compared = agree = num_d = 0
    max_d = sum_d = 0.0
    for pos in range(max(len(native), len(candidate))):
        if pos >= len(native) or pos >= len(candidate):
            first = pos
            break
        a, b = native[pos], candidate[pos]
        compared += 1
        agree += a.token == b.token
        shared = {a.token: a.logprob} | dict(a.top)
        other = {b.token: b.logprob} | dict(b.top)
        for token in shared.keys() & other.keys():
            d = abs(shared[token] - other[token])
            if math.isfinite(d):
                max_d = max(max_d, d)
                sum_d += d
                num_d += 1
        if a.token != b.token:
            first = pos
            break
    return TurnComparison(transcript.id, transcript.workload, turn, len(transcript.turns),
                          first is None, first, compared, agree, max_d, sum_d, num_d,
                          candidate_cached_tokens)


def turn_weight(turn: int, num_turns: int) -> float:
    """Turn ``turn`` (from 0) of ``num_turns`` weighs ``turn + 1``: late turns count most."""
    if not 0 <= turn < num_turns:
        raise ValueError(f"turn {turn} outside a {num_turns}-turn transcript")
    return float(turn + 1)


@dataclass(frozen=True, slots=True)
class Thresholds:
    """What a workload class must reach to pass (every class must).

    Attributes:
        min_exact_match: the late-weighted share of turns whose continuations are identical.
        min_top1_agreement: the late-weighted share of compared positions whose chosen
            tokens agree.
        max_dlogprob: the largest ``|Δ logprob|`` (nats) allowed at any compared position.
    """

    min_exact_match: float = 1.0
    min_top1_agreement: float = 1.0
    max_dlogprob: float = 0.05

    def __post_init__(self) -> None:
        for name in ("min_exact_match", "min_top1_agreement"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {value}")
        if not self.max_dlogprob >= 0.0:
            raise ValueError(f"max_dlogprob must be >= 0, got {self.max_dlogprob}")


def parse_thresholds(data: Mapping[str, Any]) -> tuple[Thresholds, dict[str, Thresholds]]:
    """The ``thresholds`` of a gate config: defaults for every class, then ``classes``
    overriding them per class (``{min_exact_match, min_top1_agreement, max_dlogprob,
    classes: {code: {...}}}``).

    Raises:
        ValueError: an unknown key or a value out of range (the message names it).
    """
    names = {"min_exact_match", "min_top1_agreement", "max_dlogprob"}

    def one(part: Mapping[str, Any], base: Thresholds, where: str) -> Thresholds:
        if not isinstance(part, Mapping):
            raise ValueError(  # noqa: TRY004 - bad config content, not a caller type error
                f"{where} must be a mapping of {', '.join(sorted(names))}")
        unknown = set(part) - names - ({"classes"} if where == "thresholds" else set())
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; use "
                             f"{', '.join(sorted(names))}")
        values = {"min_exact_match": base.min_exact_match,
                  "min_top1_agreement": base.min_top1_agreement,
                  "max_dlogprob": base.max_dlogprob}
        for key in names & set(part):
            value = part[key]
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(  # noqa: TRY004 - bad config content
                    f"{where}.{key} must be a number, got {value!r}")
            values[key] = float(value)
        try:
            return Thresholds(**values)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc

    default = one(data, Thresholds(), "thresholds")
    classes = data.get("classes", {}) or {}
    if not isinstance(classes, Mapping):
        raise ValueError(  # noqa: TRY004 - bad config content
            "thresholds.classes must map a workload class to its thresholds")
    return default, {str(c): one(v, default, f"thresholds.classes.{c}")
                     for c, v in classes.items()}


@dataclass(frozen=True, slots=True)
class ClassScore:
    """One workload class's late-weighted scores and whether it passed.

    Attributes:
        workload: the class.
        transcripts / turns: how many were replayed.
        exact_match: late-weighted share of turns with identical continuations.
        top1_agreement: late-weighted share of compared positions whose tokens agree.
        max_dlogprob: the worst ``|Δ logprob|`` of any compared position.
        mean_dlogprob: the mean over every shared top-k entry compared.
        earliest_divergence: the earliest first-divergence position of any turn (None: none).
        cached_tokens: prompt tokens the candidate served from cache, summed (None: unknown).
        passed / failures: the judgement against the class's thresholds, and why not.
    """

    workload: str
    transcripts: int
    turns: int
    exact_match: float
    top1_agreement: float
    max_dlogprob: float
    mean_dlogprob: float
    earliest_divergence: int | None
    cached_tokens: int | None
    passed: bool
    failures: tuple[str, ...]


def score_classes(turns: Iterable[TurnComparison], default: Thresholds,
                  per_class: Mapping[str, Thresholds] | None = None) -> list[ClassScore]:
    """Every class's scores (sorted by class name), each judged on its thresholds.

    Raises:
        ValueError: no turn was given (an empty replay proves nothing).
    """
    by_class: dict[str, list[TurnComparison]] = {}
    for t in turns:
        by_class.setdefault(t.workload, []).append(t)
    if not by_class:
        raise ValueError("no turn was replayed: a verdict needs at least one")
    out = []
    for workload in sorted(by_class):
        rows = by_class[workload]
        weights = [turn_weight(t.turn, t.num_turns) for t in rows]
        total = sum(weights)
        exact = sum(w for w, t in zip(weights, rows, strict=True) if t.exact) / total
        pos_w = sum(w * t.compared for w, t in zip(weights, rows, strict=True))
        agree_w = sum(w * t.top1_agree for w, t in zip(weights, rows, strict=True))
        top1 = agree_w / pos_w if pos_w else 1.0
        max_d = max(t.max_dlogprob for t in rows)
        num_d = sum(t.num_dlogprob for t in rows)
        mean_d = sum(t.sum_dlogprob for t in rows) / num_d if num_d else 0.0
        divergences = [t.first_divergence for t in rows if t.first_divergence is not None]
        cached = [t.candidate_cached_tokens for t in rows]
        limits = (per_class or {}).get(workload, default)
        failures = []
        if exact < limits.min_exact_match:
            failures.append(f"exact match {exact:.3f} < {limits.min_exact_match}")
        if top1 < limits.min_top1_agreement:
            failures.append(f"top-1 agreement {top1:.3f} < {limits.min_top1_agreement}")
        if max_d > limits.max_dlogprob:
            failures.append(f"max |dlogprob| {max_d:.4f} > {limits.max_dlogprob}")
        out.append(ClassScore(
            workload, len({t.transcript for t in rows}), len(rows), exact, top1, max_d,
            mean_d, min(divergences) if divergences else None,
            None if any(c is None for c in cached) else sum(c or 0 for c in cached),
            not failures, tuple(failures)))
    return out


def verdict_scores(classes: Sequence[ClassScore]) -> dict[str, float]:
    """The scores a verdict keeps: ``<class>.<metric>`` for every metric of CLASS_METRICS."""
    out: dict[str, float] = {}
    for c in classes:
        out[f"{c.workload}.exact_match"] = round(c.exact_match, 6)
        out[f"{c.workload}.top1_agreement"] = round(c.top1_agreement, 6)
        out[f"{c.workload}.max_dlogprob"] = round(c.max_dlogprob, 6)
        out[f"{c.workload}.mean_dlogprob"] = round(c.mean_dlogprob, 6)
        out[f"{c.workload}.turns"] = float(c.turns)
    return out


def policy_changes(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """Each cache setting (or weights fingerprint) that differs, as ``key: a -> b``; a run
    with any is void."""
    return [f"{key}: {before.get(key, '<absent>')} -> {after.get(key, '<absent>')}"
            for key in sorted(before.keys() | after.keys())
            if before.get(key) != after.get(key)]

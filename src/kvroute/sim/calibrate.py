"""Fit a step-timing profile to an OpenAI-compatible engine from measured latencies.

Owns the measurement plan (a bounded sweep over loopback), the least-squares fit and its
quality report; ``kvroute sim calibrate`` prints the result. The fitted constants feed
``StepTiming`` (``engine.model``) and can be pasted into ``sim/profiles.py``.

Model. A step costs ``fixed + a·prefill_tokens + b·decode_seqs + c·context_tokens``. Two
kinds of observation expose it:

* **TTFT of a lone request** of ``P`` prompt tokens with ``max_tokens: 1`` on an idle engine:
  one step with ``P`` prefill tokens and ``P`` context tokens, plus the HTTP round trip. The
  features are ``(1, P, 0, P)`` and an *overhead* indicator, because client-side TTFT includes
  the request's trip through the server and decode gaps do not.
* **Inter-token latency with B concurrent streams** of ``L``-token prompts: one decode step of
  ``B`` sequences reading about ``B·(L + k/2)`` context tokens, features
  ``(1, 0, B, B·(L + k/2))``.

``a`` and ``c`` are told apart because decode observations vary the context at fixed ``B``;
``fixed`` and ``b`` because ``B`` varies.

Measurement choices, each made because the obvious one failed on a small CPU model:

* **Prompts are token ids**, so their size is exact whatever the tokenizer (a word is not a
  token: the tiny Llama spells " hello" in 3). Ids are in ``[100, 1000)``, valid for any
  vocabulary of at least 1,000 entries; four leading ids spell a random nonce and every request
  carries a unique ``cache_salt``, so no prefix is ever cached.
* **The sweep fits the window.** ``max_model_len`` comes from ``/v1/models``; TTFT prompts
  longer than ``window - 1`` and decode prompts longer than ``window - decode_tokens`` are
  dropped and replaced by one prompt of exactly that limit, so the sweep still reaches the top
  of the window and no request is rejected (``window_bounded_lengths``).
* **Inter-token latency comes from the engine** when it exports vLLM's
  ``vllm:inter_token_latency_seconds`` histogram: the mean over the gaps recorded between the
  moment every stream of the batch has its first token (all prefills done, so each gap is a
  pure decode step) and the end of the batch (Δsum / Δcount), or over the whole batch when the
  engine was too fast for that (``_decode_batch``). A loaded client reads several
  buffered chunks in one go and sees gaps of a few µs; the engine's clock does not. Without the
  histogram the median client-side gap is used, ignoring gaps under ``min_gap_s`` (100 µs).
* **The fit weights relative error**: each observation's row is divided by its value, so a
  5 ms gap counts as much as a 500 ms TTFT (plain least squares let the long TTFTs decide
  everything, and the small-model decode terms came out as anything from 0 to 10x). The
  constants are kept non-negative (a coefficient that comes out negative is fixed at 0 and the
  rest refitted), solved with normal equations in plain Python (five unknowns).
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
import msgspec

from kvroute.core.errors import ConfigError
from kvroute.engine.model import StepTiming
from kvroute.wire.prom import parse_exposition

__all__ = [
    "ITL_METRIC",
    "CalibrationPlan",
    "FitResult",
    "Observation",
    "calibrate",
    "check_loopback_url",
    "client_itl",
    "fit_step_timing",
    "prompt_ids",
    "window_bounded_lengths",
]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")

ITL_METRIC = "vllm:inter_token_latency_seconds"
"""vLLM's inter-token latency histogram (``_sum`` and ``_count`` are read)."""

Weighting = Literal["relative", "absolute"]


@dataclass(frozen=True, slots=True)
class Observation:
    """One measured duration and the step features it stands for.

    ``source`` says where the duration was measured: ``"client"`` (wall clock here) or
    ``"engine"`` (the engine's own histogram).
    """

    kind: str  # "ttft" or "itl"
    prefill_tokens: float
    decode_seqs: float
    context_tokens: float
    seconds: float
    source: str = "client"

    def features(self) -> list[float]:
        return [1.0, self.prefill_tokens, self.decode_seqs, self.context_tokens,
                1.0 if self.kind == "ttft" else 0.0]


@dataclass(frozen=True, slots=True)
class FitResult:
    """The fitted profile and how well it explains the observations.

    Attributes:
        timing: the fitted step constants.
        overhead_s: the HTTP round trip included in every TTFT (not part of a step).
        r2: coefficient of determination over all observations (in seconds, unweighted).
        rmse_s: root-mean-square residual.
        max_rel_error: the largest ``|residual| / observed``.
        median_rel_error: the median ``|residual| / observed``.
        weighting: ``"relative"`` or ``"absolute"`` least squares.
        observations: what was fitted.
    """

    timing: StepTiming
    overhead_s: float
    r2: float
    rmse_s: float
    max_rel_error: float
    observations: tuple[Observation, ...]
    median_rel_error: float = 0.0
    weighting: Weighting = "relative"

    def as_dict(self) -> dict[str, Any]:
        t = self.timing
        sources = sorted({o.source for o in self.observations if o.kind == "itl"})
        return {
            "timing": {"fixed_s": t.fixed_s, "prefill_token_s": t.prefill_token_s,
                       "decode_seq_s": t.decode_seq_s, "context_token_s": t.context_token_s},
            "overhead_s": self.overhead_s, "r2": self.r2, "rmse_s": self.rmse_s,
            "max_rel_error": self.max_rel_error, "median_rel_error": self.median_rel_error,
            "weighting": self.weighting, "num_observations": len(self.observations),
            "itl_sources": sources,
        }

    def python(self) -> str:
        t = self.timing
        return (f"StepTiming(fixed_s={t.fixed_s:.6g}, prefill_token_s={t.prefill_token_s:.6g}, "
                f"decode_seq_s={t.decode_seq_s:.6g}, context_token_s={t.context_token_s:.6g})")


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                if f:
                    m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def _lstsq(rows: list[list[float]], y: list[float], active: list[int]) -> list[float] | None:
    # Column scaling keeps the normal equations well conditioned (tokens vs seconds).
    scale = [max((abs(r[j]) for r in rows), default=1.0) or 1.0 for j in active]
    cols = [[r[j] / s for j, s in zip(active, scale, strict=True)] for r in rows]
    k = len(active)
    ata = [[sum(c[i] * c[j] for c in cols) for j in range(k)] for i in range(k)]
    aty = [sum(c[i] * v for c, v in zip(cols, y, strict=True)) for i in range(k)]
    sol = _solve(ata, aty)
    if sol is None:
        return None
    return [v / s for v, s in zip(sol, scale, strict=True)]


def fit_step_timing(
    observations: Sequence[Observation], *, weighting: Weighting = "relative"
) -> FitResult:
    """Least-squares fit of the step constants (non-negative) to ``observations``.

    Args:
        observations: the measurements; every ``seconds`` must be > 0 for ``"relative"``.
        weighting: ``"relative"`` minimises the sum of squared *relative* residuals (each row
            divided by its observed value); ``"absolute"`` the squared residuals in seconds.

    Raises:
        ConfigError: fewer than 5 observations, a non-positive duration with relative
            weighting, or observations that do not determine the constants (e.g. every
            decode observation has the same batch size and context).
    """
    if len(observations) < 5:
        raise ConfigError(
            f"calibration needs at least 5 observations, got {len(observations)}; raise "
            "--max-requests or --timeout"
        )
    if weighting not in ("relative", "absolute"):
        raise ConfigError(f"weighting must be 'relative' or 'absolute', got {weighting!r}")
    rows = [o.features() for o in observations]
    y = [o.seconds for o in observations]
    if weighting == "relative":
        bad = [o for o in observations if not o.seconds > 0.0]
        if bad:
            raise ConfigError(
                f"a relative-error fit needs durations > 0, got {bad[0]!r}; drop it or use "
                "weighting='absolute'"
            )
        fit_rows = [[f / v for f in r] for r, v in zip(rows, y, strict=True)]
        fit_y = [1.0] * len(y)
    else:
        fit_rows, fit_y = rows, y
    active = [j for j in range(5) if any(r[j] for r in rows)]
    coef = [0.0] * 5
    while True:
        sol = _lstsq(fit_rows, fit_y, active)
        if sol is None:
            raise ConfigError(
                "the observations do not determine the timing constants (singular fit); "
                "vary prompt lengths and batch sizes more"
            )
        negative = [j for j, v in zip(active, sol, strict=True) if v < 0]
        if not negative:
            coef = [0.0] * 5
            for j, v in zip(active, sol, strict=True):
                coef[j] = v
            break
        worst = min(negative, key=lambda j: sol[active.index(j)])
        active.remove(worst)
    pred = [sum(c * f for c, f in zip(coef, r, strict=True)) for r in rows]
    resid = [a - p for a, p in zip(y, pred, strict=True)]
    mean = statistics.fmean(y)
    ss_tot = sum((v - mean) ** 2 for v in y) or 1e-300
    ss_res = sum(r * r for r in resid)
    rel = [abs(r) / v for r, v in zip(resid, y, strict=True) if v > 0]
    return FitResult(
        timing=StepTiming(fixed_s=coef[0], prefill_token_s=coef[1], decode_seq_s=coef[2],
                          context_token_s=coef[3]),
        overhead_s=coef[4],
        r2=1.0 - ss_res / ss_tot,
        rmse_s=(ss_res / len(y)) ** 0.5,
        max_rel_error=max(rel, default=0.0),
        observations=tuple(observations),
        median_rel_error=statistics.median(rel) if rel else 0.0,
        weighting=weighting,
    )


def check_loopback_url(url: str) -> str:
    """Return ``url`` without a trailing slash if it points at this machine.

    Raises:
        ConfigError: not an http(s) URL on 127.0.0.1, localhost or ::1.
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not (host in _LOOPBACK or host.startswith("127.")):
        raise ConfigError(
            f"calibrate only measures engines on this machine; {url!r} is not a loopback URL. "
            "Use e.g. http://127.0.0.1:8000 (tunnel a remote engine to a local port first)"
        )
    return url.rstrip("/")


@dataclass(frozen=True, slots=True)
class CalibrationPlan:
    """The bounded sweep. Every request counts against ``max_requests``.

    Attributes:
        prompt_lengths: TTFT prompt sizes in tokens (bounded by the window, see
            ``window_bounded_lengths``).
        ttft_repeats: lone requests per TTFT prompt size.
        batch_sizes: concurrent streams per decode observation.
        decode_prompt_lengths: decode prompt sizes in tokens (bounded by the window).
        decode_tokens: tokens generated per decode stream.
        max_requests / timeout_s: hard bounds on the whole run.
        min_gap_s: client-side gaps shorter than this are burst reads, not decode steps
            (used only when the engine has no ITL histogram).
        engine_itl: read ITL from the engine's histogram when it exists.
    """

    prompt_lengths: tuple[int, ...] = (16, 128, 256, 512, 1024, 2048)
    ttft_repeats: int = 2
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    decode_prompt_lengths: tuple[int, ...] = (16, 1024)
    decode_tokens: int = 32
    max_requests: int = 200
    timeout_s: float = 120.0
    min_gap_s: float = 100e-6
    engine_itl: bool = True

    def __post_init__(self) -> None:
        if self.decode_tokens < 2:
            raise ConfigError(
                f"CalibrationPlan.decode_tokens={self.decode_tokens} must be >= 2 (a gap needs "
                "two tokens)"
            )
        if self.ttft_repeats < 1 or self.max_requests < 1 or not self.timeout_s > 0:
            raise ConfigError(
                "CalibrationPlan needs ttft_repeats >= 1, max_requests >= 1 and timeout_s > 0; "
                f"got {self.ttft_repeats}, {self.max_requests}, {self.timeout_s}"
            )


def window_bounded_lengths(lengths: Sequence[int], limit: int) -> tuple[int, ...]:
    """``lengths`` that are at most ``limit`` (and >= 1); if any were longer, ``limit`` too.

    The sweep thus never sends a prompt the engine rejects, and still reaches the top of the
    window, e.g. ``window_bounded_lengths((16, 128, 2048), 511) == (16, 128, 511)``.
    """
    kept = [n for n in lengths if 1 <= n <= limit]
    if limit >= 1 and any(n > limit for n in lengths) and limit not in kept:
        kept.append(limit)
    return tuple(dict.fromkeys(kept))


_ID_BASE = 900
_FIRST_ID = 100


def prompt_ids(num_tokens: int, nonce: int) -> list[int]:
    """A token-id prompt of exactly ``num_tokens`` ids in ``[100, 1000)``.

    The first four ids spell ``nonce`` in base 900, so two prompts with different nonces
    differ in their first block; the rest count up (``100 + i``, wrapping at 1000).
    """
    head = []
    for _ in range(4):
        nonce, digit = divmod(nonce, _ID_BASE)
        head.append(_FIRST_ID + digit)
    body = [_FIRST_ID + i % _ID_BASE for i in range(max(0, num_tokens - 4))]
    return (head + body)[:num_tokens]


def client_itl(gaps: Sequence[float], min_gap_s: float = 100e-6) -> float | None:
    """The median client-side inter-token gap, ignoring gaps under ``min_gap_s``.

    A gap of a few µs is not a decode step: the client was late and read several buffered
    chunks at once. None when no gap is left.
    """
    kept = [g for g in gaps if g >= min_gap_s]
    return statistics.median(kept) if kept else None


def _nonce() -> int:
    return uuid.uuid4().int % (_ID_BASE**4)


class _Budget:
    def __init__(self, plan: CalibrationPlan) -> None:
        self.left = plan.max_requests
        self.deadline = time.monotonic() + plan.timeout_s

    def take(self, n: int) -> bool:
        if n > self.left or time.monotonic() >= self.deadline:
            return False
        self.left -= n
        return True


def _body(model: str, num_tokens: int, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt_ids(num_tokens, _nonce()), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "cache_salt": uuid.uuid4().hex}


async def _ttft(session: aiohttp.ClientSession, url: str, model: str, num_tokens: int
                ) -> tuple[int, float]:
    body = _body(model, num_tokens, 1)
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise ConfigError(f"{url}/v1/completions answered {resp.status}: {raw[:300]!r}")
    elapsed = time.perf_counter() - t0
    usage = msgspec.json.decode(raw).get("usage") or {}
    return int(usage.get("prompt_tokens", num_tokens)), elapsed


async def _stream_gaps(
    session: aiohttp.ClientSession, url: str, model: str, num_tokens: int, tokens: int,
    first: asyncio.Future[None] | None = None,
) -> tuple[int, list[float]]:
    """One streamed request; ``first`` is resolved at its first token (or when it ends)."""
    body = _body(model, num_tokens, tokens)
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    arrivals: list[float] = []
    prompt_tokens = num_tokens
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise ConfigError(f"{url}/v1/completions answered {resp.status}: "
                                  f"{(await resp.read())[:300]!r}")
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = msgspec.json.decode(line[6:])
                if event.get("choices"):
                    arrivals.append(time.perf_counter())
                    if first is not None and not first.done():
                        first.set_result(None)
                usage = event.get("usage")
                if usage:
                    prompt_tokens = int(usage.get("prompt_tokens", num_tokens))
    finally:
        if first is not None and not first.done():
            first.set_result(None)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return prompt_tokens, gaps


async def _itl_sum_count(session: aiohttp.ClientSession, url: str) -> tuple[float, float] | None:
    """The engine's ITL histogram totals (summed over label sets), or None if it has none."""
    async with session.get(url + "/metrics") as resp:
        if resp.status != 200:
            return None
        text = await resp.text()
    expo = parse_exposition(text, names=(ITL_METRIC + "_sum", ITL_METRIC + "_count"))
    sums = [x.value for x in expo.samples if x.name == ITL_METRIC + "_sum"]
    counts = [x.value for x in expo.samples if x.name == ITL_METRIC + "_count"]
    if not sums or not counts:
        return None
    return sum(sums), sum(counts)


async def _decode_batch(
    session: aiohttp.ClientSession, url: str, model: str, num_tokens: int, batch: int,
    plan: CalibrationPlan, engine_itl: bool,
) -> Observation | None:
    """B concurrent streams → one ITL observation (engine histogram, else client median).

    The histogram is read before the batch (S0), once every stream has its first token (S1)
    and at the end (S2). S1→S2 holds only decode steps of the whole batch and is used when it
    still covers at least half of the batch's gaps; a fast engine may have finished most of
    them before S1 is read, and then S0→S2 is used (it also counts the gaps of streams whose
    prefill was delayed, a small bias when all B arrive together).
    """
    loop = asyncio.get_running_loop()
    firsts = [loop.create_future() for _ in range(batch)]
    start = await _itl_sum_count(session, url) if engine_itl else None
    mid: tuple[float, float] | None = None
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(_stream_gaps(session, url, model, num_tokens,
                                                plan.decode_tokens, first))
                 for first in firsts]
        await asyncio.gather(*firsts)
        if start is not None:
            mid = await _itl_sum_count(session, url)
    end = await _itl_sum_count(session, url) if start is not None else None
    results = [t.result() for t in tasks]
    mean_prompt = statistics.fmean(p for p, _ in results)
    context = batch * (mean_prompt + plan.decode_tokens / 2)
    if start is not None and end is not None:
        expected_gaps = batch * (plan.decode_tokens - 1)
        window = mid if mid is not None and end[1] - mid[1] >= expected_gaps / 2 else start
        if end[1] > window[1] and end[0] > window[0]:
            itl = (end[0] - window[0]) / (end[1] - window[1])
            return Observation("itl", 0, batch, context, itl, source="engine")
    median = client_itl([g for _, stream_gaps in results for g in stream_gaps], plan.min_gap_s)
    if median is None:
        return None
    return Observation("itl", 0, batch, context, median, source="client")


async def calibrate(url: str, *, model: str | None = None,
                    plan: CalibrationPlan = CalibrationPlan(),
                    weighting: Weighting = "relative") -> FitResult:
    """Measure the engine at ``url`` (loopback only) and fit its step timing.

    The sweep is bounded by the engine's window (``/v1/models`` ``max_model_len``), by
    ``plan.max_requests`` and by ``plan.timeout_s``; see the module docstring for how each
    observation is taken.

    Raises:
        ConfigError: a non-loopback URL, an engine error, a window too small to measure
            (under 8 tokens), or too few observations.
    """
    base = check_loopback_url(url)
    budget = _Budget(plan)
    timeout = aiohttp.ClientTimeout(total=plan.timeout_s)
    observations: list[Observation] = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(base + "/v1/models") as resp:
            cards = msgspec.json.decode(await resp.read()).get("data") or []
        if not cards:
            raise ConfigError(f"{base}/v1/models lists no model")
        card = next((c for c in cards if c.get("id") == model), cards[0]) if model else cards[0]
        model_id = str(card["id"])
        window = int(card.get("max_model_len") or 2048)
        if window < 8 + plan.decode_tokens:
            raise ConfigError(
                f"{model_id!r} has a window of {window} tokens, too small to calibrate with "
                f"{plan.decode_tokens} decode tokens; lower decode_tokens"
            )
        await _ttft(session, base, model_id, 8)  # warm-up, not fitted
        engine_itl = plan.engine_itl and await _itl_sum_count(session, base) is not None
        for length in window_bounded_lengths(plan.prompt_lengths, window - 1):
            for _ in range(plan.ttft_repeats):
                if not budget.take(1):
                    break
                p, seconds = await _ttft(session, base, model_id, length)
                observations.append(Observation("ttft", p, 0, p, seconds))
        decode_limit = window - plan.decode_tokens
        for length in window_bounded_lengths(plan.decode_prompt_lengths, decode_limit):
            for batch in plan.batch_sizes:
                if not budget.take(batch):
                    break
                obs = await _decode_batch(session, base, model_id, length, batch, plan,
                                          engine_itl)
                if obs is not None:
                    observations.append(obs)
    return fit_step_timing(observations, weighting=weighting)

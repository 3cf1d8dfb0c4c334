"""Fit a step-timing profile to an OpenAI-compatible engine from measured latencies.

Owns the measurement plan (a bounded sweep over loopback), the least-squares fit and its
quality report; ``kvroute sim calibrate`` prints the result. The fitted constants feed
``StepTiming`` (``core.engine_model``) and can be pasted into ``sim/profiles.py``.

Model. A step costs ``fixed + a·prefill_tokens + b·decode_seqs + c·context_tokens``. Two
kinds of observation expose it:

* **TTFT of a lone request** of ``P`` prompt tokens with ``max_tokens: 1`` on an idle engine:
  one step with ``P`` prefill tokens and ``P`` context tokens, plus the HTTP round trip. The
  features are ``(1, P, 0, P)`` and an *overhead* indicator, because client-side TTFT includes
  the request's trip through the server and decode gaps do not. Prefix caching is defeated by
  a unique first word per request and a unique ``cache_salt`` (engines that do not know the
  field ignore it).
* **Inter-token gap with B concurrent streams** of ``L``-token prompts: one decode step of
  ``B`` sequences reading about ``B·(L + k)`` context tokens, features ``(1, 0, B, B·(L+k))``.
  The median gap over all streams is used, so a gap that also carried a prefill does not skew
  it.

``a`` and ``c`` are told apart because decode observations vary the context at fixed ``B``;
``fixed`` and ``b`` because ``B`` varies. The fit is ordinary least squares with
non-negativity (coefficients that come out negative are fixed at 0 and the rest refitted),
solved with normal equations in plain Python (five unknowns).
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from kvroute.core.engine_model import StepTiming
from kvroute.core.errors import ConfigError

__all__ = [
    "CalibrationPlan",
    "FitResult",
    "Observation",
    "calibrate",
    "check_loopback_url",
    "fit_step_timing",
]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True, slots=True)
class Observation:
    """One measured duration and the step features it stands for."""

    kind: str  # "ttft" or "itl"
    prefill_tokens: float
    decode_seqs: float
    context_tokens: float
    seconds: float

    def features(self) -> list[float]:
        return [1.0, self.prefill_tokens, self.decode_seqs, self.context_tokens,
                1.0 if self.kind == "ttft" else 0.0]


@dataclass(frozen=True, slots=True)
class FitResult:
    """The fitted profile and how well it explains the observations.

    Attributes:
        timing: the fitted step constants.
        overhead_s: the HTTP round trip included in every TTFT (not part of a step).
        r2: coefficient of determination over all observations.
        rmse_s: root-mean-square residual.
        max_rel_error: the largest ``|residual| / observed``.
        observations: what was fitted.
    """

    timing: StepTiming
    overhead_s: float
    r2: float
    rmse_s: float
    max_rel_error: float
    observations: tuple[Observation, ...]

    def as_dict(self) -> dict[str, Any]:
        t = self.timing
        return {
            "timing": {"fixed_s": t.fixed_s, "prefill_token_s": t.prefill_token_s,
                       "decode_seq_s": t.decode_seq_s, "context_token_s": t.context_token_s},
            "overhead_s": self.overhead_s, "r2": self.r2, "rmse_s": self.rmse_s,
            "max_rel_error": self.max_rel_error, "num_observations": len(self.observations),
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


def fit_step_timing(observations: Sequence[Observation]) -> FitResult:
    """Least-squares fit of the step constants (non-negative) to ``observations``.

    Raises:
        ConfigError: fewer than 5 observations, or they do not determine the constants
            (e.g. every decode observation has the same batch size and context).
    """
    if len(observations) < 5:
        raise ConfigError(
            f"calibration needs at least 5 observations, got {len(observations)}; raise "
            "--max-requests or --timeout"
        )
    rows = [o.features() for o in observations]
    y = [o.seconds for o in observations]
    active = [j for j in range(5) if any(r[j] for r in rows)]
    coef = [0.0] * 5
    while True:
        sol = _lstsq(rows, y, active)
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
    return FitResult(
        timing=StepTiming(fixed_s=coef[0], prefill_token_s=coef[1], decode_seq_s=coef[2],
                          context_token_s=coef[3]),
        overhead_s=coef[4],
        r2=1.0 - ss_res / ss_tot,
        rmse_s=(ss_res / len(y)) ** 0.5,
        max_rel_error=max(abs(r) / v for r, v in zip(resid, y, strict=True) if v > 0),
        observations=tuple(observations),
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
    """The bounded sweep. Every request counts against ``max_requests``."""

    prompt_lengths: tuple[int, ...] = (16, 128, 256, 512, 1024, 2048)
    ttft_repeats: int = 2
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    decode_prompt_lengths: tuple[int, ...] = (16, 1024)
    decode_tokens: int = 12
    max_requests: int = 200
    timeout_s: float = 120.0


def _prompt(n_words: int) -> str:
    # A unique first word defeats prefix caching; the rest is one common word per token.
    return "z" + uuid.uuid4().hex[:12] + " hello" * max(0, n_words - 1)


class _Budget:
    def __init__(self, plan: CalibrationPlan) -> None:
        self.left = plan.max_requests
        self.deadline = time.monotonic() + plan.timeout_s

    def take(self, n: int) -> bool:
        if n > self.left or time.monotonic() >= self.deadline:
            return False
        self.left -= n
        return True


async def _ttft(session: aiohttp.ClientSession, url: str, model: str, words: int) -> tuple[int, float]:
    body = {"model": model, "prompt": _prompt(words), "max_tokens": 1, "temperature": 0,
            "cache_salt": uuid.uuid4().hex}
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise ConfigError(f"{url}/v1/completions answered {resp.status}: {raw[:300]!r}")
    elapsed = time.perf_counter() - t0
    usage = msgspec.json.decode(raw).get("usage") or {}
    return int(usage.get("prompt_tokens", words)), elapsed


async def _stream_gaps(
    session: aiohttp.ClientSession, url: str, model: str, words: int, tokens: int
) -> tuple[int, list[float]]:
    body = {"model": model, "prompt": _prompt(words), "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "cache_salt": uuid.uuid4().hex}
    arrivals: list[float] = []
    prompt_tokens = words
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
            usage = event.get("usage")
            if usage:
                prompt_tokens = int(usage.get("prompt_tokens", words))
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return prompt_tokens, gaps


async def calibrate(url: str, *, model: str | None = None,
                    plan: CalibrationPlan = CalibrationPlan()) -> FitResult:
    """Measure the engine at ``url`` (loopback only) and fit its step timing.

    Raises:
        ConfigError: a non-loopback URL, an engine error, or too few observations.
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
        await _ttft(session, base, model_id, 8)  # warm-up, not fitted
        for length in plan.prompt_lengths:
            if length + 2 > window:
                continue
            for _ in range(plan.ttft_repeats):
                if not budget.take(1):
                    break
                p, seconds = await _ttft(session, base, model_id, length)
                observations.append(Observation("ttft", p, 0, p, seconds))
        for length in plan.decode_prompt_lengths:
            if length + plan.decode_tokens + 2 > window:
                continue
            for batch in plan.batch_sizes:
                if not budget.take(batch):
                    break
                results = await asyncio.gather(*(
                    _stream_gaps(session, base, model_id, length, plan.decode_tokens)
                    for _ in range(batch)
                ))
                gaps = [g for _, stream_gaps in results for g in stream_gaps]
                if not gaps:
                    continue
                mean_prompt = statistics.fmean(p for p, _ in results)
                context = batch * (mean_prompt + plan.decode_tokens / 2)
                observations.append(
                    Observation("itl", 0, batch, context, statistics.median(gaps)))
    return fit_step_timing(observations)

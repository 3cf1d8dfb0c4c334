"""Inter-token latency no router can beat, and what an evenly spread fleet would give.

A routing policy chooses which replica a request decodes on; it cannot make a decode step
cheaper than the engine runs it with that request alone. ``bench.bounds`` turns that into
TTFT and E2E floors; this module does the same for the three inter-token figures the
simulator reports (``sim.fleet.FleetResult.summary``): ``itl_mean_s`` and ``itl_p99_s`` over
every token gap of every request, and ``itl_request_*`` over each request's own mean gap.

**Lone floor (a bound).** A request of ``n`` prompt tokens and ``o`` output tokens (``o``
capped at ``max_model_len − n``, where the engine stops) has ``d = o − 1`` token gaps after
its first token. Gap ``j`` (``1..d``) ends with the engine step that decodes its token ``j +
1``; that step's attention reads the ``n + j`` tokens computed by then, so with the step
model ``fixed + a·prefill + b·decodes + c·context`` (``engine.model.StepTiming``) the gap is
at least

    g_j = fixed + b + c·(n + j)

(any other request in the step, or any other step between the two tokens, only adds to it).
One exception, which only profiles with ``2a < b`` reach (``vllm-cpu-tiny``): after a
preemption the token comes from a recompute whose last chunk, when it is two tokens or more,
is priced ``a`` a token rather than ``b``; the floors therefore use ``min(b, 2a)`` for ``b``
(``lone_step_s``; the same as ``b`` in the GPU profiles). So:

* every gap of the workload is at least its own ``g_j``, and since the real gaps and the
  floors pair one to one, the mean and the nearest-rank p99 over every gap are at least the
  mean and the p99 of the ``g_j`` (a percentile of values each above its partner is above
  the partners' percentile);
* each request's own mean gap is at least ``(Σ_j g_j) / d``
  ``= fixed + b + c·(n + (d + 1)/2)``, hence the mean and p99 over requests too.

The pairing needs every request to make its ``o`` tokens, as a simulated run does (it runs
every request to its end; a prompt the engine rejects has ``d = 0`` here too); a run cut
short has fewer gaps than the floors count.

The p99 over every gap is exact and cheap: ``g`` grows with the context ``n + j``, so it is
``fixed + b + c·T`` with ``T`` the nearest-rank p99 of the contexts ``{n_i + 1 .. n_i + d_i}``
of every request, found by bisection on ``T`` (counting, per request, the contexts ≤ ``T``).

Worked example (``llama-3.1-8b-h100``: 6 ms, 20 µs, 50 ns): one request of 1,000 prompt
tokens and 5 output tokens has gaps 6.02 ms + 50 ns × 1,001..1,004 = 6.07005..6.0702 ms, mean
6.070125 ms; two requests (1,000 and 30,000 prompt tokens, 5 output tokens each) have 8 gaps,
whose nearest-rank p99 (rank 8) is the 30,004-token one: 6.02 + 1.5002 = 7.5202 ms.

**Spread estimate (not a bound).** Each request decodes beside the decodes no router can
avoid, spread as evenly as whole requests allow:

1. A zero-queue timeline: request ``i`` is released at its arrival (a closed-loop turn
   ``think_time_s`` after its predecessor's end on this timeline), gets its first token a
   TTFT floor later (``bench.bounds.ttft_floor_s`` with its unbounded hits) and decodes its
   lone gaps one after another. ``M(t)`` is the number of requests decoding at ``t`` and
   ``K(t)`` the context they read (each request's context taken linear in time across its
   decode).
2. ``M`` decodes over ``R`` replicas, as evenly as whole requests allow (``q = M // R`` on
   each, one more on ``M mod R`` of them), share a step with, on average over the decoding
   requests, ``s(M) = Σ_r k_r(k_r − 1) / M`` others (0 while ``M ≤ R``): the least any
   placement gives on the ``b`` term at that moment (``Σ k_r²`` is smallest when even).
3. Each lone gap ``g_j`` starting at ``t`` is raised by ``s(M(t))·(b + c·k̄)``, ``k̄`` the
   mean context of the other requests decoding then (``(K(t) − own) / (M(t) − 1)``).

Why it is an estimate, not a floor: a router could group short contexts apart from long
ones (the ``c`` term is not smallest when even), and a real run's queueing moves decodes
in time. Two things make it optimistic instead: other requests' prefill chunks that share
the step are left out, and the timeline uses lone gaps, so decodes do not stretch and overlap
more as they do in a loaded fleet. Read it as what perfect balance of the decodes in flight
would give with zero queueing.

Pure: takes per-request numbers and a step timing, does no I/O.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.core.errors import ConfigError
from kvroute.core.stats import mean, percentile
from kvroute.engine.model import StepTiming

__all__ = [
    "DecodeFigures",
    "context_percentile",
    "decode_steps",
    "even_share",
    "lone_itl_floors",
    "lone_step_s",
    "spread_itl_estimate",
]


@dataclass(frozen=True, slots=True)
class DecodeFigures:
    """The inter-token figures of one floor or estimate (keys as the simulator's summary).

    Attributes:
        itl_mean_s / itl_p99_s: over every token gap of every request.
        itl_request_mean_s / itl_request_p99_s: over each request's own mean gap (requests
            with at least one gap).
        e2e_mean_s / e2e_p99_s: arrival to last token with these gaps and the TTFT floors
            (``None`` where the caller gave no TTFT).
    """

    itl_mean_s: float
    itl_p99_s: float
    itl_request_mean_s: float
    itl_request_p99_s: float
    e2e_mean_s: float | None = None
    e2e_p99_s: float | None = None


def lone_step_s(timing: StepTiming) -> float:
    """The least cost of a step that gives a request its next token, before attention:
    ``fixed + min(b, 2a)`` (module docstring)."""
    return timing.fixed_s + min(timing.decode_seq_s, 2 * timing.prefill_token_s)


def decode_steps(num_tokens: int, output_tokens: int, max_model_len: int | None = None) -> int:
    """``d``: the decode steps (token gaps) after the first token, ``o − 1`` with ``o``
    capped at ``max_model_len − n`` and at least 1 (``bench.bounds.decode_floor_s``).

    Raises:
        ConfigError: a negative count.
    """
    if num_tokens < 0 or output_tokens < 0:
        raise ConfigError(f"decode_steps needs num_tokens, output_tokens >= 0, got "
                          f"{num_tokens}, {output_tokens}")
    if max_model_len is not None:
        output_tokens = min(output_tokens, max_model_len - num_tokens)
    return max(output_tokens, 1) - 1


def context_percentile(prompts: Sequence[int], steps: Sequence[int], pct: float) -> int:
    """The nearest-rank ``pct``-th percentile of the multiset of decode contexts
    ``{n_i + 1, ..., n_i + d_i}`` over every request (``core.stats.percentile``'s rank).

    Raises:
        ConfigError: no context at all (every ``d_i`` is 0), or mismatched lengths.
    """
    if len(prompts) != len(steps):
        raise ConfigError(f"context_percentile needs one step count per prompt, got "
                          f"{len(prompts)} prompts and {len(steps)} counts")
    total = sum(steps)
    if total <= 0:
        raise ConfigError("context_percentile needs at least one decode step")
    rank = max(1, min(total, int(-(-total * pct // 100))))
    live = [(n, d) for n, d in zip(prompts, steps) if d > 0]

    def at_most(t: int) -> int:
        return sum(min(max(t - n, 0), d) for n, d in live)

    lo = min(n for n, _ in live) + 1  # at_most(lo) >= 1
    hi = max(n + d for n, d in live)  # at_most(hi) == total
    while lo < hi:  # smallest t with at_most(t) >= rank
        mid = (lo + hi) // 2
        if at_most(mid) >= rank:
            hi = mid
        else:
            lo = mid + 1
    return lo


def lone_itl_floors(prompts: Sequence[int], steps: Sequence[int],
                    timing: StepTiming) -> DecodeFigures:
    """The lone-decode ITL floors (module docstring) of requests with ``prompts[i]`` prompt
    tokens and ``steps[i]`` token gaps each. E2E is left ``None`` (``bench.bounds`` has it).

    Raises:
        ConfigError: no request has a gap, or mismatched lengths.
    """
    p99_context = context_percentile(prompts, steps, 99)
    lone = lone_step_s(timing)
    c = timing.context_token_s
    gap_sum = 0.0
    per_request: list[float] = []
    for n, d in zip(prompts, steps):
        if d <= 0:
            continue
        own = d * lone + c * (d * n + d * (d + 1) // 2)
        gap_sum += own
        per_request.append(own / d)
    return DecodeFigures(
        itl_mean_s=gap_sum / sum(steps),
        itl_p99_s=lone + c * p99_context,
        itl_request_mean_s=mean(per_request, 0.0),
        itl_request_p99_s=percentile(per_request, 99, 0.0),
    )


def even_share(decoding: int, replicas: int) -> float:
    """``s(M)``: with ``M`` decodes spread as evenly as whole requests allow over ``R``
    replicas, how many others share a step with a decoding request, on average over them.

    ``q = M // R`` on every replica and one more on ``M mod R`` of them:
    ``(rem·(q+1)·q + (R − rem)·q·(q − 1)) / M``; 0 while ``M ≤ R``.

    Raises:
        ConfigError: ``replicas`` < 1 or ``decoding`` < 0.
    """
    if replicas < 1 or decoding < 0:
        raise ConfigError(f"even_share needs replicas >= 1 and decoding >= 0, got "
                          f"{replicas}, {decoding}")
    if decoding <= replicas:
        return 0.0
    q, rem = divmod(decoding, replicas)
    return (rem * (q + 1) * q + (replicas - rem) * q * (q - 1)) / decoding


def spread_itl_estimate(releases: Sequence[float], ttfts: Sequence[float],
                        prompts: Sequence[int], steps: Sequence[int], timing: StepTiming,
                        replicas: int) -> DecodeFigures:
    """The spread estimate (module docstring) of requests released at ``releases[i]`` (the
    caller resolves closed-loop turns) with first tokens ``ttfts[i]`` later.

    Raises:
        ConfigError: mismatched lengths, ``replicas`` < 1, or no request has a gap.
    """
    count = len(prompts)
    if not len(releases) == len(ttfts) == len(steps) == count:
        raise ConfigError("spread_itl_estimate needs one release, TTFT and step count per "
                          "prompt")
    if replicas < 1:
        raise ConfigError(f"replicas must be >= 1, got {replicas}")
    if sum(steps) <= 0:
        raise ConfigError("spread_itl_estimate needs at least one decode step")
    lone = lone_step_s(timing)
    b, c = timing.decode_seq_s, timing.context_token_s
    # Each decode on the lone timeline: [start, end), its context n + 1 + rate·(t − start)
    # (n + j at the start of its gap j, up to rounding), rate = d / (end − start).
    starts = [r + f for r, f in zip(releases, ttfts)]
    ends: list[float] = []
    events: list[tuple[float, int, int]] = []  # (time, +1 start / -1 end, request)
    for i, (n, d, s) in enumerate(zip(prompts, steps, starts)):
        end = s + d * lone + c * (d * n + d * (d + 1) // 2)
        ends.append(end)
        if d > 0 and end > s:
            events.append((s, 1, i))
            events.append((end, -1, i))
    events.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same time
    # Segments [times[k], times[k+1]): decoding count and K(t) = base[k] + slope[k]·t.
    times: list[float] = []
    counts: list[int] = []
    bases: list[float] = []
    slopes: list[float] = []
    m, base, slope = 0, 0.0, 0.0
    for t, sign, i in events:
        rate = steps[i] / (ends[i] - starts[i])
        m += sign
        base += sign * (prompts[i] + 1 - rate * starts[i])
        slope += sign * rate
        if times and times[-1] == t:
            counts[-1], bases[-1], slopes[-1] = m, base, slope
        else:
            times.append(t)
            counts.append(m)
            bases.append(base)
            slopes.append(slope)
    gaps = array("d")
    per_request: list[float] = []
    e2e: list[float] = []
    for i, (n, d) in enumerate(zip(prompts, steps)):
        t = starts[i]
        if d <= 0:
            e2e.append(t - releases[i])
            continue
        rate = d / (ends[i] - starts[i])
        k = bisect_right(times, t) - 1
        own_sum = 0.0
        for j in range(1, d + 1):
            while k + 1 < len(times) and times[k + 1] <= t:
                k += 1
            g = lone + c * (n + j)
            decoding = counts[k]
            share = even_share(decoding, replicas)
            if share:
                others = bases[k] + slopes[k] * t - (n + 1 + rate * (t - starts[i]))
                g += share * (b + c * max(others, 0.0) / (decoding - 1))
            gaps.append(g)
            own_sum += g
            t += lone + c * (n + j)  # the timeline advances by the lone gap
        per_request.append(own_sum / d)
        e2e.append(starts[i] - releases[i] + own_sum)
    return DecodeFigures(
        itl_mean_s=sum(gaps) / len(gaps),
        itl_p99_s=percentile(gaps, 99, 0.0),
        itl_request_mean_s=mean(per_request, 0.0),
        itl_request_p99_s=percentile(per_request, 99, 0.0),
        e2e_mean_s=mean(e2e, 0.0),
        e2e_p99_s=percentile(e2e, 99, 0.0),
    )

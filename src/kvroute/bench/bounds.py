"""What no router can beat on a workload: oracle prefix-cache hits and zero-queue TTFT and
E2E floors.

A routing policy can only choose *where* a request's prefill runs; it cannot make a prefix
that was never computed (or was evicted everywhere) a hit, and it cannot make a prefill
faster than an idle engine computes it. This module computes both limits from the workload
and the engine profile alone, with no simulation of routing:

**Hit bounds** (in tokens, at the engine's block size ``B``; a prompt's blocks are chained,
so block ``k`` can hit only if blocks ``0..k-1`` do, and a hit never covers the last token:
at most ``(n - 1) // B`` blocks, as vLLM caps it):

* ``unbounded``: every block any earlier request computed is cached forever (one engine with
  infinite KV). Each request hits its longest previously seen prefix. Exact and per request;
  no fleet, whatever its routing, hits more on any request.
* ``opt``: one cache of the whole fleet's capacity (``replicas × num_gpu_blocks``) managed by
  Belady's MIN (evict the block whose next use is furthest away). Any fleet's caches can be
  seen as one cache of that size holding their union (duplicates only waste room), filled
  on demand as requests are served; MIN maximises the hits of such a cache for a given
  access order, so its total is an upper bound on the fleet's total hits. Running requests
  do not pin their blocks here, which only loosens the bound. Counted as raw resident
  blocks, without the last-token cap (which only loosens it further).
* ``lru``: the same pooled capacity with least-recently-used eviction (vLLM's policy, the
  tail of a prompt evicted before its head). Not a bound: an estimate of what perfect
  affinity (every request on a replica holding its prefix, no block duplicated, no load
  balancing) would give with the engines' own eviction.

All three take requests in arrival order. A fleet serves requests in about that order (a
request can only hit a later arrival's blocks by waiting for that prefill, which costs at
least what the hit saves).

**TTFT floor.** A request with ``n`` prompt tokens of which ``h`` are cache hits computes
``u = n - h`` tokens in chunks of at most ``max_num_batched_tokens`` (``C``) per engine step.
Each step costs at least ``fixed + a·chunk + c·context_after`` (``engine.model.
StepTiming``; other requests in the step only add to it), so its TTFT is at least

    k = ⌈u / C⌉ steps:   k·fixed + a·u + c·Σ_{j<k} (n − j·C)

(the context term is smallest with the short chunk first). Worked example, the
``llama-3.1-8b-h100`` profile (6 ms, 40 µs, 50 ns, C = 8,192), ``n = 12,000``, ``h = 2,048``:
``u = 9,952``, ``k = 2``, floor = 12 ms + 398.08 ms + (12,000 + 3,808)·50 ns = 410.9 ms.

**E2E floor.** After its first token (sampled by the last prefill step), a request of ``o``
output tokens runs ``d = o − 1`` decode steps; at the least-loaded batch (no other request on
its engine) step ``j`` costs ``fixed + b + c·(n + j)`` (one sequence decoding, attention
reading its ``n + j`` computed tokens: ``engine.model.EngineModel.step``), and any other
request in the step only adds to it (``b`` stands for ``min(b, 2a)``: a token recomputed
after a preemption can be priced as a prefill, ``bench.itl_floors.lone_step_s``; the same in
the GPU profiles). So its end-to-end latency is at least

    TTFT floor + d·(fixed + b) + c·(d·n + d(d+1)/2)

with ``o`` capped where the engine stops (``max_model_len − n`` tokens) and at least 1. Worked
example, the request above with ``o = 200``: ``d = 199``, decode = 199 × 6.02 ms + 50 ns ×
2,407,900 = 1,198.0 + 120.4 = 1,318.4 ms, E2E floor = 410.9 + 1,318.4 = 1,729.2 ms.

Rows (every floor is per request, with zero queueing; means and p99s over requests, nearest
rank as ``core.stats`` computes the simulator's figures; a percentile of per-request lower
bounds bounds the same percentile of the real values):

* ``floors: unbounded KV hits``: each request's TTFT and E2E floors with its ``unbounded``
  hits. Strict lower bounds on the mean and p99 TTFT and E2E of any router.
* ``floors: fleet KV hits``: the means as above, but the ``a·u`` term summed with the ``opt``
  total hits instead (the step counts and context terms keep the per-request ``unbounded``
  values, which are lower bounds too). Also strict, and tighter; no p99 (the ``opt`` total
  cannot be split per request).

**ITL floors** (``bench.itl_floors``): each request's gaps decoded alone, as the E2E floor
times them, give floors of the ITL mean, the p99 over every gap and the p99 (and mean) over
each request's own mean gap; a second row, an estimate, adds the decodes no router can avoid
sharing a step with, spread as evenly as whole requests allow over the replicas. Both are
``ItlRow`` values in ``BoundsReport.itl_rows``, printed as their own table.

Pure: takes workload requests and a profile, does no I/O.
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass

from kvroute.bench.itl_floors import (
    DecodeFigures,
    decode_steps,
    lone_itl_floors,
    lone_step_s,
    spread_itl_estimate,
)
from kvroute.bench.traces import BlockTokens
from kvroute.core.errors import ConfigError
from kvroute.core.stats import mean, percentile
from kvroute.engine.model import StepTiming
from kvroute.sim.profiles import TimingProfile
from kvroute.sim.workload import WorkloadRequest

__all__ = [
    "BoundRow",
    "BoundsReport",
    "ItlRow",
    "compute_bounds",
    "decode_floor_s",
    "format_bounds_table",
    "format_itl_table",
    "lru_hits",
    "opt_hit_total",
    "prompt_blocks",
    "ttft_floor_s",
    "unbounded_hits",
]


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """Every request's full engine blocks as small integer ids, in prefix order.

    Two requests share block id ``x`` at position ``k`` exactly when their first ``(k+1)·B``
    tokens are equal (the ids name nodes of a prefix trie, as chained block hashes do).

    Attributes:
        block_size: ``B``, tokens per engine block.
        offsets: request ``i``'s ids are ``ids[offsets[i]:offsets[i+1]]``.
        ids: the concatenated block ids.
        num_tokens: each request's prompt length.
    """

    block_size: int
    offsets: array  # type: ignore[type-arg]
    ids: array  # type: ignore[type-arg]
    num_tokens: array  # type: ignore[type-arg]

    def __len__(self) -> int:
        return len(self.num_tokens)

    def blocks(self, i: int) -> array:  # type: ignore[type-arg]
        return self.ids[self.offsets[i]:self.offsets[i + 1]]

    def cap_blocks(self, i: int) -> int:
        """The most blocks request ``i`` can hit (its last token is always computed)."""
        n = self.num_tokens[i]
        return (n - 1) // self.block_size if n > 0 else 0


def prompt_blocks(requests: Sequence[WorkloadRequest], block_size: int) -> PromptBlocks:
    """Number every request's full ``block_size``-token blocks by prefix identity.

    Trace prompts (``BlockTokens`` whose source block is a multiple of ``block_size``) are
    walked one source block at a time: all engine blocks inside one source block hold the same
    token, so one trie node per source block stands for up to ``source/B`` engine blocks.
    Other prompts are walked one engine block (a tuple of ``B`` tokens) at a time.

    Raises:
        ConfigError: ``block_size`` < 1.
    """
    if block_size < 1:
        raise ConfigError(f"block_size must be >= 1, got {block_size}")
    # children[node] maps a segment key to the child node; node 0 is the empty prefix.
    children: list[dict[object, int]] = [{}]
    bases = array("q", [0])  # first block id of each node
    next_id = 0
    offsets = array("q", [0])
    ids = array("q")
    num_tokens = array("q")
    for request in requests:
        tokens = request.prompt_token_ids
        n = len(tokens)
        num_tokens.append(n)
        full = n // block_size
        node = 0
        key: object
        if isinstance(tokens, BlockTokens) and tokens.block_tokens % block_size == 0:
            per_source = tokens.block_tokens // block_size
            stride = per_source
            source_ids = tokens.block_token_ids
            remaining = full
            s = 0
            while remaining > 0:
                key = source_ids[s]
                child = children[node].get(key)
                if child is None:
                    child = len(children)
                    children.append({})
                    bases.append(next_id)
                    next_id += stride
                    children[node][key] = child
                node = child
                take = min(per_source, remaining)
                base = bases[node]
                ids.extend(range(base, base + take))
                remaining -= take
                s += 1
        else:
            for k in range(full):
                key = tuple(tokens[k * block_size:(k + 1) * block_size])
                child = children[node].get(key)
                if child is None:
                    child = len(children)
                    children.append({})
                    bases.append(next_id)
                    next_id += 1
                    children[node][key] = child
                node = child
                ids.append(bases[node])
        offsets.append(len(ids))
    return PromptBlocks(block_size, offsets, ids, num_tokens)


def _leading_run(own: Sequence[int], cap: int, held: Container[int]) -> int:
    """How many of ``own``'s leading blocks (at most ``cap``) ``held`` contains."""
    k = 0
    while k < cap and own[k] in held:
        k += 1
    return k


def unbounded_hits(blocks: PromptBlocks) -> array:  # type: ignore[type-arg]
    """Per-request hit tokens with an infinite cache (every block seen is kept)."""
    seen: set[int] = set()
    hits = array("q")
    bs = blocks.block_size
    for i in range(len(blocks)):
        own = blocks.blocks(i)
        hits.append(_leading_run(own, blocks.cap_blocks(i), seen) * bs)
        seen.update(own)
    return hits


def lru_hits(blocks: PromptBlocks, capacity_blocks: int) -> array:  # type: ignore[type-arg]
    """Per-request hit tokens of one LRU cache of ``capacity_blocks`` blocks.

    A served request touches its blocks tail first, so that among blocks last used together
    the tail is evicted first (vLLM frees a request's blocks in reverse order).

    Raises:
        ConfigError: ``capacity_blocks`` < 1.
    """
    if capacity_blocks < 1:
        raise ConfigError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
    cache: OrderedDict[int, None] = OrderedDict()
    hits = array("q")
    bs = blocks.block_size
    for i in range(len(blocks)):
        own = blocks.blocks(i)
        hits.append(_leading_run(own, blocks.cap_blocks(i), cache) * bs)
        for b in reversed(own):
            if b in cache:
                cache.move_to_end(b)
            else:
                cache[b] = None
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hits


def opt_hit_total(blocks: PromptBlocks, capacity_blocks: int) -> int:
    """Total hit tokens of one cache of ``capacity_blocks`` blocks under Belady's MIN.

    Every block access (request by request, head to tail) is a hit if the block is resident;
    a miss loads it, evicting the resident block whose next use is furthest away (MIN is the
    optimal demand-paging policy for a fixed access order). Hits are counted raw: a resident
    block counts even when an earlier block of the same prompt missed, and the last-token cap
    is not applied. Both only raise the total, which keeps it an upper bound.

    Raises:
        ConfigError: ``capacity_blocks`` < 1.
    """
    if capacity_blocks < 1:
        raise ConfigError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
    ids = blocks.ids
    total = len(ids)
    never = total  # later than every real access
    next_use = array("q", bytes(8 * total))
    last: dict[int, int] = {}
    for t in range(total - 1, -1, -1):
        b = ids[t]
        next_use[t] = last.get(b, never)
        last[b] = t
    resident: dict[int, int] = {}  # block -> its current next use
    heap: list[tuple[int, int]] = []  # (-next_use, block), stale entries skipped
    hits = 0
    push, pop = heapq.heappush, heapq.heappop
    for t in range(total):
        b = ids[t]
        nu = next_use[t]
        if b in resident:
            hits += 1
        elif len(resident) >= capacity_blocks:
            while True:
                neg, victim = pop(heap)
                if resident.get(victim) == -neg:
                    del resident[victim]
                    break
        resident[b] = nu
        push(heap, (-nu, b))
    return hits * blocks.block_size


def ttft_floor_s(num_tokens: int, hit_tokens: int, timing: StepTiming, chunk_tokens: int) -> float:
    """The least TTFT of a prompt of ``num_tokens`` with ``hit_tokens`` cached (module
    docstring): ``k·fixed + a·u + c·Σ_{j<k}(n − j·C)`` with ``k = ⌈u/C⌉``, ``u ≥ 1``.

    Raises:
        ConfigError: a negative count, or ``chunk_tokens`` < 1.
    """
    if num_tokens < 0 or hit_tokens < 0 or chunk_tokens < 1:
        raise ConfigError(
            f"ttft_floor_s needs num_tokens, hit_tokens >= 0 and chunk_tokens >= 1, got "
            f"{num_tokens}, {hit_tokens}, {chunk_tokens}"
        )
    u = max(num_tokens - hit_tokens, 1)
    k = -(-u // chunk_tokens)
    context = k * num_tokens - chunk_tokens * k * (k - 1) // 2
    return k * timing.fixed_s + timing.prefill_token_s * u + timing.context_token_s * context


def decode_floor_s(num_tokens: int, output_tokens: int, timing: StepTiming,
                   max_model_len: int | None = None) -> float:
    """The least time from a prompt of ``num_tokens``'s first token to its last of
    ``output_tokens`` (module docstring, "E2E floor"): ``d = o − 1`` lone decode steps,
    ``d·(fixed + min(b, 2a)) + c·(d·n + d(d+1)/2)``, with ``o`` capped at
    ``max_model_len − n`` (where the engine stops) and at least 1.

    Raises:
        ConfigError: a negative count.
    """
    if num_tokens < 0 or output_tokens < 0:
        raise ConfigError(
            f"decode_floor_s needs num_tokens, output_tokens >= 0, got {num_tokens}, "
            f"{output_tokens}"
        )
    if max_model_len is not None:
        output_tokens = min(output_tokens, max_model_len - num_tokens)
    d = max(output_tokens, 1) - 1
    context = d * num_tokens + d * (d + 1) // 2
    return d * lone_step_s(timing) + timing.context_token_s * context


@dataclass(frozen=True, slots=True)
class BoundRow:
    """One line of the bounds table.

    Attributes:
        name: what the row is (``hits: unbounded``, ``ttft floor, fleet KV``...).
        kind: ``bound`` (no router can do better) or ``estimate``.
        token_hit_rate: hit tokens over prompt tokens (the sim's ``token_hit_rate``).
        ttft_mean_s: the mean TTFT floor with these hits (``None`` for hit-only rows).
        note: how it was computed, in a few words.
        ttft_p99_s / e2e_mean_s / e2e_p99_s: the p99 TTFT floor and the E2E floor's mean and
            p99 (``None`` where the row has none).
    """

    name: str
    kind: str
    token_hit_rate: float
    ttft_mean_s: float | None
    note: str
    ttft_p99_s: float | None = None
    e2e_mean_s: float | None = None
    e2e_p99_s: float | None = None


@dataclass(frozen=True, slots=True)
class ItlRow:
    """One line of the inter-token table.

    Attributes:
        name: what the row is (``itl: own decode alone``...).
        kind: ``bound`` (no router can do better) or ``estimate``.
        figures: the ITL figures (and E2E, for the estimate) with the simulator's keys.
        note: how it was computed, in a few words.
    """

    name: str
    kind: str
    figures: DecodeFigures
    note: str


@dataclass(frozen=True, slots=True)
class BoundsReport:
    """The bounds of one workload on one fleet shape."""

    requests: int
    prompt_tokens: int
    replicas: int
    capacity_blocks: int
    block_size: int
    rows: tuple[BoundRow, ...]
    itl_rows: tuple[ItlRow, ...] = ()

    def as_dict(self) -> dict[str, object]:
        return {
            "requests": self.requests, "prompt_tokens": self.prompt_tokens,
            "replicas": self.replicas, "capacity_blocks": self.capacity_blocks,
            "block_size": self.block_size,
            "rows": [{"name": r.name, "kind": r.kind, "token_hit_rate": r.token_hit_rate,
                      "ttft_mean_s": r.ttft_mean_s, "ttft_p99_s": r.ttft_p99_s,
                      "e2e_mean_s": r.e2e_mean_s, "e2e_p99_s": r.e2e_p99_s, "note": r.note}
                     for r in self.rows],
            "itl_rows": [{"name": r.name, "kind": r.kind, "itl_mean_s": r.figures.itl_mean_s,
                          "itl_p99_s": r.figures.itl_p99_s,
                          "itl_request_mean_s": r.figures.itl_request_mean_s,
                          "itl_request_p99_s": r.figures.itl_request_p99_s,
                          "e2e_mean_s": r.figures.e2e_mean_s,
                          "e2e_p99_s": r.figures.e2e_p99_s, "note": r.note}
                         for r in self.itl_rows],
        }


def compute_bounds(requests: Sequence[WorkloadRequest], profile: TimingProfile, replicas: int,
                   *, num_gpu_blocks: int | None = None, with_opt: bool = True,
                   shared_blocks: int = 0) -> BoundsReport:
    """Hit-rate bounds and TTFT floors of ``requests`` on ``replicas`` engines of ``profile``.

    Args:
        requests: the workload, in arrival order.
        profile: block size, KV capacity, chunk budget, window and step timing of every
            engine.
        replicas: engines in the fleet (the pooled capacity is ``replicas × num_gpu_blocks``).
        num_gpu_blocks: per-engine KV blocks, overriding the profile's.
        with_opt: also run Belady's MIN (the slowest part: one heap operation per block).
        shared_blocks: a store shared by the fleet (with the profile's CPU tier: the
            ``tiers`` rows, ``_tier_rows``).

    Raises:
        ConfigError: no requests, or ``replicas`` < 1.
    """
    if not requests:
        raise ConfigError("compute_bounds needs at least one request")
    if replicas < 1:
        raise ConfigError(f"replicas must be >= 1, got {replicas}")
    bs = profile.block_size
    per_engine = num_gpu_blocks if num_gpu_blocks is not None else profile.num_gpu_blocks
    pooled = replicas * per_engine
    timing = profile.timing
    chunk = profile.max_num_batched_tokens
    blocks = prompt_blocks(requests, bs)
    n_total = sum(blocks.num_tokens)
    if n_total == 0:
        raise ConfigError("every request has an empty prompt: there is nothing to bound")
    unb = unbounded_hits(blocks)
    floors = [ttft_floor_s(n, h, timing, chunk) for n, h in zip(blocks.num_tokens, unb)]
    decodes = [decode_floor_s(n, r.output_tokens, timing, profile.max_model_len)
               for n, r in zip(blocks.num_tokens, requests)]
    e2e = [f + d for f, d in zip(floors, decodes)]
    count = len(blocks)
    unb_total = sum(unb)
    rows = [
        BoundRow("hits: unbounded KV", "bound", unb_total / n_total, None,
                 "every block any earlier request computed stays cached"),
        BoundRow("floors: unbounded KV hits", "bound", unb_total / n_total,
                 mean(floors, 0.0),
                 "own prefill, then own decode alone; no queueing; unbounded hits",
                 ttft_p99_s=percentile(floors, 99, 0.0), e2e_mean_s=mean(e2e, 0.0),
                 e2e_p99_s=percentile(e2e, 99, 0.0)),
    ]
    if with_opt:
        opt_total = opt_hit_total(blocks, pooled)
        # The fleet hits at most min(MIN total, unbounded total): the a·u term with that.
        extra = timing.prefill_token_s * (unb_total - min(opt_total, unb_total))
        rows.append(BoundRow(
            f"hits: fleet KV, Belady ({replicas} x {per_engine:,} blocks pooled)", "bound",
            opt_total / n_total, None,
            "one cache of the fleet's capacity, evicting the block reused furthest ahead"))
        rows.append(BoundRow(
            "floors: fleet KV hits", "bound", opt_total / n_total,
            (sum(floors) + extra) / count,
            "as above, with the fleet-KV hit total (means only)",
            e2e_mean_s=(sum(e2e) + extra) / count))
    lru = lru_hits(blocks, pooled)
    lru_one = lru_hits(blocks, per_engine)
    lru_ttft = [ttft_floor_s(n, h, timing, chunk) for n, h in zip(blocks.num_tokens, lru)]
    lru_e2e = [f + d for f, d in zip(lru_ttft, decodes)]
    rows.append(BoundRow(
        f"hits: fleet KV, LRU ({replicas} x {per_engine:,} blocks pooled)", "estimate",
        sum(lru) / n_total, mean(lru_ttft, 0.0),
        "perfect affinity, no duplicates, vLLM's eviction; floors with no queueing",
        ttft_p99_s=percentile(lru_ttft, 99, 0.0), e2e_mean_s=mean(lru_e2e, 0.0),
        e2e_p99_s=percentile(lru_e2e, 99, 0.0)))
    rows.append(BoundRow(
        f"hits: one engine's KV, LRU ({per_engine:,} blocks)", "estimate",
        sum(lru_one) / n_total, None, "everything on one engine of the fleet's size"))
    tier = profile.cpu_offload_blocks
    if tier or shared_blocks:
        rows += _tier_rows(blocks, profile, replicas, per_engine, shared_blocks, floors, e2e,
                           decodes, lru, unb_total, with_opt=with_opt)
    return BoundsReport(count, n_total, replicas, per_engine, bs, tuple(rows),
                        _itl_rows(requests, blocks.num_tokens, floors, profile, replicas))


def _itl_rows(requests: Sequence[WorkloadRequest], prompts: Sequence[int],
              floors: Sequence[float], profile: TimingProfile,
              replicas: int) -> tuple[ItlRow, ...]:
    """The lone-decode ITL floors and the spread estimate (``bench.itl_floors``); none when
    no request decodes past its first token."""
    steps = [decode_steps(n, r.output_tokens, profile.max_model_len)
             for n, r in zip(prompts, requests)]
    if sum(steps) == 0:
        return ()
    timing = profile.timing
    # The zero-queue timeline: a closed-loop turn starts its think time after its
    # predecessor's last token there (``bench.workloads.release_time``).
    ends: dict[str, float] = {}
    releases: list[float] = []
    for r, n, d, f in zip(requests, prompts, steps, floors):
        release = r.arrival_s
        if r.depends_on is not None and r.depends_on in ends:
            release = ends[r.depends_on] + (r.think_time_s or 0.0)
        releases.append(release)
        ends[r.request_id] = release + f + decode_floor_s(n, d + 1, timing)
    lone = lone_itl_floors(prompts, steps, timing)
    spread = spread_itl_estimate(releases, floors, prompts, steps, timing, replicas)
    return (
        ItlRow("itl: own decode alone", "bound", lone,
               "every gap one lone decode step reading the request's own context"),
        ItlRow(f"itl: decodes in flight spread evenly ({replicas} replicas)", "estimate",
               spread, "zero-queue timeline; each gap shares its step with an even share "
               "of the other decodes then (prefills left out)"),
    )


def _tier_rows(blocks: PromptBlocks, profile: TimingProfile, replicas: int, per_engine: int,
               shared_blocks: int, floors: list[float], e2e: list[float],
               decodes: list[float], lru: Sequence[int], unb_total: int, *,
               with_opt: bool) -> list[BoundRow]:
    """The rows of a fleet with offload tiers (each engine's CPU tier, a shared store).

    * Belady over every tier pooled (``replicas × (device + CPU) + shared``): whatever the
      tiers hold is in their union, so the bound holds; its floor counts loads as free.
    * LRU with write-through tiers: every computed block is written to the CPU tier, so an
      engine's device and CPU caches together hold about its ``max(device, CPU)`` most
      recent blocks; pooled with perfect affinity, plus the shared store. Its TTFT floor
      pays each hit the device-only LRU estimate would not have at the tier's load time
      (``cpu_load_s_per_block / B`` a token; the shared store's if there is no CPU tier).
    """
    bs = profile.block_size
    tier = profile.cpu_offload_blocks
    timing = profile.timing
    chunk = profile.max_num_batched_tokens
    n_total = sum(blocks.num_tokens)
    count = len(blocks)
    label = " + ".join(x for x in (f"{replicas} x {tier:,} CPU" if tier else "",
                                   f"{shared_blocks:,} shared" if shared_blocks else "") if x)
    rows: list[BoundRow] = []
    if with_opt:
        pooled = replicas * (per_engine + tier) + shared_blocks
        opt_total = opt_hit_total(blocks, pooled)
        extra = timing.prefill_token_s * (unb_total - min(opt_total, unb_total))
        rows.append(BoundRow(f"hits: fleet KV + tiers ({label}), Belady", "bound",
                             opt_total / n_total, (sum(floors) + extra) / count,
                             "every tier pooled, loads free; TTFT floor mean with that total",
                             e2e_mean_s=(sum(e2e) + extra) / count))
    capacity = replicas * max(per_engine, tier) + shared_blocks
    tiered = lru_hits(blocks, capacity)
    load_per_token = profile.cpu_load_s_per_block / bs
    ttft = [ttft_floor_s(n, h, timing, chunk) + max(0, h - g) * load_per_token
            for n, h, g in zip(blocks.num_tokens, tiered, lru)]
    full = [f + d for f, d in zip(ttft, decodes)]
    rows.append(BoundRow(
        f"hits: fleet KV + tiers ({label}), LRU write-through", "estimate",
        sum(tiered) / n_total, mean(ttft, 0.0),
        "perfect affinity; tier hits beyond the device-only LRU pay their load",
        ttft_p99_s=percentile(ttft, 99, 0.0), e2e_mean_s=mean(full, 0.0),
        e2e_p99_s=percentile(full, 99, 0.0)))
    return rows


def format_bounds_table(report: BoundsReport) -> list[list[str]]:
    """Rows of the printed bounds table (header first)."""
    def seconds(value: float | None) -> str:
        return "—" if value is None else f"{value:.3f}s"

    rows = [["bound", "kind", "token hit rate", "TTFT mean floor", "TTFT p99 floor",
             "E2E mean floor", "E2E p99 floor", "how"]]
    for r in report.rows:
        rows.append([
            r.name, r.kind, f"{r.token_hit_rate:.3f}", seconds(r.ttft_mean_s),
            seconds(r.ttft_p99_s), seconds(r.e2e_mean_s), seconds(r.e2e_p99_s), r.note,
        ])
    return rows


def format_itl_table(report: BoundsReport) -> list[list[str]]:
    """Rows of the printed inter-token table (header first; only the header without ITL
    rows)."""
    def ms(value: float) -> str:
        return f"{value * 1e3:.2f}ms"

    def seconds(value: float | None) -> str:
        return "—" if value is None else f"{value:.3f}s"

    rows = [["inter-token", "kind", "ITL mean", "ITL p99", "ITL/req mean", "ITL/req p99",
             "E2E mean", "E2E p99", "how"]]
    for r in report.itl_rows:
        f = r.figures
        rows.append([r.name, r.kind, ms(f.itl_mean_s), ms(f.itl_p99_s),
                     ms(f.itl_request_mean_s), ms(f.itl_request_p99_s), seconds(f.e2e_mean_s),
                     seconds(f.e2e_p99_s), r.note])
    return rows

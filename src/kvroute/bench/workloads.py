"""Benchmark workloads: one request record (:class:`WorkloadRequest`) for every request stream.

Every generator is deterministic for a given ``seed`` (it owns a ``random.Random(seed)``; the
global RNG is never touched), bounded by explicit counts, and returns a list sorted by
``arrival_s``. Request ids are unique within one workload.

Token ids of generated prompts are drawn from ``VOCAB_MIN..VOCAB_MAX-1`` (100..31999), clear of
the special tokens real vocabularies put at the bottom. Trace replays (:func:`mooncake`) use
Dynamo's ids instead (see :mod:`kvroute.bench.traces`). For live HTTP runs, ``to_text``
(:mod:`kvroute.tokenize.words`) turns ids into text, one deterministic lowercase word per id
separated by single spaces, so a whitespace tokenizer sees exactly one token per id and
``from_text`` inverts it exactly.
With ``with_messages=True``, generators also fill ``messages`` (OpenAI chat form) whose contents
are :func:`to_text` of the prompt's segments (system prompt, user turns, assistant turns).

**Closed-loop sessions.** :func:`growing_sessions` makes turn ``k+1`` depend on turn ``k``: its
``depends_on`` is the previous request id and ``think_time_s`` the pause after that request
*finishes*. A closed-loop driver releases such a request at ``finish(depends_on) +
think_time_s`` (:func:`release_time` computes it) and ignores ``arrival_s``, which for dependent
requests only holds the lower bound ``arrival(previous) + think_time_s`` (zero service time)
so that list order and open-loop drivers still see a sensible schedule. Requests without
``depends_on`` are released at ``arrival_s``.

The record itself lives in :mod:`kvroute.sim.workload`: the fleet simulation consumes it, and
``sim`` must not import ``bench``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final

from kvroute.bench.traces import load_trace
from kvroute.core.errors import ConfigError
from kvroute.sim.workload import Message, WorkloadRequest
from kvroute.tokenize.words import to_text

__all__ = [
    "VOCAB_MAX",
    "VOCAB_MIN",
    "WORKLOADS",
    "generated_shared_prefix",
    "growing_sessions",
    "hot_prefix_bursts",
    "mooncake",
    "release_time",
    "sibling_fanout",
    "unique_prompts",
]

VOCAB_MIN: Final = 100
"""Smallest generated token id (ids below are left to special tokens)."""
VOCAB_MAX: Final = 32000
"""One past the largest generated token id."""
_VOCAB: Final[list[int]] = list(range(VOCAB_MIN, VOCAB_MAX))
# Drawing from a list (not a range) makes every generated token a reference to one of these
# 31,900 int objects: 8 bytes per token instead of 36.
_VOCAB_SIZE: Final = VOCAB_MAX - VOCAB_MIN


def release_time(request: WorkloadRequest, finished_s: Mapping[str, float]) -> float | None:
    """When a driver should send ``request``; ``None`` while its dependency is unfinished.

    ``finished_s`` maps request ids to the (virtual or wall) time their last token arrived.
    """
    if request.depends_on is None:
        return request.arrival_s
    done = finished_s.get(request.depends_on)
    if done is None:
        return None
    return done + (request.think_time_s or 0.0)


# --------------------------------------------------------------------------------------------
# Helpers


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _positive_int(name: str, value: int, minimum: int = 1) -> None:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        f"{name} must be an integer >= {minimum}, got {value!r}",
    )


def _random_tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.choices(_VOCAB, k=n)) if n > 0 else ()


def _distinct_heads(rng: random.Random, n: int, what: str) -> list[int]:
    """``n`` distinct first-token ids (so the prompts they start share no token at all)."""
    _require(
        n <= _VOCAB_SIZE,
        f"{what}: {n} prompts need {n} distinct first tokens but the vocabulary has "
        f"{_VOCAB_SIZE}; use fewer",
    )
    return rng.sample(_VOCAB, n)


def _poisson_arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    """First arrival at 0, then exponential gaps of mean ``1/rate``; all 0 for ``rate=inf``."""
    _require(rate > 0 and not math.isnan(rate), f"rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    arrivals = [0.0]
    for _ in range(n - 1):
        arrivals.append(arrivals[-1] + rng.expovariate(rate))
    return arrivals


def _jittered(rng: random.Random, mean: int, jitter: float) -> int:
    low = max(1, round(mean * (1 - jitter)))
    high = max(low, round(mean * (1 + jitter)))
    return rng.randint(low, high)


def _chat(*segments: tuple[str, Sequence[int]]) -> list[Message]:
    return [{"role": role, "content": to_text(ids)} for role, ids in segments if ids]


def _sorted(requests: list[WorkloadRequest]) -> list[WorkloadRequest]:
    return sorted(requests, key=lambda r: r.arrival_s)  # stable: ties keep generation order


# --------------------------------------------------------------------------------------------
# Generators


def generated_shared_prefix(
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    rate: float = math.inf,
    seed: int = 0,
    *,
    with_messages: bool = False,
) -> list[WorkloadRequest]:
    """SGLang's ``generated-shared-prefix`` shape (``bench_serving`` defaults as arguments).

    Each group has one random system prompt (distinct first tokens across groups); each request
    is its group's system prompt plus its own random question. The ``num_groups *
    prompts_per_group`` requests are shuffled (SGLang's default, un-``--gsp-ordered``) and
    arrive as a Poisson process at ``rate`` req/s, the first at 0; ``rate=inf`` (SGLang's
    default request rate) sends all at 0. Lengths are exact (SGLang's ``--gsp-range-ratio 1``).
    """
    for name, value in (("num_groups", num_groups), ("prompts_per_group", prompts_per_group)):
        _positive_int(name, value)
    _positive_int("system_prompt_len", system_prompt_len)
    _positive_int("question_len", question_len)
    _positive_int("output_len", output_len)
    rng = random.Random(seed)
    heads = _distinct_heads(rng, num_groups, "generated_shared_prefix")
    systems = [(h, *_random_tokens(rng, system_prompt_len - 1)) for h in heads]
    slots = [(g, i) for g in range(num_groups) for i in range(prompts_per_group)]
    questions = {slot: _random_tokens(rng, question_len) for slot in slots}
    rng.shuffle(slots)
    arrivals = _poisson_arrivals(rng, len(slots), rate)
    requests = []
    for arrival, (g, i) in zip(arrivals, slots):
        question = questions[(g, i)]
        requests.append(
            WorkloadRequest(
                arrival_s=arrival,
                request_id=f"gsp-g{g}-p{i}",
                prompt_token_ids=systems[g] + question,
                output_tokens=output_len,
                group=f"g{g}",
                messages=_chat(("system", systems[g]), ("user", question))
                if with_messages
                else None,
            )
        )
    return _sorted(requests)


def unique_prompts(
    num_requests: int = 1000,
    *,
    trace: str | Path = "azure_conv",
    rate_scale: float = 1.0,
    max_input_tokens: int | None = None,
    seed: int = 0,
    with_messages: bool = False,
) -> list[WorkloadRequest]:
    """Prompts that share nothing, with arrivals and lengths from an Azure 2023 trace.

    Takes the first ``num_requests`` arrivals of ``trace`` (``azure_conv`` or ``azure_code``,
    or a CSV path), scaled by ``rate_scale``; ``ContextTokens`` becomes the prompt length
    (capped at ``max_input_tokens`` if given, e.g. a small model's window minus output) and
    ``GeneratedTokens`` the output length. Every prompt has a distinct first token, so no two
    requests share even one token of prefix: the workload where prefix routing cannot help.
    """
    _positive_int("num_requests", num_requests)
    if max_input_tokens is not None:
        _positive_int("max_input_tokens", max_input_tokens)
    loaded = load_trace(trace, rate_scale=rate_scale, limit=num_requests)
    _require(
        loaded.format == "azure",
        f"unique_prompts takes an Azure-format trace (azure_conv, azure_code), got {trace!r}",
    )
    _require(
        len(loaded) == num_requests,
        f"trace {loaded.name!r} has only {len(loaded)} requests, fewer than "
        f"num_requests={num_requests}; ask for at most {len(loaded)}",
    )
    rng = random.Random(seed)
    heads = _distinct_heads(rng, num_requests, "unique_prompts")
    requests = []
    for n, (record, head) in enumerate(zip(loaded.records, heads)):
        length = record.input_length
        if max_input_tokens is not None:
            length = min(length, max_input_tokens)
        prompt = (head, *_random_tokens(rng, length - 1))
        requests.append(
            WorkloadRequest(
                arrival_s=record.arrival_s,
                request_id=f"uniq-{n}",
                prompt_token_ids=prompt,
                output_tokens=record.output_length,
                messages=_chat(("user", prompt)) if with_messages else None,
            )
        )
    return _sorted(requests)


def hot_prefix_bursts(
    num_bursts: int = 4,
    burst_size: int = 48,
    system_prompt_tokens: int = 600,
    suffix_tokens: int = 32,
    output_tokens: int = 64,
    burst_interval_s: float = 30.0,
    seed: int = 0,
    *,
    with_messages: bool = False,
) -> list[WorkloadRequest]:
    """One shared system prompt, arriving in bursts of ``burst_size`` simultaneous requests.

    Burst ``b`` arrives entirely at ``b * burst_interval_s``; each request appends its own
    suffix (distinct first suffix tokens across the whole workload). The defaults mirror the
    measured hot-spot scenario (48 concurrent requests sharing a 2.3k-character, ~600-token
    system prompt) that SGLang's and vllm-router's ``cache_aware`` sent 48/0/0/0.
    """
    _positive_int("num_bursts", num_bursts)
    _positive_int("burst_size", burst_size)
    _positive_int("system_prompt_tokens", system_prompt_tokens)
    _positive_int("suffix_tokens", suffix_tokens)
    _positive_int("output_tokens", output_tokens)
    _require(
        math.isfinite(burst_interval_s) and burst_interval_s >= 0,
        f"burst_interval_s must be a finite number >= 0, got {burst_interval_s}",
    )
    rng = random.Random(seed)
    system = _random_tokens(rng, system_prompt_tokens)
    heads = _distinct_heads(rng, num_bursts * burst_size, "hot_prefix_bursts")
    requests = []
    for b in range(num_bursts):
        for r in range(burst_size):
            suffix = (heads[b * burst_size + r], *_random_tokens(rng, suffix_tokens - 1))
            requests.append(
                WorkloadRequest(
                    arrival_s=b * burst_interval_s,
                    request_id=f"hot-b{b}-r{r}",
                    prompt_token_ids=system + suffix,
                    output_tokens=output_tokens,
                    group="hot",
                    messages=_chat(("system", system), ("user", suffix)) if with_messages else None,
                )
            )
    return _sorted(requests)


def sibling_fanout(
    num_prompts: int = 16,
    fanout: int = 8,
    prompt_tokens: int = 2048,
    output_tokens: int = 128,
    interval_s: float = 5.0,
    seed: int = 0,
    *,
    with_messages: bool = False,
    sibling_gap_s: float = 0.0,
) -> list[WorkloadRequest]:
    """Each of ``num_prompts`` prompts sent ``fanout`` times at once (parallel sampling, agents).

    Prompt ``p`` arrives at ``p * interval_s`` as ``fanout`` identical requests (one tuple),
    group ``fan{p}``; with ``sibling_gap_s``, sibling ``s`` arrives ``s * sibling_gap_s`` after
    the first (several routers: siblings closer than the bus delay reach their routers before
    any sibling's placement does, ``sim/routers.py``). Prompts have distinct first tokens, so only siblings share a prefix: the
    race where event-driven indexes scatter siblings before the first ``BlockStored`` arrives.
    """
    _positive_int("num_prompts", num_prompts)
    _positive_int("fanout", fanout)
    _positive_int("prompt_tokens", prompt_tokens)
    _positive_int("output_tokens", output_tokens)
    _require(
        math.isfinite(interval_s) and interval_s >= 0,
        f"interval_s must be a finite number >= 0, got {interval_s}",
    )
    _require(
        math.isfinite(sibling_gap_s) and sibling_gap_s >= 0,
        f"sibling_gap_s must be a finite number >= 0, got {sibling_gap_s}",
    )
    rng = random.Random(seed)
    heads = _distinct_heads(rng, num_prompts, "sibling_fanout")
    requests = []
    for p, head in enumerate(heads):
        prompt = (head, *_random_tokens(rng, prompt_tokens - 1))
        messages = _chat(("user", prompt)) if with_messages else None
        for s in range(fanout):
            requests.append(
                WorkloadRequest(
                    arrival_s=p * interval_s + s * sibling_gap_s,
                    request_id=f"fan-{p}-s{s}",
                    prompt_token_ids=prompt,
                    output_tokens=output_tokens,
                    group=f"fan{p}",
                    messages=None if messages is None else [dict(m) for m in messages],
                )
            )
    return _sorted(requests)


def growing_sessions(
    num_sessions: int = 8,
    window_tokens: int = 2048,
    system_prompt_tokens: int = 256,
    user_tokens: int = 128,
    output_tokens: int = 128,
    think_time_s: float = 5.0,
    session_interval_s: float = 2.0,
    seed: int = 0,
    *,
    length_jitter: float = 0.5,
    shared_system_prompt: bool = True,
    max_turns: int = 256,
    with_messages: bool = False,
) -> list[WorkloadRequest]:
    """Multi-turn agent sessions whose prompt grows each turn until it crosses ``window_tokens``.

    Turn 0 is system prompt + user turn; turn ``k+1`` is turn ``k``'s prompt + its synthetic
    assistant output (``output_tokens`` ids, the same the next prompt replays, as trace
    replayers substitute recorded assistant text) + a new user turn. Each session ends with
    its first turn whose *prompt alone* exceeds ``window_tokens`` (the small model cannot take
    it); earlier turns may already have ``prompt + output > window`` (the clamp case).

    User and output lengths are uniform in ``[L(1-j), L(1+j)]`` for ``j = length_jitter``.
    Sessions start ``session_interval_s`` apart; later turns are closed-loop (``depends_on``,
    ``think_time_s``; see the module docstring). With ``shared_system_prompt`` every session
    starts with the same system prompt (one agent, many users); the first user turns have
    distinct first tokens either way. Raises :class:`ConfigError` if ``max_turns`` turns do not
    reach the window.
    """
    _positive_int("num_sessions", num_sessions)
    _positive_int("window_tokens", window_tokens)
    _positive_int("system_prompt_tokens", system_prompt_tokens, minimum=0)
    _positive_int("user_tokens", user_tokens)
    _positive_int("output_tokens", output_tokens)
    _positive_int("max_turns", max_turns)
    _require(0 <= length_jitter < 1, f"length_jitter must be in [0, 1), got {length_jitter}")
    for name, value in (("think_time_s", think_time_s), ("session_interval_s", session_interval_s)):
        _require(
            math.isfinite(value) and value >= 0,
            f"{name} must be a finite number >= 0, got {value}",
        )
    rng = random.Random(seed)
    heads = _distinct_heads(rng, num_sessions, "growing_sessions")
    shared = _random_tokens(rng, system_prompt_tokens)
    requests: list[WorkloadRequest] = []
    for s, head in enumerate(heads):
        system = shared if shared_system_prompt else _random_tokens(rng, system_prompt_tokens)
        user = (head, *_random_tokens(rng, _jittered(rng, user_tokens, length_jitter) - 1))
        segments: list[tuple[str, Sequence[int]]] = [("system", system), ("user", user)]
        prompt: tuple[int, ...] = system + user
        previous: WorkloadRequest | None = None
        for turn in range(max_turns):
            out_len = _jittered(rng, output_tokens, length_jitter)
            request = WorkloadRequest(
                arrival_s=(
                    s * session_interval_s
                    if previous is None
                    else previous.arrival_s + think_time_s
                ),
                request_id=f"sess{s}-t{turn}",
                prompt_token_ids=prompt,
                output_tokens=out_len,
                session_id=f"sess{s}",
                turn=turn,
                messages=_chat(*segments) if with_messages else None,
                think_time_s=None if previous is None else think_time_s,
                depends_on=None if previous is None else previous.request_id,
            )
            requests.append(request)
            if len(prompt) > window_tokens:
                break
            previous = request
            answer = _random_tokens(rng, out_len)
            user = _random_tokens(rng, _jittered(rng, user_tokens, length_jitter))
            segments += [("assistant", answer), ("user", user)]
            prompt = prompt + answer + user
        else:
            raise ConfigError(
                f"growing_sessions: session {s} did not cross window_tokens={window_tokens} "
                f"within max_turns={max_turns}; raise max_turns or the per-turn lengths"
            )
    return _sorted(requests)


def mooncake(
    trace: str | Path = "mooncake_conversation",
    *,
    limit: int | None = None,
    rate_scale: float = 1.0,
    block_tokens: int | None = None,
    token_offset: int = 0,
    jitter_s: float = 0.0,
    seed: int = 0,
    sessions: bool = True,
) -> list[WorkloadRequest]:
    """A Mooncake-format trace as workload requests, tokens synthesized lazily as Dynamo does.

    Options are those of :func:`~kvroute.bench.traces.load_trace`; ``token_offset`` those of
    :func:`~kvroute.bench.traces.mooncake_tokens`. ``prompt_token_ids`` is a lazy
    ``BlockTokens`` (the whole conversation trace is 145 M tokens) of exactly
    ``input_length`` tokens.

    Sessions: the Mooncake files record none, so ``session_id`` is the row's ``session_id``
    when a (Dynamo-converted) trace carries one and ``None`` otherwise. Sessions are not
    inferred from shared hash-id prefixes: that would hand session-affinity policies the very
    prefix structure that real session headers do not reveal, and every conversation-trace
    request shares block 0 anyway. The bundled agentic trace is the exception: its ids are
    numbered per session, which a coding agent's session header does reveal
    (:mod:`kvroute.bench.trace_sessions`; ``sessions=False`` replays it unmarked).
    ``request_id`` is ``<trace>-<line>``.
    """
    loaded = load_trace(
        trace,
        rate_scale=rate_scale,
        limit=limit,
        block_tokens=block_tokens,
        jitter_s=jitter_s,
        seed=seed,
        sessions=sessions,
    )
    _require(
        loaded.format == "mooncake",
        f"mooncake() takes a Mooncake-format trace (mooncake_conversation, "
        f"mooncake_synthetic, claude_code_agentic_64, or a .jsonl / .jsonl.xz path), "
        f"got {trace!r}",
    )
    return [
        WorkloadRequest(
            arrival_s=record.arrival_s,
            request_id=f"{loaded.name}-{record.line}",
            prompt_token_ids=loaded.tokens(record, token_offset=token_offset),
            output_tokens=record.output_length,
            session_id=record.session_id,
        )
        for record in loaded.records
    ]


WORKLOADS: Final[dict[str, Callable[..., list[WorkloadRequest]]]] = {
    "generated_shared_prefix": generated_shared_prefix,
    "unique_prompts": unique_prompts,
    "hot_prefix_bursts": hot_prefix_bursts,
    "sibling_fanout": sibling_fanout,
    "growing_sessions": growing_sessions,
    "mooncake": mooncake,
}
"""Workload name -> generator, for the ``bench`` CLI (keyword arguments pass through)."""

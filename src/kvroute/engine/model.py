"""A model of one vLLM v1 engine that behaves like vLLM in everything a router can observe.

Owns the scheduler state of one simulated engine: the waiting queue, the running batch,
each request's tokens, block hashes and blocks (through ``blocks.BlockPool``), the
step-time model and the engine's Prometheus-style counters. The virtual-time fleet simulation
and the real-time simulated server both drive it through the same four calls:
``add_request``, ``abort_request``, ``step`` and ``reset_prefix_cache``.

Pure: no I/O, no clock (a step *returns* its modelled duration; the caller advances virtual
time or sleeps), no global RNG (output tokens are a function of a per-request seed). Must not
import ``shell``, ``sim`` or ``wire``.

Theory of operation (vLLM 0.32 ``Scheduler.schedule`` + ``update_from_output``; read for
understanding, not copied):

1. **Admission** (the OpenAI server's checks, ``vllm/renderers/params.py``): an empty
   prompt, ``max_tokens > max_model_len``, a prompt longer than ``max_model_len`` and a
   prompt of exactly ``max_model_len`` tokens are rejected with a ``Rejection`` carrying the
   numbers. Otherwise ``max_tokens`` is silently clamped to ``max_model_len - prompt`` and
   the request joins the tail of the FCFS waiting queue.
2. **Schedule, running first.** Each step has a token budget (``max_num_batched_tokens``).
   Running requests, in order, get their next tokens (one decode token, or the next prefill
   chunk). When a request cannot get the blocks it needs, the *newest* running request is
   preempted by recompute (blocks freed, progress forgotten, put back at the *front* of the
   waiting queue, ``num_preemptions`` + 1) until it fits or it was itself the victim.
3. **Then waiting requests**, FCFS, while budget and ``max_num_seqs`` allow, and only if no
   request was preempted this step: each first looks up its prefix-cache hit (the longest run
   of cached whole blocks, capped at ``num_tokens - 1`` tokens so the last token is always
   computed); it is admitted only if blocks for its whole sequence are free
   (``scheduler_reserve_full_isl``), and then takes blocks for ``min(remaining, budget)``
   tokens (chunked prefill). A request that does not fit stays at the head and blocks the
   queue (no skipping).
4. **Cache as scheduled.** Blocks that will be full after the step are hashed into the
   prefix cache (and announced with ``BlockStored``) when they are allocated, as vLLM's
   ``allocate_slots`` does; evictions (``BlockRemoved``) happen lazily inside allocation.
5. **Outputs.** A request whose computed tokens reach its known tokens samples one token
   (a partial prefill chunk samples nothing). The token is appended; a block it completes is
   hashed (and cached at the next step, when its KV is computed). It finishes with
   ``"length"`` at ``max_tokens`` (or the window) and with ``"stop"`` at ``output_length``
   when that is smaller (the model's stand-in for EOS). Finished requests free their blocks,
   which stay cached until reused.

Output tokens: ``output_token_id(seed, i, vocab_size)``, a splitmix64 mix of the request's
seed (given, or derived from the request id with BLAKE2b) and the output index. The same
request sequence therefore produces the same tokens, block hashes and events in every run.
EOS is not sampled: a request ends at ``output_length`` ("stop", like ``ignore_eos`` benchmarks
with a fixed output length) or at its token limit ("length").

6. **Offload tiers** (``engine/offload.py``): with ``cpu_offload_blocks`` the engine keeps a
   CPU tier as vLLM's native offloading does (write-through of every cached block, its own
   LRU, ``BlockStored``/``BlockRemoved`` with ``medium="CPU"``); a ``shared_tier`` given to
   several engines is a store they all read and write (LMCache-like). A waiting request's
   prefix that continues in a tier after its device hit is loaded: those tokens count as
   computed (``num_cached_tokens``; ``external_prefix_cache_hits_total``), take new device
   blocks (cached there with ``BlockStored`` GPU), and add ``load_s_per_block`` each to the
   step that admits it.

Not modelled: speculative decoding, multimodal inputs, prompt embeddings, sliding-window or
hybrid KV groups, priority scheduling, KV connectors other than offloading, async loads
(a tier load is on its step's critical path), async scheduling.
"""

from __future__ import annotations

import enum
import hashlib
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from kvroute.core.errors import ConfigError, RouterError
from kvroute.core.events import KVEvent
from kvroute.core.hashing import BlockHasher, LoraKey, validate_cache_salt
from kvroute.core.types import BlockHash, WireHash, to_wire_hash
from kvroute.engine.blocks import BlockPool
from kvroute.engine.offload import OffloadTier

__all__ = [
    "ZERO_TIMING",
    "Accepted",
    "Admission",
    "EngineConfig",
    "EngineInputError",
    "EngineMetrics",
    "EngineModel",
    "EngineRequest",
    "FinishReason",
    "Rejection",
    "RejectionKind",
    "RequestOutput",
    "StepResult",
    "StepTiming",
    "output_token_id",
]

_MASK64 = (1 << 64) - 1


class EngineInputError(RouterError):
    """The caller broke the engine model's contract (duplicate request id, hashes that do not
    match the prompt). Normal outcomes such as an over-long prompt are ``Rejection`` values."""


# ---------------------------------------------------------------------------------- timing


@dataclass(frozen=True, slots=True)
class StepTiming:
    """The step-time model ``fixed + a·prefill_tokens + b·decode_seqs + c·context_tokens``.

    What each term stands for on a real GPU:
        * ``fixed_s``: cost of any non-empty forward pass whatever its size: reading every
          weight once from HBM (memory-bound), kernel launches, the scheduler and sampler.
        * ``prefill_token_s`` (a): the compute-bound matmul cost of one prompt token
          (≈ 2·params FLOPs at the achieved FLOP rate), for every prompt token computed
          this step, including tokens recomputed after a preemption.
        * ``decode_seq_s`` (b): the extra cost of one sequence decoding one token this step
          (its share of the matmuls plus per-sequence sampling and bookkeeping).
        * ``context_token_s`` (c): attention reading the KV of one context token from HBM;
          ``context_tokens`` is, over every request scheduled this step, the tokens whose KV
          attention reads (its computed tokens after the step). This is what makes long
          contexts decode slowly and the only term that grows with history.

    Worked example (the ``llama-3.1-8b-h100`` profile: 6 ms, 40 µs, 20 µs, 0.05 µs): a step
    with a 2,048-token prefill chunk of a fresh prompt plus 32 decodes at 1,000 context each
    costs 6 + 2048·0.040 + 32·0.020 + (2048 + 32·1000)·0.00005 = 6 + 81.9 + 0.64 + 1.70
    ≈ 90.3 ms.
    """

    fixed_s: float = 0.0
    prefill_token_s: float = 0.0
    decode_seq_s: float = 0.0
    context_token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fixed_s", "prefill_token_s", "decode_seq_s", "context_token_s"):
            value = getattr(self, name)
            if not value >= 0.0 or value == float("inf"):
                raise ConfigError(
                    f"StepTiming.{name}={value!r} must be a finite number of seconds >= 0"
                )

    def step_time_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        """Modelled duration of one step; 0 for an empty step (nothing was run)."""
        if prefill_tokens == 0 and decode_seqs == 0:
            return 0.0
        return (
            self.fixed_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_seq_s * decode_seqs
            + self.context_token_s * context_tokens
        )


ZERO_TIMING = StepTiming()
"""Every step takes no time: for throughput tests of the model itself."""


# ---------------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The vLLM engine arguments the model honours.

    Attributes:
        num_gpu_blocks: KV blocks including vLLM's reserved null block (``--num-gpu-blocks-
            override``); ``num_gpu_blocks - 1`` can hold KV.
        block_size: tokens per block (16 on GPU by default, 128 on the CPU backend).
        max_model_len: the context window, prompt + output.
        max_num_seqs: the most requests in the running batch (vLLM default 256 on most GPUs).
        max_num_batched_tokens: the per-step token budget (8192 for the OpenAI server).
        timing: the step-time model.
        vocab_size: output token ids are drawn from ``[0, vocab_size)``.
        default_max_tokens: ``max_tokens`` of a completions request that gives none (16).
        scheduler_reserve_full_isl: vLLM's admission gate (default on since 0.19): a waiting
            request starts only if blocks for its whole current sequence are free, not just
            for its first chunk.
        enable_prefix_caching: vLLM's ``--enable-prefix-caching`` (on by default); off, no
            block is ever a hit, none is cached or announced in a KV event, and the prefix
            cache counters stay at 0 (vLLM records no prefix-cache stats without it).
        max_loras: vLLM's ``--max-loras``: distinct adapters one running batch holds; a
            waiting request whose adapter would exceed it is skipped (not blocking those
            behind it) until a slot frees. None: no limit.
        cpu_offload_blocks: blocks of the engine's own CPU tier (vLLM ``--kv-offloading-size``
            in blocks; 0: none). Used only with prefix caching on.
        cpu_load_s_per_block: seconds to load one block back from that tier (block bytes /
            bandwidth, ``engine/kv_sizing.py``).

    Raises:
        ConfigError: a value is out of range, or one request of ``max_model_len`` tokens
            would not fit in the KV cache (vLLM refuses to start in that case too).
    """

    num_gpu_blocks: int
    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    timing: StepTiming = ZERO_TIMING
    vocab_size: int = 32000
    default_max_tokens: int = 16
    scheduler_reserve_full_isl: bool = True
    enable_prefix_caching: bool = True
    max_loras: int | None = None
    cpu_offload_blocks: int = 0
    cpu_load_s_per_block: float = 0.0

    def __post_init__(self) -> None:
        if (not isinstance(self.cpu_offload_blocks, int) or self.cpu_offload_blocks < 0
                or not self.cpu_load_s_per_block >= 0.0
                or self.cpu_load_s_per_block == float("inf")):
            raise ConfigError(
                f"EngineConfig.cpu_offload_blocks={self.cpu_offload_blocks!r} must be an "
                f"integer >= 0 and cpu_load_s_per_block={self.cpu_load_s_per_block!r} a finite "
                "number of seconds >= 0")
        for name in (
            "num_gpu_blocks", "max_model_len", "block_size", "max_num_seqs",
            "max_num_batched_tokens", "vocab_size", "default_max_tokens",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"EngineConfig.{name}={value!r} must be a positive integer")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"EngineConfig.max_num_batched_tokens={self.max_num_batched_tokens} is smaller "
                f"than max_num_seqs={self.max_num_seqs}; vLLM requires at least one token per "
                "running sequence: raise max_num_batched_tokens or lower max_num_seqs"
            )
        needed = -(-self.max_model_len // self.block_size)
        if self.num_gpu_blocks - 1 < needed:
            raise ConfigError(
                f"EngineConfig.num_gpu_blocks={self.num_gpu_blocks} cannot hold one request of "
                f"max_model_len={self.max_model_len} tokens ({needed} blocks of "
                f"{self.block_size} plus the null block); vLLM would refuse to start: give at "
                f"least {needed + 1} blocks or lower max_model_len"
            )


# ---------------------------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One generation request as the engine receives it (after tokenization).

    Attributes:
        request_id: unique among the engine's live requests.
        prompt_token_ids: the prompt.
        max_tokens: requested output limit; ``None`` = the endpoint's default (16 for
            completions, the rest of the window for chat).
        endpoint: ``"completions"`` or ``"chat"`` (only changes the default ``max_tokens``).
        output_length: if set, the request "emits EOS" after this many tokens (finish
            ``"stop"``) unless its token limit comes first; benchmarks set it from a trace.
        cache_salt: vLLM's per-request salt (enters block 0's hash and its event keys).
        lora: the adapter (name and load path, both hashed), or ``None`` for the base model.
            Events carry its name and ``lora_id``.
        lora_id: the adapter's int id on this engine (vLLM numbers ``--lora-modules`` from
            1); events carry it as their deprecated ``lora_id``.
        report_full: vLLM's ``kv_cache_report_mode: "full"`` (``vllm_xargs``): a prefix hit
            also emits a ``BlockStored`` for the reused blocks (parent ``None``, tokens from
            0, no state change), so a consumer sees every block the engine reuses.
        prompt_block_hashes: the prompt's full-block hashes when the caller already has them
            (the router hashed the prompt the same way); saves hashing the prompt twice. They
            are trusted: they must have been made with this engine's hasher settings.
        seed: seed of the output tokens; ``None`` derives one from ``request_id``.
        arrival_s: caller's timestamp, kept for the caller's bookkeeping.
        kv_transfer_s_per_token: the prompt's KV comes from a remote prefill (vLLM's
            ``kv_transfer_params`` with ``do_remote_prefill``), at this many seconds a token:
            the blocks this engine does not hold already are pulled while the request waits
            (vLLM's ``WAITING_FOR_REMOTE_KVS``: other requests keep running), then it is
            admitted with every prompt token but the last computed. None: prefill here.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int | None = None
    endpoint: Literal["completions", "chat"] = "completions"
    output_length: int | None = None
    cache_salt: str | None = None
    lora: LoraKey | None = None
    prompt_block_hashes: Sequence[BlockHash] | None = None
    seed: int | None = None
    arrival_s: float = 0.0
    lora_id: int | None = None
    report_full: bool = False
    kv_transfer_s_per_token: float | None = None


class RejectionKind(enum.StrEnum):
    """Why the OpenAI server of vLLM 0.32 answers 400 before the request reaches the engine."""

    EMPTY_PROMPT = "empty_prompt"
    """``The decoder prompt cannot be empty``."""
    PROMPT_TOO_LONG = "prompt_too_long"
    """Prompt alone exceeds the window (param ``input_tokens``)."""
    MAX_TOKENS_TOO_LARGE = "max_tokens_too_large"
    """``max_tokens={v} cannot be greater than max_model_len={n}`` (param ``max_tokens``)."""
    MAX_TOKENS_TOO_SMALL = "max_tokens_too_small"
    """``max_tokens must be at least 1, got {v}``: asked for < 1, or a prompt of exactly
    ``max_model_len`` tokens left 0 after clamping."""


@dataclass(frozen=True, slots=True)
class Rejection:
    """A refused request, with the numbers the server's error message needs.

    Attributes:
        kind: which check failed.
        request_id: the refused request.
        max_model_len: the window.
        prompt_tokens: the prompt's length.
        max_tokens: the value the message cites (requested, or 0 after clamping).
        param: the OpenAI ``param`` of the error (``input_tokens``, ``max_tokens``,
            ``prompt``).
    """

    kind: RejectionKind
    request_id: str
    max_model_len: int
    prompt_tokens: int
    max_tokens: int | None
    param: str


@dataclass(frozen=True, slots=True)
class Accepted:
    """An admitted request and its effective limits.

    Attributes:
        max_tokens: the effective output limit after defaults and clamping.
        requested_max_tokens: what was asked (``None`` = default).
        clamped: the window forced ``max_tokens`` below what was asked or defaulted.
    """

    request_id: str
    max_tokens: int
    requested_max_tokens: int | None
    clamped: bool


Admission = Accepted | Rejection


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestOutput(msgspec.Struct, frozen=True, gc=False):
    """What one request got from one step (only requests that produced a token or finished).

    ``num_cached_tokens`` is the prefix-cache hit of the request's first scheduling (vLLM's
    ``num_cached_tokens``, reported in ``usage.prompt_tokens_details.cached_tokens``).
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    first_token: bool
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int


class StepResult(msgspec.Struct, frozen=True, gc=False):
    """One scheduler step: its modelled duration, the outputs and the KV events it produced.

    ``events`` is in emission order and may be empty (vLLM publishes a batch only when it is
    not). The timing inputs are exposed for calibration and tests.
    """

    duration_s: float
    outputs: list[RequestOutput]
    events: list[KVEvent]
    num_prefill_tokens: int
    num_decode_seqs: int
    num_context_tokens: int
    num_scheduled_reqs: int


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """The engine's ``/metrics`` values vLLM exports and kvroute reads (names without the
    ``vllm:`` prefix). Prefix-cache counters are in tokens: queries are a request's tokens at
    its first scheduling, hits its cached tokens then (recomputation after a preemption is not
    counted, as vLLM records it separately)."""

    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    request_success_total: Mapping[str, int] = field(default_factory=dict)
    external_prefix_cache_hits_total: int = 0
    """Tokens loaded from an offload tier at first scheduling (vLLM's
    ``vllm:external_prefix_cache_hits_total``); not in ``prefix_cache_hits_total``."""


def output_token_id(seed: int, index: int, vocab_size: int) -> int:
    """The ``index``-th output token of a request seeded with ``seed`` (splitmix64 mix)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) % vocab_size


def _seed_from_id(request_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big")


class _Req:
    """Mutable engine-side state of one live request."""

    __slots__ = (
        "block_hashes",
        "blocks",
        "cache_salt",
        "lora",
        "lora_id",
        "lora_name",
        "max_tokens",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_computed",
        "num_prompt",
        "remote",
        "remote_left_s",
        "remote_pulled",
        "report_full",
        "request_id",
        "seed",
        "stop_at",
        "tokens",
        "wire_hashes",
    )

    def __init__(
        self,
        request_id: str,
        tokens: list[int],
        max_tokens: int,
        stop_at: int | None,
        block_hashes: list[BlockHash],
        cache_salt: str | None,
        lora: LoraKey | None,
        seed: int,
    ) -> None:
        self.request_id = request_id
        self.tokens = tokens
        self.num_prompt = len(tokens)
        self.max_tokens = max_tokens
        self.stop_at = stop_at
        self.block_hashes = block_hashes
        # Inlined ``to_wire_hash`` (last 8 bytes, big-endian): called for every prompt block.
        from_bytes = int.from_bytes
        self.wire_hashes: list[WireHash] = [
            WireHash(from_bytes(h[-8:], "big")) for h in block_hashes
        ]
        self.blocks: list[int] = []
        self.num_cached_blocks = 0  # leading blocks of ``blocks`` registered in the cache
        self.num_computed = 0
        self.num_cached_tokens = -1  # set at the first scheduling
        self.cache_salt = cache_salt
        self.lora = lora
        self.lora_name = lora.name if lora is not None else None
        self.lora_id: int | None = None
        self.report_full = False
        self.seed = seed
        self.remote = False  # its prompt's KV comes from a remote prefill
        self.remote_left_s = 0.0  # the transfer still to wait for
        self.remote_pulled = 0  # tokens that crossed the link


# ---------------------------------------------------------------------------------- engine


class EngineModel:
    """One simulated vLLM v1 engine (see the module docstring for the rules it follows).

    Invariants:
        * a live request is in exactly one of ``running`` and ``waiting``;
        * ``len(running) <= max_num_seqs``; a waiting request holds no blocks and has
          ``num_computed == 0``;
        * a request's ``block_hashes`` are the hashes of every full block of its tokens;
          its first ``num_cached_blocks`` blocks are registered in the prefix cache;
        * the block pool's own invariants (``BlockPool``).
    """

    def __init__(self, config: EngineConfig, *, hasher: BlockHasher,
                 shared_tier: OffloadTier | None = None) -> None:
        """Create an idle engine with an empty prefix cache (and an empty CPU tier when
        ``config.cpu_offload_blocks``); ``shared_tier`` is a store shared with other engines,
        looked up after the engine's own tier. The engine takes its own tier's events into
        its steps; a shared tier's events are its owner's to take.

        Raises:
            ConfigError: the hasher's block size differs from the engine's, or it hashes with
                lookahead (speculative decoding is not modelled).
        """
        if hasher.block_size != config.block_size:
            raise ConfigError(
                f"the hasher hashes blocks of {hasher.block_size} tokens but the engine's "
                f"block_size is {config.block_size}; build the BlockHasher with block_size="
                f"{config.block_size}"
            )
        if hasher.lookahead_tokens:
            raise ConfigError(
                f"the hasher uses lookahead_tokens={hasher.lookahead_tokens} (speculative "
                "decoding), which the engine model does not simulate; use lookahead_tokens=0"
            )
        self.config = config
        self.hasher = hasher
        self.pool = BlockPool(config.num_gpu_blocks, config.block_size)
        self.cpu_tier = (OffloadTier(config.cpu_offload_blocks, config.block_size,
                                     load_s_per_block=config.cpu_load_s_per_block)
                         if config.cpu_offload_blocks else None)
        if shared_tier is not None and shared_tier.block_size != config.block_size:
            raise ConfigError(
                f"the shared tier holds blocks of {shared_tier.block_size} tokens, the engine "
                f"{config.block_size}; build it with the engine's block size")
        self.shared_tier = shared_tier
        # Tiers hold cached blocks: without prefix caching nothing is stored or looked up.
        self._tiers = tuple(t for t in (self.cpu_tier, shared_tier)
                            if t is not None and config.enable_prefix_caching)
        self._external_hits = 0
        self._running: list[_Req] = []
        self._waiting: deque[_Req] = deque()
        self._live: dict[str, _Req] = {}
        self._queries = 0
        self._hits = 0
        self._preemptions = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._success: dict[str, int] = {}

    # ------------------------------------------------------------------ requests in/out

    def add_request(self, req: EngineRequest) -> Admission:
        """Admit ``req`` to the tail of the waiting queue, or reject it as vLLM's server would.

        Returns:
            ``Accepted`` with the effective ``max_tokens``, or a ``Rejection``.

        Raises:
            EngineInputError: the request id is already live, ``prompt_block_hashes`` has
                the wrong length, ``output_length`` is < 1, or the prompt cannot be hashed
                (a negative token id, a ``cache_salt`` vLLM would refuse).
        """
        cfg = self.config
        rid = req.request_id
        if rid in self._live:
            raise EngineInputError(
                f"request id {rid!r} is already live in this engine; request ids must be "
                "unique until the request finishes or is aborted"
            )
        n = len(req.prompt_token_ids)
        window = cfg.max_model_len
        asked = req.max_tokens
        if n == 0:
            return Rejection(RejectionKind.EMPTY_PROMPT, rid, window, 0, asked, "prompt")
        if asked is not None and asked > window:
            return Rejection(
                RejectionKind.MAX_TOKENS_TOO_LARGE, rid, window, n, asked, "max_tokens"
            )
        if n > window:
            return Rejection(RejectionKind.PROMPT_TOO_LONG, rid, window, n, asked, "input_tokens")
        if asked is not None and asked < 1:
            return Rejection(RejectionKind.MAX_TOKENS_TOO_SMALL, rid, window, n, asked,
                             "max_tokens")
        if asked is not None:
            wanted = asked
        elif req.endpoint == "chat":
            wanted = window - n
        else:
            wanted = cfg.default_max_tokens
        effective = min(window - n, wanted)
        if effective < 1:
            return Rejection(RejectionKind.MAX_TOKENS_TOO_SMALL, rid, window, n, effective,
                             "max_tokens")
        if req.output_length is not None and req.output_length < 1:
            raise EngineInputError(
                f"request {rid!r} has output_length={req.output_length}; it must be >= 1 "
                "(or None to generate until max_tokens)"
            )
        tokens = list(req.prompt_token_ids)
        num_full = n // cfg.block_size
        if req.prompt_block_hashes is not None:
            hashes = list(req.prompt_block_hashes)
            if len(hashes) != num_full:
                raise EngineInputError(
                    f"request {rid!r} carries {len(hashes)} prompt_block_hashes but its "
                    f"{n}-token prompt has {num_full} full blocks of {cfg.block_size}; pass "
                    "the hashes of exactly the full blocks, or None to let the engine hash"
                )
        else:
            try:
                hashes = self._hash(tokens, req.cache_salt, req.lora, 0, None)
            except ValueError as exc:
                raise EngineInputError(f"request {rid!r} cannot be hashed: {exc}") from exc
        if req.cache_salt is not None:
            try:
                validate_cache_salt(req.cache_salt)
            except ValueError as exc:
                raise EngineInputError(f"request {rid!r}: {exc}") from exc
        stop_at = req.output_length
        if stop_at is not None and stop_at >= effective:
            stop_at = None
        seed = req.seed if req.seed is not None else _seed_from_id(rid)
        r = _Req(rid, tokens, effective, stop_at, hashes, req.cache_salt, req.lora, seed)
        r.lora_id = req.lora_id
        r.report_full = req.report_full
        if req.kv_transfer_s_per_token is not None:
            if not req.kv_transfer_s_per_token >= 0:
                raise EngineInputError(
                    f"request {rid!r} has kv_transfer_s_per_token="
                    f"{req.kv_transfer_s_per_token!r}; it must be >= 0 (None: no transfer)")
            r.remote = True  # what it lacks now crosses the link (decided on arrival, as
            # the connector's get_num_new_matched_tokens decides it)
            pulled = (n - 1) // cfg.block_size - len(self._computed_blocks(r))
            r.remote_pulled = pulled * cfg.block_size
            r.remote_left_s = r.remote_pulled * req.kv_transfer_s_per_token
        self._live[rid] = r
        self._waiting.append(r)
        return Accepted(rid, effective, asked, effective < wanted)

    def abort_request(self, request_id: str) -> None:
        """Drop a live request and free its blocks (they stay cached). Unknown ids are ignored,
        as vLLM ignores aborts of requests that already finished."""
        r = self._live.pop(request_id, None)
        if r is None:
            return
        if r in self._waiting:
            self._waiting.remove(r)
        else:
            self._running.remove(r)
            self.pool.free_blocks(r.blocks)
            r.blocks = []
        self._success["abort"] = self._success.get("abort", 0) + 1

    def has_work(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._running or self._waiting)

    # ------------------------------------------------------------------ the step

    def step(self) -> StepResult:
        """Run one scheduler step (schedule, "execute", sample, free finished requests).

        Returns:
            The step's modelled duration, per-request outputs and KV events.
        """
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        window = cfg.max_model_len
        running = self._running
        waiting = self._waiting
        scheduled: list[tuple[_Req, int]] = []
        preempted = False
        load_s = 0.0

        bs = cfg.block_size
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            computed = r.num_computed
            n = min(len(r.tokens) - computed, budget, window - 1 - computed)
            if n <= 0:
                i += 1
                continue
            # Fast path for the common decode step: the token's slot exists and it completes
            # no block, so allocate_slots would change nothing.
            if computed + n <= len(r.blocks) * bs and (computed + n) // bs <= r.num_cached_blocks:
                scheduled.append((r, n))
                budget -= n
                i += 1
                continue
            fits = True
            while not self._allocate(r, n, [], 0):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is r:
                    fits = False
                    break
            if not fits:
                break
            scheduled.append((r, n))
            budget -= n
            i += 1

        if not preempted:
            max_seqs = cfg.max_num_seqs
            reserve_full = cfg.scheduler_reserve_full_isl
            max_loras = cfg.max_loras
            skipped: list[_Req] = []
            while waiting and budget > 0 and len(running) < max_seqs:
                r = waiting[0]
                if r.remote_left_s > 0.0:  # its KV is still on the way
                    skipped.append(waiting.popleft())
                    continue
                if max_loras is not None and r.lora_name is not None:
                    active = {x.lora_name for x in running if x.lora_name is not None}
                    if r.lora_name not in active and len(active) >= max_loras:
                        skipped.append(waiting.popleft())  # vLLM skips it, keeps scanning
                        continue
                hit_blocks = self._computed_blocks(r)
                pulling = r.remote and r.num_cached_tokens < 0  # the link brings the rest
                loads = (self._tier_hits(r, len(hit_blocks)) if self._tiers and not pulling
                         else ())
                num_loaded = sum(len(hashes) for _, hashes in loads)
                num_hit = (len(hit_blocks) + num_loaded) * cfg.block_size
                pulled = 0
                if pulling:  # the remote prefill's blocks
                    pulled = r.remote_pulled
                    num_hit = max(num_hit, (len(r.tokens) - 1) // cfg.block_size
                                  * cfg.block_size)
                if hit_blocks and r.report_full:
                    self.pool.emit_cached(
                        [r.wire_hashes[i] for i in range(len(hit_blocks))], r.tokens,
                        lora_name=r.lora_name, lora_id=r.lora_id, cache_salt=r.cache_salt)
                n = min(len(r.tokens) - num_hit, budget)
                if reserve_full and not self._fits_whole(r, hit_blocks):
                    break
                if not self._allocate(r, n, hit_blocks, num_hit):
                    break
                for tier, hashes in loads:
                    load_s += tier.load(hashes)
                waiting.popleft()
                running.append(r)
                if r.num_cached_tokens < 0:
                    r.num_cached_tokens = num_hit
                    if cfg.enable_prefix_caching:
                        self._queries += len(r.tokens)
                        local = (len(hit_blocks) * cfg.block_size if r.remote
                                 else num_hit - num_loaded * cfg.block_size)
                        self._hits += local
                        self._external_hits += num_loaded * cfg.block_size + pulled
                r.num_computed = num_hit
                scheduled.append((r, n))
                budget -= n
            waiting.extendleft(reversed(skipped))

        events = self.pool.take_events()
        if self.cpu_tier is not None:
            events += self.cpu_tier.take_events()
        if not scheduled:
            # Nothing to run: the step lasts until the first transfer in flight arrives.
            wait = min((r.remote_left_s for r in waiting if r.remote_left_s > 0.0),
                       default=0.0)
            self._transfer(wait)
            return StepResult(wait, [], events, 0, 0, 0, 0)

        prefill_tokens = 0
        decode_seqs = 0
        context_tokens = 0
        outputs: list[RequestOutput] = []
        finished: list[_Req] = []
        vocab = cfg.vocab_size
        for r, n in scheduled:
            computed = r.num_computed + n
            r.num_computed = computed
            context_tokens += computed
            tokens = r.tokens
            if n == 1 and computed == len(tokens) and len(tokens) > r.num_prompt:
                decode_seqs += 1
            else:
                prefill_tokens += n
            if computed < len(tokens):
                continue  # a partial prefill chunk samples nothing
            num_out = len(tokens) - r.num_prompt
            tok = output_token_id(r.seed, num_out, vocab)
            tokens.append(tok)
            num_out += 1
            self._generation_tokens += 1
            if num_out == 1:
                self._prompt_tokens += r.num_prompt
            if len(tokens) % bs == 0:
                k = len(r.block_hashes)
                new = self._hash(tokens, r.cache_salt, r.lora, k,
                                 r.block_hashes[k - 1] if k else None)
                r.block_hashes.extend(new)
                r.wire_hashes.extend(to_wire_hash(h) for h in new)
            reason: str | None = None
            if num_out >= r.max_tokens or len(tokens) >= window:
                reason = "length"
            elif r.stop_at is not None and num_out >= r.stop_at:
                reason = "stop"
            if reason is not None:
                finished.append(r)
                self._success[reason] = self._success.get(reason, 0) + 1
            outputs.append(
                RequestOutput(r.request_id, (tok,), num_out == 1, reason is not None, reason,
                              r.num_cached_tokens, r.num_prompt, num_out)
            )
        if finished:
            done = set(map(id, finished))
            self._running = [r for r in running if id(r) not in done]
            free = self.pool.free_blocks
            live = self._live
            for r in finished:
                free(r.blocks)
                r.blocks = []
                del live[r.request_id]
        duration = cfg.timing.step_time_s(prefill_tokens, decode_seqs, context_tokens) + load_s
        self._transfer(duration)
        return StepResult(duration, outputs, events, prefill_tokens, decode_seqs,
                          context_tokens, len(scheduled))

    def _transfer(self, elapsed_s: float) -> None:
        """``elapsed_s`` of the remote transfers in flight have passed."""
        if elapsed_s > 0.0:
            for r in self._waiting:
                if r.remote_left_s > 0.0:
                    r.remote_left_s = max(0.0, r.remote_left_s - elapsed_s)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (``AllBlocksCleared``, delivered with the next step's
        events). Fails, returning False, while any request holds blocks, as vLLM does."""
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVEvent]:
        """Events produced outside ``step`` (a reset) that a caller wants published now."""
        return self.pool.take_events()

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """The adapters of the running and of the waiting requests (``vllm:lora_requests_info``
        labels), each sorted."""
        running = sorted({r.lora_name for r in self._running if r.lora_name is not None})
        waiting = sorted({r.lora_name for r in self._waiting if r.lora_name is not None})
        return running, waiting

    def metrics(self) -> EngineMetrics:
        """A snapshot of the engine's counters and gauges."""
        return EngineMetrics(
            prefix_cache_queries_total=self._queries,
            prefix_cache_hits_total=self._hits,
            num_requests_running=len(self._running),
            num_requests_waiting=len(self._waiting),
            kv_cache_usage_perc=self.pool.usage(),
            num_preemptions_total=self._preemptions,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            request_success_total=dict(self._success),
            external_prefix_cache_hits_total=self._external_hits,
        )

    # ------------------------------------------------------------------ internals

    def _hash(
        self,
        tokens: list[int],
        cache_salt: str | None,
        lora: LoraKey | None,
        start_block: int,
        parent: BlockHash | None,
    ) -> list[BlockHash]:
        return self.hasher.hash_blocks(
            tokens,
            cache_salt=cache_salt,
            lora=lora,
            start_block=start_block,
            parent=parent,
        )

    def _computed_blocks(self, r: _Req) -> list[int]:
        """The prefix-cache hit of a waiting request: cached blocks of its longest cached
        prefix, capped so that at least its last token is computed."""
        if r.num_computed:
            raise AssertionError(f"waiting request {r.request_id} has computed tokens")
        if not self.config.enable_prefix_caching:
            return []
        max_blocks = (len(r.tokens) - 1) // self.config.block_size
        get = self.pool.get_cached_block
        hits: list[int] = []
        for h in r.block_hashes[:max_blocks]:
            b = get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def _tier_hits(self, r: _Req, num_device: int) -> list[tuple[OffloadTier, list[BlockHash]]]:
        """The blocks after a waiting request's device hit that its tiers hold in a row, own
        tier first, each with the tier to load them from (capped like the device hit)."""
        max_blocks = (len(r.tokens) - 1) // self.config.block_size
        start = num_device
        out: list[tuple[OffloadTier, list[BlockHash]]] = []
        for tier in self._tiers:
            n = tier.lookup(r.block_hashes[start:max_blocks])
            if n:
                out.append((tier, r.block_hashes[start:start + n]))
                start += n
        return out

    def _fits_whole(self, r: _Req, hit_blocks: list[int]) -> bool:
        """vLLM's ``can_fit_full_sequence``: could blocks for all of the request's current
        tokens (its prompt, plus output before a preemption) be allocated now?"""
        pool = self.pool
        whole = -(-min(len(r.tokens), self.config.max_model_len) // self.config.block_size)
        evictable = sum(1 for b in hit_blocks if pool.ref_cnt(b) == 0)
        return whole - len(hit_blocks) + evictable <= pool.num_free_blocks

    def _allocate(self, r: _Req, n: int, hit_blocks: list[int], num_hit: int) -> bool:
        """vLLM's ``allocate_slots``: make room for ``n`` more tokens (after ``num_hit``
        prefix-hit tokens for a newly scheduled request), then cache the blocks that will be
        full. Returns False, changing nothing, when the free blocks do not suffice."""
        pool = self.pool
        bs = self.config.block_size
        computed = r.num_computed + num_hit
        need_tokens = min(computed + n, self.config.max_model_len)
        num_new = -(-need_tokens // bs) - len(hit_blocks) - len(r.blocks)
        if hit_blocks:
            evictable = sum(1 for b in hit_blocks if pool.ref_cnt(b) == 0)
            if num_new + evictable > pool.num_free_blocks:
                return False
            pool.touch(hit_blocks)
            r.blocks.extend(hit_blocks)
            r.num_cached_blocks = len(hit_blocks)
        elif num_new > pool.num_free_blocks:
            return False
        if num_new > 0:
            r.blocks.extend(pool.get_new_blocks(num_new))
        num_full = min(computed + n, len(r.tokens)) // bs
        if num_full > r.num_cached_blocks and not self.config.enable_prefix_caching:
            r.num_cached_blocks = num_full  # nothing is cached without prefix caching
        elif num_full > r.num_cached_blocks:
            pool.cache_full_blocks(
                r.blocks, r.block_hashes, r.wire_hashes, r.num_cached_blocks, num_full,
                r.tokens, lora_name=r.lora_name, cache_salt=r.cache_salt, lora_id=r.lora_id,
            )
            if self._tiers:
                start = r.num_cached_blocks
                parent = r.wire_hashes[start - 1] if start else None
                for tier in self._tiers:
                    tier.store(r.block_hashes[start:num_full], r.wire_hashes[start:num_full],
                               parent, r.tokens[start * bs:num_full * bs])
            r.num_cached_blocks = num_full
        return True

    def _preempt(self, r: _Req) -> None:
        """Preempt by recompute: free the blocks (they stay cached), forget progress, and put
        the request back at the front of the waiting queue."""
        self.pool.free_blocks(r.blocks)
        r.blocks = []
        r.num_cached_blocks = 0
        r.num_computed = 0
        self._preemptions += 1
        self._waiting.appendleft(r)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` on the first broken invariant (tests; O(blocks))."""
        self.pool.check_invariants()
        ids = [r.request_id for r in self._running] + [r.request_id for r in self._waiting]
        if sorted(ids) != sorted(self._live) or len(set(ids)) != len(ids):
            raise AssertionError("live requests are not exactly running + waiting")
        if len(self._running) > self.config.max_num_seqs:
            raise AssertionError("more running requests than max_num_seqs")
        bs = self.config.block_size
        for r in self._waiting:
            if r.blocks or r.num_computed:
                raise AssertionError(f"waiting request {r.request_id} holds blocks or progress")
        for r in self._running:
            if len(r.block_hashes) != len(r.tokens) // bs:
                raise AssertionError(f"request {r.request_id} has stale block hashes")
            if len(r.blocks) * bs < r.num_computed:
                raise AssertionError(f"request {r.request_id} computed beyond its blocks")
            for i in range(r.num_cached_blocks):
                if self.pool.block_hash(r.blocks[i]) != r.block_hashes[i]:
                    raise AssertionError(f"request {r.request_id} block {i} cached wrongly")

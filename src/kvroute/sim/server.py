"""A simulated vLLM 0.32 OpenAI server: real HTTP and real ZMQ around ``EngineModel``.

Owns the HTTP surface of one simulated engine: request parsing and validation, tokenization,
context-overflow answers, response and SSE framing, and the admin/observability routes. The
engine itself is stepped by ``sim.engine_driver.EngineDriver``; KV events leave through
``sim.kv_publisher.KVEventPublisher`` (vLLM's PUB + replay ROUTER framing).

Routes (what a router or gateway can observe of vLLM 0.32):

======================================  ===================================================
``POST /v1/chat/completions``           chat, streamed (SSE, one chunk per engine step) or
``POST /v1/completions``                not; ``usage`` (``prompt_tokens_details.cached_tokens``
                                        with ``enable_prompt_tokens_details``, as vLLM's
                                        ``--enable-prompt-tokens-details``); ``n`` choices;
                                        ``stream_options.include_usage``; ``cache_salt``;
                                        ``seed``; unknown fields ignored
``POST /v1/chat/completions/render``    vLLM ≥0.20 ``{"token_ids", "features", "sampling_params"}``.
``POST /v1/completions/render``         vLLM serves them only with ``--enable-scale-out``; the
                                        sim serves them unless ``render_endpoints=False``, then
                                        answers vLLM's 403
``POST /tokenize`` / ``/detokenize``    prompt or chat form (template, ``tools``,
                                        ``add_generation_prompt``, ``continue_final_message``)
``GET /v1/models``                      one card per served name, with ``max_model_len``
``GET /health`` ``/version`` ``/load``  200 empty / ``{"version": "0.32.0"}`` / in-flight count
``GET /metrics``                        vLLM's Prometheus names and labels
``GET /kv_event_sources``               ``{"<rank>": KVEventsConfig}`` with the bound endpoints
``POST /reset_prefix_cache``            vLLM dev-mode route, always on here; 200 and an
                                        ``AllBlocksCleared`` batch, or 500 while requests hold
                                        blocks (the engine refuses, as vLLM's does)
``GET|POST|DELETE /sim/faults``         fault injection, sim only, served only with
                                        ``fault_injection=True`` (``--fault-injection``);
                                        see ``SimFaults``
======================================  ===================================================

Anything else is a 404 (sglang-router's ``/server_info``-style probes are answered 404, which
it tolerates; a stray HTTP/2 preface gets a 400 and the server carries on). A body over
``wire.openai.DEFAULT_MAX_BODY_BYTES`` gets a 413.

HTTP is the router's own lean server (``http/server.py``, llhttp through ``httptools``),
not aiohttp's: benchmarks of router overhead run eight of these engines on the same two cores
as the router and the load generator, so every CPU-ms an engine spends on HTTP is taken from
what is measured. Its framing is what vLLM's uvicorn sends: a streamed answer's head goes out
at once, then one chunk per write.

Context errors are worded by ``wire.overflow_styles.check_overflow`` for the configured
``error_style``: with ``vllm-0.32`` an over-long prompt + ``max_tokens`` is clamped (200,
``finish_reason: "length"``), with styles whose engines reject it, it is rejected. vLLM's
character pre-check (``param: "input_text"``) runs on text prompts (the completion string, or
the rendered chat template) when a ``max_chars_per_token`` is known: the Hugging Face
tokenizer's longest vocabulary string, as vLLM computes it, or
``SimServerConfig.max_chars_per_token``. The built-in tokenizer has no such bound (any word is
one token), so without the option it skips the pre-check.

Data parallel (``data_parallel_size`` N > 1, vLLM's ``--data-parallel-size``): one HTTP server
in front of N engine ranks, each its own ``EngineModel`` (own batch, own KV cache), stepped by
its own driver, publishing on its own endpoints (the configured ones at vLLM's per-rank
offset, ``wire.dp_rank.offset_endpoint_port``: port + r, or a free port each for port 0) with
``data_parallel_rank`` = r in every batch. A request with ``X-data-parallel-rank: r`` runs on
rank r (a rank outside ``[0, N)`` is a 400, as vLLM answers); without it the server picks the
rank as vLLM's ``DPLBAsyncMPClient`` does: the lowest ``4 × waiting + running``, first rank on
ties. ``/metrics`` has one ``engine`` label per rank and ``/kv_event_sources`` one entry each.

Completions accept one prompt per request (a string, token ids, or a one-element list of
either); a batch of several prompts is refused with a 400 that says so.

Generation: the engine never samples EOS; a request ends (finish ``"stop"``) at the length
``answer_lengths`` draws for it (``sim.answer_lengths``: seeded, the same for the same
request), or after ``eos_after_tokens`` tokens when that is set, and with ``"length"`` at its
``max_tokens`` when that comes first. A request with vLLM's ``ignore_eos: true``, or any
request when ``answer_lengths`` is None (the in-process default, which the tests and
benchmark harnesses that fix their own lengths rely on), runs to its ``max_tokens``; chat
without ``max_tokens`` then generates to the window, as vLLM does. ``kvroute sim serve`` and
``kvroute sim fleet`` end answers naturally unless ``--answer-length max-tokens``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Self

import msgspec

from kvroute.core.errors import ConfigError
from kvroute.core.hash_memo import BlockHashMemo
from kvroute.core.hashing import BlockHasher, LoraKey
from kvroute.engine.model import (
    EngineConfig,
    EngineModel,
    EngineRequest,
    Rejection,
    RejectionKind,
    StepTiming,
)
from kvroute.http.server import Handler, HttpServer, Request, Response, StreamResponse
from kvroute.shell.heap import freeze_startup_heap
from kvroute.sim import openai_answers as answers
from kvroute.sim.answer_lengths import AnswerLengths
from kvroute.sim.engine_driver import EngineDriver, RequestStream, Submitted
from kvroute.sim.kv_publisher import KVEventPublisher, vllm_pub_binds
from kvroute.sim.profiles import get_profile
from kvroute.sim.stalls import EngineStalls
from kvroute.tokenize.sim_vocab import (
    BuiltinTokenizer,
    ChatTemplateError,
    Tokenizer,
    load_tokenizer,
)
from kvroute.wire import openai as oa
from kvroute.wire.dp_rank import DP_RANK_HEADER, DpRankError, offset_endpoint_port, parse_dp_rank
from kvroute.wire.overflow_styles import (
    OverflowCase,
    check_overflow,
    format_overflow,
    resolve_style,
)
from kvroute.wire.prom import render_vllm_metrics
from kvroute.wire.sse import DONE, encode_data

__all__ = ["VLLM_VERSION", "FaultSpecError", "RequestFault", "SimFaults", "SimServer",
           "SimServerConfig", "run_sim_server"]

log = logging.getLogger(__name__)

VLLM_VERSION: Final = "0.32.0"
_JSON_DECODER: Final = msgspec.json.Decoder()
_SCALE_OUT_MESSAGE: Final = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)
_THINKING_MESSAGE: Final = (
    "thinking_token_budget is set but reasoning_config is not configured. Please set "
    "--reasoning-parser and/or --reasoning-config to use thinking_token_budget."
)
_BUDGET_MESSAGE: Final = (
    "`thinking_token_budget` must be a non-negative integer or -1 for unlimited."
)
_BOTH_FLAGS_MESSAGE: Final = (
    "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
)
_IMPLICIT_FLAGS_MESSAGE: Final = (
    "continue_final_message and add_generation_prompt are not compatible. Use "
    "continue_final_message when you want the model to continue the final message, and "
    "add_generation_prompt when you want to add a header that will prompt it to start a new "
    "assistant message instead."
)
"""vLLM's request validator sees only explicit fields, so when ``add_generation_prompt`` is
left at its default (true) the conflict is caught later, by the chat-template code, in these
words (verified against vLLM 0.32.0, ``tests/conformance/test_sim_vs_real.py``)."""
_SSE_HEADERS: Final = {"Content-Type": "text/event-stream; charset=utf-8"}

_SHUTDOWN_GRACE_S: Final = 10.0
"""How long ``stop`` lets answers in flight finish before it cuts them off."""


def _http_error_body(status: int, message: str) -> bytes:
    """Errors of the HTTP layer itself (404, 405, 400, 431), in the engine's error shape."""
    return oa.error_body(message, status=status)


@dataclass(frozen=True, slots=True)
class SimServerConfig:
    """Everything one simulated engine is started with (the ``kvroute sim serve`` options).

    Engine shape arguments left ``None`` come from the timing profile.

    Attributes:
        model: the served model name (``--served-model-name``).
        aliases: further names the server answers to (vLLM's extra served names).
        root: the ``root`` of every ``/v1/models`` card, which vLLM fills with the model path
            (``vllm serve <path>``). None: the ``tokenizer`` directory if given (vLLM's
            ``--tokenizer`` defaults to the model path, so a sim borrowing a model's
            directory stands in for ``vllm serve`` of that directory), else ``model``.
        profile: timing profile name (``sim.profiles``).
        host / port: where HTTP listens; port 0 picks a free port.
        kv_events: the PUB endpoint (``tcp://127.0.0.1:0`` picks a free port); None disables
            KV events.
        kv_events_socket: ``"bind"`` (default) always binds the PUB socket, so free ports
            work in test fleets; ``"vllm"`` follows vLLM's ``ZmqEventPublisher``: bind only
            ``*``, ``::``, ``ipc://`` and ``inproc://`` endpoints, otherwise *connect* to a
            subscriber that binds there (the replay ROUTER always binds).
        kv_replay: the replay ROUTER endpoint, or None (vLLM's default: no replay).
        kv_topic / kv_buffer_steps: vLLM's ``topic`` and ``buffer_steps``.
        tokenizer: a local Hugging Face tokenizer directory, or None for the built-in one.
        vocab_size: the built-in tokenizer's (and the engine's output) vocabulary.
        error_style: how context errors are worded (``wire.overflow_styles.STYLES``).
        hash_algo / hash_seed: ``--prefix-caching-hash-algo`` and ``PYTHONHASHSEED``.
        enable_prompt_tokens_details: fill ``usage.prompt_tokens_details.cached_tokens``.
        render_endpoints: serve the ``/render`` routes (vLLM: ``--enable-scale-out``).
        eos_after_tokens: every request "emits EOS" after this many tokens (None: never);
            it wins over ``answer_lengths``.
        enable_prefix_caching: vLLM's ``--enable-prefix-caching`` / ``--no-enable-prefix-
            caching`` (``EngineConfig.enable_prefix_caching``), reported in
            ``vllm:cache_config_info``.
        answer_lengths: where each answer's length is drawn from when the request does not
            fix it (``sim.answer_lengths``); None runs every request to its ``max_tokens``.
        sleep_scale: multiplies modelled step durations (1.0 = real time).
        timing: step constants that replace the profile's (calibration tests, what-ifs).
        max_chars_per_token: the factor of vLLM's character pre-check; None takes the
            tokenizer's (HF: its longest vocabulary string; built-in: none, no pre-check).
        fault_injection: serve ``/sim/faults`` (``SimFaults``); off by default, and the
            faults themselves are all off until armed.
        lora_modules: vLLM's ``--lora-modules name=path``: adapters served under their own
            names (listed on ``/v1/models`` with ``parent`` = ``model``, ``root`` = path),
            hashed with vLLM's ``("lora", name, path)`` extra key, numbered from 1 in this
            order for the events' ``lora_id``. Empty: LoRA off (vLLM without
            ``--enable-lora``).
        max_loras: vLLM's ``--max-loras`` (default 1): distinct adapters one running batch
            holds; also ``max_lora`` of ``vllm:lora_requests_info``.
        allow_runtime_lora: serve ``POST /v1/load_lora_adapter`` (vLLM with
            ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``); LoRA is on even without modules.
        reasoning_parser: vLLM's ``--reasoning-parser`` name. With one, chat requests accept
            ``thinking_token_budget`` and report ``completion_tokens_details.reasoning_tokens``:
            the model is taken to think as long as allowed (the budget, or the whole output
            when unlimited) unless the chat template's switch (``enable_thinking`` /
            ``thinking``) turns it off. The text is split as vLLM 0.32's parsers split it:
            the thinking in ``message.reasoning`` (streamed: ``delta.reasoning`` chunks, then
            ``delta.content``), the answer after it in ``content``; ``include_reasoning:
            false`` drops the thinking's text but not its count.
            Without one, a budget is refused with vLLM's 400.
        cpu_offload_blocks / cpu_load_s_per_block: the engine's CPU tier, as vLLM's native
            offloading (``engine/offload.py``: ``BlockStored`` with ``medium="CPU"``); 0: none.
        data_parallel_size: engine ranks behind the one HTTP server (module docstring, "Data
            parallel"); 1: one engine, whose batches carry ``data_parallel_rank``.
        data_parallel_rank: with one rank, the rank its batches and ``/kv_event_sources``
            name (an engine of an externally balanced DP deployment); 0 with several.
        kv_transfer_s_per_token: the engine plays both roles of vLLM's disaggregated
            prefill/decode (a NixlConnector engine with ``kv_role: kv_both``,
            ``wire/disagg.py``): a request with ``kv_transfer_params.do_remote_decode``
            answers with the ``kv_transfer_params`` a decode engine pulls from; one with
            ``do_remote_prefill`` pulls the prompt's blocks it lacks at this many seconds a
            token, then computes only the last token (docs/disaggregation.md).
    """

    model: str = "sim-model"
    aliases: tuple[str, ...] = ()
    root: str | None = None
    profile: str = "zero"
    max_model_len: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    cpu_offload_blocks: int = 0
    cpu_load_s_per_block: float = 0.0
    kv_transfer_s_per_token: float = 0.0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    host: str = "127.0.0.1"
    port: int = 0
    kv_events: str | None = "tcp://127.0.0.1:0"
    kv_events_socket: Literal["bind", "vllm"] = "bind"
    kv_replay: str | None = None
    kv_topic: str = "kv"
    kv_buffer_steps: int = 10_000
    tokenizer: str | None = None
    vocab_size: int = 32_000
    error_style: str = "vllm-0.32"
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    enable_prompt_tokens_details: bool = False
    render_endpoints: bool = True
    eos_after_tokens: int | None = None
    answer_lengths: AnswerLengths | None = None
    enable_prefix_caching: bool = True
    sleep_scale: float = 1.0
    timing: StepTiming | None = None
    data_parallel_rank: int = 0
    data_parallel_size: int = 1
    extra_cache_labels: Mapping[str, str] = field(default_factory=dict)
    max_chars_per_token: int | None = None
    fault_injection: bool = False
    lora_modules: Mapping[str, str] = field(default_factory=dict)
    max_loras: int = 1
    reasoning_parser: str | None = None
    allow_runtime_lora: bool = False

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("SimServerConfig.model must be a non-empty model name")
        resolve_style(self.error_style)
        if self.eos_after_tokens is not None and self.eos_after_tokens < 1:
            raise ConfigError(
                f"eos_after_tokens={self.eos_after_tokens} must be >= 1, or None to generate "
                "until max_tokens"
            )
        if not self.sleep_scale >= 0.0:
            raise ConfigError(f"sleep_scale={self.sleep_scale!r} must be a number >= 0")
        if self.max_chars_per_token is not None and self.max_chars_per_token < 1:
            raise ConfigError(
                f"max_chars_per_token={self.max_chars_per_token} must be >= 1, or None to use "
                "the tokenizer's longest vocabulary string"
            )
        for name, path in self.lora_modules.items():
            if not name or not path or name in self.served_names:
                raise ConfigError(
                    f"lora module {name!r}={path!r}: give a new name and a non-empty path "
                    "(name=path), not one of the served model names"
                )
        if self.max_loras < 1:
            raise ConfigError(f"max_loras={self.max_loras} must be >= 1")
        if self.data_parallel_size < 1:
            raise ConfigError(f"data_parallel_size={self.data_parallel_size} must be >= 1")
        if self.data_parallel_size > 1 and self.data_parallel_rank != 0:
            raise ConfigError(
                f"data_parallel_rank={self.data_parallel_rank} with data_parallel_size="
                f"{self.data_parallel_size}: the ranks of one server are 0..size-1; leave "
                "data_parallel_rank at 0"
            )
        if self.data_parallel_size > 1:
            for endpoint in (self.kv_events, self.kv_replay):
                if endpoint is not None:
                    try:
                        offset_endpoint_port(endpoint, self.data_parallel_size - 1)
                    except DpRankError as exc:
                        raise ConfigError(str(exc)) from None
        if self.kv_events_socket not in ("bind", "vllm"):
            raise ConfigError(
                f"kv_events_socket={self.kv_events_socket!r} must be 'bind' (always bind the "
                "PUB socket) or 'vllm' (bind *, ::, ipc and inproc endpoints, connect otherwise)"
            )
        if (
            self.kv_events_socket == "vllm"
            and self.kv_events is not None
            and not vllm_pub_binds(self.kv_events)
            and self.kv_events.endswith(":0")
        ):
            raise ConfigError(
                f"kv_events={self.kv_events!r} with kv_events_socket='vllm' would *connect* to "
                "port 0; vLLM connects to concrete endpoints, so give the port where your "
                "subscriber binds, or use kv_events_socket='bind' for a free port"
            )

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.model, *self.aliases)


class _BadRequest(Exception):
    """An answer to send instead of a result (status and body already decided)."""

    def __init__(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        super().__init__(body.decode("utf-8", "replace"))
        self.status = status
        self.body = body
        self.content_type = content_type


def _error(message: str, *, status: int = 400, param: str | None = None) -> _BadRequest:
    return _BadRequest(status, oa.error_body(message, status=status, param=param))


class FaultSpecError(ValueError):
    """A ``/sim/faults`` body that cannot be applied; the message names the key and the fix."""


@dataclass(frozen=True, slots=True)
class RequestFault:
    """What the armed faults do to one generation request (decided when it arrives)."""

    fail_status: int | None = None
    stall_s: float = 0.0
    kill_after_tokens: int | None = None


_FAULT_KEYS: Final = (
    "clear", "drop_events", "fail_next", "status", "stall_first_byte_s", "stall_next",
    "kill_mid_stream_after_tokens", "kill_next",
)  # fmt: skip


def _count(body: Mapping[str, Any], key: str, *, minimum: int, nullable: bool) -> int | None:
    value = body[key]
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = f"an integer >= {minimum}" + (" or null" if nullable else "")
        raise FaultSpecError(f"/sim/faults: {key!r} must be {allowed}, got {value!r}")
    return value


class SimFaults:
    """Faults armed on one simulated engine: the router's failure paths, on demand.

    Everything is off until armed. ``POST /sim/faults`` takes a JSON object with any of these
    keys (keys not sent keep their current value) and answers with ``state()``; ``GET``
    returns ``state()``; ``DELETE`` (or ``{"clear": true}``) disarms everything.

    ================================  ======================================================
    ``drop_events: N``                the next N KV-event batches get their sequence number
                                      and go to the replay buffer but are not sent on the
                                      PUB socket (``KVEventPublisher.publish(skip_send=
                                      True)``): a subscriber sees a sequence gap it can
                                      recover by replay
    ``fail_next: N``, ``status: S``   the next N generation requests are answered with
                                      status S (default 500, 400-599) and a vLLM-shaped
                                      error body before the first byte; the engine never
                                      sees them
    ``stall_first_byte_s: S``         generation requests wait S seconds before they reach
    ``stall_next: N`` (optional)      the engine, so no byte is sent for S seconds; only the
                                      next N requests with ``stall_next``, every request
                                      until cleared (``0``) without it
    ``kill_mid_stream_after_tokens:   the connection is closed after K generated tokens
    K``, ``kill_next: N`` (opt.)      (streamed: K tokens' chunks are sent, then the socket
                                      closes without the end of the stream; unary: closed
                                      with no response); the engine aborts the request; a
                                      request that ends within K tokens is not cut;
                                      ``null`` disarms; ``kill_next`` as ``stall_next``
    ================================  ======================================================

    "Generation requests" are ``/v1/chat/completions`` and ``/v1/completions``; precedence
    per request: a failure consumes nothing else, otherwise a stall and a kill may both
    apply. The ``*_fired`` counters in ``state()`` count what happened (never reset, so
    tests can assert exact numbers). Invariant: every counter is >= 0; a fault that is not
    armed has no effect. The object belongs to the server's event loop, except
    ``take_drop``, which the engine driver calls from the same loop.
    """

    __slots__ = (
        "drop_events", "events_dropped", "fail_next", "fail_status", "kill_after_tokens",
        "kill_next", "requests_failed", "requests_killed", "requests_stalled", "stall_next",
        "stall_s",
    )  # fmt: skip

    def __init__(self) -> None:
        self.drop_events = 0
        self.fail_next = 0
        self.fail_status = 500
        self.stall_s = 0.0
        self.stall_next: int | None = None
        self.kill_after_tokens: int | None = None
        self.kill_next: int | None = None
        self.events_dropped = 0
        self.requests_failed = 0
        self.requests_stalled = 0
        self.requests_killed = 0

    def clear(self) -> None:
        """Disarm every fault (the ``*_fired`` counters are kept)."""
        self.drop_events = 0
        self.fail_next = 0
        self.fail_status = 500
        self.stall_s = 0.0
        self.stall_next = None
        self.kill_after_tokens = None
        self.kill_next = None

    def apply(self, body: Mapping[str, Any]) -> None:
        """Arm the faults ``body`` names (all checked before any is applied).

        Raises:
            FaultSpecError: an unknown key or a bad value; nothing was changed.
        """
        unknown = sorted(set(body) - set(_FAULT_KEYS))
        if unknown:
            raise FaultSpecError(
                f"/sim/faults: unknown key(s) {unknown}; valid keys are {list(_FAULT_KEYS)}"
            )
        clear = body.get("clear", False)
        if not isinstance(clear, bool):
            raise FaultSpecError(f"/sim/faults: 'clear' must be true or false, got {clear!r}")
        new: dict[str, Any] = {}
        if "drop_events" in body:
            new["drop_events"] = _count(body, "drop_events", minimum=0, nullable=False)
        if "fail_next" in body:
            new["fail_next"] = _count(body, "fail_next", minimum=0, nullable=False)
        if "status" in body:
            status = _count(body, "status", minimum=400, nullable=False)
            assert status is not None
            if status > 599:
                raise FaultSpecError(f"/sim/faults: 'status' must be 400-599, got {status}")
            new["fail_status"] = status
        if "stall_first_byte_s" in body:
            stall = body["stall_first_byte_s"]
            if (isinstance(stall, bool) or not isinstance(stall, (int, float))
                    or not 0.0 <= stall <= 3600.0):
                raise FaultSpecError(
                    "/sim/faults: 'stall_first_byte_s' must be seconds between 0 and 3600 "
                    f"(0 disarms), got {stall!r}"
                )
            new["stall_s"] = float(stall)
        if "stall_next" in body:
            new["stall_next"] = _count(body, "stall_next", minimum=1, nullable=True)
        if "kill_mid_stream_after_tokens" in body:
            new["kill_after_tokens"] = _count(
                body, "kill_mid_stream_after_tokens", minimum=0, nullable=True)
        if "kill_next" in body:
            new["kill_next"] = _count(body, "kill_next", minimum=1, nullable=True)
        if clear:
            self.clear()
        for name, value in new.items():
            setattr(self, name, value)

    def state(self) -> dict[str, Any]:
        """What is armed and what has fired (the body of every ``/sim/faults`` answer)."""
        return {
            "drop_events": self.drop_events,
            "fail_next": self.fail_next,
            "status": self.fail_status,
            "stall_first_byte_s": self.stall_s,
            "stall_next": self.stall_next,
            "kill_mid_stream_after_tokens": self.kill_after_tokens,
            "kill_next": self.kill_next,
            "fired": {
                "events_dropped": self.events_dropped,
                "requests_failed": self.requests_failed,
                "requests_stalled": self.requests_stalled,
                "requests_killed": self.requests_killed,
            },
        }

    def take_drop(self) -> bool:
        """Whether the batch being published now is to be dropped (consumes one)."""
        if self.drop_events <= 0:
            return False
        self.drop_events -= 1
        self.events_dropped += 1
        return True

    def take_request(self) -> RequestFault:
        """The faults for one arriving generation request (consumes counted ones)."""
        if self.fail_next > 0:
            self.fail_next -= 1
            self.requests_failed += 1
            return RequestFault(fail_status=self.fail_status)
        stall = 0.0
        if self.stall_s > 0.0 and (self.stall_next is None or self.stall_next > 0):
            stall = self.stall_s
            self.requests_stalled += 1
            if self.stall_next is not None:
                self.stall_next -= 1
                if self.stall_next == 0:
                    self.stall_s, self.stall_next = 0.0, None
        kill = self.kill_after_tokens
        if kill is not None and self.kill_next is not None:
            self.kill_next -= 1
            if self.kill_next == 0:
                self.kill_after_tokens, self.kill_next = None, None
        return RequestFault(stall_s=stall, kill_after_tokens=kill)


class _Killed(Exception):
    """The kill fault closed the connection; the handler ends without a response."""


@dataclass(slots=True)
class _Prepared:
    """A generation request after tokenization and the overflow checks."""

    parsed: oa.ParsedRequest
    prompt_ids: Sequence[int]
    """A list, or the ``array('I')`` of an HF tokenizer's piece cache: ``list()`` it for JSON."""
    max_tokens: int | None
    remote_decode: bool = False
    """A P/D prefill (``do_remote_decode``): the answer carries ``kv_transfer_params``."""
    remote_prefill: bool = False
    """A P/D decode (``do_remote_prefill``): the prompt's KV is pulled, not computed."""


class _TextDecoder:
    """Incremental detokenization of one choice's output."""

    __slots__ = ("_builtin", "_ids", "_text", "_tok")

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self._builtin = isinstance(tok, BuiltinTokenizer)
        self._ids: list[int] = []
        self._text = ""

    def push(self, ids: Sequence[int]) -> str:
        if self._builtin:
            words = self._tok.token_strs(ids)
            delta = " ".join(words)
            if self._ids:
                delta = " " + delta
            self._ids.extend(ids)
            return delta
        self._ids.extend(ids)
        text = self._tok.decode(self._ids)
        delta = text.removeprefix(self._text)
        self._text = text
        return delta


class SimServer:
    """One simulated vLLM engine serving HTTP and ZMQ on loopback.

    Use as ``async with SimServer(config) as server: ...`` (binds on enter, stops on exit), or
    ``await start()`` / ``await stop()``. ``url``, ``kv_events_endpoint`` and
    ``kv_replay_endpoint`` are the resolved addresses once started.

    Args:
        config: the engine and server options.
        tokenizer: overrides ``config.tokenizer`` (tests pass one directly).
    """

    def __init__(self, config: SimServerConfig, *, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.tokenizer: Tokenizer = (
            tokenizer
            if tokenizer is not None
            else load_tokenizer(config.tokenizer, vocab_size=config.vocab_size)
        )
        profile = get_profile(config.profile)
        base = profile.engine_config(
            num_gpu_blocks=config.num_gpu_blocks,
            max_model_len=config.max_model_len,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.engine_config = EngineConfig(
            num_gpu_blocks=base.num_gpu_blocks,
            max_model_len=base.max_model_len,
            block_size=base.block_size,
            max_num_seqs=base.max_num_seqs,
            max_num_batched_tokens=base.max_num_batched_tokens,
            timing=config.timing if config.timing is not None else base.timing,
            vocab_size=self.tokenizer.vocab_size,
            enable_prefix_caching=config.enable_prefix_caching,
            max_loras=(config.max_loras if config.lora_modules or config.allow_runtime_lora
                       else None),
            cpu_offload_blocks=config.cpu_offload_blocks,
            cpu_load_s_per_block=config.cpu_load_s_per_block,
        )
        self._loras: dict[str, str] = dict(config.lora_modules)
        """The adapters served: the configured ones, then those loaded at run time."""
        self._lora_ids = {name: i for i, name in enumerate(config.lora_modules, start=1)}
        self.hasher = BlockHasher(config.hash_algo, self.engine_config.block_size, config.hash_seed)
        # Prompts are hashed through a memo (bit-identical digests): requests sharing a system
        # prompt would otherwise re-hash it every time, the largest CPU cost of a zero-time
        # engine, which benchmarks of router overhead run eight of on two cores.
        self._hash_memo = BlockHashMemo(self.hasher)
        self.engines: list[EngineModel] = [
            EngineModel(self.engine_config, hasher=self.hasher)
            for _ in range(config.data_parallel_size)
        ]
        """One engine per data-parallel rank, in rank order."""
        self.engine = self.engines[0]
        self.error_style = resolve_style(config.error_style)
        self.created = int(time.time())
        self._perm_id = "modelperm-" + uuid.uuid4().hex[:16]
        self._engine_id = str(uuid.uuid4())  # the KV connector's engine id (P/D)
        self._publisher: KVEventPublisher | None = None
        self._publishers: list[KVEventPublisher] = []
        self.driver: EngineDriver | None = None
        """Rank 0's driver (the only one without data parallelism)."""
        self.drivers: list[EngineDriver] = []
        self._http: HttpServer | None = None
        self._ids = itertools.count()
        self._in_flight = 0
        self.port = 0
        self.stalls = EngineStalls()
        """This process's step lateness and collections, on ``/metrics`` (``sim/stalls.py``)."""
        self.faults = SimFaults()
        """The armed faults (``/sim/faults``); in-process tests may arm them directly."""
        mcpt = config.max_chars_per_token
        self.max_chars_per_token: int | None = (
            mcpt if mcpt is not None else self.tokenizer.max_chars_per_token
        )

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        host = self.config.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    @property
    def root(self) -> str:
        """The ``root`` of the model cards (see ``SimServerConfig.root``)."""
        cfg = self.config
        if cfg.root is not None:
            return cfg.root
        return cfg.tokenizer if cfg.tokenizer is not None else cfg.model

    @property
    def kv_events_endpoint(self) -> str | None:
        return self._publisher.endpoint if self._publisher is not None else None

    @property
    def kv_events_connect(self) -> bool:
        """True when the PUB socket connects to ``kv_events`` (a subscriber binds there)."""
        cfg = self.config
        return (cfg.kv_events is not None and cfg.kv_events_socket == "vllm"
                and not vllm_pub_binds(cfg.kv_events))

    @property
    def kv_replay_endpoint(self) -> str | None:
        return self._publisher.replay_endpoint if self._publisher is not None else None

    @property
    def kv_events_endpoints(self) -> list[str]:
        """Every rank's bound PUB endpoint, in rank order (empty without events)."""
        return [pub.endpoint for pub in self._publishers]

    @property
    def kv_replay_endpoints(self) -> list[str | None]:
        """Every rank's replay endpoint, in rank order (empty without events)."""
        return [pub.replay_endpoint for pub in self._publishers]

    def ready_info(self) -> dict[str, Any]:
        """What ``kvroute sim serve`` prints once it is listening (one JSON line)."""
        return {
            "ready": True,
            "url": self.url,
            "model": self.config.model,
            "root": self.root,
            "max_model_len": self.engine_config.max_model_len,
            "block_size": self.engine_config.block_size,
            "kv_events": self.kv_events_endpoint,
            "kv_events_connect": self.kv_events_connect,
            "kv_replay": self.kv_replay_endpoint,
            "kv_topic": self.config.kv_topic,
            "data_parallel_size": self.config.data_parallel_size,
            "kv_events_by_rank": self.kv_events_endpoints,
        }

    async def start(self) -> None:
        """Bind ZMQ and HTTP, start the engine loop.

        Raises:
            OSError: a port is taken. ``zmq.ZMQError``: a ZMQ endpoint cannot be bound.
        """
        cfg = self.config
        single = cfg.data_parallel_size == 1
        for rank, engine in enumerate(self.engines):
            publish: Callable[[Sequence[Any]], object] | None = None
            if cfg.kv_events is not None:
                pub = KVEventPublisher(
                    offset_endpoint_port(cfg.kv_events, rank),
                    replay_endpoint=(None if cfg.kv_replay is None
                                     else offset_endpoint_port(cfg.kv_replay, rank)),
                    topic=cfg.kv_topic,
                    buffer_steps=cfg.kv_buffer_steps,
                    data_parallel_rank=cfg.data_parallel_rank if single else rank,
                    socket_mode=cfg.kv_events_socket,
                )
                pub.start()
                self._publishers.append(pub)
                publish = self._publish_for(pub)
            driver = EngineDriver(engine, publish=publish, sleep_scale=cfg.sleep_scale,
                                  on_step_late=self.stalls.step_lateness.observe)
            driver.stats.engine = cfg.data_parallel_rank if single else rank
            driver.start()
            self.drivers.append(driver)
        self._publisher = self._publishers[0] if self._publishers else None
        self.driver = self.drivers[0]
        http = self._http = self.build_http()
        try:
            self.port = await http.start(cfg.host, cfg.port, backlog=2048)
        except BaseException:
            await self.stop()
            raise

    def _publish_for(self, pub: KVEventPublisher) -> Callable[[Sequence[Any]], int]:
        faults = self.faults

        def publish_batch(events: Sequence[Any]) -> int:
            return pub.publish(events, skip_send=faults.take_drop())

        return publish_batch

    async def stop(self) -> None:
        """Stop HTTP, the engine loops and the publishers. Idempotent."""
        http, self._http = self._http, None
        if http is not None:
            await http.close(grace_s=_SHUTDOWN_GRACE_S)
        drivers, self.drivers, self.driver = self.drivers, [], None
        for driver in drivers:
            await driver.stop()
        pubs, self._publishers, self._publisher = self._publishers, [], None
        for pub in pubs:
            pub.close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def build_http(self) -> HttpServer:
        """The HTTP server with its routes (``start`` binds it)."""
        routes: dict[str, dict[str, Handler]] = {
            "/v1/chat/completions": {"POST": self._chat},
            "/v1/completions": {"POST": self._completions},
            "/v1/chat/completions/render": {"POST": self._render_chat},
            "/v1/completions/render": {"POST": self._render_completions},
            "/tokenize": {"POST": self._tokenize},
            "/detokenize": {"POST": self._detokenize},
            "/v1/models": {"GET": self._models},
            "/health": {"GET": self._health},
            "/version": {"GET": self._version},
            "/load": {"GET": self._load},
            "/metrics": {"GET": self._metrics},
            "/kv_event_sources": {"GET": self._kv_event_sources},
            "/reset_prefix_cache": {"POST": self._reset_prefix_cache},
        }
        if self.config.allow_runtime_lora:
            routes["/v1/load_lora_adapter"] = {"POST": self._load_lora_adapter}
        if self.config.fault_injection:
            routes["/sim/faults"] = {"GET": self._faults_get, "POST": self._faults_post,
                                     "DELETE": self._faults_delete}
        return HttpServer(routes, max_body_bytes=oa.DEFAULT_MAX_BODY_BYTES,
                          error_body=_http_error_body, name="engine")

    # ------------------------------------------------------------------ helpers

    def _check_model(self, model: str | None) -> None:
        if (model is not None and model not in self.config.served_names
                and model not in self._loras):
            names = ", ".join((*self.config.served_names, *self._loras))
            raise _error(
                f"The model `{model}` does not exist. Valid aliases: {names}.",
                status=404,
                param="model",
            )

    def _chat_text(self, body: Mapping[str, Any], messages: Sequence[Mapping[str, Any]],
                   tools: Sequence[Any] | None) -> str:
        """The chat template applied as the request asks (the text vLLM then tokenizes)."""
        add_gen = body.get("add_generation_prompt", True)
        cont = body.get("continue_final_message", False)
        if add_gen and cont:
            explicit = bool(body.get("add_generation_prompt"))
            raise _error(_BOTH_FLAGS_MESSAGE if explicit else _IMPLICIT_FLAGS_MESSAGE)
        kwargs = body.get("chat_template_kwargs")
        try:
            text = self.tokenizer.render_chat(
                messages,
                add_generation_prompt=bool(add_gen),
                continue_final_message=bool(cont),
                tools=tools,
                chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
            )
        except ChatTemplateError as exc:
            raise _error(str(exc)) from exc
        return text

    def _chat_ids(self, body: Mapping[str, Any], messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Any] | None) -> Sequence[int]:
        text = self._chat_text(body, messages, tools)
        return self.tokenizer.encode(text, add_special_tokens=bool(
            body.get("add_special_tokens", False)))

    def _completion_ids(self, body: Mapping[str, Any],
                        prompt: Any) -> tuple[Sequence[int], int | None]:
        """The prompt's ids and, for a text prompt, its length in characters."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise _error(
                    f"'prompt' holds {len(prompt)} prompts; the simulated engine serves one "
                    "prompt per request: send them as separate requests",
                    param="prompt",
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            add = bool(body.get("add_special_tokens", True))
            return self.tokenizer.encode(prompt, add_special_tokens=add), len(prompt)
        return [int(t) for t in prompt], None

    def _prepare(self, raw: bytes, endpoint: oa.Endpoint) -> _Prepared:
        try:
            parsed = oa.parse_request(raw, endpoint)
        except oa.RequestError as exc:
            raise _BadRequest(exc.status, exc.body()) from exc
        self._check_model(parsed.model)
        body = parsed.body
        budget = body.get("thinking_token_budget")
        if self.config.reasoning_parser is None:
            if budget is not None and budget != -1:
                raise _error(_THINKING_MESSAGE)
        elif budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                     or budget < -1):
            raise _error(_BUDGET_MESSAGE, param="thinking_token_budget")
        chars: int | None
        if endpoint == "chat":
            assert parsed.messages is not None, "parse_request checked messages"
            text = self._chat_text(body, parsed.messages, parsed.tools)
            ids = self.tokenizer.encode(
                text, add_special_tokens=bool(body.get("add_special_tokens", False)))
            chars = len(text)
        else:
            if parsed.prompt is None:
                raise _error("prompt_embeds are not supported by the simulated engine",
                             param="prompt_embeds")
            ids, chars = self._completion_ids(body, parsed.prompt)
        is_text = chars is not None
        if not ids:
            raise _error("The decoder prompt cannot be empty")
        window = self.engine_config.max_model_len
        asked = parsed.max_tokens
        rejected = check_overflow(
            self.error_style,
            window=window,
            prompt_tokens=len(ids),
            max_tokens=asked,
            max_tokens_param=parsed.max_tokens_param or "max_tokens",
            prompt_chars=chars,
            max_chars_per_token=self.max_chars_per_token,
            prompt_is_text=is_text,
            stream=parsed.stream,
        )
        if rejected is not None:
            raise _BadRequest(rejected.status, rejected.body, rejected.content_type)
        if asked is not None and self.error_style != "vllm-0.32":
            asked = min(asked, window)  # the style accepted it: the engine clamps
        decode, prefill = self._kv_transfer(body.get("kv_transfer_params"), len(ids))
        return _Prepared(parsed, ids, asked, decode, prefill)

    def _kv_transfer(self, params: Any, num_tokens: int) -> tuple[bool, bool]:
        """``(remote_decode, remote_prefill)`` from a request's ``kv_transfer_params``; a
        decode's parameters must locate a prefill of this prompt (its blocks)."""
        if params is None:
            return False, False
        if not isinstance(params, Mapping):
            raise _error("kv_transfer_params must be an object", param="kv_transfer_params")
        if params.get("do_remote_decode") is True:
            return True, False
        if params.get("do_remote_prefill") is not True:
            return False, False
        blocks = params.get("remote_block_ids")
        missing = [k for k in ("remote_engine_id", "remote_host", "remote_port")
                   if params.get(k) is None]
        if missing or not isinstance(blocks, list):
            raise _error(
                "kv_transfer_params with do_remote_prefill needs remote_engine_id, "
                "remote_block_ids, remote_host and remote_port: pass on the ones the prefill "
                f"engine's answer carried (missing: {missing or ['remote_block_ids']})",
                param="kv_transfer_params")
        needed = (num_tokens - 1) // self.engine_config.block_size
        if len(blocks) < needed:
            raise _error(
                f"kv_transfer_params.remote_block_ids lists {len(blocks)} blocks but this "
                f"{num_tokens}-token prompt needs {needed}: the parameters belong to another "
                "prompt's prefill", param="kv_transfer_params")
        return False, True

    def _transfer_answer(self, prep: _Prepared, rid: str) -> dict[str, Any]:
        """The ``kv_transfer_params`` a prefill's answer carries (NixlConnector's names)."""
        bs = self.engine_config.block_size
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self._engine_id,
                "remote_block_ids": list(range(-(-len(prep.prompt_ids) // bs))),
                "remote_host": self.config.host, "remote_port": self.port,
                "remote_request_id": rid, "tp_size": 1}

    def _thinking_limit(self, prep: _Prepared) -> int | None:
        """How many of a choice's first tokens are thinking: None without a reasoning parser
        or off the chat endpoint (no split, no count), 0 when the template switch is off,
        else the ``thinking_token_budget`` (unlimited: every token). The thinking ends at the
        budget and the answer follows, as vLLM's budget forces the end-of-thinking token."""
        parsed = prep.parsed
        if self.config.reasoning_parser is None or parsed.endpoint != "chat":
            return None
        kwargs = parsed.body.get("chat_template_kwargs")
        if isinstance(kwargs, Mapping) and (kwargs.get("enable_thinking") is False
                                            or kwargs.get("thinking") is False):
            return 0
        budget = parsed.body.get("thinking_token_budget")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            return sys.maxsize
        return budget

    def _reasoning_tokens(self, prep: _Prepared, outputs: Sequence[int]) -> int | None:
        """The thinking tokens among ``outputs`` (each choice's token count), or None without
        a reasoning parser or off the chat endpoint (``SimServerConfig.reasoning_parser``)."""
        limit = self._thinking_limit(prep)
        if limit is None:
            return None
        return sum(min(limit, n) for n in outputs)

    @staticmethod
    def _shows_reasoning(prep: _Prepared) -> bool:
        """vLLM's ``include_reasoning`` (default true): false drops the text, not the count."""
        return prep.parsed.body.get("include_reasoning", True) is not False

    def _rejection(self, rej: Rejection, param: str) -> _BadRequest:
        """An engine-level rejection the style checks let through (edge cases only)."""
        if rej.kind is RejectionKind.EMPTY_PROMPT:
            return _error("The decoder prompt cannot be empty")
        case = {
            RejectionKind.PROMPT_TOO_LONG: OverflowCase.PROMPT,
            RejectionKind.MAX_TOKENS_TOO_LARGE: OverflowCase.MAX_TOKENS,
            RejectionKind.MAX_TOKENS_TOO_SMALL: OverflowCase.NO_ROOM,
        }[rej.kind]
        resp = format_overflow(
            "vllm-0.32", case, window=rej.max_model_len, prompt_tokens=rej.prompt_tokens,
            max_tokens=rej.max_tokens, max_tokens_param=param,  # type: ignore[arg-type]
        )
        return _BadRequest(resp.status, resp.body, resp.content_type)

    @staticmethod
    def _answer(exc: _BadRequest) -> Response:
        return Response(status=exc.status, body=exc.body, content_type=exc.content_type)

    @staticmethod
    def _json(obj: Any, status: int = 200) -> Response:
        return Response(status=status, body=answers.encode_json(obj),
                        content_type="application/json")

    @staticmethod
    def _body(request: Request) -> bytes:
        """The request's body; a 413 (``_BadRequest``) when it was over the limit."""
        if request.body_too_large:
            raise _error(f"The request body is over {oa.DEFAULT_MAX_BODY_BYTES} bytes, this "
                         "server's limit; send a shorter prompt.", status=413)
        return request.body

    async def _read_json(self, request: Request) -> dict[str, Any]:
        raw = self._body(request)
        try:
            body = _JSON_DECODER.decode(raw)
        except msgspec.DecodeError as exc:
            raise _error(f"Request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise _error("Request body must be a JSON object")
        return body

    # ------------------------------------------------------------------ generation

    async def _chat(self, request: Request) -> Response | StreamResponse:
        return await self._generate(request, "chat")

    async def _completions(self, request: Request) -> Response | StreamResponse:
        return await self._generate(request, "completions")

    def _rank_for(self, request: Request) -> int:
        """The rank that serves ``request``: its ``X-data-parallel-rank``, else vLLM's
        load balancer's pick (module docstring, "Data parallel")."""
        size = self.config.data_parallel_size
        header = request.headers.get(DP_RANK_HEADER.lower())
        if header is not None:
            try:
                return parse_dp_rank(header, size)
            except DpRankError as exc:
                raise _error(str(exc)) from None
        if size == 1:
            return 0
        scores = []
        for engine in self.engines:
            m = engine.metrics()
            scores.append(4 * m.num_requests_waiting + m.num_requests_running)
        return scores.index(min(scores))

    def _submit(self, prep: _Prepared, rid: str, rank: int = 0) -> Submitted:
        assert self.drivers, "the server is not started"
        driver = self.drivers[rank]
        parsed = prep.parsed
        seed = parsed.body.get("seed")
        seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else None
        n = parsed.n
        path = self._loras.get(parsed.model) if parsed.model is not None else None
        lora = LoraKey(parsed.model, path) if parsed.model is not None and path else None
        xargs = parsed.vllm_xargs or {}
        report_full = xargs.get("kv_cache_report_mode") == "full"
        if lora is not None:
            hashes = self.hasher.hash_blocks(prep.prompt_ids, cache_salt=parsed.cache_salt,
                                             lora=lora)
        else:
            hashes = self._hash_memo.hash_blocks(prep.prompt_ids, cache_salt=parsed.cache_salt)
        reqs = [
            EngineRequest(
                request_id=rid if n == 1 else f"{i}_{rid}",
                prompt_token_ids=prep.prompt_ids,
                max_tokens=prep.max_tokens,
                endpoint=parsed.endpoint,
                output_length=self._answer_length(prep, seed, i),
                cache_salt=parsed.cache_salt,
                seed=(seed + i) & ((1 << 64) - 1) if seed is not None else None,
                prompt_block_hashes=hashes,
                lora=lora,
                lora_id=self._lora_ids.get(lora.name) if lora is not None else None,
                report_full=report_full,
                kv_transfer_s_per_token=(self.config.kv_transfer_s_per_token
                                         if prep.remote_prefill else None),
            )
            for i in range(n)
        ]
        result = driver.submit(reqs)
        if isinstance(result, Rejection):
            raise self._rejection(result, parsed.max_tokens_param or "max_tokens")
        return result

    def _answer_length(self, prep: _Prepared, seed: int | None, choice: int) -> int | None:
        """When this choice "emits EOS" (module docstring, Generation); None: never."""
        config = self.config
        if config.eos_after_tokens is not None:
            return config.eos_after_tokens
        if config.answer_lengths is None or prep.parsed.body.get("ignore_eos") is True:
            return None
        return config.answer_lengths.length_for(prep.prompt_ids, request_seed=seed,
                                                choice=choice)

    async def _generate(self, request: Request, endpoint: oa.Endpoint) -> Response | StreamResponse:
        try:
            raw = self._body(request)
        except _BadRequest as exc:
            return self._answer(exc)
        fault = self.faults.take_request()
        if fault.fail_status is not None:
            return self._answer(_error(
                f"Simulated failure: /sim/faults armed fail_next, so this request is answered "
                f"with {fault.fail_status} before the first byte. Disarm it with DELETE "
                "/sim/faults.",
                status=fault.fail_status,
            ))
        if fault.stall_s > 0.0:
            await asyncio.sleep(fault.stall_s)
        try:
            prep = self._prepare(raw, endpoint)
            rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
            rank = self._rank_for(request)
            submitted = self._submit(prep, rid, rank)
        except _BadRequest as exc:
            return self._answer(exc)
        driver = self.drivers[rank]
        stream = submitted.stream
        self._in_flight += 1
        kill = fault.kill_after_tokens
        try:
            if prep.parsed.stream:
                return await self._stream(request, prep, rid, stream, kill)
            return await self._unary(request, prep, rid, stream, kill)
        except _Killed:
            return Response(status=500)  # the connection is closed: this is never sent
        finally:
            self._in_flight -= 1
            if not stream.done:
                driver.abort(stream)  # client went away (handler cancelled or write failed)

    def _kill(self, request: Request) -> None:
        """The kill fault: close the connection now (after flushing what was written)."""
        self.faults.requests_killed += 1
        request.close_connection()
        raise _Killed

    async def _unary(self, request: Request, prep: _Prepared, rid: str,
                     stream: RequestStream, kill: int | None) -> Response:
        parsed = prep.parsed
        n = parsed.n
        tokens: list[list[int]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        cached = 0
        while True:
            items = await stream.get()
            if not items:
                break
            for index, out in items:
                tokens[index].extend(out.new_token_ids)
                if out.first_token and index == 0:
                    cached = out.num_cached_tokens
                if out.finished:
                    reasons[index] = out.finish_reason
            if kill is not None and not stream.done and sum(len(t) for t in tokens) >= kill:
                self._kill(request)
        created = int(time.time())
        usage = answers.usage(
            len(prep.prompt_ids),
            sum(len(t) for t in tokens),
            cached_tokens=cached if self.config.enable_prompt_tokens_details else None,
            reasoning_tokens=self._reasoning_tokens(prep, [len(t) for t in tokens]),
        )
        choices: list[dict[str, Any]] = []
        limit = self._thinking_limit(prep)
        for i in range(n):
            thought = min(limit, len(tokens[i])) if limit is not None else 0
            answer_ids = tokens[i][thought:]
            text = _TextDecoder(self.tokenizer).push(answer_ids) if answer_ids else ""
            if parsed.endpoint == "chat":
                reasoning = (_TextDecoder(self.tokenizer).push(tokens[i][:thought])
                             if thought and self._shows_reasoning(prep) else None)
                one = answers.chat_completion_response(
                    id=rid, created=created, model=parsed.model,
                    content=None if thought and not text else text,
                    finish_reason=reasons[i], usage_info=usage, reasoning=reasoning,
                )
            else:
                one = answers.completion_response(
                    id=rid, created=created, model=parsed.model, text=text,
                    finish_reason=reasons[i], usage_info=usage,
                )
            choice = one["choices"][0]
            choice["index"] = i
            choices.append(choice)
        one["choices"] = choices
        if prep.remote_decode:
            one["kv_transfer_params"] = self._transfer_answer(prep, rid)
        return self._json(one)

    async def _stream(
        self, request: Request, prep: _Prepared, rid: str, stream: RequestStream,
        kill: int | None,
    ) -> StreamResponse:
        parsed = prep.parsed
        chat = parsed.endpoint == "chat"
        model = parsed.model
        n = parsed.n
        created = int(time.time())
        resp = StreamResponse(status=200, headers=_SSE_HEADERS)
        await resp.prepare(request)
        decoders = [_TextDecoder(self.tokenizer) for _ in range(n)]
        thinkers = [_TextDecoder(self.tokenizer) for _ in range(n)]  # the reasoning's text
        limit = self._thinking_limit(prep)
        show = self._shows_reasoning(prep)
        # The chat role chunk goes out with the first engine output, as vLLM sends it: a
        # router measuring the time to the first body chunk must see the prefill in it.
        pending = b""
        if chat:
            pending = b"".join(
                encode_data(answers.chat_chunk(id=rid, created=created, model=model,
                                               role="assistant", content="", index=i))
                for i in range(n)
            )
        if kill == 0:
            self._kill(request)
        completion_tokens = 0
        per_choice = [0] * n
        cached = 0
        while True:
            items = await stream.get()
            if not items:
                if pending:
                    await resp.write(pending)
                break
            parts: list[bytes] = [pending] if pending else []
            pending = b""
            for index, out in items:
                completion_tokens += len(out.new_token_ids)
                per_choice[index] += len(out.new_token_ids)
                if out.first_token and index == 0:
                    cached = out.num_cached_tokens
                if chat:
                    ids = out.new_token_ids
                    done = per_choice[index] - len(ids)  # this choice's tokens before these
                    split = max(0, min(len(ids), limit - done)) if limit is not None else 0
                    thought = thinkers[index].push(ids[:split]) if split else None
                    text = (decoders[index].push(ids[split:])
                            if thought is None or split < len(ids) else None)
                    chunk = answers.chat_chunk(
                        id=rid, created=created, model=model, index=index, content=text,
                        reasoning=thought if show else None,
                        finish_reason=out.finish_reason if out.finished else None,
                        final=out.finished,
                    )
                else:
                    text = decoders[index].push(out.new_token_ids)
                    chunk = answers.completion_chunk(
                        id=rid, created=created, model=model, text=text, index=index,
                        finish_reason=out.finish_reason if out.finished else None,
                    )
                parts.append(encode_data(chunk))
            if stream.done:
                if parsed.include_usage:
                    usage = answers.usage(
                        len(prep.prompt_ids), completion_tokens,
                        cached_tokens=cached if self.config.enable_prompt_tokens_details else None,
                        full=False,
                        reasoning_tokens=self._reasoning_tokens(prep, per_choice),
                    )
                    parts.append(encode_data(answers.chat_usage_chunk(
                        id=rid, created=created, model=model, usage_info=usage, chat=chat)))
                parts.append(DONE)
            await resp.write(b"".join(parts))
            if kill is not None and not stream.done and completion_tokens >= kill:
                self._kill(request)
        await resp.write_eof()
        return resp

    # ------------------------------------------------------------------ render, tokenize

    async def _render(self, request: Request, endpoint: oa.Endpoint) -> Response:
        if not self.config.render_endpoints:
            return Response(status=403, body=oa.error_body(_SCALE_OUT_MESSAGE, status=403),
                            content_type="application/json")
        try:
            prep = self._prepare(self._body(request), endpoint)
        except _BadRequest as exc:
            return self._answer(exc)
        body = prep.parsed.body
        window = self.engine_config.max_model_len
        left = window - len(prep.prompt_ids)
        if prep.max_tokens is not None:
            max_tokens = min(prep.max_tokens, left)
        elif endpoint == "chat":
            max_tokens = left
        else:
            max_tokens = min(self.engine_config.default_max_tokens, left)
        sampling = {
            "n": prep.parsed.n,
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "seed": body.get("seed"),
            "max_tokens": max_tokens,
        }
        return self._json({"token_ids": list(prep.prompt_ids), "features": None,
                           "sampling_params": sampling})

    async def _render_chat(self, request: Request) -> Response:
        return await self._render(request, "chat")

    async def _render_completions(self, request: Request) -> Response:
        return await self._render(request, "completions")

    async def _tokenize(self, request: Request) -> Response:
        try:
            body = await self._read_json(request)
            model = body.get("model")
            self._check_model(model if isinstance(model, str) else None)
            if "messages" in body:
                messages = body["messages"]
                if not isinstance(messages, list) or not all(isinstance(m, dict)
                                                             for m in messages):
                    raise _error("'messages' must be a list of message objects",
                                 param="messages")
                tools = body.get("tools")
                ids = self._chat_ids(body, messages, tools if isinstance(tools, list) else None)
            elif isinstance(body.get("prompt"), str):
                ids = self.tokenizer.encode(
                    body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
            else:
                raise _error("send 'prompt' (a string) or 'messages' (a list) to /tokenize",
                             param="prompt")
        except _BadRequest as exc:
            return self._answer(exc)
        strs = self.tokenizer.token_strs(ids) if body.get("return_token_strs") else None
        return self._json(answers.tokenize_response(
            ids, max_model_len=self.engine_config.max_model_len, token_strs=strs))

    async def _detokenize(self, request: Request) -> Response:
        try:
            body = await self._read_json(request)
            model = body.get("model")
            self._check_model(model if isinstance(model, str) else None)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 63
                for t in tokens
            ):
                raise _error("'tokens' must be a list of token ids (integers >= 0)",
                             param="tokens")
        except _BadRequest as exc:
            return self._answer(exc)
        return self._json(answers.detokenize_response(self.tokenizer.decode(tokens)))

    # ------------------------------------------------------------------ small GETs

    async def _models(self, request: Request) -> Response:
        cards = [
            oa.model_card(id=name, created=self.created,
                          max_model_len=self.engine_config.max_model_len,
                          permission_id=self._perm_id, root=self.root)
            for name in self.config.served_names
        ]
        cards.extend(
            oa.model_card(id=name, created=self.created, max_model_len=None,
                          permission_id=self._perm_id, root=path, parent=self.config.model)
            for name, path in self._loras.items()
        )
        return self._json(oa.models_response(cards))

    async def _load_lora_adapter(self, request: Request) -> Response:
        """vLLM's ``POST /v1/load_lora_adapter {lora_name, lora_path}`` (with
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): 200 and a plain-text line, or vLLM's 400s."""
        try:
            body = await self._read_json(request)
            name, path = body.get("lora_name"), body.get("lora_path")
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
                raise _error("Both 'lora_name' and 'lora_path' must be provided.")
            if name in self.config.served_names:
                raise _error(f"The lora adapter '{name}' conflicts with a served base model.")
            if name in self._loras and not body.get("load_inplace"):
                raise _error(f"The lora adapter '{name}' has already been loaded. If you want "
                             "to load the adapter in place, set 'load_inplace' to True.")
        except _BadRequest as exc:
            return self._answer(exc)
        self._loras[name] = path
        self._lora_ids.setdefault(name, len(self._lora_ids) + 1)
        return Response(status=200, body=f"Success: LoRA adapter '{name}' added successfully."
                        .encode(), content_type="text/plain")

    async def _health(self, request: Request) -> Response:
        return Response(status=200)

    async def _version(self, request: Request) -> Response:
        return self._json({"version": VLLM_VERSION})

    async def _load(self, request: Request) -> Response:
        return self._json({"server_load": self._in_flight})

    def cache_config_labels(self) -> dict[str, str]:
        """The labels of ``vllm:cache_config_info`` (vLLM writes every value as a string)."""
        ec = self.engine_config
        labels = {
            "block_size": str(ec.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(ec.enable_prefix_caching),
            "gpu_memory_utilization": "0.9",
            "hash_block_size": "None",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(ec.num_gpu_blocks),
            "num_gpu_blocks_override": str(ec.num_gpu_blocks),
            "prefix_caching_hash_algo": self.hasher.algo,
        }
        labels.update(self.config.extra_cache_labels)
        return labels

    async def _metrics(self, request: Request) -> Response:
        assert self.drivers, "the server is not started"
        text = render_vllm_metrics([d.snapshot() for d in self.drivers],
                                   model_name=self.config.model,
                                   cache_config=self.cache_config_labels(),
                                   created_s=float(self.created))
        if self.engine_config.max_loras is not None:
            running, waiting = self.engine.lora_adapters()
            for other in self.engines[1:]:  # one series for the server, as rank 0's plus
                more_running, more_waiting = other.lora_adapters()
                running = [*running, *(a for a in more_running if a not in running)]
                waiting = [*waiting, *(a for a in more_waiting if a not in waiting)]
            text += (
                "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
                "# TYPE vllm:lora_requests_info gauge\n"
                f'vllm:lora_requests_info{{max_lora="{self.config.max_loras}",'
                f'running_lora_adapters="{",".join(running)}",'
                f'waiting_lora_adapters="{",".join(waiting)}"}} {time.time()}\n'
            )
        text += self.stalls.render()
        return Response(body=text.encode("utf-8"), content_type="text/plain; charset=utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})

    async def _kv_event_sources(self, request: Request) -> Response:
        cfg = self.config
        if not self._publishers:
            ranks = ([cfg.data_parallel_rank] if cfg.data_parallel_size == 1
                     else list(range(cfg.data_parallel_size)))
            return self._json({str(rank): self._event_source(None, rank) for rank in ranks})
        if cfg.data_parallel_size == 1:
            return self._json({str(cfg.data_parallel_rank):
                               self._event_source(self._publishers[0], 0)})
        return self._json({str(rank): self._event_source(pub, rank)
                           for rank, pub in enumerate(self._publishers)})

    def _event_source(self, pub: KVEventPublisher | None, rank: int) -> dict[str, Any]:
        """One rank's ``KVEventsConfig`` as ``/kv_event_sources`` shows it."""
        cfg = self.config
        return {
            "enable_kv_cache_events": pub is not None,
            "publisher": "zmq" if pub is not None else "null",
            "endpoint": pub.endpoint if pub is not None else "tcp://*:5557",
            "replay_endpoint": pub.replay_endpoint if pub is not None else None,
            "buffer_steps": cfg.kv_buffer_steps,
            "hwm": 100_000,
            "max_queue_size": 100_000,
            "topic": cfg.kv_topic,
        }

    async def _faults_get(self, request: Request) -> Response:
        return self._json(self.faults.state())

    async def _faults_post(self, request: Request) -> Response:
        try:
            body = await self._read_json(request)
            try:
                self.faults.apply(body)
            except FaultSpecError as exc:
                raise _error(str(exc)) from exc
        except _BadRequest as exc:
            return self._answer(exc)
        return self._json(self.faults.state())

    async def _faults_delete(self, request: Request) -> Response:
        self.faults.clear()
        return self._json(self.faults.state())

    async def _reset_prefix_cache(self, request: Request) -> Response:
        assert self.drivers, "the server is not started"
        reset = [driver.reset_prefix_cache() for driver in self.drivers]  # every rank tries
        if all(reset):
            return Response(status=200)
        return self._json({"error": "Failed to reset prefix cache: requests are running"}, 500)


def run_sim_server(
    config: SimServerConfig,
    *,
    on_ready: Callable[[SimServer], None] | None = None,
    use_uvloop: bool = True,
) -> None:
    """Serve until SIGINT/SIGTERM (the body of ``kvroute sim serve``).

    Args:
        config: the server options.
        on_ready: called once HTTP and ZMQ are bound (e.g. to print the ready line).
        use_uvloop: run on uvloop when it is installed.
    """
    import signal

    server = SimServer(config)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with server:
            freeze_startup_heap()  # as the router does: no full collection walks start-up
            # The process is this server's alone: its collections are the server's pauses
            # (not watched for in-process servers, which share a process with others).
            server.stalls.watch_gc()
            try:
                if on_ready is not None:
                    on_ready(server)
                await stop.wait()
            finally:
                server.stalls.stop()

    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            uvloop = None  # type: ignore[assignment]
        if uvloop is not None:
            uvloop.run(main())
            return
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())

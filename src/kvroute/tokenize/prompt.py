"""Exact prompt tokens for routing: the engines' ``/tokenize``, a local HF tokenizer, or none.

Owns one ``PromptTokenizer`` per pool, chosen by ``pools.<name>.tokenizer``:

* ``engine``: ``POST /tokenize`` on ONE healthy replica of the pool (round-robin), in vLLM's
  chat form (``messages`` + ``tools`` + ``add_generation_prompt`` + ``chat_template_kwargs``
  ... as the request has them) or completion form (``prompt``). The chat form's ids are
  exactly the ``prompt_token_ids`` of the chat completion
  (docs/reference/vllm-engine-contract.md §3.3), so the block hashes match the engine's. A short timeout bounds the call; any failure returns None (the request
  is routed approximately) and is counted.
* ``local``: a Hugging Face tokenizer directory (``tokenizer.json`` through ``tokenizers``,
  the chat template of ``tokenizer_config.json`` through sandboxed ``jinja2``), loaded once at
  start-up. Chat prompts are encoded piecewise from a cache of already-seen pieces
  (``kvroute.tokenize.segments`` inside ``HFTokenizer``: the system prompt and earlier turns
  cost a lookup, only new text is encoded), on the event loop's thread: ``tokenizers``
  holds the GIL while it encodes, so a worker thread bought no concurrency, only a hand-off
  (``docs/benchmarks.md#tokenization-on-the-loop-piece-checks-on-a-thread``).
* ``auto``: the engines' ``/tokenize`` until the engines' own model directory is found on
  this host and gives the same ids; then local (``tokenize/check.py``). A ``local``
  directory is checked against the engines the same way, and a mismatch falls back to them.
* ``none``: always None; the pool routes in the declared approximate mode.

Requests that already carry token ids (completions with ``prompt: [ints]``) need no call in
any exact mode. Requests whose hashes the router cannot reproduce from token ids alone
(multimodal content: vLLM adds per-item hashes as extra keys; several prompts in one
completion) return None and are counted as ``unsupported``.

Visibility: each pool's mode is exported (``kvroute_tokenizer_mode``) and logged at start;
an ``engine`` tokenizer logs when ``/tokenize`` starts failing and when it recovers, so
approximate routing is never silent.

The local loader is ``kvroute.tokenize.hf.HFTokenizer``, shared with the simulated engine so
both sides apply the same chat-template rules.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Annotated, Any, Final, Literal, NamedTuple, Protocol

import msgspec

from kvroute.config import PoolConfig, RouterConfig
from kvroute.core.errors import ConfigError
from kvroute.http.client import ConnectFailed, ConnectTimeout, EngineClient, EngineClientError
from kvroute.tokenize.hf import ChatTemplateError, HFTokenizer
from kvroute.tokenize.piece_check import PieceCheckThread
from kvroute.tokenize.ports import ReplicaDirectory, TokenizerMetrics
from kvroute.tokenize.segments import SegmentEncoder
from kvroute.wire.openai import ParsedRequest

__all__ = [
    "DEFAULT_TOKENIZE_TIMEOUT_S",
    "ApproximateTokenizer",
    "EngineTokenizer",
    "LocalTokenizer",
    "PromptTokenizer",
    "SwitchingTokenizer",
    "TokenizeFailure",
    "TokenizerMode",
    "build_tokenizers",
    "post_tokenize",
    "prompt_token_ids",
    "tokenize_request_body",
    "tokens_of_answer",
]

log = logging.getLogger(__name__)

TokenizerMode = Literal["engine", "local", "approximate"]

DEFAULT_TOKENIZE_TIMEOUT_S: Final = 1.0
"""Bound on one ``/tokenize`` call; the request waits for it, so it is kept short."""

# Chat fields vLLM's /tokenize chat form accepts with the same meaning as in a chat
# completion; copied over when the request has them.
_CHAT_FORM_FIELDS: Final = (
    "continue_final_message", "add_special_tokens", "chat_template", "chat_template_kwargs",
    "mm_processor_kwargs",
)  # fmt: skip
_JSON_ENCODER: Final = msgspec.json.Encoder()


class PromptTokenizer(Protocol):
    """The exact prompt tokens of a request, as the pool's engines will see them."""

    mode: TokenizerMode

    async def token_ids(self, parsed: ParsedRequest) -> Sequence[int] | None:
        """The prompt's token ids, or None: route this request approximately.

        A list, or an ``array('I')`` from a local tokenizer's piece cache (the block-hash memo
        keys those by their bytes, with no int object per token): read them as a sequence,
        and convert with ``list()`` before JSON-encoding or comparing them with a list."""
        ...


# -- request shapes ---------------------------------------------------------------------------


def prompt_token_ids(parsed: ParsedRequest) -> list[int] | None:
    """The ids a completions request already carries (``[ints]`` or ``[[ints]]``), else None."""
    prompt = parsed.prompt
    if parsed.endpoint != "completions" or not isinstance(prompt, list) or not prompt:
        return None
    if len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)  # type: ignore[arg-type]
    return None


def _text_only(messages: Sequence[Mapping[str, Any]]) -> bool:
    for message in messages:
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            return False
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                return False
    return True


def tokenize_request_body(parsed: ParsedRequest, model: str | None) -> dict[str, Any] | None:
    """vLLM's ``/tokenize`` body that yields the same ids as ``parsed``, or None if none does.

    Chat: ``messages``, ``add_generation_prompt`` (the request's, default True, as a chat
    completion), ``tools`` and the template fields of ``_CHAT_FORM_FIELDS`` when present.
    Completions: ``prompt`` (one string) and ``add_special_tokens`` (default True).
    None for multimodal messages and for several prompts in one request.
    """
    body = parsed.body
    out: dict[str, Any] = {} if model is None else {"model": model}
    if parsed.endpoint == "chat":
        messages = parsed.messages or []
        if not _text_only(messages):
            return None
        out["messages"] = messages
        out["add_generation_prompt"] = body.get("add_generation_prompt", True)
        if parsed.tools:
            out["tools"] = parsed.tools
        for key in _CHAT_FORM_FIELDS:
            if key in body:
                out[key] = body[key]
        return out
    prompt = parsed.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None
    out["prompt"] = prompt
    out["add_special_tokens"] = body.get("add_special_tokens", True)
    return out


# -- the three modes -------------------------------------------------------------------------


class ApproximateTokenizer:
    """No tokenizer: every request is routed on text (``tokenizer: none``)."""

    mode: TokenizerMode = "approximate"

    def __init__(self, pool: str) -> None:
        self.pool = pool

    async def token_ids(self, parsed: ParsedRequest) -> Sequence[int] | None:
        return None


class EngineTokenizer:
    """``POST /tokenize`` on one healthy replica of the pool, round-robin.

    Invariant: one upstream call per request, bounded by ``timeout_s``, except that a refused
    connection (nothing listens on the port: the answer came at once) moves to the next
    healthy replica and reports the dead one to discovery, as a refused inference request
    does; any other failure is not retried (the request would wait twice; approximate routing
    is the cheaper fallback). ``failing`` is True from a failed call to the next good one,
    and each flip is logged once.

    Identical prompts are tokenized once: the ``/tokenize`` body (model, messages, tools,
    template options, byte for byte) keys an answer shared by calls in flight together (a
    burst of siblings, ``n`` parallel samples of an agent step) and kept for
    ``recent_ttl_s`` afterwards (a retry, a re-sent turn), at most ``recent_entries``
    answers. Equal bodies give equal ids from the same engine build, so this is exact;
    the TTL bounds how long a tokenizer swapped under an unchanged model name could be
    answered from the old one. Outcomes ``shared`` and ``cached`` count these.

    Args:
        pool: the pool's config (its ``model`` is sent as ``model``).
        discovery: which replicas are healthy, and their URLs.
        client: the router's engine client (the request path's lean HTTP client: a
            ``/tokenize`` round trip is on every request's path too).
        metrics: ``kvroute_tokenize_total{pool, outcome}``.
        timeout_s: bound on one call.
    """

    mode: TokenizerMode = "engine"
    recent_ttl_s: float = 30.0
    recent_entries: int = 1024

    def __init__(
        self,
        pool: PoolConfig,
        discovery: ReplicaDirectory,
        client: EngineClient,
        metrics: TokenizerMetrics,
        *,
        timeout_s: float = DEFAULT_TOKENIZE_TIMEOUT_S,
    ) -> None:
        self.pool = pool.name
        self._model = pool.model
        self._discovery = discovery
        self._client = client
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._next = 0
        self.failing = False
        self._recent: OrderedDict[bytes, tuple[float, list[int]]] = OrderedDict()
        self._in_flight: dict[bytes, asyncio.Future[list[int] | None]] = {}

    async def token_ids(self, parsed: ParsedRequest) -> list[int] | None:
        direct = prompt_token_ids(parsed)
        if direct is not None:
            self._metrics.tokenize(self.pool, "token_ids")
            return direct
        body = tokenize_request_body(parsed, self._model)
        if body is None:
            self._metrics.tokenize(self.pool, "unsupported")
            return None
        encoded = _JSON_ENCODER.encode(body)
        loop = asyncio.get_running_loop()
        now = loop.time()
        recent = self._recent.get(encoded)
        if recent is not None:
            if now - recent[0] <= self.recent_ttl_s:
                self._metrics.tokenize(self.pool, "cached")
                return list(recent[1])
            del self._recent[encoded]
        pending = self._in_flight.get(encoded)
        if pending is not None:
            ids = await asyncio.shield(pending)
            self._metrics.tokenize(self.pool, "shared")
            return None if ids is None else list(ids)
        future: asyncio.Future[list[int] | None] = loop.create_future()
        self._in_flight[encoded] = future
        ids = None
        try:
            ids = await self._ask(encoded)
        finally:
            del self._in_flight[encoded]
            future.set_result(ids)
        if ids is not None:
            self._recent[encoded] = (now, ids)
            if len(self._recent) > self.recent_entries:
                self._recent.popitem(last=False)
            return list(ids)
        return None

    async def _ask(self, encoded: bytes) -> list[int] | None:
        """One ``POST /tokenize`` (counted ``ok`` or by failure)."""
        replicas = self._discovery.healthy_replicas(self.pool)
        if not replicas:
            self._fail("no_replica", "no healthy replica to ask")
            return None
        start = self._next
        self._next += 1
        for k in range(len(replicas)):
            replica = replicas[(start + k) % len(replicas)]
            url = self._discovery.replica_url(replica) + "/tokenize"
            tokens = await post_tokenize(self._client, url, encoded, self._timeout_s)
            if not isinstance(tokens, TokenizeFailure):
                break
            if tokens.refused:
                self._discovery.report_failure(replica, tokens.detail)
            if not tokens.refused or k == len(replicas) - 1:
                self._fail(tokens.outcome, tokens.detail)
                return None
            # NOTE: a refused connection answers at once: the next replica costs nothing,
            # while approximate routing would cost the request its exact prefix match.
            self._metrics.tokenize(self.pool, "refused")
        assert isinstance(tokens, list), "every failure returned inside the loop"
        if self.failing:
            self.failing = False
            log.warning("pool %s: engine /tokenize works again; exact routing resumed",
                        self.pool)
        self._metrics.tokenize(self.pool, "ok")
        return tokens

    def _fail(self, outcome: str, detail: str) -> None:
        self._metrics.tokenize(self.pool, outcome)
        if not self.failing:
            self.failing = True
            log.warning("pool %s: engine /tokenize failed (%s); requests are routed "
                        "APPROXIMATELY until it works again", self.pool, detail)
        else:
            log.debug("pool %s: engine /tokenize failed again (%s)", self.pool, detail)


class _TokenizeAnswer(msgspec.Struct):
    """The part of vLLM's ``/tokenize`` answer the router reads (other keys are ignored)."""

    tokens: list[Annotated[int, msgspec.Meta(ge=0)]]


_ANSWER_DECODER: Final = msgspec.json.Decoder(_TokenizeAnswer)


def tokens_of_answer(raw: bytes) -> list[int] | None:
    """The ``tokens`` of a ``/tokenize`` answer, checked in C (non-negative ints, no bools:
    msgspec is strict), or None when the answer has no such list."""
    try:
        return _ANSWER_DECODER.decode(raw).tokens
    except msgspec.DecodeError:  # ValidationError (wrong shape or types) is a DecodeError
        return None


class TokenizeFailure(NamedTuple):
    """Why a ``POST /tokenize`` gave no ids: ``outcome`` (``timeout``, ``error`` or
    ``malformed``, as counted in ``kvroute_tokenize_total``) and a message naming the URL;
    ``refused``: nothing listened on the port (the answer came at once, so asking another
    replica costs the request nothing)."""

    outcome: str
    detail: str
    refused: bool = False


async def post_tokenize(client: EngineClient, url: str, encoded: bytes,
                        timeout_s: float) -> list[int] | TokenizeFailure:
    """One ``POST /tokenize`` of an encoded body, bounded by ``timeout_s``: the answer's
    ``tokens``, or why there are none (never raises for the engine's fault)."""
    response = None
    try:
        async with asyncio.timeout(timeout_s):
            response = await client.post(url, encoded)
            raw = await response.read()
            status = response.status
    except TimeoutError:
        if response is not None:
            response.close()
        return TokenizeFailure("timeout", f"POST {url} took longer than {timeout_s:g}s")
    except EngineClientError as exc:
        refused = isinstance(exc, ConnectFailed) and not isinstance(exc, ConnectTimeout)
        return TokenizeFailure("error", f"POST {url} failed: {type(exc).__name__}: {exc}",
                               refused)
    if status != 200:
        return TokenizeFailure("error", f"POST {url} answered HTTP {status}: {raw[:200]!r}")
    tokens = tokens_of_answer(raw)
    if tokens is None:
        return TokenizeFailure(
            "malformed", f"POST {url} gave no 'tokens' list of ints: {raw[:200]!r}")
    return tokens


class LocalTokenizer:
    """A Hugging Face tokenizer directory, loaded at start-up, run on the event loop.

    Chat prompts: the template is rendered with the request's ``messages``, ``tools``,
    ``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs``, then
    encoded with ``add_special_tokens`` (default False, as vLLM encodes chat prompts: the
    template writes BOS itself), which ``HFTokenizer`` serves from its piece cache
    (``tokenize.segments``) as an ``array('I')``. Completion strings: encoded with
    ``add_special_tokens`` (default True), as a list.

    The piece cache's serving checks (one prompt in ``verify_every`` encoded whole) run on a
    worker thread (``tokenize/piece_check.py``), not on the request's path.

    Args:
        pool: the pool's name.
        tokenizer: the loaded tokenizer.
        metrics: ``kvroute_tokenize_total{pool, outcome}``.
    """

    mode: TokenizerMode = "local"

    def __init__(self, pool: str, tokenizer: HFTokenizer, metrics: TokenizerMetrics) -> None:
        self.pool = pool
        self._tok = tokenizer
        self._metrics = metrics
        self.piece_check = PieceCheckThread(tokenizer.pieces, tokenizer.encode_plain_unlocked,
                                            name=f"pool {pool}")
        tokenizer.pieces.defer_checks(self.piece_check.submit)

    def close(self) -> None:
        """Stop the piece cache's check thread (the tokenizer still works, checking inline)."""
        self._tok.pieces.defer_checks(None)
        self.piece_check.close()

    @property
    def pieces(self) -> SegmentEncoder:
        """The tokenizer's piece cache (its hit, miss and mismatch counts are exported)."""
        return self._tok.pieces

    @classmethod
    def load(cls, pool: str, path: str, metrics: TokenizerMetrics) -> LocalTokenizer:
        """Load ``path`` (blocking file I/O: call at start-up, before serving).

        Raises:
            ConfigError: ``tokenizers``/``jinja2`` missing (names ``pip install 'kvroute[hf]'``)
                or the directory holds no usable ``tokenizer.json``.
        """
        try:
            tok = HFTokenizer.from_dir(path)
        except ConfigError as exc:
            raise ConfigError(f"pools.{pool}.tokenizer.local: {exc}") from exc
        return cls(pool, tok, metrics)

    async def token_ids(self, parsed: ParsedRequest) -> Sequence[int] | None:
        direct = prompt_token_ids(parsed)
        if direct is not None:
            self._metrics.tokenize(self.pool, "token_ids")
            return direct
        body = tokenize_request_body(parsed, None)
        if body is None:
            self._metrics.tokenize(self.pool, "unsupported")
            return None
        try:
            ids = self.encode_body(body)
        except (ChatTemplateError, ValueError, TypeError) as exc:
            # The template's (or the tokenizer's) verdict on this request's input: the engine
            # will answer it with a 400; routing it approximately costs nothing more.
            self._metrics.tokenize(self.pool, "error")
            log.warning("pool %s: local tokenizer refused a request: %s", self.pool, exc)
            return None
        self._metrics.tokenize(self.pool, "ok")
        return ids

    def encode_body(self, body: Mapping[str, Any]) -> Sequence[int]:
        """The ids of a vLLM ``/tokenize`` body (chat form or completion form), as the engine
        would give them.

        Raises:
            ChatTemplateError, ValueError, TypeError: the template or the tokenizer refuses
                the input.
        """
        if "messages" in body:
            kwargs = body.get("chat_template_kwargs")
            tools = body.get("tools")
            text = self._tok.render_chat(
                body["messages"],
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
                tools=tools if isinstance(tools, list) else None,
                chat_template_kwargs=kwargs if isinstance(kwargs, Mapping) else None,
            )
            return self._tok.encode(
                text, add_special_tokens=bool(body.get("add_special_tokens", False))
            )
        return self._tok.encode(
            body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True))
        )


class SwitchingTokenizer:
    """A pool's prompt tokenizer that ``tokenize/check.py`` switches as its checks say:
    ``tokenizer: {local: DIR}`` (checked against the engines, which it falls back to on a
    mismatch) and ``tokenizer: auto`` (starts on the engines, adopts their model directory
    when it is on this host and matches).

    ``token_ids`` and ``mode`` are the current tokenizer's own (bound when switched), so a
    request pays no extra call for the indirection.

    Attributes:
        want: what the configuration asked for (``local`` or ``auto``).
        current: the tokenizer in use.
        engine: the pool's ``/tokenize`` tokenizer (the fallback, and ``auto``'s start).
    """

    __slots__ = ("current", "engine", "mode", "pool", "token_ids", "want")

    def __init__(self, pool: str, want: Literal["local", "auto"], current: PromptTokenizer,
                 engine: EngineTokenizer) -> None:
        self.pool = pool
        self.want = want
        self.current = current
        self.engine = engine
        self.mode: TokenizerMode = current.mode
        self.token_ids: Callable[[ParsedRequest], Coroutine[Any, Any, Sequence[int] | None]] = (
            current.token_ids
        )

    def use(self, tokenizer: PromptTokenizer) -> None:
        """Serve every later request from ``tokenizer``."""
        self.current = tokenizer
        self.mode = tokenizer.mode
        self.token_ids = tokenizer.token_ids

    @property
    def local(self) -> LocalTokenizer | None:
        """The local tokenizer in use, if that is what is in use."""
        return self.current if isinstance(self.current, LocalTokenizer) else None


# -- composition ------------------------------------------------------------------------------


def build_tokenizers(
    config: RouterConfig,
    discovery: ReplicaDirectory,
    client: EngineClient,
    metrics: TokenizerMetrics,
) -> dict[str, PromptTokenizer]:
    """One tokenizer per pool, as ``pools.<name>.tokenizer`` asks; local ones load here.

    ``local`` and ``auto`` pools get a ``SwitchingTokenizer`` (starting on the local tokenizer
    and on the engines' ``/tokenize`` respectively) for ``tokenize/check.py`` to check.

    Raises:
        ConfigError: a ``local`` tokenizer cannot be loaded (the message says why and how to
            fix it), or an unknown mode.
    """
    out: dict[str, PromptTokenizer] = {}
    for pool in config.pools.values():
        if pool.external is not None:
            continue  # a provider pool is routed by load only: nothing to tokenize for
        setting = pool.tokenizer
        tokenizer: PromptTokenizer
        timeout_s = float(getattr(setting, "timeout_s", DEFAULT_TOKENIZE_TIMEOUT_S))
        # Every exact mode has the engines' /tokenize: as the tokenizer, as auto's start, or
        # as local's fallback (an inert object for a none pool: it sends nothing by itself).
        engine = EngineTokenizer(pool, discovery, client, metrics, timeout_s=timeout_s)
        if setting.mode == "engine":
            tokenizer = engine
            log.info("pool %s: exact prompt tokens from the engines' /tokenize", pool.name)
        elif setting.mode == "auto":
            tokenizer = SwitchingTokenizer(pool.name, "auto", engine, engine)
            log.info("pool %s: exact prompt tokens from the engines' /tokenize until their "
                     "model directory is found on this host and checked (tokenizer: auto)",
                     pool.name)
        elif setting.mode == "local":
            if not setting.path:
                raise ConfigError(
                    f"pools.{pool.name}.tokenizer: mode local needs a directory; write "
                    "tokenizer: {local: /path/to/hf-model-dir}"
                )
            local = LocalTokenizer.load(pool.name, setting.path, metrics)
            tokenizer = SwitchingTokenizer(pool.name, "local", local, engine)
            log.info("pool %s: exact prompt tokens from the local tokenizer %s (to be checked "
                     "against the engines' /tokenize)", pool.name, setting.path)
        elif setting.mode == "none":
            tokenizer = ApproximateTokenizer(pool.name)
            log.warning("pool %s: tokenizer none; requests are routed APPROXIMATELY on text "
                        "(set tokenizer: engine, auto or {local: DIR} for exact prefix "
                        "routing)", pool.name)
        else:
            raise ConfigError(
                f"pools.{pool.name}.tokenizer: unknown mode {setting.mode!r}; use engine, "
                "auto, none or {local: DIR}"
            )
        metrics.set_tokenizer_mode(pool.name, tokenizer.mode)
        out[pool.name] = tokenizer
    return out

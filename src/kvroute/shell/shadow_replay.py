"""The gate's shadow replay over HTTP, and the cache-policy audit it runs with.

For a pair (serving engine, state source, transfer path) every transcript
(``core/shadow_replay.Transcript``) is replayed turn by turn, at temperature 0 with top-k
logprobs, through:

* the **native path**: the serving engine recomputes; a fresh ``cache_salt`` per request
  makes sure no prefix block can hit (vLLM puts the salt into the first block's hash);
* the **candidate path** (``CANDIDATE_MODE``): either served from cache (``hit``: the prompt
  is sent once with the run's salt, ``max_tokens: 1``, then again, so every full block of
  it is a hit on the candidate engine) or computed by the source engine (``recompute``:
  another engine, other weights). For ``cross-engine`` the candidate is the source's own
  answer: it stands for "state the source wrote", since no reader translates one model's
  KV for another (issue #22 leaves that out of scope).

Each turn's next context holds the native answer on both sides, so a divergence on one turn
does not spill into the next: every turn is scored on the same prompt.

The cache-policy audit reads each engine's cache settings (``vllm:cache_config_info`` on
``/metrics``: block size, hash algorithm, KV dtype, prefix caching on or off) and its
``/v1/models`` card (model root, window) with its weights fingerprint
(``shell/model_files.py``) before the run and after every turn; any change voids the run
at once (no verdict). A verdict keeps the settings it was measured under, and
``VerdictStore.allows`` compares them with :func:`read_policy` now.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import aiohttp

from kvroute.core.model_identity import ModelIdentity
from kvroute.core.shadow_replay import (
    CACHE_POLICY_KEYS,
    TokenStep,
    Transcript,
    TurnComparison,
    compare_turn,
    policy_changes,
)
from kvroute.shell.model_files import ModelFilesError, read_identity
from kvroute.wire.model_list import ModelListError, model_cards
from kvroute.wire.prom import parse_vllm_metrics

__all__ = [
    "CANDIDATE_MODE",
    "POLICY_KEYS",
    "Endpoint",
    "ReplayError",
    "ReplayRun",
    "read_policy",
    "read_side_identity",
    "run_replay",
]

CANDIDATE_MODE: Final = {"prefix-cache-hit": "hit", "cross-engine": "recompute",
                         "shared-store": "hit", "lossy-kv": "hit"}
"""How each transfer path's candidate is produced (module docstring)."""

POLICY_KEYS: Final = CACHE_POLICY_KEYS
"""The ``vllm:cache_config_info`` labels the audit records (``core/shadow_replay.py``)."""

_TIMEOUT: Final = aiohttp.ClientTimeout(total=120.0, connect=5.0)


class ReplayError(RuntimeError):
    """An engine did not answer as the replay needs (the message says which and how)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One engine: its base URL (``http://host:port``) and the model name it serves."""

    url: str
    model: str


@dataclass(frozen=True, slots=True)
class ReplayRun:
    """A replay's outcome: the turns compared, the cache settings measured under, and
    ``void``: the changes seen mid-run (non-empty: the run proves nothing)."""

    turns: tuple[TurnComparison, ...]
    policy: Mapping[str, str]
    void: tuple[str, ...] = ()


async def _card(http: aiohttp.ClientSession, ep: Endpoint) -> Mapping[str, Any]:
    try:
        cards = model_cards((await _get_text(http, ep.url + "/v1/models")).encode())
    except ModelListError as exc:
        raise ReplayError(f"{ep.url}: {exc}") from exc
    card = cards.get(ep.model)
    if card is None:
        raise ReplayError(f"{ep.url} does not serve {ep.model!r} (it serves "
                          f"{', '.join(sorted(cards)) or 'nothing'}); pass --model")
    return card


async def read_side_identity(http: aiohttp.ClientSession, ep: Endpoint,
                             model_dir: str | None = None) -> ModelIdentity:
    """The identity of the model ``ep`` serves: read from ``model_dir`` when given, else from
    the ``root`` of its ``/v1/models`` card when that is a directory on this host.

    Raises:
        ReplayError: the engine cannot be read, or the model directory cannot.
    """
    root = model_dir
    if root is None:
        card_root = (await _card(http, ep)).get("root")
        root = card_root if isinstance(card_root, str) else None
    try:
        return await read_identity(ep.model, root)
    except ModelFilesError as exc:
        raise ReplayError(str(exc)) from exc


async def read_policy(http: aiohttp.ClientSession, sides: Mapping[str, Endpoint]
                      ) -> dict[str, str]:
    """Each side's cache settings, model root, window and weights version, as
    ``<side>.<setting>`` (sides sharing one URL are read once, under the first name).

    Raises:
        ReplayError: an engine's ``/metrics`` or ``/v1/models`` cannot be read, or it does
            not serve its model.
    """
    out: dict[str, str] = {}
    seen: set[str] = set()
    for side, ep in sides.items():
        if ep.url in seen:
            continue
        seen.add(ep.url)
        metrics = parse_vllm_metrics(await _get_text(http, ep.url + "/metrics"), ep.model)
        if not metrics.cache_config:
            raise ReplayError(f"{ep.url}/metrics has no vllm:cache_config_info: the cache "
                              "settings cannot be audited (is it a vLLM engine?)")
        for key in POLICY_KEYS:
            if key in metrics.cache_config:
                out[f"{side}.{key}"] = metrics.cache_config[key]
        card = await _card(http, ep)
        root = card.get("root")
        out[f"{side}.root"] = str(root)
        out[f"{side}.max_model_len"] = str(card.get("max_model_len"))
        try:
            identity = await read_identity(ep.model, root if isinstance(root, str) else None)
        except ModelFilesError as exc:
            raise ReplayError(str(exc)) from exc
        out[f"{side}.weights"] = identity.version
    return out


async def run_replay(http: aiohttp.ClientSession, serving: Endpoint, source: Endpoint,
                     path: str, transcripts: Sequence[Transcript], *, top_k: int = 5,
                     on_turn: Callable[[TurnComparison], None] | None = None) -> ReplayRun:
    """Replay ``transcripts`` through the native and candidate paths (module docstring).

    Raises:
        ReplayError: an engine answered an error, or without logprobs.
        ValueError: ``path`` is not a transfer path.
    """
    mode = CANDIDATE_MODE.get(path)
    if mode is None:
        raise ValueError(f"unknown transfer path {path!r}; use one of "
                         f"{', '.join(CANDIDATE_MODE)}")
    candidate_ep = serving if path == "prefix-cache-hit" else source
    sides = {"serving": serving, "source": source}
    before = await read_policy(http, sides)
    run_salt = "kvroute-gate-run-" + uuid.uuid4().hex
    turns: list[TurnComparison] = []
    for transcript in transcripts:
        messages: list[dict[str, str]] = []
        if transcript.system is not None:
            messages.append({"role": "system", "content": transcript.system})
        for i, user in enumerate(transcript.turns):
            messages.append({"role": "user", "content": user})
            native, text, hit = await _complete(http, serving, messages,
                                                transcript.max_tokens, top_k, _fresh_salt())
            if hit:
                raise ReplayError(f"{serving.url}: the native request of {transcript.id} turn "
                                  f"{i + 1} hit {hit} cached tokens despite a fresh "
                                  "cache_salt; the engine ignores cache_salt, so recompute "
                                  "cannot be forced and the replay cannot measure the path")
            if mode == "hit":
                await _complete(http, candidate_ep, messages, 1, 0, run_salt)
                candidate, _, cached = await _complete(http, candidate_ep, messages,
                                                       transcript.max_tokens, top_k, run_salt)
            else:
                candidate, _, cached = await _complete(http, candidate_ep, messages,
                                                       transcript.max_tokens, top_k,
                                                       _fresh_salt())
            turn = compare_turn(transcript, i, native, candidate,
                                candidate_cached_tokens=cached)
            turns.append(turn)
            if on_turn is not None:
                on_turn(turn)
            changes = policy_changes(before, await read_policy(http, sides))
            if changes:
                return ReplayRun(tuple(turns), before, tuple(changes))
            messages.append({"role": "assistant", "content": text})
    return ReplayRun(tuple(turns), before)


def _fresh_salt() -> str:
    return "kvroute-gate-native-" + uuid.uuid4().hex


async def _get_text(http: aiohttp.ClientSession, url: str) -> str:
    try:
        async with http.get(url, timeout=_TIMEOUT) as resp:
            body = await resp.text()
            if resp.status != 200:
                raise ReplayError(f"GET {url} answered HTTP {resp.status}: {body[:200]}")
            return body
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ReplayError(f"GET {url} failed: {exc!r}; is the engine up?") from exc


async def _complete(http: aiohttp.ClientSession, ep: Endpoint,
                    messages: Sequence[Mapping[str, str]], max_tokens: int, top_k: int,
                    salt: str) -> tuple[list[TokenStep], str, int | None]:
    """One greedy chat completion: (token steps, answer text, cached prompt tokens)."""
    body: dict[str, Any] = {
        "model": ep.model, "messages": list(messages), "max_tokens": max_tokens,
        "temperature": 0.0, "logprobs": True, "top_logprobs": top_k,
        "return_tokens_as_token_ids": True, "cache_salt": salt,
    }
    url = ep.url + "/v1/chat/completions"
    try:
        async with http.post(url, json=body, timeout=_TIMEOUT) as resp:
            data = await resp.json(content_type=None)
            if resp.status != 200:
                raise ReplayError(f"POST {url} answered HTTP {resp.status}: "
                                  f"{str(data)[:300]}")
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise ReplayError(f"POST {url} failed: {exc!r}") from exc
    try:
        choice = data["choices"][0]
        content = (choice.get("logprobs") or {}).get("content") or []
        steps = [TokenStep(str(c["token"]), float(c["logprob"]),
                           {str(t["token"]): float(t["logprob"])
                            for t in c.get("top_logprobs") or []})
                 for c in content]
        text = choice["message"].get("content") or ""
        details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ReplayError(f"POST {url}: an answer without the logprobs the replay needs "
                          f"({exc!r}); the engine must support logprobs/top_logprobs") from exc
    if max_tokens > 1 and not steps and text:
        raise ReplayError(f"POST {url}: no logprobs in the answer; the engine must return "
                          "them (vLLM: --max-logprobs >= --top-k)")
    return steps, str(text), int(cached) if isinstance(cached, int) else None

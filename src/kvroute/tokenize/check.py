"""Check a pool's local tokenizer against its engines' ``/tokenize``; resolve ``tokenizer: auto``.

Why this exists: a ``local`` tokenizer is only as exact as the files it was given. The
directory of another model or revision, or an engine started with its own ``--chat-template``,
gives other ids, so other block hashes, and the router then routes on prefixes no engine
holds. Nothing fails; the cache hit rate just drops. So once a replica of the pool is healthy,
the router tokenizes a few probe prompts both ways and compares them id by id.

* ``local``: a match is logged as verified. A mismatch is logged as an error naming the probe
  and the first differing position, and the pool switches to the engines' ``/tokenize``
  (exact, at one more round trip per request). An engine that cannot answer (no
  ``/tokenize``, an error, a timeout) leaves the local tokenizer in use, unverified, with a
  warning.
* ``auto``: the pool starts on the engines' ``/tokenize``. When a healthy replica's model card
  names a ``root`` that is a directory on this host holding ``tokenizer.json`` (vLLM fills
  ``root`` with the path it was started on), the router loads it off the event loop, checks
  it as above, and on a match switches the pool to it: the same exact ids without the round
  trip. On anything else it stays on the engines, and says why. The directory is only read
  (``tokenizer.json`` through ``tokenizers``, the chat template in sandboxed ``jinja2``;
  no model code runs), and a relative root is taken from the router's working directory.

The check runs in the background, at start and then once a minute against the next healthy
replica in turn (an engine restarted on another revision under the same served name must not
leave the router hashing with the old tokenizer): requests are served from the start with
the tokenizer the pool began on, and a later round can switch either way. Its result is
exported as
``kvroute_tokenizer_check{pool, result}`` (1 for the current result) beside
``kvroute_tokenizer_mode``.

Owns ``TokenizerCheck`` (the probes and the decision); the pool's tokenizer it switches is
``tokenize/prompt.py``'s ``SwitchingTokenizer``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

from kvroute.core.errors import ConfigError
from kvroute.http.client import EngineClient
from kvroute.tokenize.hf import ChatTemplateError
from kvroute.tokenize.ports import ReplicaDirectory, TokenizerMetrics
from kvroute.tokenize.prompt import (
    LocalTokenizer,
    PromptTokenizer,
    SwitchingTokenizer,
    TokenizeFailure,
    post_tokenize,
)

__all__ = [
    "PROBES",
    "CheckResult",
    "Probe",
    "TokenizerCheck",
]

log = logging.getLogger(__name__)

CheckResult = Literal["pending", "verified", "mismatch", "unverifiable", "no_local"]
"""Exported as ``kvroute_tokenizer_check{result}`` (``metrics.TOKENIZER_CHECKS``)."""

_ENCODER: Final = msgspec.json.Encoder()
_WAIT_STEP_S: Final = 0.25
"""How often the check looks for a healthy replica while none is."""


@dataclass(frozen=True, slots=True)
class Probe:
    """One prompt tokenized both ways: ``body`` is a vLLM ``/tokenize`` body without ``model``."""

    name: str
    body: Mapping[str, Any]


_TEXT: Final = (
    "Route the request to the replica that holds its prefix. Numbers 0 7 42 1999 3.14159, "
    "punctuation (a) [b] {c} <d> 'e' \"f\" -- and  double  spaces,\ttabs,\nnew lines, "
    "accents: café naïve Ærø, and other scripts: 你好 世界, こんにちは, Привет, مرحبا."
)

PROBES: Final[tuple[Probe, ...]] = (
    Probe("chat, system and two turns", {
        "messages": [
            {"role": "system", "content": "You are a careful assistant. " + _TEXT},
            {"role": "user", "content": "What does a KV-cache-aware router do?"},
            {"role": "assistant", "content": "It sends a request where its prefix is cached."},
            {"role": "user", "content": _TEXT},
        ],
        "add_generation_prompt": True,
    }),
    Probe("chat, one user turn", {
        "messages": [{"role": "user", "content": _TEXT}],
        "add_generation_prompt": True,
    }),
    Probe("completion", {"prompt": _TEXT}),
)
"""What is compared. Several chat shapes, because some templates refuse a system turn or
require alternating roles: a probe the local template refuses is skipped (the engine would
refuse it too), and at least one probe must be compared for a verdict."""


@dataclass(frozen=True, slots=True)
class _Compared:
    result: CheckResult
    detail: str


class TokenizerCheck:
    """The check of one pool, at start and then every ``recheck_s`` (module docstring).

    Re-checking matters because engines change under a running router: a replica restarted
    on a new revision of the model under the same served name tokenizes differently, and
    an adopted local tokenizer would then hash prompts no engine holds. Each round asks the
    next healthy replica in turn, so every replica is compared in time; a round costs a few
    short ``/tokenize`` calls.

    Each round's verdict decides the tokenizer in use: ``verified`` -> the local one;
    ``mismatch`` and (``auto`` only) ``no_local`` -> the engines' ``/tokenize``;
    ``unverifiable`` -> unchanged. A change of result is logged once (a mismatch as an
    error for ``local``); rounds that confirm the last result log at debug level.

    Args:
        pool: the pool's name.
        model: the model name sent in ``/tokenize`` bodies.
        target: the pool's tokenizer as the app holds it; its ``want`` says what to do:
            ``local`` (check the configured local tokenizer) or ``auto`` (find, load and
            check the directory the replica's model card names).
        discovery: healthy replicas, their URLs and model roots.
        client: the engine client the ``/tokenize`` probes are sent with.
        metrics: ``kvroute_tokenizer_check`` and ``kvroute_tokenizer_mode``.
        load: loads a ``LocalTokenizer`` from a directory (blocking; run in a thread).
        timeout_s: bound on each probe call.
        recheck_s: time between rounds after the first.
    """

    def __init__(
        self,
        *,
        pool: str,
        model: str,
        target: SwitchingTokenizer,
        discovery: ReplicaDirectory,
        client: EngineClient,
        metrics: TokenizerMetrics,
        load: Callable[[str], LocalTokenizer],
        timeout_s: float = 5.0,
        recheck_s: float = 60.0,
    ) -> None:
        self.pool = pool
        self._model = model
        self._want = target.want
        self._target = target
        self._configured = target.local if target.want == "local" else None
        self._loaded: tuple[str, LocalTokenizer] | None = None  # auto: (root, tokenizer)
        self._discovery = discovery
        self._client = client
        self._metrics = metrics
        self._load = load
        self._timeout_s = timeout_s
        self._recheck_s = recheck_s
        self._turn = 0
        self.rounds = 0
        self.result: CheckResult = "pending"
        self.detail = ""
        metrics.set_tokenizer_check(pool, "pending")

    async def run(self) -> None:
        """Check now, then every ``recheck_s``, until cancelled with the router.

        Never raises for an engine's or a directory's fault (those are results)."""
        while True:
            await self.check_once()
            await asyncio.sleep(self._recheck_s)

    async def check_once(self) -> CheckResult:
        """One round: wait for a healthy replica, compare, switch as the result says."""
        replica = await self._healthy_replica()
        local = await self._local_for(replica)
        if isinstance(local, _Compared):
            compared = local
        else:
            compared = await self._compare(local, replica)
            if compared.result == "verified":
                self._use(local)
        if compared.result == "mismatch" or compared.result == "no_local":
            self._use(self._target.engine)
            self._loaded = None  # read the directory again next round: it may be fixed
        self.rounds += 1
        return self._settle(compared)

    def _use(self, tokenizer: PromptTokenizer) -> None:
        if self._target.current is not tokenizer:
            self._target.use(tokenizer)
            self._metrics.set_tokenizer_mode(self.pool, tokenizer.mode)

    async def _healthy_replica(self) -> str:
        while True:
            healthy = self._discovery.healthy_replicas(self.pool)
            if healthy:
                replica = healthy[self._turn % len(healthy)]
                self._turn += 1
                return replica
            await asyncio.sleep(_WAIT_STEP_S)

    async def _local_for(self, replica: str) -> LocalTokenizer | _Compared:
        """The local tokenizer to compare: the configured one (``local``), or the one in the
        directory this replica's model card names (``auto``; loaded once per directory)."""
        if self._configured is not None:
            return self._configured
        root = self._discovery.replica_info(replica).model_root
        if self._loaded is not None and self._loaded[0] == root:
            return self._loaded[1]
        found = await self._find_local(root)
        if isinstance(found, LocalTokenizer) and root is not None:
            self._loaded = (root, found)
        return found

    async def _find_local(self, root: str | None) -> LocalTokenizer | _Compared:
        if not root:
            return _Compared("no_local", "the engines' model card names no root directory")
        if not os.path.isfile(os.path.join(root, "tokenizer.json")):
            return _Compared(
                "no_local",
                f"the model root {root!r} is not a directory with tokenizer.json on this host",
            )
        try:
            return await asyncio.to_thread(self._load, root)
        except ConfigError as exc:
            return _Compared("no_local", f"cannot load the tokenizer at {root!r}: {exc}")

    async def _compare(self, local: LocalTokenizer, replica: str) -> _Compared:
        url = self._discovery.replica_url(replica) + "/tokenize"
        compared = 0
        for probe in PROBES:
            try:
                mine = list(local.encode_body(probe.body))
            except (ChatTemplateError, ValueError, TypeError):
                continue  # the template refuses this shape; another probe covers it
            body = {"model": self._model, **probe.body}
            theirs = await self._ask(url, body)
            if isinstance(theirs, _Compared):
                return theirs
            if mine != theirs:
                at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b),
                          min(len(mine), len(theirs)))
                return _Compared("mismatch", (
                    f"probe {probe.name!r}: {len(mine)} local ids against {len(theirs)} from "
                    f"{url}, first difference at position {at} (local "
                    f"{mine[at:at + 5]}, engine {theirs[at:at + 5]})"
                ))
            compared += 1
        if compared == 0:
            return _Compared("unverifiable", "the local chat template refused every probe")
        return _Compared("verified", f"{compared} probes matched {url} id for id")

    async def _ask(self, url: str, body: Mapping[str, Any]) -> list[int] | _Compared:
        tokens = await post_tokenize(self._client, url, _ENCODER.encode(body), self._timeout_s)
        if isinstance(tokens, TokenizeFailure):
            return _Compared("unverifiable", tokens.detail)
        return tokens

    def _settle(self, compared: _Compared) -> CheckResult:
        changed = compared.result != self.result
        self.result, self.detail = compared.result, compared.detail
        self._metrics.set_tokenizer_check(self.pool, compared.result)
        pool, detail = self.pool, compared.detail
        if not changed:
            log.debug("pool %s: tokenizer check confirmed %s (%s)", pool, compared.result, detail)
        elif self._want == "local":
            if compared.result == "verified":
                log.info("pool %s: local tokenizer verified against the engines (%s)", pool,
                         detail)
            elif compared.result == "mismatch":
                log.error("pool %s: the local tokenizer does NOT give the engines' ids (%s); "
                          "routing switched to the engines' /tokenize. Point "
                          "pools.%s.tokenizer.local at the directory the engines serve, or "
                          "use tokenizer: engine", pool, detail, pool)
            else:
                log.warning("pool %s: local tokenizer in use UNVERIFIED (%s)", pool, detail)
        elif compared.result == "verified":
            log.info("pool %s: tokenizer auto: exact ids now from the engines' model directory "
                     "on this host, no /tokenize round trip (%s)", pool, detail)
        elif compared.result == "mismatch":
            log.warning("pool %s: tokenizer auto uses the engines' /tokenize: the directory "
                        "their model card names gives other ids (%s)", pool, detail)
        else:
            log.info("pool %s: tokenizer auto uses the engines' /tokenize (%s)", pool, detail)
        return compared.result

"""Which finished live conversations become shadow-replay transcripts (opt-in, bounded).

The transfer-fidelity gate (``core/gate.py``) replays multi-turn transcripts through a
pair's native and candidate paths (``core/shadow_replay.py``); a file of real traffic says
more about a fleet than the bundled sample. This module decides, without any I/O, what the
router keeps of its chat traffic for that file; ``shell/transcript_sample.py`` writes it.

What is kept, and why it is bounded everywhere:

* only tenants named in the settings (opt-in per tenant: prompts go to disk), and each
  tenant's conversations only into that tenant's own file: a line never mixes tenants and a
  conversation is keyed by (tenant, conversation), so two tenants' sessions never merge;
* a conversation is sampled or not once, by a seeded hash of (tenant, conversation) against
  ``rate``, so every turn of it gets the same answer and the decision needs no state;
* a conversation is known by its session id and a hash of its system prompt and first user
  message (the opening alone without a session); each successful answer replaces the held
  history with the longer one;
* it is *finished* when no turn arrived for ``idle_s`` (or when the router stops), and is
  written only when it has at least ``min_turns`` user turns; only the first
  ``MAX_TURNS`` turns are kept (a replay starts at the first turn);
* at most ``max_open`` conversations are held at once (new ones beyond are not sampled),
  at most ``max_per_minute`` lines are written (a token bucket over all tenants), and each
  tenant's file holds at most ``max_per_tenant`` lines and ``max_bytes_per_tenant`` bytes;
  whatever a bound stops is counted (``SampleCounts``), never silently lost.

A line is exactly what ``parse_transcripts`` reads: ``id`` (a hash, never the client's
session id), ``class`` (the route's name: scores are reported per class), ``system``,
``turns`` (the user messages only: the replay recomputes every answer at temperature 0 on
both paths, and a live answer, sampled at the client's temperature, is no reference), and
``max_tokens`` (the request's, capped by the settings).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kvroute.core.shadow_replay import MAX_TURNS

__all__ = ["Conversation", "SampleCounts", "SampleSettings", "TranscriptSampler",
           "conversation_of"]

_HASH_SPACE: Final = float(1 << 64)


@dataclass(frozen=True, slots=True)
class SampleSettings:
    """The bounds of the live transcript sample, declared here once:
    ``config.TranscriptSampleConfig`` (``gate.sample``) is these plus the directory.

    Attributes:
        tenants: the tenants whose conversations may be sampled (opt-in; a few names, in
            the order configured).
        rate: the share of their conversations sampled, in (0, 1].
        idle_s: a conversation with no turn for this long is finished.
        min_turns: fewer user turns than this: not written (one turn is not multi-turn).
        max_open: conversations held in memory at once.
        max_per_minute: lines written per minute, over all tenants.
        max_per_tenant: lines in one tenant's file.
        max_bytes_per_tenant: bytes in one tenant's file.
        max_tokens: the cap on a transcript's ``max_tokens`` (each replayed turn's length).
        seed: the sampling hash's seed (another seed samples other conversations).
    """

    tenants: tuple[str, ...]
    rate: float = 0.05
    idle_s: float = 300.0
    min_turns: int = 2
    max_open: int = 256
    max_per_minute: int = 60
    max_per_tenant: int = 1000
    max_bytes_per_tenant: int = 10_000_000
    max_tokens: int = 32
    seed: str = "kvroute-transcripts"


@dataclass(frozen=True, slots=True)
class Conversation:
    """A chat request's history in transcript form (what :func:`conversation_of` reads)."""

    key: str
    system: str | None
    turns: tuple[str, ...]
    max_tokens: int | None


def _text(content: Any) -> str | None:
    """A message's text: a string, or a list of text parts joined; None for other parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, Mapping)]
        if texts and all(isinstance(t, str) and p.get("type", "text") == "text"
                         for t, p in zip(texts, content, strict=True)):
            return "".join(t for t in texts if t is not None)
    return None


def conversation_of(messages: Sequence[Mapping[str, Any]], session: str | None,
                    max_tokens: int | None) -> Conversation | None:
    """The transcript form of one chat request's ``messages``, or None when it has none.

    The system prompt is the leading ``system`` (or ``developer``) message; the turns are
    the ``user`` messages in order. None when a message holds other content than text
    (images, audio: a transcript holds text), or a second system message comes later (the
    format has one system prompt), or there is no non-empty user turn.
    """
    system: str | None = None
    turns: list[str] = []
    for position, message in enumerate(messages):
        role = message.get("role")
        text = _text(message.get("content", ""))
        if role in ("system", "developer"):
            if position != 0 or text is None:
                return None
            system = text
        elif role == "user":
            if not text:
                return None
            turns.append(text)
        elif role not in ("assistant", "tool") or (
                text is None and message.get("content") is not None):
            return None
    if not turns:
        return None
    opening = hashlib.sha256(json.dumps([system, turns[0]]).encode()).hexdigest()[:32]
    # The opening is in the key with a session too: a session id may be a user name (the
    # body's ``user``), under which one user's conversations would otherwise share a slot.
    key = "h:" + opening if session is None else f"s:{session}:{opening}"
    return Conversation(key, system, tuple(turns[:MAX_TURNS]), max_tokens)


@dataclass(slots=True)
class SampleCounts:
    """What the sample did since the router started (logged when the router stops)."""

    offered: int = 0
    sampled: int = 0
    written: int = 0
    too_short: int = 0
    dropped_open: int = 0
    dropped_rate: int = 0
    dropped_full: int = 0
    duplicate: int = 0


@dataclass(slots=True)
class _Held:
    tenant: str
    route: str
    conversation: Conversation
    last_s: float


@dataclass(slots=True)
class _TenantFile:
    lines: int = 0
    bytes: int = 0
    ids: set[str] = field(default_factory=set)


class TranscriptSampler:
    """The sample's decisions (module docstring); the caller owns the clock and the files.

    ``offer`` after each successful chat answer; ``due(now)`` at least every few seconds
    returns the finished conversations to append, as (tenant, line) pairs, already counted
    against every bound; ``due(now, everything=True)`` when the router stops.
    """

    def __init__(self, settings: SampleSettings) -> None:
        if not settings.tenants:
            raise ValueError("a transcript sample needs at least one opted-in tenant")
        if not 0.0 < settings.rate <= 1.0:
            raise ValueError(f"rate must be in (0, 1], got {settings.rate}")
        self.settings = settings
        self.counts = SampleCounts()
        self._held: dict[tuple[str, str], _Held] = {}
        self._files: dict[str, _TenantFile] = {}
        self._tokens = float(settings.max_per_minute)
        self._refilled_s: float | None = None

    def existing(self, tenant: str, ids: Sequence[str], size_bytes: int) -> None:
        """Account for what ``tenant``'s file already holds (a restarted router): its ids
        are not written again and its lines and bytes count against the bounds."""
        file = self._files.setdefault(tenant, _TenantFile())
        file.ids.update(ids)
        file.lines += len(ids)
        file.bytes += size_bytes

    def chosen(self, tenant: str, key: str) -> bool:
        """Whether the conversation ``key`` of ``tenant`` is in the sample (stable)."""
        if tenant not in self.settings.tenants:
            return False
        digest = hashlib.sha256(f"{self.settings.seed}\0{tenant}\0{key}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / _HASH_SPACE < self.settings.rate

    def offer(self, tenant: str, route: str, conversation: Conversation, now: float) -> bool:
        """One successful answer of ``conversation``; True when the sample holds it."""
        self.counts.offered += 1
        if not self.chosen(tenant, conversation.key):
            return False
        slot = (tenant, conversation.key)
        held = self._held.get(slot)
        if held is None:
            if len(self._held) >= self.settings.max_open:
                self.counts.dropped_open += 1
                return False
            self.counts.sampled += 1
            self._held[slot] = _Held(tenant, route, conversation, now)
            return True
        if len(conversation.turns) >= len(held.conversation.turns):
            held.conversation = conversation
            held.route = route
        held.last_s = now
        return True

    @property
    def open(self) -> int:
        """Conversations held now."""
        return len(self._held)

    def due(self, now: float, *, everything: bool = False) -> list[tuple[str, str]]:
        """The finished conversations' lines, as (tenant, JSON line without newline), in
        the order they finished; each is forgotten once returned or dropped."""
        self._refill(now)
        finished = sorted((h for h in self._held.values()
                           if everything or now - h.last_s >= self.settings.idle_s),
                          key=lambda h: h.last_s)
        out: list[tuple[str, str]] = []
        for held in finished:
            del self._held[(held.tenant, held.conversation.key)]
            line = self._line(held)
            if line is not None:
                out.append((held.tenant, line))
        return out

    def _refill(self, now: float) -> None:
        cap = float(self.settings.max_per_minute)
        if self._refilled_s is not None:
            self._tokens = min(cap, self._tokens + (now - self._refilled_s) * cap / 60.0)
        self._refilled_s = now

    def _line(self, held: _Held) -> str | None:
        conversation = held.conversation
        if len(conversation.turns) < self.settings.min_turns:
            self.counts.too_short += 1
            return None
        if self._tokens < 1.0:
            self.counts.dropped_rate += 1
            return None
        file = self._files.setdefault(held.tenant, _TenantFile())
        ident = hashlib.sha256(
            f"{self.settings.seed}\0{held.tenant}\0{conversation.key}\0"
            f"{len(conversation.turns)}".encode()).hexdigest()[:16]
        ident = f"{held.tenant}-{ident}"
        requested = conversation.max_tokens
        max_tokens = (self.settings.max_tokens if requested is None
                      else max(1, min(requested, self.settings.max_tokens)))
        item: dict[str, Any] = {"id": ident, "class": held.route}
        if conversation.system is not None:
            item["system"] = conversation.system
        item["turns"] = list(conversation.turns)
        item["max_tokens"] = max_tokens
        line = json.dumps(item, ensure_ascii=False, separators=(",", ":"))
        size = len(line.encode("utf-8")) + 1
        if ident in file.ids:  # the same conversation, written before a restart
            self.counts.duplicate += 1
            return None
        if (file.lines >= self.settings.max_per_tenant
                or file.bytes + size > self.settings.max_bytes_per_tenant):
            self.counts.dropped_full += 1
            return None
        self._tokens -= 1.0
        file.ids.add(ident)
        file.lines += 1
        file.bytes += size
        self.counts.written += 1
        return line

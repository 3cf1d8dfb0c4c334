"""Exact prompt tokens from cached pieces: a chat prompt is mostly text the router has already
tokenized (the system prompt, the earlier turns), so only the new text is encoded.

Owns ``SegmentEncoder``, which gives the same ids as ``HFTokenizer.encode(text,
add_special_tokens=False)`` (how vLLM encodes a rendered chat prompt) at a fraction of the
cost once the prompt's pieces have been seen.

Why it is exact: a Hugging Face tokenizer first cuts its input at its *added tokens* and
encodes each piece between them on its own (normalizer, pre-tokenizer and model run per
piece); a piece's ids depend only on its text and on whether it is the input's first piece
(Metaspace ``prepend_scheme: first``). So the ids of ``text`` are the concatenation, piece by
piece, of the ids of each piece encoded in the same position. ``SegmentEncoder`` splits only
at special added tokens that match the raw text exactly (``normalized``, ``lstrip``,
``rstrip`` and ``single_word`` all false), encodes the first piece alone and every later piece
behind the special token that precedes it (then drops that token's id), so the piece sits in
the same position as in the whole prompt. Other added tokens stay inside pieces, where the
real encoder handles them.

Two checks keep that argument honest: at construction, probe strings are encoded both ways
and the cache is switched off (``enabled`` False, logged) on any difference; while serving,
one call in ``verify_every`` is encoded both ways and a difference switches the cache off
for good (logged as an error, counted in ``mismatches``), so a tokenizer whose rules break the
argument costs one wrong routing decision at most, never a silent drift.

Where the serving check runs: inline by default (the call that is checked returns the whole
encoding). Encoding a whole prompt costs what the cache saves, so inline it is a stall of the
caller once every ``verify_every`` calls; on a router's event loop every request then in
flight waits it out (``docs/benchmarks.md#tokenization-on-the-loop-piece-checks-on-a-thread``).
``defer_checks(submit)`` hands the due call's ``(text, ids)`` to ``submit`` instead, which
encodes the whole prompt elsewhere (``tokenize/piece_check.py``: a worker thread) and reports
back through ``check``. The checked call then returns the cached ids unverified, which the
argument above already allows: one routing decision at most.

Memory: pieces are kept in an LRU bounded by their total tokens (``max_tokens``), as the raw
bytes of an ``array('I')`` (4 bytes a token). Bytes, not the arrays: an ``array`` is tracked
by the garbage collector although it holds no references, so a full cache was some 15,000
long-lived tracked objects that every full collection walked while the event loop waited;
``bytes`` are never tracked, and ``array.frombytes`` copies them into the result in one
memcpy, as ``+=`` of an array did (``docs/benchmarks.md#long-run-memory-and-p99``).

Checkpoints: a growing conversation resends its earlier text, which would still be split at
every marker and looked up piece by piece (~1 µs a piece: ~1,100 pieces at 128K tokens of
1K-character turns, docs/long-contexts.md). So after each prompt the encoder keeps a
*checkpoint*: the ids up to the end ``e`` of its last marker whose start ``s`` lies at least
``M`` characters (the longest marker) before the text's end, and the text up to ``s + M``.
A later text that starts with that text takes those ids as they are and splits and encodes
only ``text[e:]``, its first piece behind that marker. Exact: ``re.split`` scans left to right
and, at a position ``j``, reads at most ``text[j:j + M]`` (the pattern is an alternation of
literal markers, no anchors, no look-around); every scanning decision up to and including the
marker at ``s`` reads only text before ``s + M``, which the two texts share, so they split
alike up to ``e``, and each piece's ids are a function of the piece and the marker before it.
Scanning ``text[e:]`` alone is scanning ``text`` from ``e``. Checkpoints are found by content
(``startswith`` against each, newest first; no session id is needed, and a wrong one cannot
be taken), at most ``max_checkpoints`` of them within ``max_tokens`` ids in total, and only
for prompts of at least ``min_checkpoint_tokens`` ids up to the checkpoint (a short prompt's
piece loop is cheaper than the search its checkpoint would add to every later prompt); the
serving checks compare their results like any other. The property tests compare prompts grown,
edited and cut against whole encodings.

Output: ``encode`` returns an ``array('I')`` too, the cached pieces concatenated (an array
``+=`` an array of the same type code is one memcpy) with the special tokens' ids in between.
A list would cost an int object per token (~1,500 for a typical chat prompt) that nothing
downstream needs: the router's block-hash memo keys blocks by the array's raw bytes
(``core.hash_memo``). An array never compares equal to a list, so the checks here compare
arrays with arrays; callers that need a list (JSON bodies) convert at that edge.
"""

from __future__ import annotations

import logging
import re
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Final

__all__ = [
    "DEFAULT_MAX_CACHED_TOKENS",
    "DEFAULT_MAX_CHECKPOINTS",
    "DEFAULT_MIN_CHECKPOINT_TOKENS",
    "DEFAULT_VERIFY_EVERY",
    "CheckSubmit",
    "SegmentEncoder",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_CACHED_TOKENS: Final = 4_000_000
"""Hundreds of long system prompts and conversations: 4 bytes an id, plus the pieces' text and
the ordered dict (the size at this bound: ``docs/benchmarks.md#long-run-memory-and-p99``)."""

_ITEM_BYTES: Final = array("I").itemsize
"""Bytes a cached id takes (an ``array('I')`` item)."""

DEFAULT_VERIFY_EVERY: Final = 1024
"""One call in this many is also encoded whole and compared (0: never)."""

DEFAULT_MAX_CHECKPOINTS: Final = 64
"""Growing prompts remembered at once (module docstring, "Checkpoints"): each is probed with
one ``startswith`` per prompt, which stops at the first differing character."""

DEFAULT_MIN_CHECKPOINT_TOKENS: Final = 2048
"""A prompt shorter than this leaves no checkpoint. What a checkpoint saves is the split and
one lookup a piece (~1 µs each) up to it, a few µs on a short prompt; what it costs is a
``startswith`` in every later prompt's search and a copy of the prompt's text and ids. On
traffic of short unique prompts every prompt left one, so each request probed all 64 and a
long session's checkpoint was pushed out within a fraction of a second
(``docs/long-contexts.md``)."""
"""One call in this many is also encoded whole and compared (0: never)."""

_PROBES: Final = (
    "plain text, no markers at all",
    " leading space and  double spaces\n\nand new lines\n",
    "{s0}system prompt{s1}\nthe user's question{s0}\n",
    "{s0}{s1}  spaces after a marker{s0}\tTab and ünïcödé, emoji 🙂, CJK 漢字",
    "word{s0}word{s1}word{s0} word {s1}\n",
    "{s1}starts with a marker",
)


EncodeFn = Callable[[str], Sequence[int]]
CheckSubmit = Callable[[str, "array[int]"], None]
"""Takes a due check's prompt text and the ids the cache gave for it (``defer_checks``)."""


class SegmentEncoder:
    """``encode(text)`` equal to ``encode_whole(text)``, served from cached pieces.

    Args:
        encode_whole: the tokenizer's encoder without special tokens added
            (``lambda t: tok.encode(t, add_special_tokens=False)``).
        split_tokens: special added tokens to cut at, as ``{text: id}`` (see the module
            docstring for which tokens qualify; ``HFTokenizer.split_tokens`` gives them).
        max_tokens: bound on the ids kept in the cache.
        verify_every: compare one call in this many against ``encode_whole`` (0: never).
        name: for log lines.
        max_checkpoints: growing prompts remembered at once (0: none; module docstring).
        min_checkpoint_tokens: a prompt with fewer ids up to its checkpoint leaves none.
    """

    def __init__(
        self,
        encode_whole: EncodeFn,
        split_tokens: dict[str, int],
        *,
        max_tokens: int = DEFAULT_MAX_CACHED_TOKENS,
        verify_every: int = DEFAULT_VERIFY_EVERY,
        name: str = "tokenizer",
        max_checkpoints: int = DEFAULT_MAX_CHECKPOINTS,
        min_checkpoint_tokens: int = DEFAULT_MIN_CHECKPOINT_TOKENS,
    ) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens={max_tokens} must be >= 0 (0 turns the cache off)")
        if verify_every < 0:
            raise ValueError(f"verify_every={verify_every} must be >= 0 (0: never verify)")
        self._encode = encode_whole
        self._ids = dict(split_tokens)
        self._max_tokens = max_tokens
        self._verify_every = verify_every
        self._name = name
        self._cache: OrderedDict[tuple[str | None, str], bytes] = OrderedDict()
        """A piece's ids as the raw bytes of an ``array('I')`` (untracked by the collector)."""
        self._cached_tokens = 0
        self._calls = 0
        self._submit: CheckSubmit | None = None
        self.hits = 0
        self.misses = 0
        self.mismatches = 0
        self.checks = 0
        if max_checkpoints < 0:
            raise ValueError(f"max_checkpoints={max_checkpoints} must be >= 0 (0: none)")
        self._max_checkpoints = max_checkpoints
        if min_checkpoint_tokens < 0:
            raise ValueError(f"min_checkpoint_tokens={min_checkpoint_tokens} must be >= 0 "
                             "(0: every prompt with a marker leaves a checkpoint)")
        self._min_checkpoint_tokens = min_checkpoint_tokens
        self._checkpoints: OrderedDict[int, _Checkpoint] = OrderedDict()
        self._checkpoint_tokens = 0
        self._next_checkpoint = 0
        self.checkpoint_hits = 0
        self._marker_len = max((len(t) for t in self._ids), default=0)
        self._pattern: re.Pattern[str] | None = None
        if self._ids:
            alternatives = sorted(self._ids, key=len, reverse=True)  # leftmost-longest
            self._pattern = re.compile("(" + "|".join(re.escape(t) for t in alternatives) + ")")
        self.enabled = self._pattern is not None and max_tokens > 0 and self._self_check()

    @property
    def cached_tokens(self) -> int:
        return self._cached_tokens

    def encode(self, text: str) -> array[int]:
        """The ids of ``text`` (``add_special_tokens=False``), as ``array('I')`` whether they
        come from the cache or, with the cache off, from ``encode_whole``."""
        if not self.enabled:
            return array("I", self._encode(text))
        try:
            ids = self._encode_pieces(text)
        except _Unsplittable as exc:
            whole = array("I", self._encode(text))
            self._disable(text, whole, (), reason=str(exc))
            return whole
        self._calls += 1
        if self._verify_every and self._calls % self._verify_every == 0:
            if self._submit is not None:
                self._submit(text, ids)
                return ids
            whole = array("I", self._encode(text))
            if not self.check(text, whole, ids):
                return whole
        return ids

    def defer_checks(self, submit: CheckSubmit | None) -> None:
        """Hand each due serving check to ``submit(text, ids)`` instead of running it inline
        (None: inline again). ``submit`` must not block; it reports through ``check``."""
        self._submit = submit

    def check(self, text: str, whole: array[int], ids: array[int]) -> bool:
        """Compare ``text``'s whole encoding with the ``ids`` the cache gave for it; on a
        difference switch the cache off for good (logged, counted in ``mismatches``).

        Returns whether they agree. A deferred check may arrive after the cache was already
        switched off: it is still counted, but logs and counts no second mismatch.
        """
        self.checks += 1
        if whole == ids:
            return True
        if self.enabled:
            self._disable(text, whole, ids)
        return False

    # -- internals ------------------------------------------------------------------------

    def _encode_pieces(self, text: str) -> array[int]:
        assert self._pattern is not None
        found = self._find_checkpoint(text)
        previous: str | None = None
        pos = 0
        if found is not None:
            out = array("I")
            out.frombytes(found.ids)  # a copy: the caller owns what it is given
            previous, pos = found.marker, found.end
        else:
            out = array("I")
        last: tuple[int, int, str, int] | None = None
        limit = len(text) - self._marker_len
        for i, piece in enumerate(self._pattern.split(text[pos:] if pos else text)):
            if i % 2:  # a special token (split() puts the captured separators at odd indices)
                out.append(self._ids[piece])
                previous = piece
                if pos <= limit:
                    last = (pos, pos + len(piece), piece, len(out))
            elif piece:
                out.frombytes(self._piece(previous, piece))  # the same item size: a memcpy
            pos += len(piece)
        if last is not None and self._max_checkpoints:
            self._remember(text, last, out, replaces=found)
        return out

    def _find_checkpoint(self, text: str) -> _Checkpoint | None:
        """The newest checkpoint whose text ``text`` starts with, or None."""
        for key in reversed(self._checkpoints):
            found = self._checkpoints[key]
            if text.startswith(found.prefix):
                self._checkpoints.move_to_end(key)
                self.checkpoint_hits += 1
                return found
        return None

    def _remember(self, text: str, last: tuple[int, int, str, int], out: array[int],
                  replaces: _Checkpoint | None) -> None:
        start, end, marker, count = last
        if replaces is not None and replaces.end >= end:
            return  # nothing new past the checkpoint used
        if count > self._max_tokens or count < self._min_checkpoint_tokens:
            return
        if replaces is not None:
            self._forget_checkpoint(replaces.key)
        key = self._next_checkpoint
        self._next_checkpoint += 1
        with memoryview(out) as view, view[:count] as head:
            ids = head.tobytes()  # one copy; released before the caller may grow ``out``
        self._checkpoints[key] = _Checkpoint(key, text[: start + self._marker_len], end, marker,
                                             ids)
        self._checkpoint_tokens += count
        while (len(self._checkpoints) > self._max_checkpoints
               or self._checkpoint_tokens > self._max_tokens):
            self._forget_checkpoint(next(iter(self._checkpoints)))

    def _forget_checkpoint(self, key: int) -> None:
        dropped = self._checkpoints.pop(key, None)
        if dropped is not None:
            self._checkpoint_tokens -= len(dropped.ids) // _ITEM_BYTES

    def _piece(self, previous: str | None, piece: str) -> bytes:
        """The piece's ids as the raw bytes of an ``array('I')``, from the cache or encoded
        (and cached)."""
        key = (previous, piece)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return cached
        self.misses += 1
        raw = array("I", self._encode_in_place(previous, piece)).tobytes()
        tokens = len(raw) // _ITEM_BYTES
        if tokens <= self._max_tokens:
            self._cache[key] = raw
            self._cached_tokens += tokens
            while self._cached_tokens > self._max_tokens:
                _, dropped = self._cache.popitem(last=False)
                self._cached_tokens -= len(dropped) // _ITEM_BYTES
        return raw

    def _encode_in_place(self, previous: str | None, piece: str) -> Sequence[int]:
        """``piece``'s ids where it stands: first piece alone, later ones behind their marker."""
        if previous is None:
            return self._encode(piece)
        ids = self._encode(previous + piece)
        if not ids or ids[0] != self._ids[previous]:
            raise _Unsplittable(previous)
        return ids[1:]

    def _self_check(self) -> bool:
        markers = list(self._ids)
        s0, s1 = markers[0], markers[-1]
        try:
            for probe in _PROBES:
                text = probe.format(s0=s0, s1=s1)
                if array("I", self._encode(text)) != self._encode_pieces(text):
                    log.warning("%s: piecewise tokenization differs from whole-prompt "
                                "tokenization on a probe; the token cache is off (every prompt "
                                "is encoded whole)", self._name)
                    return False
        except _Unsplittable as exc:
            log.warning("%s: %s; the token cache is off", self._name, exc)
            return False
        finally:
            self._cache.clear()
            self._cached_tokens = 0
            self.hits = self.misses = 0
            self._checkpoints.clear()
            self._checkpoint_tokens = 0
            self.checkpoint_hits = 0
        return True

    def _disable(self, text: str, whole: Sequence[int], pieces: Sequence[int],
                 reason: str | None = None) -> None:
        self.mismatches += 1
        self.enabled = False
        self._cache.clear()
        self._cached_tokens = 0
        self._checkpoints.clear()
        self._checkpoint_tokens = 0
        if reason is None:
            at = next((i for i, (a, b) in enumerate(zip(whole, pieces, strict=False)) if a != b),
                      min(len(whole), len(pieces)))
            reason = (f"piecewise tokenization differed from whole-prompt tokenization at "
                      f"token {at} of {len(whole)} (prompt of {len(text)} chars)")
        log.error("%s: %s; the token cache is now off for this tokenizer (every prompt is "
                  "encoded whole). Please report this with the tokenizer's name.", self._name,
                  reason)


class _Checkpoint:
    """What a later prompt that starts with ``prefix`` reuses: the ids of its text up to
    ``end`` (the end of ``marker``), its next piece to be encoded behind ``marker``. The ids
    are the raw bytes of an ``array('I')``, as the piece cache keeps them (never tracked by
    the garbage collector)."""

    __slots__ = ("end", "ids", "key", "marker", "prefix")

    def __init__(self, key: int, prefix: str, end: int, marker: str, ids: bytes) -> None:
        self.key = key
        self.prefix = prefix
        self.end = end
        self.marker = marker
        self.ids = ids


class _Unsplittable(ValueError):
    def __init__(self, marker: str) -> None:
        super().__init__(f"the special token {marker!r} does not encode to its own id when a "
                         "piece follows it")

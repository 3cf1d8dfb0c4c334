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

Memory: pieces are kept in an LRU bounded by their total tokens (``max_tokens``), as
``array('I')`` (4 bytes a token).

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

__all__ = ["DEFAULT_MAX_CACHED_TOKENS", "DEFAULT_VERIFY_EVERY", "CheckSubmit", "SegmentEncoder"]

log = logging.getLogger(__name__)

DEFAULT_MAX_CACHED_TOKENS: Final = 4_000_000
"""Hundreds of long system prompts and conversations: 4 bytes an id, plus the pieces' text and
the ordered dict (the size at this bound: ``docs/benchmarks.md#long-run-memory-and-p99``)."""

DEFAULT_VERIFY_EVERY: Final = 1024
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
    """

    def __init__(
        self,
        encode_whole: EncodeFn,
        split_tokens: dict[str, int],
        *,
        max_tokens: int = DEFAULT_MAX_CACHED_TOKENS,
        verify_every: int = DEFAULT_VERIFY_EVERY,
        name: str = "tokenizer",
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
        self._cache: OrderedDict[tuple[str | None, str], array[int]] = OrderedDict()
        self._cached_tokens = 0
        self._calls = 0
        self._submit: CheckSubmit | None = None
        self.hits = 0
        self.misses = 0
        self.mismatches = 0
        self.checks = 0
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
        out = array("I")
        previous: str | None = None
        for i, piece in enumerate(self._pattern.split(text)):
            if i % 2:  # a special token (split() puts the captured separators at odd indices)
                out.append(self._ids[piece])
                previous = piece
            elif piece:
                out += self._piece(previous, piece)  # same type code: a memcpy
        return out

    def _piece(self, previous: str | None, piece: str) -> array[int]:
        key = (previous, piece)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return cached
        self.misses += 1
        ids = array("I", self._encode_in_place(previous, piece))
        if len(ids) <= self._max_tokens:
            self._cache[key] = ids
            self._cached_tokens += len(ids)
            while self._cached_tokens > self._max_tokens:
                _, dropped = self._cache.popitem(last=False)
                self._cached_tokens -= len(dropped)
        return ids

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
        return True

    def _disable(self, text: str, whole: Sequence[int], pieces: Sequence[int],
                 reason: str | None = None) -> None:
        self.mismatches += 1
        self.enabled = False
        self._cache.clear()
        self._cached_tokens = 0
        if reason is None:
            at = next((i for i, (a, b) in enumerate(zip(whole, pieces, strict=False)) if a != b),
                      min(len(whole), len(pieces)))
            reason = (f"piecewise tokenization differed from whole-prompt tokenization at "
                      f"token {at} of {len(whole)} (prompt of {len(text)} chars)")
        log.error("%s: %s; the token cache is now off for this tokenizer (every prompt is "
                  "encoded whole). Please report this with the tokenizer's name.", self._name,
                  reason)


class _Unsplittable(ValueError):
    def __init__(self, marker: str) -> None:
        super().__init__(f"the special token {marker!r} does not encode to its own id when a "
                         "piece follows it")

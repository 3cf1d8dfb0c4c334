"""Token ids spelled as words: the text form of the simulated engines' built-in vocabulary.

Owns ``token_word`` (one id → one lowercase word: its base-80 digits as consonant-vowel
syllables), ``to_text`` (ids → words joined by single spaces) and ``from_text``, its exact
inverse. The benchmark workloads send prompts in this form to live engines, and the built-in
tokenizer of the simulated engine (``tokenize/sim_vocab.py``) reads it back to the same ids
and spells ids with it when decoding, so both sides must share this one definition.

Why here: it is the lowest ring both users reach (``tokenize`` for the simulated engine's
tokenizer, ``bench`` for the workloads); ``tokenize`` must not import ``bench``.

Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Final

from kvroute.core.errors import ConfigError

__all__ = ["from_text", "to_text", "token_word"]

_CONSONANTS: Final = "bdfghjklmnprstvz"
_VOWELS: Final = "aeiou"
_SYLLABLES: Final = tuple(c + v for c in _CONSONANTS for v in _VOWELS)
_SYLLABLE_INDEX: Final = {s: i for i, s in enumerate(_SYLLABLES)}
_BASE: Final = len(_SYLLABLES)  # 80


@functools.lru_cache(maxsize=1 << 16)
def token_word(token_id: int) -> str:
    """The word for one token id: its base-80 digits spelled as consonant-vowel syllables.

    Injective (positional notation without leading zeros), lowercase ASCII letters only, so a
    whitespace tokenizer reads one token and :func:`from_text` recovers the id.
    """
    if token_id < 0:
        raise ConfigError(f"token ids must be >= 0, got {token_id}")
    digits: list[str] = []
    value = token_id
    while True:
        value, digit = divmod(value, _BASE)
        digits.append(_SYLLABLES[digit])
        if value == 0:
            break
    return "".join(reversed(digits))


def to_text(token_ids: Iterable[int]) -> str:
    """Deterministic text for token ids: one word per id, separated by single spaces."""
    return " ".join([token_word(t) for t in token_ids])


def from_text(text: str) -> tuple[int, ...]:
    """The inverse of :func:`to_text` (splits on any whitespace).

    Raises :class:`ConfigError` naming the first word that :func:`to_text` cannot produce.
    """
    ids: list[int] = []
    for word in text.split():
        if len(word) % 2 or (len(word) > 2 and word[:2] == _SYLLABLES[0]):
            raise ConfigError(f"word {word!r} was not produced by to_text")
        value = 0
        for i in range(0, len(word), 2):
            digit = _SYLLABLE_INDEX.get(word[i : i + 2])
            if digit is None:
                raise ConfigError(f"word {word!r} was not produced by to_text")
            value = value * _BASE + digit
        ids.append(value)
    return tuple(ids)

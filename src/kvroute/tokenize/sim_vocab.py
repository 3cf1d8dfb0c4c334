"""Tokenizers for the simulated engine: a built-in deterministic one, or a local Hugging Face one.

Owns text → token ids, token ids → text, and the chat template, for ``sim/server.py``. It does
no network I/O: the Hugging Face variant reads a local directory only.

The built-in tokenizer (``BuiltinTokenizer``) is designed so that the benchmark workloads' text
form round-trips exactly:

* **Special tokens** are the lowest ids: ``<|endoftext|>`` = 0, ``<|im_start|>`` = 1,
  ``<|im_end|>`` = 2. They are recognised anywhere in the text, even glued to a word.
* **Words** are whitespace-separated runs of other characters (whitespace itself is not a
  token). A word that ``kvroute.tokenize.words.to_text`` can produce (base-80 consonant-vowel
  syllables, no leading zero syllable) maps back to exactly its id, whatever its size, so
  ``encode(to_text(ids)) == ids`` for any ids, including trace ids above the vocabulary.
* **Any other word** gets an id by a stable hash (BLAKE2b-64 of its UTF-8 bytes) into
  ``[100, vocab_size)``, the range ``bench.workloads`` draws from (ids below 100 are left to
  special tokens, as real vocabularies do).
* **Decoding** spells each id with ``token_word`` (special ids as their text) and joins them
  with single spaces, so ``decode(encode(to_text(ids))) == to_text(ids)``; a hashed word does
  not come back (the tokenizer is not injective on arbitrary text).
* **Chat template** (ChatML, as Qwen uses): for each message
  ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; content parts of type ``text`` are joined
  with ``\\n``, other parts become the word ``<{type}>``; ``tools`` (if any) come first as a
  ``<|im_start|>system\\n# Tools\\n{json of each tool}<|im_end|>\\n`` turn; the generation
  prompt is ``<|im_start|>assistant\\n``. ``continue_final_message`` leaves the last message
  open (no ``<|im_end|>``). Because whitespace is not a token, the rendered text tokenizes to
  ``[1, id(role), *ids(content), 2, ...]``.

The Hugging Face tokenizer (``HFTokenizer.from_dir``, in ``kvroute.tokenize.hf`` because the
router's local tokenizer uses the very same code) loads ``tokenizer.json`` with the
``tokenizers`` package and renders the Jinja chat template of ``tokenizer_config.json`` with
``jinja2``, so its ids match the real model's; both packages are the ``hf`` extra.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

from kvroute.core.errors import ConfigError
from kvroute.tokenize.hf import ChatTemplateError, HFTokenizer, content_text
from kvroute.tokenize.words import token_word

__all__ = [
    "BuiltinTokenizer",
    "ChatTemplateError",
    "HFTokenizer",
    "Tokenizer",
    "load_tokenizer",
]

_CONSONANTS: Final = "bdfghjklmnprstvz"
_VOWELS: Final = "aeiou"
_SYLLABLE_VALUE: Final = {
    c + v: i for i, (c, v) in enumerate((c, v) for c in _CONSONANTS for v in _VOWELS)
}
_BASE: Final = len(_SYLLABLE_VALUE)  # 80, as in tokenize.words

SPECIAL_TOKENS: Final = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
FIRST_WORD_ID: Final = 100
"""Hashed words land in ``[FIRST_WORD_ID, vocab_size)``."""


class Tokenizer(Protocol):
    """What the simulated server needs from a tokenizer (the seam between the two kinds)."""

    name: str
    vocab_size: int

    @property
    def max_chars_per_token(self) -> int | None:
        """The longest vocabulary string, in characters (vLLM's ``max_chars_per_token``, the
        factor of its character pre-check); None when a token has no length bound."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> Sequence[int]:
        """Token ids of ``text`` (a list, or ``HFTokenizer``'s ``array('I')``)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``."""
        ...

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary string of each id (``/tokenize`` with ``return_token_strs``)."""
        ...

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat template applied to ``messages``, as text."""
        ...


def _parse_word(word: str) -> int | None:
    """The id ``token_word`` spells as ``word``, or None if it cannot have produced it."""
    n = len(word)
    if n == 0 or n % 2:
        return None
    if n > 2 and word[:2] == "ba":  # leading zero digit: never produced
        return None
    value = 0
    get = _SYLLABLE_VALUE.get
    for i in range(0, n, 2):
        digit = get(word[i : i + 2])
        if digit is None:
            return None
        value = value * _BASE + digit
    return value


class BuiltinTokenizer:
    """The documented deterministic whitespace tokenizer (see the module docstring).

    Invariant: ``encode`` is a pure function of the text and ``vocab_size``; the word cache
    only memoises it.
    """

    name = "kvroute-builtin"

    def __init__(self, vocab_size: int = 32000) -> None:
        if vocab_size <= FIRST_WORD_ID:
            raise ConfigError(
                f"the built-in tokenizer needs vocab_size > {FIRST_WORD_ID} (ids below "
                f"{FIRST_WORD_ID} are reserved for special tokens), got {vocab_size}"
            )
        self.vocab_size = vocab_size
        self._special = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
        self._split = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
        self._cache: dict[str, int] = {}

    @property
    def max_chars_per_token(self) -> int | None:
        """None: any whitespace-free word is one token, so no character count bounds a
        token count (the server then skips vLLM's character pre-check unless
        ``SimServerConfig.max_chars_per_token`` sets a bound)."""
        return None

    def _word_id(self, word: str) -> int:
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        value = _parse_word(word)
        if value is None:
            digest = hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest()
            value = FIRST_WORD_ID + int.from_bytes(digest, "big") % (
                self.vocab_size - FIRST_WORD_ID
            )
        if len(self._cache) < 1 << 17:
            self._cache[word] = value
        return value

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (``add_special_tokens`` is accepted for the Protocol; the
        built-in tokenizer adds no BOS, like Qwen's)."""
        word_id = self._word_id
        if "<|" not in text:
            return [word_id(w) for w in text.split()]
        out: list[int] = []
        for piece in self._split.split(text):
            special = self._special.get(piece)
            if special is not None:
                out.append(special)
            else:
                out.extend(word_id(w) for w in piece.split())
        return out

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        return [
            SPECIAL_TOKENS[t] if 0 <= t < len(SPECIAL_TOKENS) else token_word(t)
            for t in token_ids
        ]

    def decode(self, token_ids: Sequence[int]) -> str:
        return " ".join(self.token_strs(token_ids))

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        parts: list[str] = []
        if tools:
            rendered = "\n".join(json.dumps(t, sort_keys=True) for t in tools)
            parts.append(f"<|im_start|>system\n# Tools\n{rendered}<|im_end|>\n")
        last = len(messages) - 1
        for i, message in enumerate(messages):
            role = message.get("role")
            if not isinstance(role, str):
                raise ChatTemplateError(f"messages[{i}] has no string 'role'")
            text = content_text(message.get("content"))
            if continue_final_message and i == last:
                parts.append(f"<|im_start|>{role}\n{text}")
            else:
                parts.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
        if add_generation_prompt and not continue_final_message:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


def load_tokenizer(path: str | Path | None, *, vocab_size: int = 32000) -> Tokenizer:
    """The built-in tokenizer when ``path`` is None, else ``HFTokenizer.from_dir(path)``.

    Raises:
        ConfigError: see ``HFTokenizer.from_dir`` and ``BuiltinTokenizer``.
    """
    if path is None:
        return BuiltinTokenizer(vocab_size)
    return HFTokenizer.from_dir(path)

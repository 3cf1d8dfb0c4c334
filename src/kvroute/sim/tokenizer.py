"""Tokenizers for the simulated engine: a built-in deterministic one, or a local Hugging Face one.

Owns text → token ids, token ids → text, and the chat template, for ``sim/server.py``. It does
no network I/O: the Hugging Face variant reads a local directory only.

The built-in tokenizer (``BuiltinTokenizer``) is designed so that the benchmark workloads' text
form round-trips exactly:

* **Special tokens** are the lowest ids: ``<|endoftext|>`` = 0, ``<|im_start|>`` = 1,
  ``<|im_end|>`` = 2. They are recognised anywhere in the text, even glued to a word.
* **Words** are whitespace-separated runs of other characters (whitespace itself is not a
  token). A word that ``kvroute.bench.workloads.to_text`` can produce (base-80 consonant-vowel
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

The Hugging Face tokenizer (``HFTokenizer.from_dir``) loads ``tokenizer.json`` with the
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

from kvroute.bench.workloads import token_word
from kvroute.core.errors import ConfigError

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
_BASE: Final = len(_SYLLABLE_VALUE)  # 80, as in bench.workloads

SPECIAL_TOKENS: Final = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
FIRST_WORD_ID: Final = 100
"""Hashed words land in ``[FIRST_WORD_ID, vocab_size)``."""


class ChatTemplateError(ValueError):
    """The chat template rejected the messages (``raise_exception`` in a Jinja template, or a
    message the built-in template cannot render)."""


class Tokenizer(Protocol):
    """What the simulated server needs from a tokenizer (the seam between the two kinds)."""

    name: str
    vocab_size: int

    @property
    def max_chars_per_token(self) -> int | None:
        """The longest vocabulary string, in characters (vLLM's ``max_chars_per_token``, the
        factor of its character pre-check); None when a token has no length bound."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
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


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        elif isinstance(part, Mapping):
            parts.append(f"<{part.get('type')}>")
    return "\n".join(parts)


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
            text = _content_text(message.get("content"))
            if continue_final_message and i == last:
                parts.append(f"<|im_start|>{role}\n{text}")
            else:
                parts.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
        if add_generation_prompt and not continue_final_message:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


def _require_hf() -> tuple[Any, Any]:
    try:
        import jinja2
        import jinja2.sandbox
        import tokenizers
    except ImportError as exc:
        raise ConfigError(
            f"--tokenizer needs the optional packages 'tokenizers' and 'jinja2' ({exc}); "
            "install them with: pip install 'kvroute[hf]'"
        ) from exc
    return tokenizers, jinja2


class HFTokenizer:
    """A local Hugging Face tokenizer directory: ``tokenizer.json`` + ``tokenizer_config.json``.

    The chat template is rendered with a sandboxed Jinja environment and the globals
    Transformers provides (``raise_exception``, ``bos_token``, ``eos_token``, the ``tojson``
    filter), and the result is encoded with ``add_special_tokens=False``, as vLLM encodes chat
    prompts. Completion prompts are encoded with ``add_special_tokens=True`` (BOS if the
    tokenizer's post-processor adds one).
    """

    def __init__(self, tokenizer: Any, config: Mapping[str, Any], name: str) -> None:
        _, jinja2 = _require_hf()
        self._tok = tokenizer
        self.name = name
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        # vLLM's get_cached_tokenizer: max(len(tok) for tok in tokenizer.get_vocab()), the
        # vocabulary strings as stored (byte-level or sentencepiece spelling, added tokens too).
        self._max_chars_per_token: int | None = max((len(t) for t in vocab), default=None)
        self._config = dict(config)
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            by_name = {t.get("name"): t.get("template") for t in template}
            template = by_name.get("default") or next(iter(by_name.values()), None)
        self._template_src: str | None = template if isinstance(template, str) else None
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(message)

        def tojson(value: Any, indent: int | None = None) -> str:
            return json.dumps(value, ensure_ascii=False, indent=indent)

        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(self._template_src) if self._template_src else None

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """Load ``path/tokenizer.json`` and ``path/tokenizer_config.json`` (optional).

        Raises:
            ConfigError: the packages are missing, or the directory holds no usable
                ``tokenizer.json``.
        """
        tokenizers, _ = _require_hf()
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ConfigError(
                f"--tokenizer {str(root)!r} has no tokenizer.json; point it at a local Hugging "
                "Face model directory (one with tokenizer.json and tokenizer_config.json)"
            )
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust library raises a bare Exception
            raise ConfigError(f"cannot load {str(tok_file)!r}: {exc}") from exc
        config: dict[str, Any] = {}
        cfg_file = root / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{str(cfg_file)!r} is not valid JSON: {exc}") from exc
        template_file = root / "chat_template.jinja"
        if "chat_template" not in config and template_file.is_file():
            config["chat_template"] = template_file.read_text(encoding="utf-8")
        return cls(tok, config, root.name)

    @property
    def max_chars_per_token(self) -> int | None:
        """The longest vocabulary string (13 for the tiny Llama used in conformance)."""
        return self._max_chars_per_token

    def _special(self, key: str) -> str | None:
        value = self._config.get(key)
        if isinstance(value, Mapping):
            value = value.get("content")
        return value if isinstance(value, str) else None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        return [self._tok.id_to_token(t) or "" for t in token_ids]

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if self._template is None:
            raise ChatTemplateError(
                "this tokenizer has no chat template (tokenizer_config.json 'chat_template'); "
                "use /v1/completions or a model directory that ships one"
            )
        try:
            text = self._template.render(
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._special("bos_token") or "",
                eos_token=self._special("eos_token") or "",
                **dict(chat_template_kwargs or {}),
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # any Jinja error is the template's verdict on the input
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        if continue_final_message and messages:
            last = _content_text(messages[-1].get("content"))
            cut = text.rfind(last) if last else -1
            if cut >= 0:
                text = text[: cut + len(last)]
        return str(text)


def load_tokenizer(path: str | Path | None, *, vocab_size: int = 32000) -> Tokenizer:
    """The built-in tokenizer when ``path`` is None, else ``HFTokenizer.from_dir(path)``.

    Raises:
        ConfigError: see ``HFTokenizer.from_dir`` and ``BuiltinTokenizer``.
    """
    if path is None:
        return BuiltinTokenizer(vocab_size)
    return HFTokenizer.from_dir(path)

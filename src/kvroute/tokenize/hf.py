"""A local Hugging Face tokenizer and its chat template, shared by the simulated engine and the
router's local tokenizer mode.

Owns reading a model directory (``tokenizer.json`` with the ``tokenizers`` package, the Jinja
chat template of ``tokenizer_config.json`` with ``jinja2``) and turning a chat request into the
token ids vLLM would compute for it. One implementation serves both sides on purpose: the
simulated engine (``sim/server.py``) and the router (``tokenize/prompt.py``, ``tokenizer:
{local: DIR}``) must apply identical template rules, or the router's block hashes would not
be the engine's. Reads local files only; both packages are the optional ``hf`` extra.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from kvroute.core.errors import ConfigError
from kvroute.tokenize.segments import SegmentEncoder

__all__ = ["ChatTemplateError", "HFTokenizer", "bundled_tokenizer_dir", "content_text"]


def bundled_tokenizer_dir() -> Path:
    """The tokenizer shipped with kvroute (``kvroute/data/tokenizers/kvroute-tiny-bpe``: the
    conformance suite's tiny BPE and chat template; its README says where it comes from)."""
    return Path(str(resources.files("kvroute").joinpath("data", "tokenizers",
                                                         "kvroute-tiny-bpe")))


class ChatTemplateError(ValueError):
    """The chat template rejected the messages (``raise_exception`` in a Jinja template, or a
    message the built-in template cannot render)."""


def content_text(content: Any) -> str:
    """The text of a message's ``content``: a string, or its text parts joined with newlines
    (other parts become ``<type>``)."""
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
        self._encode_fast: Any = getattr(tokenizer, "encode_batch_fast", None)
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
        self.pieces = SegmentEncoder(self._encode_plain, self.split_tokens(),
                                     name=f"tokenizer {name}")

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

    def encode(self, text: str, *, add_special_tokens: bool = True) -> Sequence[int]:
        """The ids of ``text``. Without special tokens added (how vLLM encodes a rendered chat
        prompt) they come from the piece cache (``tokenize.segments``): the same ids, computed
        only for text not seen before, as an ``array('I')``; with them, a list. Convert with
        ``list()`` where a list is required (a JSON body: an array is not JSON)."""
        if not add_special_tokens:
            return self.pieces.encode(text)
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def _encode_plain(self, text: str) -> list[int]:
        """``text``'s ids without special tokens added: the piece cache's misses, which are
        the new text of a growing conversation and most of its turn's router CPU.

        ``encode_batch_fast`` (tokenizers >= 0.21) gives the same ids as ``encode`` without
        computing character offsets, for 30-50 % less CPU a token (docs/long-contexts.md,
        "Where a long turn's CPU goes"); the piece cache's serving checks still compare with
        ``encode_batch``, so a difference would switch the cache off, never drift."""
        fast = self._encode_fast
        if fast is not None:
            return list(fast([text], add_special_tokens=False)[0].ids)
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_plain_unlocked(self, text: str) -> list[int]:
        """``text``'s ids without special tokens added, encoded whole (no piece cache), for a
        worker thread: the same ids as ``_encode_plain``, but through ``encode_batch``, which
        releases the GIL while it encodes (``encode`` holds it throughout: a thread calling
        it would stall the event loop as much as calling it inline)."""
        return list(self._tok.encode_batch([text], add_special_tokens=False)[0].ids)

    def split_tokens(self) -> dict[str, int]:
        """The special added tokens matched on the raw text as they are (``{text: id}``).

        ``tokenizers`` cuts its input at added tokens before anything else; these are the
        ones whose match neither normalizes nor eats surrounding whitespace, so text between
        two of them is encoded independently of what lies beyond (``tokenize.segments``).
        """
        out: dict[str, int] = {}
        for token_id, added in self._tok.get_added_tokens_decoder().items():
            if (added.special and added.content and not added.normalized
                    and not added.lstrip and not added.rstrip and not added.single_word):
                out[str(added.content)] = int(token_id)
        return out

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
            last = content_text(messages[-1].get("content"))
            cut = text.rfind(last) if last else -1
            if cut >= 0:
                text = text[: cut + len(last)]
        return str(text)

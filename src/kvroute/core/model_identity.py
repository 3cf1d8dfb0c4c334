"""Which weights a replica runs: its model identity, and the fingerprints it rests on.

A KV cache is a function of the weights that wrote it, and vLLM's block hashes do not name the
model: the same tokens hash the same on any weights (docs/model-bound-caches.md). So every
replica carries a :class:`ModelIdentity` — the served name, the model path its ``/v1/models``
card gives as ``root``, and a weights fingerprint where one can be read — and a replica whose
identity changes loses what the router believed about its cache and speed
(``core/versions.py``, ``RouterCore.set_identity``).

The fingerprint is computed here from file contents the shell read (``shell/model_files.py``);
nothing in this module touches a file:

* a ``version`` declared in the model's ``config.json`` is the identity's version as it is
  (an operator's own name for a checkpoint, stable across copies);
* otherwise the weights fingerprint hashes ``config.json``, every weight index
  (``*.safetensors.index.json``), each safetensors file's header (tensor names, shapes,
  offsets) and each weight file's size and modification time. Contents of multi-gigabyte
  weight files are not read: a copy of identical weights with a new modification time reads
  as a new version, which costs a cold cache, never a wrong hit (fail closed);
* nothing readable (the path is a hub id, or not on this host): the version is the ``root``
  itself, so a replica restarted on another path still reads as another identity.

The tokenizer fingerprint (vocabulary, merges, added and special tokens, chat template) is
what the A/B split and the fidelity gate compare before token ids may be shared between two
models: equal fingerprints mean the same text gives the same ids and the same prompt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "FINGERPRINT_HEX",
    "ModelIdentity",
    "TokenizerFingerprintError",
    "declared_version",
    "tokenizer_fingerprint",
    "weights_fingerprint",
]

FINGERPRINT_HEX: Final = 16
"""Hex digits kept of a fingerprint (64 bits: collisions between a fleet's checkpoints are
not a practical concern, and the value stays short in metric labels and logs)."""

_VERSION_KEYS: Final = ("version", "model_version")


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """A replica's model identity as discovery read it.

    Attributes:
        served_model: the name the engine serves (``--served-model-name``).
        root: the model path or hub id of its ``/v1/models`` card, None when it gives none.
        fingerprint: the weights fingerprint or the declared version (module docstring),
            None when no local model directory could be read.
        tokenizer: the tokenizer fingerprint (:func:`tokenizer_fingerprint`) of the model
            directory, None when it has none that could be read.
    """

    served_model: str
    root: str | None = None
    fingerprint: str | None = None
    tokenizer: str | None = None

    @property
    def version(self) -> str:
        """The version this identity names: the fingerprint, else the root, else the name.

        Two replicas of one pool with different versions never share cache entries or a
        session (``core/versions.py``)."""
        return self.fingerprint or self.root or self.served_model


def declared_version(config_json: bytes) -> str | None:
    """The ``version`` (or ``model_version``) a model's ``config.json`` declares, if any.

    Raises:
        ValueError: the bytes are not a JSON object (a corrupt config should be seen, not
            fingerprinted as if it were fine).
    """
    data = _json_object(config_json, "config.json")
    for key in _VERSION_KEYS:
        value = data.get(key)
        if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
            return f"v:{value}"
    return None


def weights_fingerprint(files: Mapping[str, bytes]) -> str:
    """A fingerprint of a model directory's weights from what was read of it.

    Args:
        files: relative file name → the bytes read for it (``config.json``, index files and
            safetensors headers in full; for a weight file, whatever stands for its contents,
            e.g. ``b"size=...;mtime_ns=..."``).

    Raises:
        ValueError: ``files`` is empty (there is nothing to fingerprint).
    """
    if not files:
        raise ValueError("a weights fingerprint needs at least one file (config.json or weights)")
    digest = hashlib.sha256()
    for name in sorted(files):
        data = files[name]
        digest.update(name.encode("utf-8") + b"\0" + str(len(data)).encode() + b"\0" + data)
    return "w:" + digest.hexdigest()[:FINGERPRINT_HEX]


class TokenizerFingerprintError(ValueError):
    """A tokenizer's files cannot be fingerprinted (missing or malformed ``tokenizer.json``)."""


def tokenizer_fingerprint(tokenizer_json: bytes, tokenizer_config_json: bytes | None) -> str:
    """The fingerprint of what makes two tokenizers give the same ids for the same prompt.

    Covers ``tokenizer.json``'s model (vocabulary, merges, its type), normalizer,
    pre-tokenizer, post-processor and added tokens (ids, contents, ``special``), and
    ``tokenizer_config.json``'s chat template and special tokens (bos, eos, pad, unk,
    added_tokens_decoder). Keys are canonicalised (sorted JSON), so reformatting a file does
    not change the fingerprint; any change of content does.

    Raises:
        TokenizerFingerprintError: ``tokenizer.json`` is not a JSON object with a ``model``.
    """
    try:
        tok = _json_object(tokenizer_json, "tokenizer.json")
    except ValueError as exc:
        raise TokenizerFingerprintError(str(exc)) from exc
    if not isinstance(tok.get("model"), dict):
        raise TokenizerFingerprintError(
            "tokenizer.json has no 'model' object (vocabulary and merges); pass the "
            "tokenizer.json a Hugging Face fast tokenizer saves")
    parts: dict[str, Any] = {key: tok.get(key) for key in (
        "model", "normalizer", "pre_tokenizer", "post_processor", "added_tokens")}
    if tokenizer_config_json is not None:
        try:
            cfg = _json_object(tokenizer_config_json, "tokenizer_config.json")
        except ValueError as exc:
            raise TokenizerFingerprintError(str(exc)) from exc
        parts["config"] = {key: cfg.get(key) for key in (
            "chat_template", "bos_token", "eos_token", "pad_token", "unk_token",
            "added_tokens_decoder", "add_bos_token", "add_eos_token")}
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "t:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:FINGERPRINT_HEX]


def _json_object(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(  # noqa: TRY004 - bad file content, not a caller's type error
            f"{what} must hold a JSON object, got {type(value).__name__}")
    return value

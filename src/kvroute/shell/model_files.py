"""Reads a local model directory for its weights and tokenizer fingerprints.

Discovery knows each replica's served name and its ``/v1/models`` ``root`` (vLLM fills it
with the path it was started on). When that path is a directory on this host, this module
reads what identifies the weights in it and hands the bytes to the pure fingerprints of
``core/model_identity.py``:

* ``config.json`` in full (a ``version`` it declares is the version as it is);
* every ``*.index.json`` (the weight map of a sharded checkpoint) in full;
* each ``*.safetensors`` file's header (its first 8 bytes give the header's length; the
  header names every tensor with its dtype, shape and offsets) plus its size and
  modification time; other weight files (``*.bin``, ``*.pt``, ``*.gguf``) by size and
  modification time. Weight contents are never read: a checkpoint can be hundreds of
  gigabytes, and a new modification time on identical weights only costs a cold cache;
* ``tokenizer.json`` and ``tokenizer_config.json`` for the tokenizer fingerprint.

Blocking file reads run on a worker thread (``asyncio.to_thread``): discovery's event loop
also relays requests. A path that is not a local directory (a hub id, another host's path)
gives an identity without fingerprint; a directory that cannot be read is an error the caller
logs and counts (the replica keeps the identity it had).
"""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path
from typing import Final

from kvroute.core.model_identity import (
    ModelIdentity,
    TokenizerFingerprintError,
    declared_version,
    tokenizer_fingerprint,
    weights_fingerprint,
)

__all__ = ["MAX_HEADER_BYTES", "ModelFilesError", "read_identity", "read_identity_sync"]

MAX_HEADER_BYTES: Final = 64 * 1024 * 1024
"""Largest safetensors header read (the format's own limit is 100 MB; real ones are far
smaller: a 70B checkpoint's shards have headers of tens of kilobytes)."""

_WEIGHT_SUFFIXES: Final = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_MAX_FILES: Final = 4096


class ModelFilesError(OSError):
    """A local model directory exists but could not be read (the message says which file)."""


def read_identity_sync(served_model: str, root: str | None) -> ModelIdentity:
    """The identity of a replica serving ``served_model`` from ``root`` (blocking).

    Raises:
        ModelFilesError: ``root`` is a local directory whose files cannot be read, or whose
            ``config.json`` is not a JSON object.
    """
    if root is None or not os.path.isdir(root):
        return ModelIdentity(served_model, root)
    directory = Path(root)
    files: dict[str, bytes] = {}
    version: str | None = None
    try:
        names = sorted(p.name for p in directory.iterdir() if p.is_file())[:_MAX_FILES]
        for name in names:
            path = directory / name
            if name == "config.json" or name.endswith(".index.json"):
                data = path.read_bytes()
                files[name] = data
                if name == "config.json":
                    version = declared_version(data)
            elif name.endswith(_WEIGHT_SUFFIXES):
                stat = path.stat()
                stamp = f"size={stat.st_size};mtime_ns={stat.st_mtime_ns}".encode()
                header = _safetensors_header(path) if name.endswith(".safetensors") else b""
                files[name] = stamp + b"\0" + header
        tokenizer = _tokenizer(directory)
    except ValueError as exc:
        raise ModelFilesError(f"model directory {root}: {exc}") from exc
    except OSError as exc:
        raise ModelFilesError(f"model directory {root}: cannot read {exc.filename or ''}: "
                              f"{exc.strerror or exc}") from exc
    fingerprint = version if version is not None else (
        weights_fingerprint(files) if files else None)
    return ModelIdentity(served_model, root, fingerprint, tokenizer)


async def read_identity(served_model: str, root: str | None) -> ModelIdentity:
    """:func:`read_identity_sync` on a worker thread."""
    return await asyncio.to_thread(read_identity_sync, served_model, root)


def _safetensors_header(path: Path) -> bytes:
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path.name} is shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path.name} declares a {length}-byte safetensors header "
                             f"(more than {MAX_HEADER_BYTES}); the file is not safetensors")
        return head + f.read(length)


def _tokenizer(directory: Path) -> str | None:
    tok = directory / "tokenizer.json"
    if not tok.is_file():
        return None
    cfg = directory / "tokenizer_config.json"
    try:
        return tokenizer_fingerprint(tok.read_bytes(),
                                     cfg.read_bytes() if cfg.is_file() else None)
    except TokenizerFingerprintError as exc:
        raise ValueError(str(exc)) from exc

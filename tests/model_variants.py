"""Other checkpoints of the tiny model, for the gate's proof (a helper module, not a test file).

* :func:`perturbed_checkpoint`: the same architecture and tokenizer, every weight tensor plus
  Gaussian noise of ``relative_noise`` times its own standard deviation (seeded): "another
  version of the same model".
* :func:`other_tokenizer_checkpoint`: the same weights, a tokenizer whose vocabulary maps two
  ordinary tokens to each other's ids (same size, so vLLM serves it; any text containing them
  gives other ids): "another tokenizer".

Both copy the source directory's files with fresh modification times, so the copy is also a
new weights fingerprint (``shell/model_files.py``).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np

__all__ = ["other_tokenizer_checkpoint", "perturbed_checkpoint"]


def _copy(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=False)
    for path in src.iterdir():
        if path.is_file() and not path.name.startswith("."):
            shutil.copyfile(path, dst / path.name)  # fresh mtime: a new fingerprint


def perturbed_checkpoint(src: Path, dst: Path, *, relative_noise: float, seed: int) -> Path:
    """Copy ``src`` to ``dst`` with noise added to every tensor of ``model.safetensors``.

    Tensors in bfloat16, float16 or float32 are handled (bfloat16 through its top 16 bits of
    a float32); the header (names, dtypes, shapes, offsets) is kept byte for byte.
    """
    _copy(src, dst)
    raw = (src / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    data = bytearray(raw[8 + length:])
    rng = np.random.default_rng(seed)
    for name, meta in sorted(header.items()):
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        chunk = bytes(data[begin:end])
        dtype = meta["dtype"]
        if dtype == "BF16":
            values = (np.frombuffer(chunk, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif dtype in ("F16", "F32"):
            values = np.frombuffer(chunk, dtype="<f2" if dtype == "F16" else "<f4").astype(
                np.float32)
        else:
            raise ValueError(f"tensor {name} has dtype {dtype}; only BF16, F16, F32 are handled")
        std = float(values.std()) or 1.0
        noisy = values + rng.normal(0.0, relative_noise * std, values.shape).astype(np.float32)
        if dtype == "BF16":
            out = (noisy.view(np.uint32) >> 16).astype("<u2").tobytes()
        else:
            out = noisy.astype("<f2" if dtype == "F16" else "<f4").tobytes()
        assert len(out) == end - begin
        data[begin:end] = out
    (dst / "model.safetensors").write_bytes(raw[:8 + length] + bytes(data))
    return dst


def other_tokenizer_checkpoint(src: Path, dst: Path) -> Path:
    """Copy ``src`` to ``dst`` with a tokenizer whose vocabulary swaps two tokens' ids."""
    _copy(src, dst)
    tok = json.loads((dst / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = tok["model"]["vocab"]
    specials = {t["id"] for t in tok.get("added_tokens", [])}
    a, b = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if i not in specials][
        -2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dst / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    return dst

"""A tiny PEFT LoRA adapter written at test time (a helper module, not a test file).

Owns writing an adapter directory vLLM's ``--lora-modules name=path`` can load for the tiny
random Llama of ``scripts/real_vllm/``: ``adapter_config.json`` plus ``adapter_model.safetensors``
with seeded random ``lora_A``/``lora_B`` weights for ``q_proj`` and ``v_proj`` of every layer.
The weights are generated here (no file from anywhere else, so no licence to carry); the
safetensors container is written by hand (an 8-byte little-endian header length, the JSON
header, the raw little-endian float32 data) so the tests need neither torch nor safetensors.

The adapter's numbers do not matter to the router: vLLM hashes the adapter's *name and path*
into every block, never its weights. They only have to load.
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Any

__all__ = ["write_tiny_lora"]


def _shapes(config: dict[str, Any], rank: int) -> dict[str, tuple[int, int]]:
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim", hidden // heads))
    outs = {"q_proj": heads * head_dim, "v_proj": kv_heads * head_dim}
    shapes: dict[str, tuple[int, int]] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module, out in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            shapes[f"{prefix}.lora_A.weight"] = (rank, hidden)
            shapes[f"{prefix}.lora_B.weight"] = (out, rank)
    return shapes


def write_tiny_lora(model_dir: Path, out_dir: Path, *, rank: int = 8, seed: int = 0) -> Path:
    """Write a LoRA adapter for the model in ``model_dir`` (its ``config.json``) to ``out_dir``.

    Returns ``out_dir``. Same ``seed``, same bytes.
    """
    config = json.loads((model_dir / "config.json").read_text())
    rng = random.Random(seed)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name, (rows, cols) in sorted(_shapes(config, rank).items()):
        values = [rng.uniform(-0.01, 0.01) for _ in range(rows * cols)]
        blob = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": [rows, cols],
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8 bytes
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "adapter_model.safetensors").open("wb") as fh:
        fh.write(struct.pack("<Q", len(head)))
        fh.write(head)
        for blob in blobs:
            fh.write(blob)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out_dir

"""KV-cache sizing: what one token, one block and one replica of a model hold, as vLLM sizes them.

Pure arithmetic (no I/O): ``kvroute plan`` (``commands/plan.py``) reads the files and prints,
``sim``/``bench`` take a replica's block count from it, and the offload tiers price a block's
load from its bytes. docs/plan.md walks through every formula with worked figures.

The shape of a model's KV (``KvShape.from_config`` reads a Hugging Face ``config.json``):

* **attention layers** keep, per token, a key and a value of ``head_size`` for each of their
  ``kv_heads`` (grouped-query attention: ``num_key_value_heads``, default
  ``num_attention_heads``; ``head_dim``, default ``hidden_size / num_attention_heads``):
  ``2 · kv_heads · head_size`` values a layer;
* **MLA** (DeepSeek-V2/V3, ``kv_lora_rank`` set) keeps one compressed latent per token and
  layer, ``kv_lora_rank + qk_rope_head_dim`` values (576 for DeepSeek-V3), no separate value;
  vLLM replicates the latent on every tensor-parallel rank instead of splitting heads;
* **sliding-window layers** keep at most ``sliding_window`` tokens of a sequence; a model may
  mix them with full layers (``layer_types``, Gemma 2's alternation, Gemma 3's
  ``sliding_window_pattern``), or be all sliding (Mistral-7B-v0.1's ``sliding_window``);
* **state layers** (``linear_attention``, ``mamba`` in ``layer_types``) keep a fixed state per
  sequence, not per token: counted and reported, not sized.

Bytes: a value is 2 bytes in BF16/FP16 (``"auto"`` follows the model's dtype, and a float32
checkpoint is served in BF16 as vLLM does), 1 byte in FP8 (``kv_cache_dtype="fp8"``), 4 in FP32.

vLLM's block count (``vllm/v1/core/kv_cache_utils.py``): one block of ``block_size`` tokens is
one page per layer, ``page = block_size · values_per_token_per_layer · bytes``, and a rank's
blocks are ``kv_cache_bytes // (layers · page)``. The KV memory of a rank is what its worker
measured (GPU: ``memory · gpu_memory_utilization`` − weights − activations; the CPU backend:
``VLLM_CPU_KVCACHE_SPACE`` GiB, or ``--kv-cache-memory-bytes``). Tensor parallelism splits
heads (``kv_heads / tp`` per rank, at least 1: a rank keeps a whole head when ``tp`` exceeds
the heads) and weights (``weights / tp`` per rank). The ``num_gpu_blocks`` this computes is the
figure vLLM reports in ``vllm:cache_config_info`` (and uses as ``--num-gpu-blocks-override``),
the reserved null block included.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.core.errors import ConfigError

__all__ = [
    "GIB",
    "GPUS",
    "KvShape",
    "ReplicaPlan",
    "TierPlan",
    "kv_dtype_bytes",
    "plan_replica",
    "plan_tiers",
    "safetensors_header_bytes",
]

GIB = 1 << 30

GPUS: Mapping[str, float] = {
    "a100-40gb": 40_960 / 1024,
    "a100-80gb": 81_920 / 1024,
    "h100-80gb": 81_559 / 1024,
    "h200": 143_771 / 1024,
    "l40s": 46_068 / 1024,
    "l4": 23_034 / 1024,
}
"""Total device memory in GiB, as ``nvidia-smi`` reports it (MiB / 1024); vLLM's
``gpu_memory_utilization`` is a fraction of this total."""

_DTYPE_BYTES: Mapping[str, int] = {
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float32": 4, "fp32": 4, "float": 4,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "float8_e4m3fn": 1,
}
_FULL_TYPES = frozenset({"full_attention", "attention", "global", "global_attention"})
_SLIDING_TYPES = frozenset({"sliding_attention", "sliding_window", "local", "local_attention"})
_STATE_TYPES = frozenset({"linear_attention", "mamba", "mamba2", "ssm", "recurrent"})


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype: str) -> int:
    """Bytes of one cached value for vLLM's ``--kv-cache-dtype`` (``"auto"`` follows the model;
    a float32 checkpoint is served in BF16, as vLLM's ``dtype="auto"`` does).

    Raises:
        ConfigError: a dtype name this table does not know.
    """
    name = kv_cache_dtype.lower()
    if name == "auto":
        name = model_dtype.lower().removeprefix("torch.")
        if name in ("float32", "fp32", "float"):
            name = "bfloat16"
    if name not in _DTYPE_BYTES:
        raise ConfigError(
            f"unknown KV dtype {name!r}; use one of auto, bfloat16, float16, float32, fp8, "
            "fp8_e4m3, fp8_e5m2"
        )
    return _DTYPE_BYTES[name]


def _int_field(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise ConfigError(f"config.json has no {key!r}; it is needed to size the KV cache")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"config.json {key!r} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class KvShape:
    """What one token leaves in each layer of a model's KV cache.

    Attributes:
        name: the model (``config.json``'s ``_name_or_path``, ``model_type``, or given).
        full_layers: attention layers that keep every token of a sequence.
        sliding_layers: attention layers that keep the last ``sliding_window`` tokens.
        state_layers: layers with a fixed per-sequence state (not sized).
        sliding_window: tokens a sliding layer keeps (``None`` without sliding layers).
        kv_heads: key/value heads of an attention layer (1 for MLA).
        values_per_head: cached values per head and token: ``2 · head_size`` (key and
            value), or the MLA latent ``kv_lora_rank + qk_rope_head_dim``.
        mla: the latent is replicated on every tensor-parallel rank, not split.
        model_dtype: the checkpoint's dtype (``torch_dtype`` / ``dtype``).
    """

    name: str
    full_layers: int
    sliding_layers: int
    state_layers: int
    sliding_window: int | None
    kv_heads: int
    values_per_head: int
    mla: bool
    model_dtype: str

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, name: str | None = None) -> KvShape:
        """Read a Hugging Face ``config.json`` (a multimodal one's ``text_config`` if present).

        Raises:
            ConfigError: a field the KV size needs is missing or not a positive integer, or a
                ``layer_types`` entry is unknown.
        """
        outer = config
        text = config.get("text_config")
        if isinstance(text, Mapping):
            config = {**{k: v for k, v in outer.items() if k != "text_config"}, **text}
        layers = _int_field(config, "num_hidden_layers")
        heads = _int_field(config, "num_attention_heads")
        model_dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        label = name or str(outer.get("_name_or_path") or config.get("model_type") or "model")
        if config.get("kv_lora_rank") is not None:
            latent = _int_field(config, "kv_lora_rank") + _int_field(config, "qk_rope_head_dim")
            return cls(label, layers, 0, 0, None, 1, latent, True, model_dtype)
        kv_heads = _int_field(config, "num_key_value_heads", heads)
        head_size = config.get("head_dim")
        if head_size is None:
            hidden = _int_field(config, "hidden_size")
            if hidden % heads:
                raise ConfigError(
                    f"config.json hidden_size={hidden} is not a multiple of "
                    f"num_attention_heads={heads}; give head_dim"
                )
            head_size = hidden // heads
        head_size = _int_field({"head_dim": head_size}, "head_dim")
        full, sliding, state = _layer_kinds(config, layers)
        window = None
        if sliding:
            window = _int_field(config, "sliding_window")
        return cls(label, full, sliding, state, window, kv_heads, 2 * head_size, False,
                   model_dtype)

    @property
    def attention_layers(self) -> int:
        return self.full_layers + self.sliding_layers

    def heads_per_rank(self, tp: int) -> int:
        """KV heads one tensor-parallel rank keeps (MLA's latent is whole on every rank)."""
        if self.mla:
            return 1
        return max(1, self.kv_heads // tp)

    def values_per_token_layer(self, tp: int = 1) -> int:
        """Cached values one token leaves in one attention layer on one rank."""
        return self.heads_per_rank(tp) * self.values_per_head

    def bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """KV bytes of one token over every attention layer and every rank (the replica's
        figure: Llama-3.1-8B in BF16 is 131,072 = 128 KiB; MLA counts its latent once per
        rank, as vLLM stores it)."""
        return self.attention_layers * self.values_per_token_layer(tp) * dtype_bytes * tp

    def page_bytes(self, block_size: int, dtype_bytes: int, tp: int = 1) -> int:
        """One layer's page of one block on one rank (vLLM's ``page_size_bytes``)."""
        return block_size * self.values_per_token_layer(tp) * dtype_bytes

    def groups(self) -> tuple[int, int, int]:
        """vLLM's KV cache groups: (layers per group, full groups, sliding groups).

        One attention kind is one group of every layer. A hybrid model's layers are split
        into groups of equal size, the smaller kind's count (the larger's when the two are
        within 1.5x), the last group of a kind padded (``_get_kv_cache_groups_uniform_page_
        size``): Gemma 3's 10 full and 52 sliding layers are 1 + 6 groups of 10.
        """
        if not (self.full_layers and self.sliding_layers):
            return self.attention_layers, int(self.full_layers > 0), int(
                self.sliding_layers > 0)
        low = min(self.full_layers, self.sliding_layers)
        high = max(self.full_layers, self.sliding_layers)
        size = high if high < 1.5 * low else low
        return size, -(-self.full_layers // size), -(-self.sliding_layers // size)

    def block_bytes_per_rank(self, block_size: int, dtype_bytes: int, tp: int = 1) -> int:
        """One block's bytes on one rank: a page in every layer of a group (every attention
        layer unless the model is hybrid; vLLM's ``bytes_per_block``)."""
        return self.groups()[0] * self.page_bytes(block_size, dtype_bytes, tp)

    def session_blocks(self, context: int, block_size: int) -> int:
        """Blocks a sequence of ``context`` tokens takes: whole blocks in each full group, at
        most the window plus the block it straddles in each sliding group."""
        _, full_groups, sliding_groups = self.groups()
        blocks = full_groups * -(-context // block_size)
        if sliding_groups:
            assert self.sliding_window is not None
            kept = min(context, self.sliding_window + block_size)
            blocks += sliding_groups * -(-kept // block_size)
        return blocks


def _layer_kinds(config: Mapping[str, Any], layers: int) -> tuple[int, int, int]:
    """(full, sliding, state) layer counts from ``layer_types`` or the sliding-window fields."""
    types = config.get("layer_types")
    if isinstance(types, Sequence) and not isinstance(types, str):
        if len(types) != layers:
            raise ConfigError(
                f"config.json layer_types lists {len(types)} layers, num_hidden_layers is "
                f"{layers}"
            )
        counts = [0, 0, 0]
        for kind in types:
            key = str(kind).lower()
            if key in _FULL_TYPES:
                counts[0] += 1
            elif key in _SLIDING_TYPES:
                counts[1] += 1
            elif key in _STATE_TYPES:
                counts[2] += 1
            else:
                raise ConfigError(
                    f"config.json layer_types has {kind!r}; known: "
                    f"{sorted(_FULL_TYPES | _SLIDING_TYPES | _STATE_TYPES)}"
                )
        return counts[0], counts[1], counts[2]
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window") is False:
        return layers, 0, 0
    pattern = config.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 1:
        full = layers // pattern                  # Gemma 3: every pattern-th layer is global
        return full, layers - full, 0
    if str(config.get("model_type", "")).startswith("gemma2"):
        sliding = (layers + 1) // 2                # Gemma 2: even layers slide
        return layers - sliding, sliding, 0
    return 0, layers, 0                            # Mistral-7B-v0.1: every layer slides


def safetensors_header_bytes(header: Mapping[str, Any]) -> int:
    """Bytes of the tensors a safetensors header describes (its ``data_offsets`` spans).

    Raises:
        ConfigError: an entry has no ``[begin, end]`` offsets.
    """
    total = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, Mapping) else None
        if (not isinstance(offsets, Sequence) or len(offsets) != 2
                or not all(isinstance(x, int) for x in offsets)):
            raise ConfigError(f"safetensors header entry {key!r} has no [begin, end] data_offsets")
        total += offsets[1] - offsets[0]
    return total


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    """One replica's KV cache.

    Attributes:
        shape: the model's KV shape.
        dtype_bytes: bytes of one cached value.
        tp: tensor-parallel ranks.
        block_size: tokens per block.
        kv_bytes_per_rank: memory each rank gives its KV cache.
        num_gpu_blocks: blocks of the replica as vLLM reports them (null block included).
    """

    shape: KvShape
    dtype_bytes: int
    tp: int
    block_size: int
    kv_bytes_per_rank: int
    num_gpu_blocks: int

    @property
    def bytes_per_token(self) -> int:
        return self.shape.bytes_per_token(self.dtype_bytes, self.tp)

    @property
    def block_bytes_per_rank(self) -> int:
        return self.shape.block_bytes_per_rank(self.block_size, self.dtype_bytes, self.tp)

    @property
    def block_bytes(self) -> int:
        """One block over every rank: what a tier stores and a load moves."""
        return self.block_bytes_per_rank * self.tp

    @property
    def usable_blocks(self) -> int:
        """Blocks that can hold KV (vLLM keeps block 0 as the null block)."""
        return max(0, self.num_gpu_blocks - 1)

    @property
    def tokens(self) -> int:
        """Tokens of KV the replica holds when every layer keeps every token: usable blocks ×
        block size over the KV cache groups (one group unless the model is hybrid, whose
        long sequences fit more: ``sessions_at``)."""
        _, full_groups, sliding_groups = self.shape.groups()
        return self.usable_blocks * self.block_size // (full_groups + sliding_groups)

    def sessions_at(self, context: int) -> int:
        """Sequences of ``context`` tokens that fit at once."""
        if context < 1:
            raise ConfigError(f"context length must be >= 1 token, got {context}")
        return self.usable_blocks // self.shape.session_blocks(context, self.block_size)

    def survival_s(self, prefill_tokens_per_s: float) -> float:
        """Seconds an unused prefix stays in this replica's LRU cache while it computes
        ``prefill_tokens_per_s`` new tokens (each new block takes the oldest free one)."""
        if prefill_tokens_per_s <= 0:
            raise ConfigError(f"prefill rate must be > 0 tokens/s, got {prefill_tokens_per_s}")
        return self.tokens / prefill_tokens_per_s


def plan_replica(
    shape: KvShape,
    *,
    block_size: int,
    kv_cache_dtype: str = "auto",
    tp: int = 1,
    kv_cache_gib: float | None = None,
    gpu_memory_gib: float | None = None,
    gpu_memory_utilization: float = 0.9,
    weights_bytes: int | None = None,
    reserve_gib: float = 0.0,
) -> ReplicaPlan:
    """Size one replica's KV cache: from an explicit KV memory per rank (``kv_cache_gib``, the
    CPU backend's ``VLLM_CPU_KVCACHE_SPACE``), or from the device memory left after weights
    and an activation reserve at the utilisation.

    Raises:
        ConfigError: a value out of range, neither memory given, or no memory left for KV.
    """
    for label, value in (("block size", block_size), ("tensor parallelism", tp)):
        if value < 1:
            raise ConfigError(f"{label} must be >= 1, got {value}")
    dtype_bytes = kv_dtype_bytes(kv_cache_dtype, shape.model_dtype)
    if kv_cache_gib is not None:
        if kv_cache_gib <= 0:
            raise ConfigError(f"KV cache memory must be > 0 GiB, got {kv_cache_gib}")
        kv_bytes = int(kv_cache_gib * GIB)
    else:
        if gpu_memory_gib is None or weights_bytes is None:
            raise ConfigError(
                "give the KV memory per rank (--kv-cache-gib, the CPU backend's "
                "VLLM_CPU_KVCACHE_SPACE), or a GPU (--gpu or --gpu-memory-gib) and the weights "
                "(--weights-gib, --params-b or a safetensors index)"
            )
        if not 0 < gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu memory utilization must be in (0, 1], got {gpu_memory_utilization}")
        budget = gpu_memory_gib * GIB * gpu_memory_utilization
        kv_bytes = int(budget - weights_bytes / tp - reserve_gib * GIB)
        if kv_bytes <= 0:
            raise ConfigError(
                f"no memory left for KV: {gpu_memory_gib:.1f} GiB x {gpu_memory_utilization} "
                f"minus {weights_bytes / tp / GIB:.1f} GiB of weights per rank minus "
                f"{reserve_gib} GiB reserve is {kv_bytes / GIB:.1f} GiB; raise tensor "
                "parallelism or the utilisation, or use a larger GPU"
            )
    block = shape.block_bytes_per_rank(block_size, dtype_bytes, tp)
    if block == 0:
        raise ConfigError(f"{shape.name} has no attention layers: nothing to size")
    return ReplicaPlan(shape, dtype_bytes, tp, block_size, kv_bytes, kv_bytes // block)


@dataclass(frozen=True, slots=True)
class TierPlan:
    """A tier below a replica's device memory (host DRAM, disk, a shared store).

    Attributes:
        name: ``cpu``, ``disk``, ``shared``...
        blocks: blocks the tier holds.
        block_size: tokens per block.
        writers: replicas whose new blocks the tier takes (1 for a per-replica tier).
        load_gbps: bytes per second a load back reaches, in GB/s (10^9), if given.
        block_bytes: bytes of one block.
    """

    name: str
    blocks: int
    block_size: int
    writers: int
    load_gbps: float | None
    block_bytes: int

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    def survival_s(self, prefill_tokens_per_s: float) -> float:
        """Seconds an unused prefix survives in the tier's LRU while each of its writers
        computes ``prefill_tokens_per_s`` new tokens (every new block is written through)."""
        if prefill_tokens_per_s <= 0:
            raise ConfigError(f"prefill rate must be > 0 tokens/s, got {prefill_tokens_per_s}")
        return self.tokens / (prefill_tokens_per_s * self.writers)

    def load_s_per_block(self) -> float | None:
        """Seconds to load one block back, or ``None`` without a bandwidth."""
        if self.load_gbps is None:
            return None
        return self.block_bytes / (self.load_gbps * 1e9)


def plan_tiers(
    replica: ReplicaPlan, tiers: Sequence[tuple[str, float, int, float | None]]
) -> list[TierPlan]:
    """Size each ``(name, GiB, writers, load GB/s)`` tier in the replica's blocks.

    Raises:
        ConfigError: a size or writer count out of range.
    """
    out: list[TierPlan] = []
    for name, gib, writers, gbps in tiers:
        if gib <= 0 or writers < 1 or (gbps is not None and gbps <= 0):
            raise ConfigError(
                f"tier {name!r}: size must be > 0 GiB, writers >= 1 and bandwidth > 0, got "
                f"{gib} GiB, {writers} writers, {gbps} GB/s")
        blocks = math.floor(gib * GIB) // replica.block_bytes
        out.append(TierPlan(name, blocks, replica.block_size, writers, gbps, replica.block_bytes))
    return out

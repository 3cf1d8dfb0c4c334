"""``kvroute plan``: how much KV one replica of a model holds, and what that buys.

Reads a model's ``config.json`` (a bundled shape with ``--model``, or any file or Hugging Face
snapshot directory with ``--config``), the weights' size (``--weights-gib``, a safetensors
index or file, or a parameter count), and the memory (a GPU and its utilisation, or the KV
memory itself as the CPU backend's ``VLLM_CPU_KVCACHE_SPACE``); prints bytes per token and
block, vLLM's ``num_gpu_blocks``, tokens and concurrent sessions per replica, the CPU/disk/
shared tiers in blocks, and how long an unused prefix survives at a prefill rate. The
arithmetic is ``engine/kv_sizing.py``; docs/plan.md explains it.

``replica_from_spec`` turns ``MODEL@GPU[,tp=N][,util=F][,reserve=GIB][,kv=DTYPE]`` into a
plan, for ``kvroute sim ... --kv-plan`` and ``kvroute bench sim --kv-plan``.
"""

from __future__ import annotations

import json
import struct
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from kvroute.commands.results import exit_on_router_error, write_json_report
from kvroute.core.errors import ConfigError
from kvroute.engine.kv_sizing import (
    GIB,
    GPUS,
    KvShape,
    ReplicaPlan,
    TierPlan,
    kv_dtype_bytes,
    plan_replica,
    plan_tiers,
    safetensors_header_bytes,
)

HELP = "Size a replica's KV cache from a model's config.json, the GPU and the tiers."

__all__ = ["HELP", "bundled_models", "load_model", "plan", "plan_report", "replica_from_spec"]

_MAX_HEADER = 100 << 20


def bundled_models() -> list[str]:
    """Names ``--model`` takes: the files of ``kvroute/data/models``."""
    root = resources.files("kvroute") / "data" / "models"
    return sorted(p.name.removesuffix(".json") for p in root.iterdir()
                  if p.name.endswith(".json"))


def load_model(model: str) -> tuple[dict[str, Any], Path | None]:
    """A bundled name, a ``config.json`` path, or a snapshot directory → (config, directory
    holding the weights, if any).

    Raises:
        ConfigError: no such model or file, or the file is not a JSON object.
    """
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
        directory: Path | None = path.parent
    elif path.suffix == ".json" or path.exists():
        directory = path.parent
    else:
        if model not in bundled_models():
            raise ConfigError(
                f"no model {model!r}: give a config.json path, a model directory, or one of "
                f"{', '.join(bundled_models())}")
        text = (resources.files("kvroute") / "data" / "models" / f"{model}.json").read_text(
            encoding="utf-8")
        return _object(json.loads(text), model), None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the model config {path}: {exc}") from exc
    return _object(data, str(path)), directory


def _object(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(f"{where} is not a JSON object")
    return data


def _safetensors_bytes(path: Path) -> int:
    """Weights of a ``*.safetensors.index.json`` (``metadata.total_size``) or of one
    ``.safetensors`` file (its header's tensor spans)."""
    try:
        if path.name.endswith(".json"):
            index = json.loads(path.read_text(encoding="utf-8"))
            total = index.get("metadata", {}).get("total_size")
            if not isinstance(total, int):
                raise ConfigError(f"{path} has no metadata.total_size")
            return total
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER:
                raise ConfigError(f"{path}: header of {length} bytes is not a safetensors file")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise ConfigError(f"cannot read the weights' size from {path}: {exc}") from exc
    return safetensors_header_bytes(_object(header, str(path)))


def weights_bytes(config: dict[str, Any], directory: Path | None, *,
                  weights_gib: float | None = None, safetensors: Path | None = None,
                  params_b: float | None = None) -> tuple[int | None, str]:
    """The weights' size and where it came from, first of: ``--weights-gib``,
    ``--safetensors``, the directory's index or single file, ``--params-b``, the bundled
    file's ``kvroute_params_b`` (bytes per parameter: ``kvroute_weight_bytes_per_param``,
    else the served dtype's)."""
    if weights_gib is not None:
        return int(weights_gib * GIB), "--weights-gib"
    if safetensors is not None:
        return _safetensors_bytes(safetensors), str(safetensors)
    if directory is not None:
        for name in ("model.safetensors.index.json", "model.safetensors"):
            if (directory / name).is_file():
                return _safetensors_bytes(directory / name), str(directory / name)
    params = params_b if params_b is not None else config.get("kvroute_params_b")
    if params is None:
        return None, "unknown"
    per = config.get("kvroute_weight_bytes_per_param")
    if not isinstance(per, (int, float)):
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        per = kv_dtype_bytes("auto", dtype)
    return int(float(params) * 1e9 * per), f"{float(params):g} B parameters x {per} B"


def _gib(value: float) -> str:
    return f"{value / GIB:,.2f} GiB"


def plan_report(plan: ReplicaPlan, tiers: list[TierPlan], contexts: list[int],
                prefill_rate: float | None, *, memory: str,
                link_gbps: float | None = None) -> dict[str, Any]:
    """The figures ``kvroute plan`` prints, as a JSON-ready dict (``link_gbps``: the time
    to move a prompt's KV of each context length between replicas, as disaggregated
    prefill/decode does)."""
    shape = plan.shape
    report: dict[str, Any] = {
        "model": shape.name,
        "layers": {"full": shape.full_layers, "sliding": shape.sliding_layers,
                   "state": shape.state_layers, "sliding_window": shape.sliding_window},
        "attention": ("MLA latent" if shape.mla else "GQA"),
        "kv_heads": shape.kv_heads,
        "values_per_token_layer": shape.values_per_token_layer(1),
        "dtype_bytes": plan.dtype_bytes,
        "tp": plan.tp,
        "block_size": plan.block_size,
        "bytes_per_token": plan.bytes_per_token,
        "bytes_per_block": plan.block_bytes,
        "bytes_per_block_per_rank": plan.block_bytes_per_rank,
        "kv_bytes_per_rank": plan.kv_bytes_per_rank,
        "kv_memory": memory,
        "num_gpu_blocks": plan.num_gpu_blocks,
        "tokens": plan.tokens,
        "sessions": {str(c): plan.sessions_at(c) for c in contexts},
        "tiers": {t.name: {"blocks": t.blocks, "tokens": t.tokens, "writers": t.writers,
                           "load_gbps": t.load_gbps, "load_s_per_block": t.load_s_per_block()}
                  for t in tiers},
    }
    if link_gbps is not None:
        if link_gbps <= 0:
            raise ConfigError(f"--link-gbps must be > 0, got {link_gbps}")
        report["link_gbps"] = link_gbps
        report["transfer_s"] = {str(c): plan.bytes_per_token * c / (link_gbps * 1e9)
                                for c in contexts}
    if prefill_rate is not None:
        report["prefill_tokens_per_s"] = prefill_rate
        report["survival_s"] = {"gpu": plan.survival_s(prefill_rate),
                                **{t.name: t.survival_s(prefill_rate) for t in tiers}}
    return report


def _lines(report: dict[str, Any]) -> list[str]:
    layers = report["layers"]
    kinds = [f"{layers['full']} full"]
    if layers["sliding"]:
        kinds.append(f"{layers['sliding']} sliding (window {layers['sliding_window']:,})")
    if layers["state"]:
        kinds.append(f"{layers['state']} state layers (fixed per sequence, not sized)")
    tokens_per_block = report["block_size"]
    per_token = report["bytes_per_token"]
    out = [
        (f"model            {report['model']}: {', '.join(kinds)}; {report['attention']}, "
         f"{report['values_per_token_layer']} values per token and layer, "
         f"{report['dtype_bytes']} B each"),
        (f"per token        {per_token:,} B ({per_token / 1024:,.1f} KiB) over the "
         f"replica's {report['tp']} rank(s)"),
        (f"per block        {report['bytes_per_block']:,} B ({tokens_per_block} tokens; "
         f"{report['bytes_per_block_per_rank']:,} B per rank)"),
        f"KV per rank      {_gib(report['kv_bytes_per_rank'])}  ({report['kv_memory']})",
        f"num_gpu_blocks   {report['num_gpu_blocks']:,}  (vLLM's figure, null block included)",
        f"tokens           {report['tokens']:,}",
    ]
    for context, count in report["sessions"].items():
        out.append(f"sessions         {count:,} at {int(context):,} tokens of context")
    for name, tier in report["tiers"].items():
        load = ""
        if tier["load_s_per_block"] is not None:
            load = (f"; a block loads in {tier['load_s_per_block'] * 1e6:,.1f} us at "
                    f"{tier['load_gbps']:g} GB/s")
        shared = f", shared by {tier['writers']} replicas" if tier["writers"] > 1 else ""
        out.append(f"{name + ' tier':<16} {tier['blocks']:,} blocks = {tier['tokens']:,} tokens"
                   f" ({tier['blocks'] / max(1, report['num_gpu_blocks'] - 1):.2f}x the GPU)"
                   f"{shared}{load}")
    for context, seconds in report.get("transfer_s", {}).items():
        out.append(f"transfer         {seconds * 1e3:,.1f} ms for {int(context):,} tokens of KV at "
                   f"{report['link_gbps']:g} GB/s (prefill -> decode replica)")
    if "survival_s" in report:
        rate = report["prefill_tokens_per_s"]
        parts = ", ".join(f"{k} {v:,.1f} s" for k, v in report["survival_s"].items())
        out.append(f"prefix survives  {parts}  (unused, at {rate:,.0f} new prefill tokens/s "
                   "per replica, LRU)")
    return out


def _memory(gpu: str | None, gpu_memory_gib: float | None) -> float | None:
    if gpu is None:
        return gpu_memory_gib
    if gpu.lower() not in GPUS:
        raise ConfigError(f"unknown GPU {gpu!r}; choose one of {', '.join(GPUS)} or give "
                          "--gpu-memory-gib")
    return GPUS[gpu.lower()]


def build_plan(model: str, *, block_size: int, kv_cache_dtype: str = "auto", tp: int = 1,
               kv_cache_gib: float | None = None, gpu: str | None = None,
               gpu_memory_gib: float | None = None, gpu_memory_utilization: float = 0.9,
               weights_gib: float | None = None, safetensors: Path | None = None,
               params_b: float | None = None, reserve_gib: float = 0.0
               ) -> tuple[ReplicaPlan, str]:
    """Read the model, resolve the memory, size the replica; also say where the KV memory
    came from."""
    config, directory = load_model(model)
    shape = KvShape.from_config(config, name=None)
    memory_gib = _memory(gpu, gpu_memory_gib)
    weights: int | None = None
    if kv_cache_gib is not None:
        memory = f"given: {kv_cache_gib:g} GiB per rank (VLLM_CPU_KVCACHE_SPACE / " \
                 "--kv-cache-memory-bytes)"
    else:
        weights, source = weights_bytes(config, directory, weights_gib=weights_gib,
                                        safetensors=safetensors, params_b=params_b)
        if weights is None:
            raise ConfigError(
                f"the weights' size of {shape.name} is unknown: give --weights-gib, "
                "--params-b, or --safetensors (an index or a .safetensors file)")
        memory = (f"{memory_gib or 0:,.2f} GiB x {gpu_memory_utilization:g} - "
                  f"{_gib(weights / tp)} weights per rank ({source}) - "
                  f"{reserve_gib:g} GiB reserve")
    plan = plan_replica(shape, block_size=block_size, kv_cache_dtype=kv_cache_dtype, tp=tp,
                        kv_cache_gib=kv_cache_gib, gpu_memory_gib=memory_gib,
                        gpu_memory_utilization=gpu_memory_utilization,
                        weights_bytes=weights, reserve_gib=reserve_gib)
    return plan, memory


def replica_from_spec(text: str, *, block_size: int) -> ReplicaPlan:
    """``MODEL@GPU[,tp=N][,util=F][,reserve=GIB][,kv=DTYPE]`` (or ``MODEL@kv=GIB`` for a
    given KV memory per rank) → the replica plan, with the profile's ``block_size``.

    Raises:
        ConfigError: a malformed spec, or anything ``build_plan`` refuses.
    """
    model, sep, rest = text.partition("@")
    if not sep or not model or not rest:
        raise ConfigError(
            f"--kv-plan takes MODEL@GPU[,tp=N][,util=F][,reserve=GIB][,kv=DTYPE] or "
            f"MODEL@kvgib=GIB, e.g. llama-3.1-8b@h100-80gb,reserve=4; got {text!r}")
    gpu, *options = rest.split(",")
    args: dict[str, Any] = {}
    if gpu.startswith("kvgib="):
        options.insert(0, gpu)
        gpu = ""
    keys = {"tp": ("tp", int), "util": ("gpu_memory_utilization", float),
            "reserve": ("reserve_gib", float), "kv": ("kv_cache_dtype", str),
            "kvgib": ("kv_cache_gib", float)}
    for item in options:
        key, eq, value = item.partition("=")
        if not eq or key not in keys:
            raise ConfigError(f"--kv-plan option {item!r}: use one of "
                              f"{', '.join(k + '=' for k in keys)}")
        name, kind = keys[key]
        try:
            args[name] = kind(value)
        except ValueError as exc:
            raise ConfigError(f"--kv-plan option {item!r}: {value!r} is not a {kind.__name__}") \
                from exc
    plan, _ = build_plan(model, block_size=block_size, gpu=gpu or None, **args)
    return plan


def plan(
    model: Annotated[str, typer.Option(help="A bundled model (see --list), a config.json path, or a model directory (its safetensors give the weights).")] = "llama-3.1-8b",
    gpu: Annotated[str | None, typer.Option(help=f"GPU: {', '.join(GPUS)}.")] = None,
    gpu_memory_gib: Annotated[float | None, typer.Option(help="Device memory per GPU, GiB (instead of --gpu).")] = None,
    gpu_memory_utilization: Annotated[float, typer.Option(help="vLLM's --gpu-memory-utilization.")] = 0.9,
    tp: Annotated[int, typer.Option(help="Tensor-parallel ranks of one replica.")] = 1,
    kv_cache_gib: Annotated[float | None, typer.Option(help="KV memory per rank, GiB, instead of the GPU arithmetic: the CPU backend's VLLM_CPU_KVCACHE_SPACE, or --kv-cache-memory-bytes / 2^30.")] = None,
    weights_gib: Annotated[float | None, typer.Option(help="Weights of the whole replica, GiB.")] = None,
    safetensors: Annotated[Path | None, typer.Option(help="model.safetensors.index.json or a .safetensors file: the weights' size.")] = None,
    params_b: Annotated[float | None, typer.Option(help="Parameters in billions (weights = params x the served dtype's bytes).")] = None,
    reserve_gib: Annotated[float, typer.Option(help="Memory per rank held back for activations and CUDA graphs (vLLM measures it at start-up; a few GiB on a GPU).")] = 0.0,
    block_size: Annotated[int, typer.Option(help="Tokens per block (vLLM: 16 on GPU, 128 on the CPU backend).")] = 16,
    kv_cache_dtype: Annotated[str, typer.Option(help="vLLM's --kv-cache-dtype: auto, fp8, bfloat16...")] = "auto",
    context: Annotated[str, typer.Option(help="Context lengths for the concurrent sessions, comma-separated.")] = "8192,32768",
    cpu_gib: Annotated[float | None, typer.Option(help="CPU tier per replica (vLLM --kv-offloading-size), GiB.")] = None,
    cpu_gbps: Annotated[float, typer.Option(help="CPU tier load bandwidth, GB/s.")] = 25.0,
    disk_gib: Annotated[float | None, typer.Option(help="Disk tier per replica, GiB.")] = None,
    disk_gbps: Annotated[float, typer.Option(help="Disk tier load bandwidth, GB/s.")] = 3.0,
    shared_gib: Annotated[float | None, typer.Option(help="A store shared by --shared-replicas (LMCache-like), GiB.")] = None,
    shared_replicas: Annotated[int, typer.Option(help="Replicas writing to the shared store.")] = 8,
    shared_gbps: Annotated[float, typer.Option(help="Shared store load bandwidth, GB/s.")] = 10.0,
    prefill_rate: Annotated[float | None, typer.Option(help="New prefill tokens per second per replica: how long an unused prefix survives.")] = None,
    link_gbps: Annotated[float | None, typer.Option(help="Link between replicas, GB/s: the time to move a prompt's KV (disaggregated prefill/decode).")] = None,
    list_models: Annotated[bool, typer.Option("--list", help="List the bundled models and GPUs.")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the figures here.")] = None,
) -> None:
    """Size one replica's KV cache and its tiers from the model's config.json."""
    console = Console(stderr=True)
    if list_models:
        typer.echo("models: " + ", ".join(bundled_models()))
        typer.echo("gpus:   " + ", ".join(f"{k} ({v:.1f} GiB)" for k, v in GPUS.items()))
        return
    with exit_on_router_error(console):
        try:
            contexts = [int(x) for x in context.split(",") if x.strip()]
        except ValueError as exc:
            raise ConfigError(f"--context takes comma-separated token counts, got "
                              f"{context!r}") from exc
        replica, memory = build_plan(
            model, block_size=block_size, kv_cache_dtype=kv_cache_dtype, tp=tp,
            kv_cache_gib=kv_cache_gib, gpu=gpu, gpu_memory_gib=gpu_memory_gib,
            gpu_memory_utilization=gpu_memory_utilization, weights_gib=weights_gib,
            safetensors=safetensors, params_b=params_b, reserve_gib=reserve_gib)
        specs = [(name, gib, writers, gbps) for name, gib, writers, gbps in (
            ("cpu", cpu_gib, 1, cpu_gbps), ("disk", disk_gib, 1, disk_gbps),
            ("shared", shared_gib, shared_replicas, shared_gbps)) if gib is not None]
        tiers = plan_tiers(replica, specs)
        report = plan_report(replica, tiers, contexts, prefill_rate, memory=memory,
                             link_gbps=link_gbps)
    for line in _lines(report):
        typer.echo(line)
    if json_out is not None:
        write_json_report(json_out, report, console)

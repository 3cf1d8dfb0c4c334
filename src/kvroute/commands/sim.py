"""``kvroute sim``: simulated vLLM engines without GPUs.

* ``kvroute sim serve`` runs one simulated vLLM 0.32 server (HTTP + ZMQ KV events) and prints
  one JSON line (``{"ready": true, "url": ..., "kv_events": ..., "kv_replay": ...}``) on stdout
  once it listens; logs go to stderr.
* ``kvroute sim fleet`` starts several as child processes. One pool:
  ``--replicas 2 --model m --max-model-len 4096``; several pools: repeat
  ``--pool NAME:COUNT:MODEL:MAX_MODEL_LEN[:PROFILE]``, e.g. ``--pool small:2:qwen3-8b:2048
  --pool large:2:qwen3-32b:8192``. It prints the endpoints and a ``pools:`` YAML block, and
  stops every child on Ctrl-C / SIGTERM (exit 0).
* ``kvroute sim calibrate --url http://127.0.0.1:8000`` fits a timing profile to a running
  OpenAI-compatible engine (loopback only): token-id prompts, a sweep bounded by the engine's
  ``max_model_len``, ITL from its ``vllm:inter_token_latency_seconds`` histogram, a
  relative-error fit (``sim.calibrate``).

Sim-only switches of ``serve`` (and ``fleet``): ``--fault-injection`` serves ``/sim/faults``
(``sim.server.SimFaults``); ``--kv-events-socket vllm`` binds or connects the PUB socket by
vLLM's rule instead of always binding.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import sys
import threading
from typing import Annotated

import aiohttp
import typer

from kvroute.core.errors import ConfigError, RouterError
from kvroute.engine.model import StepTiming
from kvroute.sim.answer_lengths import ANSWER_LENGTH_MODES, AnswerLengths
from kvroute.sim.calibrate import CalibrationPlan, calibrate
from kvroute.sim.launcher import ReplicaSpec, start_fleet
from kvroute.sim.profiles import profile_names
from kvroute.sim.server import SimServer, SimServerConfig, run_sim_server

HELP = "Simulated vLLM engines: serve one, start a fleet, calibrate a profile."

sim_app = typer.Typer(name="sim", help=HELP, no_args_is_help=True, add_completion=False)


@sim_app.callback()
def _sim() -> None:
    """Simulated vLLM engines: serve one, start a fleet, calibrate a profile."""


def _fail(exc: Exception) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(code=2)


@sim_app.command("serve")
def serve(
    port: Annotated[int, typer.Option(help="HTTP port (0 = a free port).")] = 8000,
    model: Annotated[str, typer.Option(help="Served model name.")] = "sim-model",
    max_model_len: Annotated[int | None, typer.Option(help="Context window (default: the profile's).")] = None,
    block_size: Annotated[int | None, typer.Option(help="KV block size in tokens.")] = None,
    num_gpu_blocks: Annotated[int | None, typer.Option(help="KV blocks (vLLM --num-gpu-blocks-override).")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="Running batch limit.")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(help="Per-step token budget.")] = None,
    profile: Annotated[str, typer.Option(help=f"Timing profile: {', '.join(profile_names())}.")] = "zero",
    kv_events: Annotated[str, typer.Option(help="KV-event PUB endpoint ('none' disables).")] = "tcp://127.0.0.1:5557",
    kv_events_socket: Annotated[str, typer.Option(help="'bind': the PUB socket always binds (free ports work); 'vllm': vLLM's rule, bind *, ::, ipc and inproc endpoints, connect to any other.")] = "bind",
    kv_replay: Annotated[str | None, typer.Option(help="Replay ROUTER endpoint.")] = None,
    kv_topic: Annotated[str, typer.Option(help="KV-event topic.")] = "kv",
    tokenizer: Annotated[str | None, typer.Option(help="Local Hugging Face tokenizer directory (needs kvroute[hf]).")] = None,
    error_style: Annotated[str, typer.Option(help="Context-error wording: vllm-0.32, vllm-0.18-0.31, sglang, llamacpp, tgi, openai, ...")] = "vllm-0.32",
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    hash_algo: Annotated[str, typer.Option(help="--prefix-caching-hash-algo.")] = "sha256",
    enable_prompt_tokens_details: Annotated[bool, typer.Option(help="Report usage.prompt_tokens_details.cached_tokens.")] = False,
    no_render: Annotated[bool, typer.Option(help="Answer the /render routes with vLLM's 403, as vLLM without --enable-scale-out.")] = False,
    eos_after: Annotated[int | None, typer.Option(help="Every request stops ('stop') after this many tokens.")] = None,
    answer_length: Annotated[str, typer.Option(help="'natural': each answer ends ('stop') at a length drawn per request (median 180 tokens, long tail; sim.answer_lengths); 'max-tokens': run to max_tokens or the window, as vLLM with ignore_eos.")] = "natural",
    answer_seed: Annotated[int, typer.Option(help="Seed of the natural answer lengths.")] = 0,
    prefix_caching: Annotated[bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching", help="vLLM's prefix caching (on by default).")] = True,
    vocab_size: Annotated[int, typer.Option(help="Built-in tokenizer vocabulary.")] = 32000,
    timing: Annotated[str | None, typer.Option(help="Override the profile's step constants: FIXED_S,PREFILL_TOKEN_S,DECODE_SEQ_S,CONTEXT_TOKEN_S.")] = None,
    root: Annotated[str | None, typer.Option(help="'root' of the /v1/models card, vLLM's model path (default: --tokenizer if given, else --model).")] = None,
    max_chars_per_token: Annotated[int | None, typer.Option(help="Factor of vLLM's character pre-check (default: the tokenizer's longest vocabulary string; none for the built-in tokenizer).")] = None,
    fault_injection: Annotated[bool, typer.Option(help="Serve POST/GET/DELETE /sim/faults (drop events, fail, stall, kill mid-stream).")] = False,
    lora_modules: Annotated[list[str] | None, typer.Option("--lora-modules", help="A LoRA adapter as vLLM's NAME=PATH (served as model NAME, hashed with its name and path); repeatable.")] = None,
    max_loras: Annotated[int, typer.Option(help="Distinct adapters one running batch holds (vLLM --max-loras).")] = 1,
    reasoning_parser: Annotated[str | None, typer.Option(help="vLLM's --reasoning-parser name: accept thinking_token_budget and report reasoning_tokens (the model thinks as long as allowed).")] = None,
    allow_runtime_lora: Annotated[bool, typer.Option(help="Serve POST /v1/load_lora_adapter (vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).")] = False,
    kv_plan: Annotated[str | None, typer.Option(help="KV blocks from `kvroute plan`: MODEL@GPU[,tp=N][,util=F][,reserve=GIB] (instead of --num-gpu-blocks).")] = None,
    cpu_offload_blocks: Annotated[int, typer.Option(help="Blocks of a CPU tier (vLLM native offloading: BlockStored with medium CPU); 0: none.")] = 0,
    cpu_load_s_per_block: Annotated[float, typer.Option(help="Seconds to load one block back from the CPU tier.")] = 0.0,
    data_parallel_size: Annotated[int, typer.Option(help="Engine ranks behind this one server (vLLM --data-parallel-size): rank r publishes on the --kv-events port + r and serves requests with X-data-parallel-rank: r.")] = 1,
    kv_transfer_s_per_token: Annotated[float, typer.Option(help="Disaggregated prefill/decode: seconds a token of KV takes to reach this engine from a prefill engine (bytes per token / link bandwidth).")] = 0.0,
) -> None:
    """Serve one simulated vLLM engine until SIGINT/SIGTERM."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        num_gpu_blocks = _plan_blocks(kv_plan, num_gpu_blocks, profile, block_size)
        step_timing = _parse_timing(timing) if timing is not None else None
        config = SimServerConfig(
            model=model, profile=profile, max_model_len=max_model_len, block_size=block_size,
            num_gpu_blocks=num_gpu_blocks, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, host=host, port=port,
            kv_events=None if kv_events.lower() == "none" else kv_events, kv_replay=kv_replay,
            kv_topic=kv_topic, tokenizer=tokenizer, vocab_size=vocab_size,
            error_style=error_style, hash_algo=hash_algo,
            enable_prompt_tokens_details=enable_prompt_tokens_details,
            render_endpoints=not no_render, eos_after_tokens=eos_after, timing=step_timing,
            answer_lengths=_answer_lengths(answer_length, answer_seed),
            enable_prefix_caching=prefix_caching,
            kv_events_socket=kv_events_socket,  # type: ignore[arg-type]  # checked by the config
            root=root, max_chars_per_token=max_chars_per_token, fault_injection=fault_injection,
            lora_modules=_parse_lora_modules(lora_modules or []), max_loras=max_loras,
            reasoning_parser=reasoning_parser, allow_runtime_lora=allow_runtime_lora,
            cpu_offload_blocks=cpu_offload_blocks, cpu_load_s_per_block=cpu_load_s_per_block,
            data_parallel_size=data_parallel_size,
            kv_transfer_s_per_token=kv_transfer_s_per_token,
        )

        def ready(server: SimServer) -> None:
            sys.stdout.write(json.dumps(server.ready_info()) + "\n")
            sys.stdout.flush()

        run_sim_server(config, on_ready=ready)
    except (RouterError, ValueError, OSError) as exc:
        raise _fail(exc) from exc


def _answer_lengths(mode: str, seed: int) -> AnswerLengths | None:
    if mode not in ANSWER_LENGTH_MODES:
        raise ConfigError(f"--answer-length must be one of {', '.join(ANSWER_LENGTH_MODES)}, "
                          f"got {mode!r}")
    return AnswerLengths(seed=seed) if mode == "natural" else None


def _parse_lora_modules(items: list[str]) -> dict[str, str]:
    """``--lora-modules NAME=PATH`` values as {name: path}, in the order given."""
    modules: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path or name in modules:
            raise ConfigError(
                f"--lora-modules takes NAME=PATH with a new name each time (vLLM's form), "
                f"got {item!r}"
            )
        modules[name] = path
    return modules


def _plan_blocks(kv_plan: str | None, num_gpu_blocks: int | None, profile: str,
                 block_size: int | None) -> int | None:
    """``--num-gpu-blocks``, or the block count ``kvroute plan`` gives for ``--kv-plan`` at
    the engine's block size (``--block-size``, else the profile's)."""
    if kv_plan is None:
        return num_gpu_blocks
    if num_gpu_blocks is not None:
        raise ConfigError("give --kv-plan or --num-gpu-blocks, not both")
    from kvroute.commands.plan import replica_from_spec
    from kvroute.sim.profiles import get_profile

    size = block_size if block_size is not None else get_profile(profile).block_size
    return replica_from_spec(kv_plan, block_size=size).num_gpu_blocks


def _parse_timing(text: str) -> StepTiming:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 4:
        raise ConfigError(
            f"--timing takes four comma-separated seconds FIXED,PREFILL_TOKEN,DECODE_SEQ,"
            f"CONTEXT_TOKEN (e.g. 0.006,4e-5,2e-5,5e-8), got {text!r}"
        )
    return StepTiming(*values)


def _parse_pool(text: str) -> tuple[str, int, str, int, str | None]:
    parts = text.split(":")
    if len(parts) not in (4, 5):
        raise typer.BadParameter(
            f"--pool takes NAME:COUNT:MODEL:MAX_MODEL_LEN[:PROFILE], got {text!r}"
        )
    try:
        count, window = int(parts[1]), int(parts[3])
    except ValueError as exc:
        raise typer.BadParameter(f"--pool {text!r}: COUNT and MAX_MODEL_LEN must be integers") from exc
    if count < 1:
        raise typer.BadParameter(f"--pool {text!r}: COUNT must be >= 1")
    return parts[0], count, parts[2], window, parts[4] if len(parts) == 5 else None


@sim_app.command("fleet")
def fleet(
    replicas: Annotated[int, typer.Option(help="Replicas of the single pool (ignored with --pool).")] = 2,
    base_port: Annotated[int, typer.Option(help="First port; replica i uses +3i (HTTP), +1 (events), +2 (replay). 0 = free ports.")] = 8100,
    model: Annotated[str, typer.Option(help="Model of the single pool.")] = "sim-model",
    max_model_len: Annotated[int | None, typer.Option(help="Window of the single pool.")] = None,
    pool: Annotated[list[str] | None, typer.Option(help="NAME:COUNT:MODEL:MAX_MODEL_LEN[:PROFILE], repeatable.")] = None,
    profile: Annotated[str, typer.Option(help="Default timing profile.")] = "zero",
    block_size: Annotated[int | None, typer.Option(help="KV block size.")] = None,
    num_gpu_blocks: Annotated[int | None, typer.Option(help="KV blocks per replica.")] = None,
    error_style: Annotated[str, typer.Option(help="Context-error wording.")] = "vllm-0.32",
    tokenizer: Annotated[str | None, typer.Option(help="Local HF tokenizer directory.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for every replica.")] = 60.0,
    kv_events_socket: Annotated[str, typer.Option(help="'bind' or 'vllm' (connect to base-port endpoints; needs --base-port > 0 and subscribers bound there).")] = "bind",
    fault_injection: Annotated[bool, typer.Option(help="Every replica serves /sim/faults.")] = False,
    answer_length: Annotated[str, typer.Option(help="'natural' (answers end like a model's) or 'max-tokens' (run to max_tokens, as vLLM with ignore_eos).")] = "natural",
    prompt_tokens_details: Annotated[bool, typer.Option(help="Engines report usage.prompt_tokens_details.cached_tokens (vLLM's --enable-prompt-tokens-details), which kvroute checks its predictions against.")] = True,
    kv_plan: Annotated[str | None, typer.Option(help="KV blocks per replica from `kvroute plan`: MODEL@GPU[,tp=N][,util=F][,reserve=GIB].")] = None,
    cpu_offload_blocks: Annotated[int, typer.Option(help="Every replica's CPU tier, blocks (medium CPU events); 0: none.")] = 0,
    cpu_load_s_per_block: Annotated[float, typer.Option(help="Seconds to load one block from the CPU tier.")] = 0.0,
    pd: Annotated[str, typer.Option(help="A disaggregated prefill/decode fleet of the single pool: counts of P (prefill), D (decode), B (both), e.g. 1P2D; the YAML gets the roles and a disaggregation section.")] = "",
    kv_transfer_s_per_token: Annotated[float, typer.Option(help="With --pd: seconds a token of KV takes from a prefill to a decode engine.")] = 131_072 / 12.5e9,
) -> None:
    """Start a fleet of simulated engines and keep it up until Ctrl-C / SIGTERM."""
    if kv_events_socket not in ("bind", "vllm"):
        raise typer.BadParameter(f"--kv-events-socket must be 'bind' or 'vllm', got {kv_events_socket!r}")
    if answer_length not in ANSWER_LENGTH_MODES:
        raise typer.BadParameter(f"--answer-length must be one of {', '.join(ANSWER_LENGTH_MODES)}, "
                                 f"got {answer_length!r}")
    try:
        num_gpu_blocks = _plan_blocks(kv_plan, num_gpu_blocks, profile, block_size)
    except RouterError as exc:
        raise _fail(exc) from exc
    tier_args: tuple[str, ...] = ()
    if cpu_offload_blocks:
        tier_args = ("--cpu-offload-blocks", str(cpu_offload_blocks),
                     "--cpu-load-s-per-block", str(cpu_load_s_per_block))
    roles: list[str] = []
    if pd:
        if pool:
            raise typer.BadParameter("--pd lays out the single pool; leave out --pool")
        for count, letter in re.findall(r"(\d+)([PDBpdb])", pd):
            roles += [{"P": "prefill", "D": "decode", "B": "both"}[letter.upper()]] * int(count)
        if not re.fullmatch(r"((\d+)[PDBpdb])+", pd) or all(r == "prefill" for r in roles):
            raise typer.BadParameter(f"--pd {pd!r}: give counts of P, D and B with at least one "
                                     "D or B, e.g. 1P2D")
        replicas = len(roles)
        tier_args += ("--kv-transfer-s-per-token", str(kv_transfer_s_per_token))
    specs: list[ReplicaSpec] = []
    common = {"block_size": block_size, "num_gpu_blocks": num_gpu_blocks,
              "extra_args": tier_args,
              "error_style": error_style, "tokenizer": tokenizer,
              "kv_events_socket": kv_events_socket, "fault_injection": fault_injection,
              "answer_length": answer_length,
              "enable_prompt_tokens_details": prompt_tokens_details}
    if pool:
        for text in pool:
            name, count, pool_model, window, pool_profile = _parse_pool(text)
            specs += [ReplicaSpec(pool=name, model=pool_model, max_model_len=window,
                                  profile=pool_profile or profile, **common)  # type: ignore[arg-type]
                      for _ in range(count)]
    else:
        if replicas < 1:
            raise typer.BadParameter("--replicas must be >= 1")
        specs = [ReplicaSpec(model=model, max_model_len=max_model_len, profile=profile,
                             **common) for _ in range(replicas)]  # type: ignore[arg-type]
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        running = start_fleet(specs, base_port=base_port, timeout_s=timeout)
    except (RouterError, OSError) as exc:
        raise _fail(exc) from exc
    try:
        for r in running.replicas:
            typer.echo(f"{r.name:<16} {r.model:<20} window={r.max_model_len:<7} {r.url}  "
                       f"events={r.kv_events}  replay={r.kv_replay}")
        typer.echo("")
        if roles:
            gbps = 131_072 / max(kv_transfer_s_per_token, 1e-15) / 1e9
            typer.echo(running.yaml(
                {r.name: role for r, role in zip(running.replicas, roles, strict=True)},
                f"{{mode: auto, link_gbps: {gbps:.6g}, kv_bytes_per_token: 131072}}"), nl=False)
        else:
            typer.echo(running.yaml(), nl=False)
        typer.echo("# Ctrl-C stops the fleet", err=True)
        while not stop.wait(0.5):
            dead = [p for p in running.processes if p.poll() is not None]
            if dead:
                typer.echo(f"error: {len(dead)} replica(s) exited; stopping the fleet", err=True)
                running.stop()
                raise typer.Exit(code=1)
    finally:
        running.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@sim_app.command("calibrate")
def calibrate_cmd(
    url: Annotated[str, typer.Option(help="Engine base URL on loopback, e.g. http://127.0.0.1:8000.")],
    model: Annotated[str | None, typer.Option(help="Model name (default: the first of /v1/models).")] = None,
    max_requests: Annotated[int, typer.Option(help="Upper bound on requests sent.")] = 200,
    timeout: Annotated[float, typer.Option(help="Upper bound on the whole run, seconds.")] = 120.0,
    max_prompt: Annotated[int | None, typer.Option(help="Longest prompt of the TTFT sweep, tokens (default: up to the engine's max_model_len).")] = None,
    decode_tokens: Annotated[int, typer.Option(help="Tokens per decode stream.")] = 32,
    weighting: Annotated[str, typer.Option(help="Least squares on 'relative' errors (default) or 'absolute' seconds.")] = "relative",
    client_itl: Annotated[bool, typer.Option(help="Measure inter-token gaps on the client even when the engine exports vllm:inter_token_latency_seconds.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON result.")] = False,
) -> None:
    """Fit StepTiming(fixed, prefill/token, decode/seq, context/token) to a running engine.

    Prompts are token ids sized in tokens; the sweep stays inside the engine's window.
    """
    lengths: tuple[int, ...] = (16, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
    if max_prompt is not None:
        lengths = tuple(n for n in lengths if n < max_prompt) + (max_prompt,)
    if weighting not in ("relative", "absolute"):
        raise _fail(ConfigError(f"--weighting must be 'relative' or 'absolute', got {weighting!r}"))
    try:
        plan = CalibrationPlan(prompt_lengths=lengths, max_requests=max_requests,
                               timeout_s=timeout, decode_tokens=decode_tokens,
                               engine_itl=not client_itl)
        result = asyncio.run(calibrate(url, model=model, plan=plan,
                                       weighting=weighting))  # type: ignore[arg-type]
    except (TimeoutError, ConfigError, OSError, aiohttp.ClientError) as exc:
        raise _fail(exc) from exc
    if json_out:
        typer.echo(json.dumps(result.as_dict()))
        return
    typer.echo(result.python())
    typer.echo(json.dumps(result.as_dict(), indent=2))
    typer.echo(f"fit ({result.weighting} errors): R^2={result.r2:.4f}  "
               f"rmse={result.rmse_s * 1e3:.3f} ms  "
               f"median relative error={result.median_rel_error:.1%}  "
               f"max relative error={result.max_rel_error:.1%}  "
               f"observations={len(result.observations)}  "
               f"http overhead={result.overhead_s * 1e3:.3f} ms")

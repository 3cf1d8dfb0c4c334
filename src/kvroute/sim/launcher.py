"""Start and stop fleets of simulated vLLM servers: subprocesses, or servers in this event loop.

Owns the child processes of a fleet (``kvroute sim serve`` each) and their lifetime: start,
wait until every child reports it is listening, hand out the endpoints, and terminate and
reap every child on exit, also when start-up fails half way. Integration tests and live
benchmarks use it; ``kvroute sim fleet`` is a thin CLI over it.

Readiness protocol: a child binds HTTP and ZMQ (port 0 means the kernel picks a free port,
so there is no race between choosing a port and binding it) and then prints exactly one JSON
line on stdout, ``SimServer.ready_info()``: ``{"ready": true, "url", "kv_events",
"kv_replay", ...}``. The launcher reads that line with a deadline. Children log to a file per
replica (kept in a temporary directory, quoted in any start-up error).

``inprocess_fleet`` runs ``SimServer`` objects in the caller's event loop instead: no process
start-up cost, for fast tests (one core shared by servers and test).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self

from kvroute.core.errors import ConfigError, RouterError
from kvroute.sim.server import SimServer, SimServerConfig

__all__ = [
    "Fleet",
    "FleetStartError",
    "ReplicaHandle",
    "ReplicaSpec",
    "inprocess_fleet",
    "read_ready_line",
    "start_fleet",
]

_CHILD_ENTRY = (
    "import sys; from kvroute.commands.sim import sim_app; "
    "sim_app(sys.argv[1:], prog_name='kvroute sim')"
)
"""Children run the ``sim`` command group directly: they do not depend on the rest of the CLI."""


class FleetStartError(RouterError):
    """A replica did not become ready (it exited, or timed out); the message quotes its log."""


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One simulated replica to start. ``None`` engine values come from the profile.

    Attributes:
        name: replica name (``<pool>-<i>`` when empty).
        pool: the pool (model tier) it belongs to, for the YAML block.
        replay: bind a replay ROUTER as well as the PUB socket.
        kv_events_socket: ``"bind"`` (default: the PUB socket binds, free ports work) or
            ``"vllm"`` (vLLM's rule: bind ``*``/``::``/ipc/inproc endpoints, otherwise
            connect). With ``"vllm"`` the replica connects to ``kv_events_endpoint``, or to
            ``tcp://<host>:<base_port + 3i + 1>``; the subscriber must bind there first.
        kv_events_endpoint: the PUB endpoint to use instead of the launcher's choice.
        root: the ``root`` of the model card (``kvroute sim serve --root``).
        fault_injection: serve ``/sim/faults`` (``SimFaults``).
        max_chars_per_token: bound for vLLM's character pre-check (``--max-chars-per-token``).
        answer_length: ``"max-tokens"`` (default here: harnesses that launch replicas give
            each request its own length) or ``"natural"`` (answers end like a model's;
            ``kvroute sim fleet``'s default), ``sim.answer_lengths``.
        extra_args: further ``kvroute sim serve`` options, passed as given.
    """

    name: str = ""
    pool: str = "default"
    model: str = "sim-model"
    max_model_len: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    profile: str = "zero"
    error_style: str = "vllm-0.32"
    tokenizer: str | None = None
    replay: bool = True
    enable_prompt_tokens_details: bool = False
    eos_after_tokens: int | None = None
    kv_events_socket: Literal["bind", "vllm"] = "bind"
    kv_events_endpoint: str | None = None
    root: str | None = None
    fault_injection: bool = False
    max_chars_per_token: int | None = None
    answer_length: str = "max-tokens"
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kv_events_socket not in ("bind", "vllm"):
            raise ConfigError(
                f"ReplicaSpec.kv_events_socket={self.kv_events_socket!r} must be 'bind' or "
                "'vllm'"
            )

    def serve_args(self, *, host: str, port: int, kv_port: int, replay_port: int) -> list[str]:
        """The ``kvroute sim`` arguments (from ``serve`` on) for this replica."""
        kv_events = self.kv_events_endpoint or f"tcp://{host}:{kv_port}"
        args = [
            "serve", "--host", host, "--port", str(port), "--model", self.model,
            "--profile", self.profile, "--error-style", self.error_style,
            "--kv-events", kv_events, "--kv-events-socket", self.kv_events_socket,
            "--answer-length", self.answer_length,
        ]  # fmt: skip
        if self.replay:
            args += ["--kv-replay", f"tcp://{host}:{replay_port}"]
        for flag, value in (
            ("--max-model-len", self.max_model_len),
            ("--block-size", self.block_size),
            ("--num-gpu-blocks", self.num_gpu_blocks),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--tokenizer", self.tokenizer),
            ("--eos-after", self.eos_after_tokens),
            ("--root", self.root),
            ("--max-chars-per-token", self.max_chars_per_token),
        ):
            if value is not None:
                args += [flag, str(value)]
        if self.enable_prompt_tokens_details:
            args.append("--enable-prompt-tokens-details")
        if self.fault_injection:
            args.append("--fault-injection")
        return args + list(self.extra_args)


@dataclass(frozen=True, slots=True)
class ReplicaHandle:
    """A running replica's coordinates.

    ``kv_events_connect`` is True when the replica's PUB socket *connects* to ``kv_events``
    (``kv_events_socket="vllm"`` with a concrete tcp endpoint): the subscriber binds there,
    which a kvroute config says with ``kv_events_bind: true``.
    """

    name: str
    pool: str
    model: str
    url: str
    kv_events: str | None
    kv_replay: str | None
    max_model_len: int
    block_size: int
    pid: int | None = None
    kv_events_connect: bool = False

    @classmethod
    def from_ready(cls, name: str, pool: str, info: dict[str, Any], pid: int | None) -> ReplicaHandle:
        return cls(name, pool, str(info["model"]), str(info["url"]), info.get("kv_events"),
                   info.get("kv_replay"), int(info["max_model_len"]), int(info["block_size"]),
                   pid, bool(info.get("kv_events_connect", False)))


def pools_yaml(replicas: Sequence[ReplicaHandle], roles: Mapping[str, str] | None = None,
               disaggregation: str | None = None) -> str:
    """A ``pools:`` and ``routes:`` block for ``kvroute serve`` (one route per pool, named
    after it), in exactly the shape ``kvroute.config`` accepts. ``roles`` (by replica name)
    and ``disaggregation`` (the pools' flow mapping) lay out a prefill/decode fleet."""
    roles = roles or {}
    lines = ["pools:"]
    seen: dict[str, list[ReplicaHandle]] = {}
    for r in replicas:
        seen.setdefault(r.pool, []).append(r)
    for pool, members in seen.items():
        first = members[0]
        lines += [
            f"  {pool}:                 # window {first.max_model_len}, block size {first.block_size}",
            f"    model: {first.model}",
        ]
        if disaggregation is not None:
            lines.append(f"    disaggregation: {disaggregation}")
        lines.append("    replicas:")
        for r in members:
            lines.append(f"      - name: {r.name}")
            lines.append(f"        url: {r.url}")
            if r.name in roles:
                lines.append(f"        role: {roles[r.name]}")
            if r.kv_events:
                lines.append(f"        kv_events: {r.kv_events}")
                if r.kv_events_connect:
                    lines.append("        kv_events_bind: true")
            if r.kv_replay:
                lines.append(f"        kv_replay: {r.kv_replay}")
    lines.append("routes:")
    for pool in seen:
        lines.append(f"  {pool}: {{pools: [{pool}]}}")
    return "\n".join(lines) + "\n"


@dataclass(slots=True)
class Fleet:
    """Running child servers. ``stop()`` (or leaving the ``with`` block) ends them all.

    Invariant: every process in ``processes`` is terminated and reaped by ``stop``.
    """

    replicas: list[ReplicaHandle] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    log_dir: Path | None = None
    _own_log_dir: bool = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def by_pool(self, pool: str) -> list[ReplicaHandle]:
        return [r for r in self.replicas if r.pool == pool]

    def yaml(self, roles: Mapping[str, str] | None = None,
             disaggregation: str | None = None) -> str:
        return pools_yaml(self.replicas, roles, disaggregation)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every child, wait up to ``timeout_s`` in total, then SIGKILL the rest."""
        for proc in self.processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.processes.clear()
        if self._own_log_dir and self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self.log_dir = None


def _log_tail(path: Path, limit: int = 2000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-limit:] or "(empty log)"


def read_ready_line(proc: subprocess.Popen[bytes], deadline: float) -> dict[str, Any] | None:
    """The child's ready line, or None if it exited or the deadline passed.

    The first JSON object with a true ``ready`` the child prints on its stdout (a pipe);
    other lines are skipped. Both ``kvroute sim serve`` and ``kvroute serve`` print one
    once they listen, so launchers of either wait with this. ``deadline`` is on
    ``time.monotonic()``. None when the child's stdout closed, it exited, or the deadline
    passed; the caller tells which from ``proc.poll()`` and the clock.
    """
    assert proc.stdout is not None
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not sel.select(min(left, 0.25)):
                if proc.poll() is not None:
                    return None
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                return None
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    info = json.loads(line)
                except ValueError:
                    continue
                if isinstance(info, dict) and info.get("ready"):
                    return info


def start_fleet(
    specs: Sequence[ReplicaSpec],
    *,
    host: str = "127.0.0.1",
    base_port: int = 0,
    timeout_s: float = 30.0,
    log_dir: str | Path | None = None,
    python: str = sys.executable,
) -> Fleet:
    """Start one ``kvroute sim serve`` child per spec and wait until all are listening.

    Ports: with ``base_port`` 0 every socket binds a free port; otherwise replica ``i`` uses
    ``base_port + 3i`` (HTTP), ``+1`` (KV events) and ``+2`` (replay).

    Args:
        specs: the replicas, in order.
        host: the loopback address to bind.
        base_port: see above.
        timeout_s: how long all replicas together may take to become ready.
        log_dir: where each child's log goes (``<name>.log``); a temporary directory,
            removed by ``stop``, when None.
        python: the interpreter to run the children with.

    Returns:
        The running fleet (a context manager that stops it).

    Raises:
        ConfigError: no specs, duplicate names, or a non-loopback host.
        FleetStartError: a replica exited or was not ready in time; every child started so
            far has been stopped.
    """
    if not specs:
        raise ConfigError("start_fleet needs at least one ReplicaSpec")
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ConfigError(f"simulated fleets bind loopback only; got host {host!r}, use 127.0.0.1")
    if base_port < 0 or base_port + 3 * len(specs) > 65536:
        raise ConfigError(f"base_port={base_port} leaves no room for {len(specs)} replicas")
    names: list[str] = []
    counters: dict[str, int] = {}
    for spec in specs:
        index = counters.get(spec.pool, 0)
        counters[spec.pool] = index + 1
        names.append(spec.name or f"{spec.pool}-{index}")
    if len(set(names)) != len(names):
        raise ConfigError(f"replica names must be unique, got {names}")
    for spec, name in zip(specs, names, strict=True):
        if spec.kv_events_socket == "vllm" and not base_port and spec.kv_events_endpoint is None:
            raise ConfigError(
                f"replica {name!r}: kv_events_socket='vllm' connects the PUB socket to a "
                "concrete endpoint, which base_port=0 cannot name; set "
                "ReplicaSpec.kv_events_endpoint to where your subscriber binds, give a "
                "base_port, or use kv_events_socket='bind'"
            )
    own = log_dir is None
    logs = Path(tempfile.mkdtemp(prefix="kvroute-fleet-")) if own else Path(str(log_dir))
    logs.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(log_dir=logs, _own_log_dir=own)
    deadline = time.monotonic() + timeout_s
    try:
        for i, (spec, name) in enumerate(zip(specs, names, strict=True)):
            port = base_port + 3 * i if base_port else 0
            args = spec.serve_args(host=host, port=port, kv_port=port + 1 if port else 0,
                                   replay_port=port + 2 if port else 0)
            with open(logs / f"{name}.log", "wb") as log_file:
                proc = subprocess.Popen(
                    [python, "-c", _CHILD_ENTRY, *args],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_file,
                )
            fleet.processes.append(proc)
        for proc, spec, name in zip(fleet.processes, specs, names, strict=True):
            info = read_ready_line(proc, deadline)
            if info is None:
                state = (f"exited with code {proc.returncode}" if proc.poll() is not None
                         else f"was not ready within {timeout_s:g} s")
                raise FleetStartError(
                    f"simulated replica {name!r} {state}; its log ends with:\n"
                    f"{_log_tail(logs / f'{name}.log')}"
                )
            fleet.replicas.append(ReplicaHandle.from_ready(name, spec.pool, info, proc.pid))
    except BaseException:
        fleet.stop()
        raise
    return fleet


@contextlib.asynccontextmanager
async def inprocess_fleet(configs: Sequence[SimServerConfig]) -> AsyncIterator[list[SimServer]]:
    """Run ``SimServer`` objects in the current event loop; stop them all on exit."""
    servers: list[SimServer] = []
    try:
        for cfg in configs:
            server = SimServer(cfg)
            await server.start()
            servers.append(server)
        yield servers
    finally:
        for server in reversed(servers):
            await server.stop()


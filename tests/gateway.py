"""Real gateways in front of kvroute for integration tests: a LiteLLM proxy subprocess, and a
kvroute router running on its own event-loop thread.

Owns two lifetimes that a test module shares across its tests:

* ``litellm_proxy(config)``: the PyPI ``litellm[proxy]`` installed by
  ``scripts/litellm/setup.sh`` (a cached venv, never the project's), started on a free
  loopback port with a generated YAML config, waited for on ``/health/liveliness`` with a
  deadline, then terminated and reaped (its whole process group) however the test ends.
* ``RouterThread``: ``RouterRuntime`` on a private event loop in a daemon thread, so a
  long-lived router can serve a separate process (LiteLLM) or a blocking client (the OpenAI
  SDK) while the test still inspects its core and session state (``call``).
* ``one_engine_router(...)``: a ``RouterThread`` in front of one fast simulated engine (pool
  ``main``), the set-up the feature suites share, each adding its own pool, route and
  top-level settings.

Why LiteLLM runs in its own venv: its ``[proxy]`` extra pins fastapi/uvicorn/pydantic and
~120 packages; letting those constrain kvroute's own dependencies would be the tail wagging
the dog. Why the environment is built from scratch rather than inherited: the proxy must not
call anything outside this machine, so every switch that keeps it offline is set here (local
cost map and other bundled data, telemetry vetoed), and HTTP(S) proxies point at a closed
loopback port so that any call we did not foresee fails fast instead of leaving the host.

When LiteLLM is not installed, ``require_litellm()`` skips with the reason setup.sh recorded
(``unavailable.txt``), or with the command that installs it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import secrets
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Self, TypeVar

import yaml  # type: ignore[import-untyped]  # types-PyYAML is not a dependency
from required import skip_unless_required

from kvroute.bench.processes import free_port
from kvroute.config import RouterConfig, parse_config
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.launcher import ReplicaSpec, start_fleet

__all__ = [
    "FAST_ENGINE_TIMING",
    "LITELLM_VERSION",
    "GatewayError",
    "LiteLLMInstall",
    "LiteLLMModel",
    "LiteLLMProxy",
    "RouterThread",
    "find_litellm",
    "free_port",
    "litellm_config",
    "litellm_proxy",
    "one_engine_router",
    "require_litellm",
]

LITELLM_VERSION: Final = "1.108.7"
"""The version scripts/litellm/setup.sh pins (the one the gateway research verified)."""

_SETUP: Final = "bash scripts/litellm/setup.sh"
_T = TypeVar("_T")


class GatewayError(RuntimeError):
    """A gateway did not start, or did not become ready in time; the message quotes its log."""


def _cache_root() -> Path:
    return Path(os.environ.get("KVROUTE_CACHE") or Path.home() / ".cache" / "kvroute")


# --------------------------------------------------------------------------------------------
# The install
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LiteLLMInstall:
    """A ready LiteLLM venv: ``litellm`` is its proxy's console script."""

    venv: Path
    version: str

    @property
    def litellm(self) -> Path:
        return self.venv / "bin" / "litellm"


def find_litellm() -> tuple[LiteLLMInstall | None, str]:
    """The cached install, or None and the reason it is not usable (for a skip message)."""
    root = _cache_root() / "litellm"
    marker = root / "unavailable.txt"
    if marker.is_file():
        return None, marker.read_text(encoding="utf-8").strip()
    venv = root / "venv"
    stamp = venv / ".kvroute-stamp"
    if not stamp.is_file() or not (venv / "bin" / "litellm").exists():
        return None, f"LiteLLM proxy not installed under {root}; run: {_SETUP}"
    want = f"litellm[proxy]=={LITELLM_VERSION}"
    got = stamp.read_text(encoding="utf-8").strip()
    if got != want and not os.environ.get("KVROUTE_LITELLM_VERSION"):
        return None, f"cached LiteLLM is {got!r}, tests pin {want!r}; re-run: {_SETUP}"
    return LiteLLMInstall(venv, got.partition("==")[2]), ""


def require_litellm() -> LiteLLMInstall:
    """The install, or skip the calling test with the recorded reason (fail under CI or
    with ``KVROUTE_REQUIRE_LITELLM=1``: ``tests/required.py``)."""
    install, reason = find_litellm()
    if install is None:
        skip_unless_required("the LiteLLM suite", reason, env="KVROUTE_REQUIRE_LITELLM")
    return install


# --------------------------------------------------------------------------------------------
# The config
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LiteLLMModel:
    """One LiteLLM model group backed by one kvroute route.

    Attributes:
        name: the name clients send to LiteLLM.
        route: the kvroute route (model name) LiteLLM sends upstream, verbatim.
        api_base: kvroute's base URL *with* ``/v1`` (LiteLLM's convention).
        max_input_tokens: LiteLLM's ``model_info.max_input_tokens`` (its pre-call check only).
    """

    name: str
    route: str
    api_base: str
    max_input_tokens: int | None = None


def litellm_config(
    models: Sequence[LiteLLMModel],
    *,
    context_window_fallbacks: Mapping[str, Sequence[str]] | None = None,
    forward_client_headers: bool = True,
    router_settings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A LiteLLM proxy config (as a dict, dumped to YAML by ``litellm_proxy``).

    Each model uses the ``hosted_vllm/`` provider, the one whose error mapping the reference
    verified (vLLM-compatible upstreams). ``num_retries: 0`` so that a test sees each upstream
    answer once; ``forward_client_headers_to_llm_api`` is what lets session headers reach
    kvroute (without it LiteLLM sends only its user-agent and the body).
    """
    model_list = []
    for m in models:
        entry: dict[str, Any] = {
            "model_name": m.name,
            "litellm_params": {"model": f"hosted_vllm/{m.route}", "api_base": m.api_base,
                               "api_key": "none"},
        }
        if m.max_input_tokens is not None:
            entry["model_info"] = {"max_input_tokens": m.max_input_tokens}
        model_list.append(entry)
    settings: dict[str, Any] = {"num_retries": 0}
    if context_window_fallbacks:
        settings["context_window_fallbacks"] = [
            {small: list(larger)} for small, larger in context_window_fallbacks.items()
        ]
    settings.update(router_settings or {})
    return {
        "model_list": model_list,
        "router_settings": settings,
        "litellm_settings": {"telemetry": False, "drop_params": False, "callbacks": [],
                             "success_callback": [], "failure_callback": []},
        "general_settings": {"forward_client_headers_to_llm_api": forward_client_headers},
    }


def _offline_env(master_key: str, extra: Mapping[str, str] | None) -> dict[str, str]:
    """The proxy's whole environment: enough to run, everything that keeps it local."""
    dead_proxy = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
        "LANG": "C.UTF-8",
        "TMPDIR": os.environ.get("TMPDIR", "/tmp"),
        "LITELLM_MASTER_KEY": master_key,
        # Bundled copies instead of fetching from GitHub at import.
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
        "LITELLM_LOCAL_AUTOROUTER_PRESETS": "True",
        "LITELLM_LOCAL_BLOG_POSTS": "True",
        "LITELLM_LOCAL_POLICY_TEMPLATES": "True",
        "LITELLM_TELEMETRY_DISABLED": "true",
        "LITELLM_DONT_SHOW_FEEDBACK_BOX": "true",
        "HF_HUB_OFFLINE": "1",
        "HTTP_PROXY": dead_proxy,
        "HTTPS_PROXY": dead_proxy,
        "http_proxy": dead_proxy,
        "https_proxy": dead_proxy,
        "NO_PROXY": "127.0.0.1,localhost,::1",
        "no_proxy": "127.0.0.1,localhost,::1",
        "PYTHONUNBUFFERED": "1",
    }
    env.update(extra or {})
    return env


# --------------------------------------------------------------------------------------------
# The proxy process
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class LiteLLMProxy:
    """A running LiteLLM proxy. ``url`` has no ``/v1``; send ``headers()`` with each call."""

    url: str
    master_key: str
    log_path: Path
    config_path: Path
    process: subprocess.Popen[bytes]
    install: LiteLLMInstall

    def headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.master_key}",
                "Content-Type": "application/json", **(extra or {})}

    def log_tail(self, limit: int = 4000) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-limit:]
        except OSError as exc:
            return f"(no log: {exc})"

    def post(self, path: str, body: Any, *, headers: Mapping[str, str] | None = None,
             timeout_s: float = 20.0) -> tuple[int, dict[str, str], bytes]:
        """POST JSON; return ``(status, lower-cased headers, raw body)``, errors included."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     method="POST", headers=self.headers(headers))
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health/liveliness", timeout=2.0) as resp:
            return bool(resp.status == 200)
    except (OSError, ValueError):
        return False


def _stop(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM the proxy's process group (it may fork workers), SIGKILL if it lingers, reap."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5.0)


@contextlib.contextmanager
def litellm_proxy(
    config: Mapping[str, Any],
    *,
    install: LiteLLMInstall | None = None,
    ready_timeout_s: float = 90.0,
    extra_env: Mapping[str, str] | None = None,
    log_dir: Path | None = None,
) -> Iterator[LiteLLMProxy]:
    """Start a LiteLLM proxy with ``config`` on a free loopback port; stop it on exit.

    Args:
        config: the proxy config (``litellm_config``).
        install: defaults to ``require_litellm()`` (skips the test when missing).
        ready_timeout_s: the deadline for ``/health/liveliness`` (start-up took 8-14 s on an
            idle machine in the reference run; a loaded 2-core CI box needs more).
        extra_env: more environment variables for the proxy.
        log_dir: where ``config.yaml`` and ``litellm.log`` go (a temporary directory kept
            while the proxy runs, by default).

    Raises:
        GatewayError: the proxy exited during start-up or was not ready in time.
    """
    install = install or require_litellm()
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="litellm-")))
        config_path = log_dir / "config.yaml"
        config_path.write_text(yaml.safe_dump(dict(config), sort_keys=False), encoding="utf-8")
        log_path = log_dir / "litellm.log"
        master_key = "sk-" + secrets.token_hex(24)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [str(install.litellm), "--config", str(config_path), "--host", "127.0.0.1",
               "--port", str(port), "--num_workers", "1"]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, cwd=log_dir,
                                    env=_offline_env(master_key, extra_env),
                                    start_new_session=True)
        stack.callback(_stop, proc)
        proxy = LiteLLMProxy(url, master_key, log_path, config_path, proc, install)
        deadline = time.monotonic() + ready_timeout_s
        while not _ready(url):
            code = proc.poll()
            if code is not None:
                raise GatewayError(f"LiteLLM proxy exited with {code} during start-up "
                                   f"({' '.join(cmd)}); log tail:\n{proxy.log_tail()}")
            if time.monotonic() > deadline:
                raise GatewayError(f"LiteLLM proxy not ready after {ready_timeout_s:.0f} s on "
                                   f"{url}; log tail:\n{proxy.log_tail()}")
            time.sleep(0.25)
        yield proxy


# --------------------------------------------------------------------------------------------
# kvroute on its own thread
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class RouterThread:
    """``RouterRuntime`` serving from a daemon thread's event loop.

    Use as a context manager. ``call(coro)`` runs a coroutine on the router's loop (the only
    thread that may touch ``runtime.core`` and ``runtime.state``) and returns its result.
    """

    config: RouterConfig
    env: Mapping[str, str] = field(default_factory=dict)
    start_timeout_s: float = 20.0
    runtime: RouterRuntime | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _stop: asyncio.Event | None = None
    _error: BaseException | None = None

    @property
    def url(self) -> str:
        assert self.runtime is not None, "RouterThread used outside its with-block"
        return self.runtime.url

    def __enter__(self) -> Self:
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(started,),
                                        name="kvroute-router", daemon=True)
        self._thread.start()
        try:
            started.result(self.start_timeout_s)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(15.0)
            if self._thread.is_alive():
                raise GatewayError("kvroute router thread did not stop within 15 s")
        if self._error is not None:
            raise GatewayError(f"kvroute router thread failed: {self._error!r}") from self._error

    def call(self, coro: Coroutine[Any, Any, _T], timeout_s: float = 10.0) -> _T:
        assert self._loop is not None, "RouterThread used outside its with-block"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _main(self, started: concurrent.futures.Future[None]) -> None:
        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            async with RouterRuntime(self.config, env=self.env) as runtime:
                self.runtime = runtime
                started.set_result(None)
                await self._stop.wait()

        try:
            asyncio.run(serve())
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread, not dropped
            if not started.done():
                started.set_exception(exc)
            else:
                self._error = exc


FAST_ENGINE_TIMING: Final = ("--timing", "0.001,0.00005,0.0002,0")
"""A simulated engine whose steps take about a millisecond: fast answers, real events."""


@contextlib.contextmanager
def one_engine_router(*, model: str = "sim-model", pool: Mapping[str, Any] | None = None,
                      routes: Mapping[str, Any] | None = None,
                      settings: Mapping[str, Any] | None = None) -> Iterator[RouterThread]:
    """``kvroute serve`` on a thread in front of one simulated engine ``s0`` in pool ``main``.

    ``pool`` adds settings to the pool, ``routes`` replaces the default one route
    (``assistant`` on ``main``), ``settings`` adds top-level config keys. The engine is
    stopped however the test ends; its start is bounded at 120 s (a deadline against a
    hang, not a speed requirement).
    """
    fleet = start_fleet([ReplicaSpec(name="s0", pool="main", model=model,
                                     extra_args=FAST_ENGINE_TIMING)], timeout_s=120.0)
    try:
        replicas = [{"name": r.name, "url": r.url, "kv_events": r.kv_events,
                     "kv_replay": r.kv_replay} for r in fleet.replicas]
        config = parse_config({
            "listen": {"host": "127.0.0.1", "port": 0},
            "pools": {"main": {"model": model, "replicas": replicas, **(pool or {})}},
            "routes": dict(routes) if routes is not None else {"assistant": {"pools": ["main"]}},
            "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 0.5,
                          "models_interval_s": 5, "timeout_s": 1.0},
            "log_level": "warning",
            **(settings or {}),
        }, env={})
        with RouterThread(config) as rt:
            yield rt
    finally:
        fleet.stop()

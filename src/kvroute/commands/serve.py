"""``kvroute serve -c kvroute.yaml``: run the router in front of a fleet of engines.

Reads and validates the config (errors name the key, the value and the fix, and exit with
status 2), starts ``shell.runtime.RouterRuntime``, prints one JSON line
``{"ready": true, "url": ...}`` on stdout once it listens (launchers and tests wait for it),
and runs until SIGINT or SIGTERM, then shuts down in order.

The event loop is asyncio's own by default. ``--loop uvloop`` (or ``auto``: uvloop when it is
installed) is there to measure, not recommended: since the router serves and forwards through
its own protocols (``http/server.py``, ``http/client.py``) the two cost the same
router CPU per request (``docs/benchmarks.md#the-event-loop-asyncio-not-uvloop``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvroute.config import load_config
from kvroute.core.errors import ConfigError
from kvroute.shell.heap import freeze_startup_heap

HELP = "Serve the OpenAI API in front of the engines of a kvroute.yaml, routing on KV cache."


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )


async def _run(config_path: Path, host: str | None, port: int | None) -> None:
    from kvroute.shell.runtime import RouterRuntime

    config = load_config(config_path)
    if host is not None or port is not None:
        listen = dataclasses.replace(
            config.listen,
            host=host if host is not None else config.listen.host,
            port=port if port is not None else config.listen.port,
        )
        config = dataclasses.replace(config, listen=listen)
    _configure_logging(config.log_level)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with RouterRuntime(config) as runtime:
        freeze_startup_heap()
        print(json.dumps({"ready": True, "url": runtime.url, "port": runtime.port}), flush=True)
        await stop.wait()


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event-loop factory for ``--loop``: uvloop's, or None for asyncio's default.

    Raises:
        ConfigError: an unknown choice, or ``uvloop`` asked for and not installed.
    """
    if choice not in ("auto", "uvloop", "asyncio"):
        raise ConfigError(f"--loop {choice!r} is not one of auto, uvloop, asyncio")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        if choice == "uvloop":
            raise ConfigError(
                "--loop uvloop needs the uvloop package: pip install uvloop "
                "(or use --loop auto/asyncio)") from exc
        return None
    return uvloop.new_event_loop


def serve(
    config: Annotated[Path, typer.Option("--config", "-c", help="The kvroute.yaml to serve.")],
    host: Annotated[Optional[str], typer.Option(help="Override listen.host.")] = None,  # noqa: UP045 (typer needs Optional)
    port: Annotated[Optional[int], typer.Option(help="Override listen.port (0 = a free port).")] = None,  # noqa: UP045
    loop: Annotated[str, typer.Option(
        help="Event loop: asyncio (default), uvloop, or auto (uvloop when installed).")] = "asyncio",
) -> None:
    """Run the router until interrupted."""
    try:
        with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
            runner.run(_run(config, host, port))
    except ConfigError as exc:
        typer.echo(f"kvroute: configuration error: {exc}", err=True)
        raise typer.Exit(code=2) from exc

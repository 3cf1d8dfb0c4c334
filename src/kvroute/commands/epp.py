"""``kvroute epp -c kvroute.yaml``: run the router as an Envoy Endpoint Picker.

The gateway (Envoy, or a Gateway with an ``InferencePool``) calls it over gRPC for every
request (``envoy.service.ext_proc.v3.ExternalProcessor`` on ``--grpc-port``, 9002 by
convention; gRPC health on ``--health-port``, 9003) and proxies to the endpoint it names.
The config's ``listen`` address serves ``/metrics``, ``/health`` and ``/admin/*`` as
``kvroute serve`` does. Prints one JSON line ``{"ready": true, ...}`` once it listens and
runs until SIGINT or SIGTERM. docs/epp.md shows an Envoy config.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvroute.commands.serve import _configure_logging, loop_factory
from kvroute.config import load_config
from kvroute.core.errors import ConfigError

HELP = "Run the router as an Envoy external processor (the Endpoint Picker protocol)."


async def _run(config_path: Path, host: str, grpc_port: int, health_port: int,
               http_port: int | None, fallbacks: int) -> None:
    try:
        from kvroute.shell.epp_runtime import EppRuntime
    except ImportError as exc:
        raise ConfigError(
            f"kvroute epp needs gRPC and Envoy's protos ({exc.name} is missing): "
            "pip install 'kvroute[epp]'") from exc
    from kvroute.wire.endpoint_picker import EndpointError

    config = load_config(config_path)
    if http_port is not None:
        config = dataclasses.replace(config,
                                     listen=dataclasses.replace(config.listen, port=http_port))
    _configure_logging(config.log_level)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        runtime = EppRuntime(config, host=host, grpc_port=grpc_port, health_port=health_port,
                             fallbacks=fallbacks)
        async with runtime:
            print(json.dumps({"ready": True, "grpc_port": runtime.grpc_port,
                              "health_port": runtime.health_port, "url": runtime.router.url}),
                  flush=True)
            await stop.wait()
    except (EndpointError, OSError) as exc:
        raise ConfigError(str(exc)) from exc


def epp(
    config: Annotated[Path, typer.Option("--config", "-c", help="The kvroute.yaml to serve.")],
    host: Annotated[str, typer.Option(help="Where the gRPC servers listen.")] = "127.0.0.1",
    grpc_port: Annotated[int, typer.Option(help="ext_proc port (0 = a free port).")] = 9002,
    health_port: Annotated[int, typer.Option(help="gRPC health port (0 = a free port).")] = 9003,
    http_port: Annotated[Optional[int], typer.Option(  # noqa: UP045 (typer needs Optional)
        help="Override listen.port: /metrics, /health, /admin (0 = a free port).")] = None,
    fallbacks: Annotated[int, typer.Option(
        help="Fallback endpoints after the chosen one, at most retries.max_retries (0 for "
             "Envoy's ORIGINAL_DST cluster, which reads one endpoint).", min=0)] = 0,
    loop: Annotated[str, typer.Option(
        help="Event loop: asyncio (default), uvloop, or auto (uvloop when installed).")] = "asyncio",
) -> None:
    """Run the picker until interrupted."""
    try:
        with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
            runner.run(_run(config, host, grpc_port, health_port, http_port, fallbacks))
    except ConfigError as exc:
        typer.echo(f"kvroute: configuration error: {exc}", err=True)
        raise typer.Exit(code=2) from exc

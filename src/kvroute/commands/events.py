"""``kvroute events``: look at an engine's KV-event stream, and relay it.

``kvroute events tail tcp://engine:5557 --topic kv --count 20`` subscribes like the router
does and prints every decoded event as one JSON object per line, so an operator can check
that an engine publishes, with which block size, medium and hashes, before routing on it.

``kvroute events relay -c kvroute.yaml`` mirrors every engine of the config into the
durable stream its ``kv_stream`` section names (``shell/kv_relay.py``), until SIGINT or
SIGTERM; it prints ``{"ready": true}`` once every replica is followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer
import zmq

from kvroute.config import load_config
from kvroute.core.errors import ConfigError, MalformedEventError
from kvroute.core.events import BlockStored, EventBatch, KVEvent
from kvroute.wire.vllm_events import decode_message

HELP = "Inspect engines' KV-cache event streams, and relay them into NATS JetStream."

_STATS_EVERY_S = 60.0
"""How often ``kvroute events relay`` logs what it relayed."""

events_app = typer.Typer(name="events", help=HELP, no_args_is_help=True, add_completion=False)


@events_app.callback()
def _events() -> None:
    """Inspect engines' KV-cache event streams."""


_ALWAYS = {"BlockStored": ("parent_block_hash", "medium"), "BlockRemoved": ("medium",)}
_JSON = msgspec.json.Encoder()


def event_record(batch: EventBatch, event: KVEvent, *, tokens: bool = False) -> dict[str, Any]:
    """The JSON object printed for one event.

    Keys: ``seq``, ``ts``, ``type``, then the event's fields that are set (``parent_block_hash``
    and ``medium`` always, since null is meaningful there), ``data_parallel_rank`` when known.
    ``token_ids`` is replaced by ``num_tokens`` unless ``tokens`` is true.
    """
    kind = type(event).__name__
    record: dict[str, Any] = {"seq": batch.seq, "ts": batch.ts, "type": kind}
    always = _ALWAYS.get(kind, ())
    for name, value in msgspec.structs.asdict(event).items():
        if name == "token_ids" and not tokens:
            continue
        if value is not None or name in always:
            record[name] = value
    if isinstance(event, BlockStored) and not tokens:
        record["num_tokens"] = len(event.token_ids)
    if batch.data_parallel_rank is not None:
        record["data_parallel_rank"] = batch.data_parallel_rank
    return record


@events_app.command("tail")
def tail(
    endpoint: Annotated[
        str, typer.Argument(help="The engine's PUB endpoint, e.g. tcp://127.0.0.1:5557.")
    ],
    topic: Annotated[str, typer.Option(help="Topic prefix to subscribe to ('' = all).")] = "",
    count: Annotated[int | None, typer.Option(min=1, help="Exit after this many events.")] = None,
    timeout: Annotated[
        float | None, typer.Option(min=0.0, help="Exit after this many seconds.")
    ] = None,
    tokens: Annotated[bool, typer.Option(help="Print token_ids instead of num_tokens.")] = False,
) -> None:
    """Print each KV event of ENDPOINT as one JSON line until COUNT events or TIMEOUT seconds."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    printed = 0
    try:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        try:
            sub.connect(endpoint)
        except zmq.ZMQError as exc:
            raise typer.BadParameter(
                f"cannot connect to {endpoint!r} ({exc}); expected an endpoint such as "
                "tcp://127.0.0.1:5557 or ipc:///tmp/kv.sock",
                param_hint="ENDPOINT",
            ) from exc
        deadline = None if timeout is None else time.monotonic() + timeout
        while count is None or printed < count:
            wait_ms = 200 if deadline is None else (deadline - time.monotonic()) * 1000
            if wait_ms <= 0:
                break
            if not sub.poll(int(min(wait_ms, 200)) + 1):
                continue
            frames = sub.recv_multipart()
            try:
                batch = decode_message(frames)
            except MalformedEventError as exc:
                typer.echo(f"malformed message skipped: {exc}", err=True)
                continue
            for event in batch.events:
                typer.echo(_JSON.encode(event_record(batch, event, tokens=tokens)).decode())
                printed += 1
                if count is not None and printed >= count:
                    break
    except KeyboardInterrupt:
        pass
    finally:
        sub.close(linger=0)
        ctx.term()
    if count is not None and printed < count:
        typer.echo(f"timed out after {timeout}s with {printed} of {count} events", err=True)


async def _relay(config_path: Path) -> None:
    from kvroute.shell.kv_relay import StandaloneRelay

    config = load_config(config_path)
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log = logging.getLogger("kvroute.relay")
    async with StandaloneRelay(config) as relay:
        print(json.dumps({"ready": True, "replicas": sorted(relay.subscribers)}), flush=True)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_STATS_EVERY_S):
                    await stop.wait()
            if relay.relay is not None:  # what the relay did so far, for the operator
                stats = relay.relay.stats
                log.info("relayed %d batches (%d resets), %d publishes failed, %d dropped, "
                         "%d snapshots written (%d failed); last batch per replica: %s",
                         stats.published, stats.resets, stats.failed, stats.dropped,
                         stats.snapshots, stats.snapshot_failures, stats.last_seq)


@events_app.command("relay")
def relay(
    config: Annotated[Path, typer.Option(
        "--config", "-c", help="The kvroute.yaml whose engines and kv_stream to use.")],
) -> None:
    """Mirror the engines' KV events into the durable NATS JetStream stream until stopped."""
    try:
        asyncio.run(_relay(config))
    except ConfigError as exc:
        typer.echo(f"kvroute: configuration error: {exc}", err=True)
        raise typer.Exit(code=2) from exc

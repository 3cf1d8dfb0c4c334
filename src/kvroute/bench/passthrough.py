"""A bare pass-through proxy: the floor any Python router's overhead is measured against.

``python -m kvroute.bench.passthrough --port P --upstream URL [--upstream URL ...]``

What it does, and no more: an aiohttp server that sends each POST to the next upstream in
turn (round robin) through one shared keep-alive ``ClientSession``, relays the body bytes
unparsed, returns a whole response whole and relays an event stream chunk by chunk;
``GET /health`` answers 200. ``TCP_NODELAY`` is on for both sides (aiohttp's default). No
routing, no tokenization, no metrics: the cheapest a Python relay can be, so
``kvroute bench overhead`` runs it beside kvroute and the two are compared in one run
(docs/benchmarks.md, "Router overhead: the verdict").

Loopback only: it binds 127.0.0.1 and refuses non-loopback upstreams.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

__all__ = ["build_app", "main"]

_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                         "content-encoding"})


def build_app(upstreams: Sequence[str]) -> web.Application:
    """The relay over ``upstreams`` (base URLs)."""
    cycle = itertools.cycle([u.rstrip("/") for u in upstreams])
    app = web.Application(client_max_size=64 * 1024 * 1024)
    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def start(app: web.Application) -> None:
        app[session_key] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=300))

    async def stop(app: web.Application) -> None:
        await app[session_key].close()

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        url = next(cycle) + request.path_qs
        async with app[session_key].post(
                url, data=body, headers={"Content-Type": "application/json"}) as up:
            headers = {k: v for k, v in up.headers.items() if k.lower() not in _HOP_BY_HOP}
            if not up.headers.get("Content-Type", "").startswith("text/event-stream"):
                return web.Response(status=up.status, body=await up.read(), headers=headers)
            response = web.StreamResponse(status=up.status, headers=headers)
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/health", health)
    app.router.add_post("/{path:.*}", relay)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvroute.bench.passthrough",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", action="append", required=True,
                        help="an engine's base URL (repeat for each)")
    args = parser.parse_args(argv)
    for url in args.upstream:
        host = urlsplit(url).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            parser.error(f"--upstream {url!r} is not a loopback address; this relay only "
                         "serves benchmarks on 127.0.0.1")
    web.run_app(build_app(args.upstream), host="127.0.0.1", port=args.port, print=None,
                handle_signals=True, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

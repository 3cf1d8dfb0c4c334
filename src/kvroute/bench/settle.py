"""Bringing a kvroute router under test to its steady state before a benchmark measures it.

Owns the wait for a router's KV-event catch-up. A kvroute router that starts beside engines
that have served earlier routers catches up on their KV-event buffers: each replica's
subscriber replays the engine's last batches (vLLM keeps 10,000) when its first message
arrives (``shell/zmq_events.py``, Replays). That is start-up work, not a cost per request, so
a benchmark of what the router adds per request waits it out:

* ``settle_kvroute`` sends every engine one request of text no engine has seen, so each
  stores blocks and publishes an event and every subscriber has had its first message (a
  catch-up that has not started yet would otherwise start inside the measurement);
* then it polls the router's ``/metrics`` until every replica has applied a batch and none
  is replaying (``caught_up``: ``kvroute_kv_event_batches_applied_total`` and
  ``kvroute_kv_event_replaying``), at most ``CATCH_UP_S``.

Bounds: one request per engine (each bounded by the request timeout), and a poll every
0.2 s for at most ``CATCH_UP_S`` seconds. Loopback only (the fleet's and the router's URLs).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, Final

from kvroute.bench.live_client import LiveRequest, replay
from kvroute.bench.live_routers import http_text
from kvroute.sim.launcher import ReplicaHandle
from kvroute.wire.prom import wanted_samples

__all__ = ["CATCH_UP_S", "caught_up", "event_primers", "settle_kvroute"]

CATCH_UP_S: Final = 60.0
"""Longest wait for a router's KV-event catch-up to end."""


def caught_up(exposition: str, replicas: Sequence[str]) -> bool:
    """Whether a kvroute router's ``/metrics`` show every replica's KV events flowing (a
    batch applied) and no replay under way (its catch-up done)."""
    samples, _ = wanted_samples(exposition, ("kvroute_kv_event_batches_applied_total",
                                             "kvroute_kv_event_replaying"))
    applied: dict[str, float] = {}
    replaying = 0.0
    for sample in samples:
        replica = sample.labels.get("replica", "")
        if sample.name == "kvroute_kv_event_batches_applied_total":
            applied[replica] = sample.value
        elif sample.name == "kvroute_kv_event_replaying":
            replaying += sample.value
    return replaying == 0 and all(applied.get(r, 0) > 0 for r in replicas)


def event_primers(engines: int, tag: str, model: str) -> list[LiveRequest]:
    """One request per engine (the client sends request *i* to engine *i* mod ``engines``)
    whose prompt no engine has seen (``tag`` makes it unique to the caller), so each engine
    stores blocks and publishes an event."""
    out = []
    for i in range(engines):
        text = " ".join(f"prime {tag} engine {i} word {w}" for w in range(24))
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}],
                           "max_tokens": 1, "stream": False}).encode()
        out.append(LiveRequest(f"prime-{tag}-{i}", 0.0, body, len(text) // 4, 1, stream=False))
    return out


def wait_caught_up(metrics_url: str, replicas: Sequence[str],
                   timeout_s: float = CATCH_UP_S) -> tuple[float, bool]:
    """Poll ``caught_up`` until true or ``timeout_s``; returns (seconds waited, caught up)."""
    began = time.monotonic()
    while True:
        if caught_up(http_text(metrics_url, timeout_s=5.0), replicas):
            return time.monotonic() - began, True
        if time.monotonic() - began >= timeout_s:
            return time.monotonic() - began, False
        time.sleep(0.2)


def settle_kvroute(metrics_url: str, engines: Sequence[ReplicaHandle], tag: str, *,
                   model: str, request_timeout_s: float) -> dict[str, Any]:
    """Prime every engine's event stream, then wait out the router's catch-up.

    Returns the fields a benchmark row records: ``catch_up_wait_s`` (seconds waited after
    the primers) and ``caught_up`` (False when ``CATCH_UP_S`` ran out first).
    """
    replay([e.url for e in engines], event_primers(len(engines), tag, model),
           concurrency=len(engines), request_timeout_s=request_timeout_s,
           duration_s=request_timeout_s)
    waited, done = wait_caught_up(metrics_url, [e.name for e in engines])
    return {"catch_up_wait_s": round(waited, 2), "caught_up": done}

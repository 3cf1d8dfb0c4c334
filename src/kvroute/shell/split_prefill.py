"""A split request's prefill half: the first of disaggregation's two steps, sent live.

In a pool with ``disaggregation:`` the walk may split a request (``core/disagg.py``): its
prompt is prefilled on a prefill replica and decoded on a decode replica, which pulls the
KV from the first. vLLM's protocol for that (docs/disaggregation.md, "The two-step
protocol"; the bodies and answers are ``wire/disagg.py``'s) takes two requests:

1. the prompt with ``max_tokens: 1`` and ``kv_transfer_params`` asking for a remote decode
   goes to the prefill replica, which answers with the ``kv_transfer_params`` the decode
   replica needs (where the blocks are);
2. the client's own request goes to the decode replica with those parameters added
   (``shell/forward.py`` sends it like any other attempt).

This module sends step 1 and reads its answer. Success is told to the walk
(``prefill_answered``); a failure is the walk's to handle (``prefill_failed``: the request
is colocated on its decode replica, no retry spent), with the replica's error counted. It
stands apart from the driver because only a split uses it: ``shell/forward.py`` stays the
walk's driver, and the protocol's extra step lives in one place beside its explanation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvroute.core.router import RoutingDecision
from kvroute.core.walk import RequestWalk, WalkAction
from kvroute.shell.metrics import RouterMetrics
from kvroute.shell.proxy import Upstream, UpstreamError
from kvroute.wire.disagg import TransferParamsError, prefill_body, transfer_params

__all__ = ["send_prefill"]


async def send_prefill(walk: RequestWalk, decision: RoutingDecision, body: Mapping[str, Any],
                       *, url: str | None, model: str, headers: Mapping[str, str],
                       upstream: Upstream,
                       metrics: RouterMetrics) -> Mapping[str, Any] | WalkAction:
    """Send split ``decision``'s prefill half; its answer's ``kv_transfer_params``, or the
    walk's next action when it failed (the request is then colocated).

    Args:
        walk: the request's walk (told the prefill's outcome).
        decision: a split decision (``prefill_replica`` set).
        body: the client's parsed body (``wire/disagg.prefill_body`` derives step 1's).
        url: the prefill replica's URL for the request's endpoint (None: it left the pool).
        model: the model name the prefill replica serves the request under (the pool's, or
            the request's LoRA adapter).
        headers: the prefill request's headers (its request id, the replica's DP rank).
        upstream: the engine client.
        metrics: where a failure of the prefill replica is counted.
    """
    prefill = decision.prefill_replica
    assert prefill is not None, "send_prefill() is for a split decision"
    if url is None:
        return walk.prefill_failed("connect", detail=f"replica {prefill} left the pool")
    step_one = prefill_body(body, model=model, cache_salt=decision.request.cache_salt)
    try:
        reply = await upstream.open(url, step_one, stream=False, headers=headers)
    except UpstreamError as exc:
        metrics.upstream_error(prefill, exc.kind)
        return walk.prefill_failed(exc.kind, unreachable=exc.connect_failed, detail=str(exc))
    try:
        params = transfer_params(reply.body)
    except TransferParamsError as exc:
        metrics.upstream_error(prefill, "protocol")
        return walk.prefill_failed("protocol", detail=str(exc))
    walk.prefill_answered()
    return params

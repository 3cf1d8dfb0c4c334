"""The real-time stepping loop around one ``EngineModel``: the simulated engine core's clock.

Owns the engine model, the per-request output streams, the KV-event publication and the
latency histograms of one simulated engine. ``sim/server.py`` submits requests and reads
streams; nothing else touches the engine.

Theory of operation (one asyncio task, ``run``):

1. Sleep until there is work (a submit or an abort sets ``_wake``).
2. ``step()`` the model. The model returns the step's modelled duration *d*.
3. Sleep until ``t0 + d`` (absolute deadline, so scheduling overshoot does not accumulate
   inside one step). With ``d == 0`` (the ``zero`` profile) yield once to the event loop, so
   HTTP handlers run between steps and the loop cannot starve them.
4. Publish the step's KV events as one batch (only if there are any, as vLLM does), then hand
   each request its outputs. This is the order vLLM's ``update_from_output`` observes: a
   client never sees a token before the events of the step that produced it were queued.

Requests that arrive during the sleep of step *k* are scheduled by step *k+1*, as in vLLM's
busy loop. Output delivery is per step: every token of a step reaches its stream at once.

Why the model is stepped from the event loop and not a thread: the model is pure Python and
fast (a step of 256 decodes is well under a millisecond); a thread would add locking around
every submit and abort for no gain under the GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvroute.core.events import KVEvent
from kvroute.engine.model import (
    Accepted,
    EngineModel,
    EngineRequest,
    Rejection,
    RequestOutput,
)
from kvroute.wire.prom import EngineStats

__all__ = ["EngineDriver", "RequestStream", "Submitted"]

log = logging.getLogger(__name__)

_IDLE_EMPTY_STEP_S = 0.005
"""How long to wait after a step that scheduled nothing although work is queued."""


class RequestStream:
    """The outputs of one client request (``n`` engine requests, one per choice).

    Invariants: items are ``(choice index, RequestOutput)`` in step order; ``done`` becomes
    True once every choice has finished (or was aborted), after which ``get`` drains what is
    left and then returns an empty list.
    """

    __slots__ = ("_items", "_remaining", "_waiter", "arrival_s", "engine_ids")

    def __init__(self, engine_ids: Sequence[str], arrival_s: float) -> None:
        self.engine_ids = tuple(engine_ids)
        self.arrival_s = arrival_s
        self._items: deque[tuple[int, RequestOutput]] = deque()
        self._remaining = len(engine_ids)
        self._waiter: asyncio.Future[None] | None = None

    @property
    def done(self) -> bool:
        return self._remaining == 0

    def _push(self, index: int, out: RequestOutput) -> None:
        self._items.append((index, out))
        if out.finished:
            self._remaining -= 1
        self._wake()

    def _close(self) -> None:
        self._remaining = 0
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> list[tuple[int, RequestOutput]]:
        """Wait for the next outputs; an empty list means the stream has ended."""
        while not self._items:
            if self._remaining == 0:
                return []
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        return items


@dataclass(frozen=True, slots=True)
class Submitted:
    """An accepted submission: the admissions (one per choice) and the stream to read."""

    admissions: tuple[Accepted, ...]
    stream: RequestStream


class _Track:
    __slots__ = ("index", "last_token_s", "stream")

    def __init__(self, stream: RequestStream, index: int) -> None:
        self.stream = stream
        self.index = index
        self.last_token_s: float | None = None


class EngineDriver:
    """Steps one ``EngineModel`` in real time and routes its outputs to request streams.

    Args:
        engine: the model (owned by the driver from now on).
        publish: called with each non-empty step's events, e.g. ``KVEventPublisher.publish``;
            None drops them.
        clock: monotonic seconds (``time.monotonic`` in production; injectable for tests).
        sleep_scale: multiplies every modelled step duration (1.0 = real time).
        on_step_late: called after every step with how long after its modelled end (its
            start plus its modelled duration: with the ``zero`` profile, its start) the loop
            ran again: the simulator's own overrun (computing the step, and whatever held
            the process meanwhile), e.g. ``EngineStalls.step_lateness.observe``
            (``sim/stalls.py``).
    """

    def __init__(
        self,
        engine: EngineModel,
        *,
        publish: Callable[[Sequence[KVEvent]], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep_scale: float = 1.0,
        on_step_late: Callable[[float], None] | None = None,
    ) -> None:
        self.engine = engine
        self._publish = publish
        self._clock = clock
        self._sleep_scale = sleep_scale
        self._on_step_late = on_step_late
        self._tracks: dict[str, _Track] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.stats = EngineStats()
        self.num_steps = 0
        self.busy_s = 0.0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> asyncio.Task[None]:
        """Start the stepping task on the running loop."""
        if self._task is not None:
            raise RuntimeError("EngineDriver.start() was already called")
        self._task = asyncio.get_running_loop().create_task(self.run(), name="engine-driver")
        return self._task

    async def stop(self) -> None:
        """Cancel the stepping task and end every open stream."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for track in self._tracks.values():
            track.stream._close()
        self._tracks.clear()

    # ------------------------------------------------------------------ requests

    def submit(self, requests: Sequence[EngineRequest]) -> Submitted | Rejection:
        """Admit every request of one client request (the ``n`` choices), or none.

        Returns:
            ``Submitted`` with the stream, or the first ``Rejection`` (nothing is admitted).

        Raises:
            EngineInputError: as ``EngineModel.add_request`` (duplicate id, bad token ids).
        """
        engine = self.engine
        admitted: list[Accepted] = []
        for req in requests:
            result = engine.add_request(req)
            if isinstance(result, Rejection):
                for done in admitted:
                    engine.abort_request(done.request_id)
                return result
            admitted.append(result)
        stream = RequestStream([r.request_id for r in requests], self._clock())
        for i, req in enumerate(requests):
            self._tracks[req.request_id] = _Track(stream, i)
        self._wake.set()
        return Submitted(tuple(admitted), stream)

    def abort(self, stream: RequestStream) -> None:
        """Abort whatever of ``stream`` is still live in the engine (client went away)."""
        for rid in stream.engine_ids:
            if self._tracks.pop(rid, None) is not None:
                self.engine.abort_request(rid)
        stream._close()
        self._wake.set()

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``; publishes ``AllBlocksCleared`` at once on success."""
        ok = self.engine.reset_prefix_cache()
        if ok:
            events = self.engine.take_events()
            if events and self._publish is not None:
                self._publish(events)
        return ok

    @property
    def num_live(self) -> int:
        """Engine requests not yet finished."""
        return len(self._tracks)

    def snapshot(self) -> EngineStats:
        """``EngineStats`` for ``/metrics``: the engine's counters plus the histograms."""
        m = self.engine.metrics()
        s = self.stats
        s.num_requests_running = m.num_requests_running
        s.num_requests_waiting = m.num_requests_waiting
        s.kv_cache_usage_perc = m.kv_cache_usage_perc
        s.prefix_cache_queries = m.prefix_cache_queries_total
        s.prefix_cache_hits = m.prefix_cache_hits_total
        s.num_preemptions = m.num_preemptions_total
        s.prompt_tokens = m.prompt_tokens_total
        s.generation_tokens = m.generation_tokens_total
        s.request_success = dict(m.request_success_total)
        return s

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """The stepping loop (see the module docstring). Runs until cancelled."""
        engine = self.engine
        clock = self._clock
        wake = self._wake
        scale = self._sleep_scale
        while True:
            if not engine.has_work():
                wake.clear()
                await wake.wait()
                continue
            t0 = clock()
            result = engine.step()
            self.num_steps += 1
            duration = result.duration_s * scale
            due = t0 + duration
            if duration > 0.0:
                self.busy_s += duration
                await asyncio.sleep(max(0.0, due - clock()))
            elif result.num_scheduled_reqs == 0 and not result.events:
                # Work is queued but nothing could be scheduled: wait for a change.
                wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), _IDLE_EMPTY_STEP_S)
                continue
            else:
                await asyncio.sleep(0)
            if self._on_step_late is not None:
                self._on_step_late(max(0.0, clock() - due))
            if result.events and self._publish is not None:
                self._publish(result.events)
            if result.outputs:
                self._deliver(result.outputs, clock())

    def _deliver(self, outputs: Sequence[RequestOutput], now: float) -> None:
        tracks = self._tracks
        stats = self.stats
        for out in outputs:
            track = tracks.get(out.request_id)
            if track is None:  # aborted while its step was running
                continue
            stream = track.stream
            if out.first_token:
                stats.time_to_first_token_seconds.observe(now - stream.arrival_s)
                stats.prompt_tokens_cached += out.num_cached_tokens
            elif track.last_token_s is not None:
                stats.inter_token_latency_seconds.observe(now - track.last_token_s)
            track.last_token_s = now
            if out.finished:
                del tracks[out.request_id]
                stats.e2e_request_latency_seconds.observe(now - stream.arrival_s)
            stream._push(track.index, out)

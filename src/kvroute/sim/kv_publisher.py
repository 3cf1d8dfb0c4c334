"""A KV-event publisher that behaves like vLLM's ``ZmqEventPublisher``.

Owns one PUB socket, one replay ROUTER socket, a bounded replay buffer and the thread that
drives them. It is the engine side of the event stream for the simulated engines
(``sim/server.py``) and the test double for ``shell/zmq_events.py``.

What is reproduced from vLLM (``vllm/distributed/kv_events.py``, 0.32/0.33):

* the PUB socket is bound (``set_hwm(hwm)``), and every batch is one 3-frame message
  ``[topic, seq8, payload]`` with ``seq`` counting from 0 per publisher;
* the payload bytes come from ``wire.vllm_events.encode_payload`` (byte-identical to vLLM);
  ``data_parallel_rank`` is filled in, as vLLM's ``publish`` does;
* the replay ROUTER answers a request ``[identity, b"", seq8]`` (exactly 3 frames, anything
  else is logged as ``Invalid replay request`` and gets no answer) with
  ``[identity, b"", topic, seq8, payload]`` for every buffered batch with ``seq >= start``,
  in order, then ``[identity, b"", b"", ff*8, b""]``;
* the buffer is ``deque(maxlen=buffer_steps)`` of the exact published bytes; the ROUTER's
  send HWM is ``2 * (buffer_steps + 1)`` as in 0.33;
* ``publish`` puts onto a ``Queue(maxsize=max_queue_size)`` (blocking when full) and one
  background thread sends, so callers never touch a socket.

Threading: ``publish`` is thread-safe and does not block unless the queue is full, so it
may be called from an asyncio event loop, from a simulator thread, or from several threads.
The sockets belong to the background thread alone (ZMQ sockets are not thread-safe).

One addition for fault injection: ``publish(..., skip_send=True)`` assigns a sequence number
and buffers the batch for replay but does not send it on the PUB socket, which is exactly
what a subscriber sees when a message is lost. Tests and the simulator use it to make gaps
deterministically.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Literal, Self

import zmq

from kvroute.core.errors import MalformedEventError
from kvroute.core.events import EventBatch, KVEvent
from kvroute.wire.vllm_events import (
    decode_replay_request,
    encode_payload,
    encode_replay_end,
    encode_seq,
)

__all__ = ["KVEventPublisher"]

log = logging.getLogger(__name__)

_POLL_SECONDS = 0.01
"""How long the thread waits for a batch before looking at the replay socket again."""


def vllm_pub_binds(endpoint: str) -> bool:
    """Whether vLLM's publisher binds (True) or connects (False) its PUB socket at ``endpoint``."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith(("ipc://", "inproc://"))
    )


class _Stop:
    pass


_STOP = _Stop()


class KVEventPublisher:
    """PUB + replay ROUTER for one engine (one data-parallel rank).

    Invariants: sequence numbers are assigned in ``publish`` under a lock, together with the
    enqueue, so the wire order equals the sequence order; the replay buffer holds the last
    ``buffer_steps`` batches (sent or skipped) as ``(seq, payload bytes)``.

    Args:
        endpoint: where the PUB socket binds (or connects, see ``socket_mode``);
            ``tcp://127.0.0.1:0`` picks a free port.
        replay_endpoint: where the replay ROUTER binds; None disables replay (vLLM's default).
        topic: the topic frame (vLLM's default is ``""``; its examples use ``"kv"``).
        buffer_steps: replay buffer length in batches (vLLM default 10 000).
        hwm: PUB send high-water mark (vLLM default 100 000).
        max_queue_size: bound of the publish queue (vLLM default 100 000).
        data_parallel_rank: written into every batch (vLLM always writes it).
        form: ``"map"`` (current vLLM) or ``"array"`` (older vLLM) event encoding.
        socket_mode: ``"bind"`` always binds the PUB socket (test-friendly: free ports work);
            ``"vllm"`` follows vLLM's ``ZmqEventPublisher`` exactly: bind when the endpoint
            contains ``*`` or ``::`` or is ``ipc://``/``inproc://``, otherwise *connect* — so
            an engine given ``tcp://127.0.0.1:5601`` connects to a subscriber that binds
            there. The replay ROUTER always binds, as in vLLM.
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        *,
        replay_endpoint: str | None = "tcp://127.0.0.1:0",
        topic: str = "kv",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        data_parallel_rank: int | None = 0,
        form: Literal["map", "array"] = "map",
        socket_mode: Literal["bind", "vllm"] = "bind",
    ) -> None:
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
        if form not in ("map", "array"):
            raise ValueError(f"form must be 'map' or 'array', got {form!r}")
        if socket_mode not in ("bind", "vllm"):
            raise ValueError(f"socket_mode must be 'bind' or 'vllm', got {socket_mode!r}")
        self._endpoint_arg = endpoint
        self._pub_binds = socket_mode == "bind" or vllm_pub_binds(endpoint)
        self._replay_endpoint_arg = replay_endpoint
        self._topic = topic
        self._topic_bytes = topic.encode("utf-8")
        self._buffer_steps = buffer_steps
        self._hwm = hwm
        self._rank = data_parallel_rank
        self._form: Literal["map", "array"] = form
        self._queue: queue.Queue[tuple[int, bytes, bool] | _Stop] = queue.Queue(max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._done = threading.Condition()
        self._handled = -1  # highest seq the thread has sent (or buffered, if skipped)
        self._assigned = -1  # highest seq handed out by publish()
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._endpoint: str | None = None
        self._replay_endpoint: str | None = None
        self._closed = False
        self.invalid_replay_requests = 0
        """Replay requests rejected as malformed (vLLM only logs them)."""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Bind both sockets and start the sending thread. Endpoints are known on return."""
        if self._thread is not None or self._closed:
            raise RuntimeError("a KVEventPublisher can be started once")
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        replay: zmq.Socket[bytes] | None = None
        try:
            pub.setsockopt(zmq.LINGER, 0)
            pub.set_hwm(self._hwm)
            if self._pub_binds:
                pub.bind(self._endpoint_arg)
                self._endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(self._endpoint_arg)
                self._endpoint = self._endpoint_arg
            if self._replay_endpoint_arg is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.setsockopt(zmq.SNDHWM, 2 * (self._buffer_steps + 1))
                replay.bind(self._replay_endpoint_arg)
                self._replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            ctx.term()
            raise
        self._ctx, self._pub, self._replay = ctx, pub, replay
        self._thread = threading.Thread(target=self._run, name="kv-publisher", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, stop the thread, close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is not None:
            self._queue.put(_STOP)
            thread.join(timeout)
            if thread.is_alive():
                raise RuntimeError(f"kv-publisher thread did not stop within {timeout}s")
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ properties

    @property
    def endpoint(self) -> str:
        """The PUB socket's resolved endpoint (``tcp://127.0.0.1:<port>``), after ``start``."""
        if self._endpoint is None:
            raise RuntimeError("the publisher is not started")
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The replay ROUTER's resolved endpoint, or None when replay is disabled."""
        if self._thread is None:
            raise RuntimeError("the publisher is not started")
        return self._replay_endpoint

    @property
    def topic(self) -> str:
        return self._topic

    @property
    def buffer_steps(self) -> int:
        return self._buffer_steps

    # ------------------------------------------------------------------ publishing

    def publish(
        self, events: Sequence[KVEvent], ts: float | None = None, *, skip_send: bool = False
    ) -> int:
        """Queue one batch for sending and return its sequence number.

        Args:
            events: the engine step's events, in order (vLLM never publishes an empty batch,
                but an empty one is legal on the wire and is sent as such).
            ts: batch timestamp (seconds since the epoch); the wall clock when None.
            skip_send: buffer for replay but do not send (fault injection, see module doc).

        Raises:
            RuntimeError: the publisher is not started or is closed.
        """
        if self._thread is None or self._closed:
            raise RuntimeError("publish() needs a started, open KVEventPublisher")
        stamp = time.time() if ts is None else ts
        with self._lock:
            seq = next(self._seq)
            self._assigned = seq
            payload = encode_payload(
                EventBatch(seq, stamp, tuple(events), self._rank), form=self._form
            )
            self._queue.put((seq, payload, not skip_send))
        return seq

    def wait_sent(self, timeout: float = 5.0) -> None:
        """Block until everything published so far has been handed to ZMQ (tests, shutdown)."""
        target = self._assigned
        with self._done:
            if not self._done.wait_for(lambda: self._handled >= target, timeout):
                raise TimeoutError(f"queued batches were not sent within {timeout}s")

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        pub, replay = self._pub, self._replay
        assert pub is not None
        seq_frame = encode_seq
        while True:
            if replay is not None:
                self._service_replay(replay)
            try:
                item = self._queue.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                continue
            if isinstance(item, _Stop):
                return
            seq, payload, send = item
            if send:
                pub.send_multipart((self._topic_bytes, seq_frame(seq), payload))
            self._buffer.append((seq, payload))
            with self._done:
                self._handled = seq
                self._done.notify_all()

    def _service_replay(self, replay: zmq.Socket[bytes]) -> None:
        while replay.poll(0):
            frames = replay.recv_multipart()
            try:
                start = decode_replay_request(frames)
            except MalformedEventError as exc:
                self.invalid_replay_requests += 1
                log.warning("Invalid replay request: %s", exc)
                continue
            identity = frames[0]
            for seq, payload in self._buffer:
                if seq >= start:
                    replay.send_multipart(
                        (identity, b"", self._topic_bytes, encode_seq(seq), payload)
                    )
            replay.send_multipart((identity, *encode_replay_end()))

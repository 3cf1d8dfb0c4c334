"""kvroute as an Envoy external processor: the Endpoint Picker protocol over gRPC.

Owns the gRPC side of ``kvroute epp``: the ``envoy.service.ext_proc.v3.ExternalProcessor``
service (one bidirectional stream per HTTP request), the gRPC health service on its own port,
and the mapping between protobuf messages and the plain values ``shell/picker.py`` works on.
Every decision is the picker's (and so the walk's); the protocol's names and value formats
are ``wire/endpoint_picker.py``'s.

One stream, in the order Envoy sends it (processing mode: headers SEND, bodies
``FULL_DUPLEX_STREAMED``, trailers SEND, as the protocol asks):

* request headers: kept (and the gateway's candidate subset, from the stream's metadata);
  nothing is answered yet, Envoy streams the body on;
* request body: gathered up to its end of stream, then :meth:`Picker.pick`, and either an
  ``ImmediateResponse`` (a 4xx, 503 or 429 in OpenAI's error shape) or, in this order, a
  ``HeadersResponse`` (the destination header, ``content-length`` when the body changed,
  ``clear_route_cache``) with the ``envoy.lb`` dynamic metadata, then the body, streamed
  back in pieces of at most 64 KiB, then (when the request had trailers) a
  ``TrailersResponse``;
* response headers: the endpoint that served it (``envoy.lb`` metadata), its status, and
  the routing headers ``kvroute serve`` adds (``x-kvroute-replica`` ...);
* response body: every piece echoed back unchanged as it comes (tokens stream through) and
  watched for ``finish_reason`` and ``usage``; at its end the walk ends.

A gateway whose filter says ``BUFFERED`` for the request body (Envoy states its modes in the
stream's first message) gets its headers answered at once and everything else on the one
body answer; any other response body mode is answered without mutation. A request body mode
that would send the headers on before the body (``STREAMED``, ``NONE``) is refused with a
500 that says how to configure the filter.

A stream that ends before the answer does (the client gone, the engine's answer broken
off: Envoy closes the exchange either way) ends the walk as ``gateway_closed``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, Final

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvroute.shell.picker import Picked, PickedWalk, Picker, Refused
from kvroute.wire import endpoint_picker as epp
from kvroute.wire.openai import error_body

__all__ = ["HEALTH_SERVICES", "EppServer", "ExternalProcessor"]

log = logging.getLogger("kvroute.epp")

SERVICE_NAME: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
_READINESS: Final = ("", "readiness", SERVICE_NAME)
HEALTH_SERVICES: Final = ("liveness", *_READINESS)
"""The gRPC health services answered, as the protocol names them ("" is the server's):
``liveness`` serves while the process runs, the others while it takes requests."""

_OVERWRITE: Final = base_pb2.HeaderValueOption.HeaderAppendAction.Value(
    "OVERWRITE_IF_EXISTS_OR_ADD")
_MODES: Final = processing_mode_pb2.ProcessingMode.BodySendMode
_BUFFERED: Final = _MODES.Value("BUFFERED")
_DUPLEX: Final = _MODES.Value("FULL_DUPLEX_STREAMED")


def _headers_of(message: Any) -> dict[str, str]:
    """An ``HttpHeaders`` message as a dict, names lower-cased (the first of repeats)."""
    out: dict[str, str] = {}
    for header in message.headers.headers:
        value = header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        out.setdefault(header.key.lower(), value)
    return out


def _metadata_of(request: Any) -> dict[str, Any]:
    """The stream's ``metadata_context.filter_metadata`` as plain mappings (most messages
    carry none: the conversion is skipped then)."""
    if not request.HasField("metadata_context"):
        return {}
    return {name: json_format.MessageToDict(value)
            for name, value in request.metadata_context.filter_metadata.items()}


def _mutation(headers: Mapping[str, str], remove: tuple[str, ...] = ()) -> Any:
    return ep.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                                   append_action=_OVERWRITE)
        for k, v in headers.items()], remove_headers=list(remove))


def _immediate(refused: Refused) -> Any:
    headers = {"content-type": "application/json", **refused.headers}
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=refused.status), headers=_mutation(headers),
        body=refused.body, details=f"kvroute_refused_{refused.status}"))


def _destination(picked: Picked, *, buffered: bool) -> Iterator[Any]:
    """The answers for a picked request: the destination header (and ``content-length``,
    ``x-request-id``), the ``envoy.lb`` metadata and the body. Streamed (``FULL_DUPLEX_
    STREAMED``): a headers answer, then the body in pieces. ``BUFFERED``: the headers have
    been answered already, so all of it rides on the one body answer."""
    value = epp.destination_value(picked.endpoints)
    set_headers = {**picked.set_headers, epp.DESTINATION: value}
    if picked.body_changed:
        set_headers["content-length"] = str(len(picked.body))
    metadata = struct_pb2.Struct()
    metadata.update({epp.DESTINATION_NAMESPACE: {epp.DESTINATION: value}})
    mutation = _mutation(set_headers, picked.remove_headers)
    if buffered:
        yield ep.ProcessingResponse(
            request_body=ep.BodyResponse(response=ep.CommonResponse(
                header_mutation=mutation, body_mutation=ep.BodyMutation(body=picked.body),
                clear_route_cache=True)),
            dynamic_metadata=metadata)
        return
    yield ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(response=ep.CommonResponse(
            header_mutation=mutation, clear_route_cache=True)),
        dynamic_metadata=metadata)


def _body_pieces(body: bytes, *, end: bool, response: bool) -> Iterator[Any]:
    """``body`` as streamed body answers (``FULL_DUPLEX_STREAMED``), the last one carrying
    ``end`` as its end of stream."""
    pieces = list(epp.body_chunks(body))
    for i, piece in enumerate(pieces):
        streamed = ep.StreamedBodyResponse(body=piece, end_of_stream=end and i == len(pieces) - 1)
        common = ep.CommonResponse(body_mutation=ep.BodyMutation(streamed_response=streamed))
        yield _body_answer(common, response)


def _body_answer(common: Any, response: bool) -> Any:
    if response:
        return ep.ProcessingResponse(response_body=ep.BodyResponse(response=common))
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))


class _Stream:
    """One ext_proc stream: one HTTP request and its answer (module docstring)."""

    __slots__ = ("_body", "_body_size", "_headers", "_picker", "_request_mode",
                 "_response_mode", "_subset", "answered", "walk")

    def __init__(self, picker: Picker) -> None:
        self._picker = picker
        self._headers: dict[str, str] = {}
        self._subset: frozenset[str] | None = None
        self._body: list[bytes] = []
        self._body_size = 0  # pieces past the router's max_body_bytes are counted, not kept
        # Envoy states its modes in the stream's first message; the protocol's are assumed.
        self._request_mode = _DUPLEX
        self._response_mode = _DUPLEX
        self.answered = False  # the destination has been answered
        self.walk: PickedWalk | None = None

    async def on(self, request: Any) -> list[Any]:
        """The answers to one message from Envoy (possibly none yet)."""
        kind = request.WhichOneof("request")
        if request.HasField("protocol_config"):
            config = request.protocol_config
            self._request_mode = config.request_body_mode
            self._response_mode = config.response_body_mode
        if kind == "request_headers":
            self._headers = _headers_of(request.request_headers)
            try:
                self._subset = epp.subset_hint(_metadata_of(request))
            except epp.EndpointError as exc:
                return [_immediate(_refusal(400, f"The gateway's endpoint subset is malformed: "
                                                 f"{exc}."))]
            if request.request_headers.end_of_stream:
                return await self._pick(b"", trailers=False)
            if self._request_mode == _BUFFERED:  # the body follows once the head is answered
                return [ep.ProcessingResponse(request_headers=ep.HeadersResponse())]
            if self._request_mode != _DUPLEX:
                name = _MODES.Name(self._request_mode)
                return [_immediate(_refusal(500, (
                    f"kvroute epp needs the whole request body before the headers go on, and "
                    f"this gateway sends it with request_body_mode {name}; configure the "
                    "ext_proc filter with request_body_mode FULL_DUPLEX_STREAMED (with "
                    "request_trailer_mode SEND) or BUFFERED.")))]
            return []
        if kind == "request_body":
            body = request.request_body
            self._body_size += len(body.body)
            if self._body_size <= self._picker.config.max_body_bytes:
                self._body.append(body.body)
            if not body.end_of_stream:
                return []
            return await self._pick(b"".join(self._body), trailers=False)
        if kind == "request_trailers":
            out = [] if self.answered else await self._pick(b"".join(self._body), trailers=True)
            if out and out[0].HasField("immediate_response"):
                return out
            return [*out, ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
        if kind == "response_headers":
            return [self._response_headers(request)]
        if kind == "response_body":
            body = request.response_body
            self._watch(body.body, body.end_of_stream)
            if self._response_mode == _DUPLEX:
                return list(_body_pieces(body.body, end=body.end_of_stream, response=True))
            # Other modes: the body goes on as it is (no mutation).
            return [ep.ProcessingResponse(response_body=ep.BodyResponse())]
        if kind == "response_trailers":
            self._watch(b"", True)
            return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        raise ValueError(f"ext_proc message of unknown kind {kind!r}")

    async def _pick(self, body: bytes, *, trailers: bool) -> list[Any]:
        self.answered = True
        headers = self._headers
        outcome = await self._picker.pick(headers.get(":path", ""), headers, body, self._subset,
                                          body_size=self._body_size)
        if isinstance(outcome, Refused):
            return [_immediate(outcome)]
        self.walk = outcome.walk
        if self._request_mode == _BUFFERED:
            return list(_destination(outcome, buffered=True))
        return [*_destination(outcome, buffered=False),
                *_body_pieces(outcome.body, end=not trailers, response=False)]

    def _response_headers(self, request: Any) -> Any:
        added: Mapping[str, str] = {}
        walk = self.walk
        if walk is not None:
            headers = _headers_of(request.response_headers)
            status_text = headers.get(":status", "0")
            status = int(status_text) if status_text.isdigit() else 0
            served = epp.served_endpoint(_metadata_of(request), headers)
            try:
                added = walk.response_headers(status, served, headers.get("content-type", ""))
                if request.response_headers.end_of_stream:
                    walk.finish()
            except Exception:  # noqa: BLE001 - logged in _lost; the answer flows on
                self._lost(walk)
        # The served endpoint, when Envoy reported it as a header, is for kvroute only.
        return ep.ProcessingResponse(response_headers=ep.HeadersResponse(
            response=ep.CommonResponse(header_mutation=_mutation(added, (epp.SERVED,)))))

    def _watch(self, piece: bytes, end: bool) -> None:
        """Feed a piece of the answer to the walk (and end it at the answer's end)."""
        walk = self.walk
        if walk is None:
            return
        try:
            walk.response_body(piece)
            if end:
                walk.finish()
        except Exception:  # noqa: BLE001 - logged in _lost; the answer flows on
            self._lost(walk)

    def _lost(self, walk: PickedWalk) -> None:
        """A bug on the answer's path: the answer still flows; the walk is closed."""
        log.exception("kvroute epp: following request %s's answer failed; the answer is "
                      "relayed, its accounting closed", walk.ex.walk.request.request_id)
        self.walk = None
        try:
            walk.finish("picker_error")
        except Exception:  # logged; the stream goes on
            log.exception("kvroute epp: closing request %s's walk failed too",
                          walk.ex.walk.request.request_id)

    def close(self) -> None:
        """The stream is over. A walk whose answer has not ended ends here as
        ``gateway_closed``: Envoy closes the exchange (cleanly) when the client leaves, and
        when the engine's answer breaks off."""
        if self.walk is not None:
            self.walk.finish("gateway_closed")  # a no-op when the answer's end finished it


def _refusal(status: int, message: str) -> Refused:
    return Refused(status, error_body(message, status=status))


class ExternalProcessor:
    """The ``ExternalProcessor`` gRPC service (its one method, ``Process``)."""

    def __init__(self, picker: Picker) -> None:
        self._picker = picker

    async def Process(self, requests: AsyncIterator[Any],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        stream = _Stream(self._picker)
        try:
            async for request in requests:
                for answer in await stream.on(request):
                    yield answer
        finally:
            stream.close()


def _listen(server: grpc.aio.Server, host: str, port: int, what: str, option: str) -> int:
    """Bind ``server`` to ``host:port``; the bound port.

    Raises:
        OSError: the address is taken or cannot be bound (gRPC says so as a RuntimeError
            or a port of 0, depending on its version).
    """
    try:
        bound = int(server.add_insecure_port(f"{host}:{port}"))
    except RuntimeError as exc:
        raise OSError(f"kvroute epp cannot listen for {what} on {host}:{port} ({exc}); "
                      f"choose another {option}") from exc
    if not bound:
        raise OSError(f"kvroute epp cannot listen for {what} on {host}:{port}; "
                      f"choose another {option}")
    return bound


class EppServer:
    """The picker's gRPC servers: ext_proc on one port, health on another.

    ``start`` binds both (port 0: a free one) and returns the bound ports; health answers
    ``NOT_SERVING`` for readiness and the ext_proc service until ``set_ready(True)``.
    """

    def __init__(self, picker: Picker) -> None:
        self._picker = picker
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()

    async def start(self, host: str, port: int, health_port: int) -> tuple[int, int]:
        """Listen; returns (ext_proc port, health port)."""
        server = grpc.aio.server()
        ep_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(self._picker), server)
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, health_server)
        bound = _listen(server, host, port, "ext_proc", "--grpc-port")
        health_bound = _listen(health_server, host, health_port, "gRPC health", "--health-port")
        self._server, self._health_server = server, health_server
        await server.start()
        await health_server.start()
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self.set_ready(False)
        return bound, health_bound

    async def set_ready(self, ready: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if ready
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in _READINESS:
            await self.health.set(service, status)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop answering health, let streams in flight end (``grace_s``), close both."""
        await self.set_ready(False)
        for server in (self._server, self._health_server):
            if server is not None:
                await server.stop(grace_s)
        self._server = self._health_server = None

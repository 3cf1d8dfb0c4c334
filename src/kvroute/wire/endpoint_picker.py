"""The Endpoint Picker protocol's names and values, as plain Python (no gRPC, no protobuf).

The Gateway API Inference Extension's Endpoint Picker (EPP) protocol rides on Envoy's
external processor: the gateway asks the picker where each request goes, the picker answers
with ``ip:port`` endpoints in a header and in dynamic metadata, and the gateway reports back
which one served it. This module owns the protocol's vocabulary and the small parsers and
renderers around it; ``shell/epp_server.py`` moves them in and out of protobuf messages and
``shell/picker.py`` drives the request walk with them. docs/epp.md describes the exchange.

Pure: no I/O, no protobuf; metadata arrives here as the plain mappings that
``google.protobuf.Struct`` converts to.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

__all__ = [
    "DESTINATION",
    "DESTINATION_NAMESPACE",
    "DROPPED_REASON",
    "DROPPED_REASONS",
    "SERVED",
    "SUBSET",
    "SUBSET_NAMESPACE",
    "EndpointError",
    "body_chunks",
    "destination_value",
    "endpoint_of_url",
    "fairness_id",
    "header_value",
    "model_rewrite",
    "objective",
    "parse_endpoints",
    "served_endpoint",
    "subset_hint",
]

DESTINATION: Final = "x-gateway-destination-endpoint"
"""The header (and metadata key) naming the chosen endpoint, then its ordered fallbacks."""
DESTINATION_NAMESPACE: Final = "envoy.lb"
"""The dynamic-metadata namespace of the destination, and of the served endpoint."""
SERVED: Final = "x-gateway-destination-endpoint-served"
"""The metadata key under which the gateway reports the endpoint that served the request."""
SUBSET_NAMESPACE: Final = "envoy.lb.subset_hint"
SUBSET: Final = "x-gateway-destination-endpoint-subset"
"""The gateway's candidate subset: the picker must choose among these endpoints only."""
DROPPED_REASON: Final = "x-llm-d-request-dropped-reason"
"""The header llm-d's picker adds to a 429 (why the request was shed)."""
DROPPED_REASONS: Final[Mapping[str, str]] = {
    "queue_full": "rejected-saturated", "queue_timeout": "rejected-ttl-expired"}
"""kvroute's admission refusals in llm-d's words for ``DROPPED_REASON`` (a full wait queue is
saturation; a wait past ``queue_timeout_s`` is an expired TTL)."""

# Request headers a gateway may send, each under its current name (``x-llm-d-*``) first and
# its older ``x-gateway-*`` alias second (llm-d renamed them; both are read).
_OBJECTIVE: Final = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
_FAIRNESS: Final = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
_MODEL_REWRITE: Final = ("x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite")

MAX_CHUNK_BYTES: Final = 64 * 1024
"""The largest body piece sent back in one streamed body message."""


class EndpointError(ValueError):
    """An endpoint that is not ``ip:port`` (or a replica URL that cannot give one)."""


def header_value(headers: Mapping[str, str], names: Sequence[str]) -> str | None:
    """The first of ``names`` present in ``headers`` (lower-cased names), else None."""
    for name in names:
        value = headers.get(name)
        if value is not None:
            return value
    return None


def objective(headers: Mapping[str, str]) -> str | None:
    """The request's inference objective (``x-llm-d-inference-objective`` or its alias)."""
    return header_value(headers, _OBJECTIVE)


def fairness_id(headers: Mapping[str, str]) -> str | None:
    """The request's fairness id (``x-llm-d-inference-fairness-id`` or its alias)."""
    return header_value(headers, _FAIRNESS)


def model_rewrite(headers: Mapping[str, str]) -> str | None:
    """The model name the gateway rewrote the request to (``x-llm-d-model-name-rewrite`` or
    its alias); empty values count as absent."""
    value = header_value(headers, _MODEL_REWRITE)
    return value.strip() or None if value is not None else None


def _check_endpoint(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EndpointError(f"endpoint {text!r} is not ip:port (for example 10.0.0.7:8000)")
    return text


def parse_endpoints(value: Any) -> tuple[str, ...]:
    """Endpoints from a header or metadata value: ``"ip:port"``, ``"ip:port,ip:port"``, or a
    list of such strings (the subset hint may be either). Blank entries are skipped.

    Raises:
        EndpointError: an entry that is not ``ip:port``, or a value of another type.
    """
    if isinstance(value, str):
        parts: list[Any] = value.split(",")
    elif isinstance(value, list | tuple):
        parts = list(value)
    else:
        raise EndpointError(
            f"endpoint list {value!r} is neither a string nor a list of ip:port strings")
    out: list[str] = []
    for part in parts:
        if not isinstance(part, str):
            raise EndpointError(f"endpoint {part!r} is not a string (ip:port)")
        part = part.strip()
        if part:
            out.append(_check_endpoint(part))
    return tuple(out)


def subset_hint(filter_metadata: Mapping[str, Any]) -> frozenset[str] | None:
    """The gateway's candidate subset, or None when it sent none (every endpoint may be
    chosen). An empty set means none may: the picker answers 503.

    Raises:
        EndpointError: the subset is malformed.
    """
    namespace = filter_metadata.get(SUBSET_NAMESPACE)
    if not isinstance(namespace, Mapping) or SUBSET not in namespace:
        return None
    return frozenset(parse_endpoints(namespace[SUBSET]))


def served_endpoint(filter_metadata: Mapping[str, Any],
                    headers: Mapping[str, str] | None = None) -> str | None:
    """The endpoint the gateway reports as having served the request: from the ``envoy.lb``
    metadata as the protocol says, else from a response header of the same name (what a
    plain Envoy can add with ``%UPSTREAM_REMOTE_ADDRESS%``); the first, should it send a
    list; None when it reported none (or nothing readable)."""
    value: Any = None
    namespace = filter_metadata.get(DESTINATION_NAMESPACE)
    if isinstance(namespace, Mapping):
        value = namespace.get(SERVED)
    if value is None and headers is not None:
        value = headers.get(SERVED)
    if value is None:
        return None
    try:
        endpoints = parse_endpoints(value)
    except EndpointError:
        return None
    return endpoints[0] if endpoints else None


def destination_value(endpoints: Sequence[str]) -> str:
    """The destination header's (and metadata's) value: the chosen endpoint first, then the
    fallbacks in the order to try them, comma-separated."""
    if not endpoints:
        raise EndpointError("a destination needs at least one endpoint")
    return ",".join(endpoints)


def endpoint_of_url(url: str) -> str:
    """``ip:port`` of a replica's base URL (``http://10.0.0.7:8000`` → ``10.0.0.7:8000``).

    Raises:
        EndpointError: the URL has no explicit port, or its host is a name rather than an IP
            address (gateways connect to the address as given: ``ORIGINAL_DST`` resolves
            nothing).
    """
    _, sep, rest = url.partition("://")
    authority = (rest if sep else url).split("/", 1)[0].rsplit("@", 1)[-1]
    if authority.startswith("["):  # [v6]:port
        host, _, port_text = authority[1:].partition("]")
        port_text = port_text.removeprefix(":")
    else:
        host, _, port_text = authority.rpartition(":")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise EndpointError(
            f"replica URL {url!r} has no host:port; give it as http://<ip>:<port>")
    port = int(port_text)
    if not _is_ip(host):
        raise EndpointError(
            f"replica URL {url!r} names host {host!r}; the Endpoint Picker protocol sends "
            "ip:port, so give the replica's IP address (for example http://10.0.0.7:8000)")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_ip(host: str) -> bool:
    if ":" in host:  # IPv6 literal (urlsplit strips the brackets)
        return all(c in "0123456789abcdefABCDEF:." for c in host)
    parts = host.split(".")
    return len(parts) == 4 and all(p.isdigit() and int(p) < 256 for p in parts)


def body_chunks(body: bytes, size: int = MAX_CHUNK_BYTES) -> Iterator[bytes]:
    """``body`` in pieces of at most ``size`` bytes (one empty piece for an empty body, so
    the end of stream is always sent)."""
    if not body:
        yield b""
        return
    for start in range(0, len(body), size):
        yield body[start : start + size]

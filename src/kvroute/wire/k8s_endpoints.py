"""Kubernetes EndpointSlices -> engine endpoints, and the difference between two endpoint sets.

Pure: reads the JSON objects of the ``discovery.k8s.io/v1`` API (``EndpointSliceList`` and
the ``{"type": ..., "object": ...}`` events of a watch) and returns plain values; the HTTP
list/watch lives in ``shell/k8s_watch.py``.

An engine is one *endpoint* of a slice: its first address, the slice's port named
``http_port`` (its OpenAI-compatible server) and, when named, the port ``kv_events_port`` (its
ZMQ KV-event publisher). It is named after the pod it targets (``targetRef.name``), so a pod
keeps its name across slices and restarts of the router. Only endpoints the API marks
``ready`` (absent counts as ready, as the API reference says) and not ``terminating`` are
engines: a pod that is scaling in leaves the set before it stops answering.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EndpointDiff", "EngineEndpoint", "K8sFormatError", "PortNames", "WatchEvent",
    "diff_endpoints", "merge_slices", "parse_slice_list", "parse_watch_event", "slice_endpoints",
]


class K8sFormatError(ValueError):
    """An API object is not shaped as the Kubernetes API reference says."""


@dataclass(frozen=True, slots=True)
class PortNames:
    """The names of the EndpointSlice ports to read (the Service's ``ports[].name``)."""

    http: str = "http"
    kv_events: str | None = "kv-events"


@dataclass(frozen=True, slots=True)
class EngineEndpoint:
    """One engine found in the API: ``name`` (its pod), ``url`` and its KV-event endpoint."""

    name: str
    url: str
    kv_events: str | None = None


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One event of a watch stream.

    Attributes:
        kind: ``ADDED``, ``MODIFIED``, ``DELETED``, ``BOOKMARK`` or ``ERROR``.
        slice_name: the EndpointSlice's ``metadata.name`` (empty for ``ERROR``).
        resource_version: the object's ``metadata.resourceVersion`` (to resume the watch).
        endpoints: the engines of the slice (empty for ``DELETED``, ``BOOKMARK``, ``ERROR``).
        error_code: for ``ERROR``, the ``Status`` object's ``code`` (410: resource version
            too old, relist).
        error_message: for ``ERROR``, the ``Status`` message.
    """

    kind: str
    slice_name: str
    resource_version: str
    endpoints: tuple[EngineEndpoint, ...] = ()
    error_code: int | None = None
    error_message: str = ""


@dataclass(frozen=True, slots=True)
class EndpointDiff:
    """What changed between two endpoint sets, each sorted by name."""

    added: tuple[EngineEndpoint, ...]
    removed: tuple[EngineEndpoint, ...]
    changed: tuple[EngineEndpoint, ...]  # same name, new address or ports (the new value)

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed)


_WATCH_KINDS = frozenset({"ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"})


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise K8sFormatError(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def _url_host(address: str, address_type: str) -> str:
    return f"[{address}]" if address_type == "IPv6" else address


def slice_endpoints(obj: Any, ports: PortNames) -> tuple[str, tuple[EngineEndpoint, ...]]:
    """The slice's name and its ready engines, sorted by name.

    Raises:
        K8sFormatError: the object is not an EndpointSlice, or an endpoint has no address.
    """
    s = _mapping(obj, "EndpointSlice")
    meta = _mapping(s.get("metadata"), "EndpointSlice.metadata")
    name = str(meta.get("name", ""))
    address_type = str(s.get("addressType", "IPv4"))
    if address_type == "FQDN":
        raise K8sFormatError(
            f"EndpointSlice {name!r} has addressType FQDN; select IPv4 or IPv6 slices "
            "(kvroute connects to pod addresses)")
    by_name = {str(p.get("name", "")): p for p in s.get("ports") or ()}
    http = by_name.get(ports.http)
    if http is None or http.get("port") is None:
        # A slice without the named port (another Service's port set): no engines in it.
        return name, ()
    kv = by_name.get(ports.kv_events) if ports.kv_events is not None else None
    found: list[EngineEndpoint] = []
    for i, ep in enumerate(s.get("endpoints") or ()):
        ep = _mapping(ep, f"EndpointSlice {name!r}.endpoints[{i}]")
        cond = ep.get("conditions") or {}
        if cond.get("ready") is False or cond.get("terminating") is True:
            continue
        addresses = ep.get("addresses") or ()
        if not addresses:
            raise K8sFormatError(f"EndpointSlice {name!r}.endpoints[{i}] has no addresses")
        host = _url_host(str(addresses[0]), address_type)
        ref = ep.get("targetRef") or {}
        engine = str(ref.get("name") or ep.get("hostname") or addresses[0])
        kv_events = f"tcp://{host}:{int(kv['port'])}" if kv and kv.get("port") else None
        found.append(EngineEndpoint(name=engine, url=f"http://{host}:{int(http['port'])}",
                                    kv_events=kv_events))
    return name, tuple(sorted(found, key=lambda e: e.name))


def parse_slice_list(body: Any, ports: PortNames) -> tuple[str, dict[str, tuple[EngineEndpoint, ...]]]:
    """An ``EndpointSliceList``: its ``metadata.resourceVersion`` and engines by slice name."""
    lst = _mapping(body, "EndpointSliceList")
    if lst.get("kind") not in (None, "EndpointSliceList"):
        raise K8sFormatError(f"expected an EndpointSliceList, got kind {lst.get('kind')!r}")
    version = str(_mapping(lst.get("metadata"), "EndpointSliceList.metadata")
                  .get("resourceVersion", ""))
    slices: dict[str, tuple[EngineEndpoint, ...]] = {}
    for item in lst.get("items") or ():
        name, eps = slice_endpoints(item, ports)
        slices[name] = eps
    return version, slices


def parse_watch_event(body: Any, ports: PortNames) -> WatchEvent:
    """One line of a watch stream (``{"type": ..., "object": ...}``)."""
    ev = _mapping(body, "watch event")
    kind = ev.get("type")
    if kind not in _WATCH_KINDS:
        raise K8sFormatError(f"watch event type {kind!r} is not one of {sorted(_WATCH_KINDS)}")
    obj = _mapping(ev.get("object"), f"{kind} event object")
    if kind == "ERROR":
        code = obj.get("code")
        return WatchEvent(kind=kind, slice_name="", resource_version="",
                          error_code=int(code) if code is not None else None,
                          error_message=str(obj.get("message", "")))
    meta = _mapping(obj.get("metadata"), f"{kind} event object.metadata")
    version = str(meta.get("resourceVersion", ""))
    if kind == "BOOKMARK":
        return WatchEvent(kind=kind, slice_name="", resource_version=version)
    name, eps = slice_endpoints(obj, ports)
    return WatchEvent(kind=kind, slice_name=name, resource_version=version,
                      endpoints=() if kind == "DELETED" else eps)


def merge_slices(slices: Mapping[str, Iterable[EngineEndpoint]]) -> dict[str, EngineEndpoint]:
    """The engines of every slice by name (a pod briefly in two slices counts once)."""
    merged: dict[str, EngineEndpoint] = {}
    for name in sorted(slices):
        for ep in slices[name]:
            merged.setdefault(ep.name, ep)
    return merged


def diff_endpoints(old: Mapping[str, EngineEndpoint],
                   new: Mapping[str, EngineEndpoint]) -> EndpointDiff:
    """What to add, remove and re-point to go from ``old`` to ``new`` (both keyed by name)."""
    return EndpointDiff(
        added=tuple(new[n] for n in sorted(new.keys() - old.keys())),
        removed=tuple(old[n] for n in sorted(old.keys() - new.keys())),
        changed=tuple(new[n] for n in sorted(new.keys() & old.keys()) if new[n] != old[n]),
    )

"""EndpointSlices -> engines, on the recorded API objects of ``tests/data/k8s/``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.wire.k8s_endpoints import (
    EngineEndpoint,
    K8sFormatError,
    PortNames,
    diff_endpoints,
    merge_slices,
    parse_slice_list,
    parse_watch_event,
    slice_endpoints,
)

DATA = Path(__file__).resolve().parents[2] / "data" / "k8s"
PORTS = PortNames()


def _events(name: str) -> list[object]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line]


def test_list_maps_ready_endpoints_to_engines_named_after_their_pods() -> None:
    version, slices = parse_slice_list(json.loads((DATA / "list_initial.json").read_text()), PORTS)
    assert version == "48211"
    assert slices == {"vllm-x7k2p": (
        EngineEndpoint("vllm-7d9f8c6b5-abcde", "http://10.244.1.7:8000", "tcp://10.244.1.7:5557"),
        EngineEndpoint("vllm-7d9f8c6b5-fghij", "http://10.244.2.9:8000", "tcp://10.244.2.9:5557"),
    )}


def test_watch_events_follow_scale_out_and_scale_in() -> None:
    _, slices = parse_slice_list(json.loads((DATA / "list_initial.json").read_text()), PORTS)
    seen = [merge_slices(slices)]
    for body in _events("watch_scale.jsonl"):
        ev = parse_watch_event(body, PORTS)
        if ev.kind in ("ADDED", "MODIFIED"):
            slices[ev.slice_name] = ev.endpoints
        seen.append(merge_slices(slices))
    names = [sorted(s) for s in seen]
    # The new pod is not an engine until ready; the terminating one leaves at once.
    assert names[1] == names[0]
    assert names[2] == [*names[0], "vllm-7d9f8c6b5-klmno"]
    assert names[4] == ["vllm-7d9f8c6b5-abcde", "vllm-7d9f8c6b5-klmno"]
    bookmark = parse_watch_event(_events("watch_scale.jsonl")[2], PORTS)
    assert (bookmark.kind, bookmark.resource_version, bookmark.endpoints) == ("BOOKMARK", "48250", ())


def test_gone_is_an_error_event_with_code_410() -> None:
    ev = parse_watch_event(_events("watch_gone.jsonl")[0], PORTS)
    assert (ev.kind, ev.error_code) == ("ERROR", 410)
    assert "too old resource version" in ev.error_message


def test_diff_says_added_removed_and_repointed() -> None:
    a = EngineEndpoint("a", "http://10.0.0.1:8000")
    b = EngineEndpoint("b", "http://10.0.0.2:8000")
    b2 = EngineEndpoint("b", "http://10.0.0.9:8000")
    c = EngineEndpoint("c", "http://10.0.0.3:8000")
    diff = diff_endpoints({"a": a, "b": b}, {"b": b2, "c": c})
    assert (diff.added, diff.removed, diff.changed) == ((c,), (a,), (b2,))
    assert diff_endpoints({"a": a}, {"a": a}).empty


def test_port_names_select_the_ports_and_ipv6_is_bracketed() -> None:
    obj = {"metadata": {"name": "s"}, "addressType": "IPv6",
           "endpoints": [{"addresses": ["fd00::7"], "targetRef": {"kind": "Pod", "name": "p"}}],
           "ports": [{"name": "api", "port": 9000}]}
    assert slice_endpoints(obj, PortNames(http="api", kv_events=None)) == (
        "s", (EngineEndpoint("p", "http://[fd00::7]:9000", None),))
    # No port of that name: the slice holds no engines.
    assert slice_endpoints(obj, PORTS) == ("s", ())


def test_malformed_objects_say_what_is_wrong() -> None:
    with pytest.raises(K8sFormatError, match="FQDN"):
        slice_endpoints({"metadata": {"name": "s"}, "addressType": "FQDN"}, PORTS)
    with pytest.raises(K8sFormatError, match="no addresses"):
        slice_endpoints({"metadata": {"name": "s"}, "endpoints": [{"addresses": []}],
                         "ports": [{"name": "http", "port": 1}]}, PORTS)
    with pytest.raises(K8sFormatError, match="not one of"):
        parse_watch_event({"type": "SYNC", "object": {}}, PORTS)
    with pytest.raises(K8sFormatError, match="EndpointSliceList"):
        parse_slice_list({"kind": "PodList", "metadata": {}}, PORTS)

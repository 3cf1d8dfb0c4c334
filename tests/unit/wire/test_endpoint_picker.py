"""The Endpoint Picker protocol's values: endpoints, subset hints, served reports, names."""

from __future__ import annotations

import pytest

from kvroute.wire import endpoint_picker as epp


def test_destination_lists_the_choice_then_fallbacks_in_order() -> None:
    assert epp.destination_value(["10.0.0.1:8000"]) == "10.0.0.1:8000"
    assert epp.destination_value(["10.0.0.2:8000", "10.0.0.1:8000"]) == (
        "10.0.0.2:8000,10.0.0.1:8000")
    with pytest.raises(epp.EndpointError, match="at least one"):
        epp.destination_value([])


@pytest.mark.parametrize(("value", "want"), [
    ("10.0.0.1:80", ("10.0.0.1:80",)),
    ("10.0.0.1:80, 10.0.0.2:81,", ("10.0.0.1:80", "10.0.0.2:81")),
    (["10.0.0.1:80", "10.0.0.2:81"], ("10.0.0.1:80", "10.0.0.2:81")),
    ("", ()),
    ([], ()),
])
def test_endpoints_parse_from_a_string_or_a_list(value: object, want: tuple[str, ...]) -> None:
    assert epp.parse_endpoints(value) == want


@pytest.mark.parametrize("value", ["10.0.0.1", "10.0.0.1:http", "10.0.0.1:0", ":80", 7,
                                   [7], {"a": 1}])
def test_malformed_endpoints_say_what_was_expected(value: object) -> None:
    with pytest.raises(epp.EndpointError, match="ip:port|string"):
        epp.parse_endpoints(value)


def test_the_subset_hint_is_absent_given_or_empty() -> None:
    assert epp.subset_hint({}) is None
    assert epp.subset_hint({"envoy.lb.subset_hint": {}}) is None
    hint = {"envoy.lb.subset_hint": {epp.SUBSET: ["10.0.0.1:80", "10.0.0.2:80"]}}
    assert epp.subset_hint(hint) == {"10.0.0.1:80", "10.0.0.2:80"}
    assert epp.subset_hint({"envoy.lb.subset_hint": {epp.SUBSET: "10.0.0.1:80"}}) == {
        "10.0.0.1:80"}
    assert epp.subset_hint({"envoy.lb.subset_hint": {epp.SUBSET: []}}) == frozenset()


def test_the_served_endpoint_comes_from_metadata_else_a_header() -> None:
    metadata = {"envoy.lb": {epp.SERVED: "10.0.0.2:80"}}
    assert epp.served_endpoint(metadata) == "10.0.0.2:80"
    assert epp.served_endpoint(metadata, {epp.SERVED: "10.0.0.3:80"}) == "10.0.0.2:80"
    assert epp.served_endpoint({}, {epp.SERVED: "10.0.0.3:80"}) == "10.0.0.3:80"
    assert epp.served_endpoint({}, {}) is None
    assert epp.served_endpoint({"envoy.lb": {epp.SERVED: "garbage"}}) is None


def test_replica_urls_become_ip_port_and_names_are_refused() -> None:
    assert epp.endpoint_of_url("http://10.0.0.7:8000") == "10.0.0.7:8000"
    assert epp.endpoint_of_url("http://10.0.0.7:8000/v1") == "10.0.0.7:8000"
    assert epp.endpoint_of_url("http://[::1]:8000") == "[::1]:8000"
    with pytest.raises(epp.EndpointError, match="IP address"):
        epp.endpoint_of_url("http://vllm-0.vllm:8000")
    with pytest.raises(epp.EndpointError, match="host:port"):
        epp.endpoint_of_url("http://10.0.0.7")


def test_newer_llm_d_header_names_win_over_their_older_aliases() -> None:
    both = {"x-llm-d-model-name-rewrite": "new", "x-gateway-model-name-rewrite": "old"}
    assert epp.model_rewrite(both) == "new"
    assert epp.model_rewrite({"x-gateway-model-name-rewrite": "old"}) == "old"
    assert epp.model_rewrite({"x-llm-d-model-name-rewrite": " "}) is None
    assert epp.objective({"x-gateway-inference-objective": "chat"}) == "chat"
    assert epp.fairness_id({"x-llm-d-inference-fairness-id": "t1"}) == "t1"


@pytest.mark.parametrize(("size", "want"), [(0, [b""]), (3, [b"abc"]), (7, [b"abcd", b"efg"])])
def test_bodies_go_back_in_bounded_pieces(size: int, want: list[bytes]) -> None:
    assert list(epp.body_chunks(b"abcdefg"[:size], size=4)) == want

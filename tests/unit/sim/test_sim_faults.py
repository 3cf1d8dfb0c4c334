"""``SimFaults``: the fault-injection state of one simulated engine, without a server."""

from __future__ import annotations

from typing import Any

import pytest

from kvroute.sim.server import FaultSpecError, RequestFault, SimFaults


def test_nothing_is_armed_by_default() -> None:
    faults = SimFaults()
    assert [faults.take_drop() for _ in range(3)] == [False] * 3
    assert [faults.take_request() for _ in range(3)] == [RequestFault()] * 3
    assert faults.state()["fired"] == {"events_dropped": 0, "requests_failed": 0,
                                       "requests_stalled": 0, "requests_killed": 0}


def test_counted_faults_are_consumed_exactly() -> None:
    faults = SimFaults()
    faults.apply({"drop_events": 2, "fail_next": 2, "status": 502})
    assert [faults.take_drop() for _ in range(4)] == [True, True, False, False]
    assert [faults.take_request().fail_status for _ in range(3)] == [502, 502, None]
    state = faults.state()
    assert (state["drop_events"], state["fail_next"]) == (0, 0)
    assert state["fired"]["events_dropped"] == 2 and state["fired"]["requests_failed"] == 2


def test_a_failure_consumes_no_stall_or_kill() -> None:
    faults = SimFaults()
    faults.apply({"fail_next": 1, "stall_first_byte_s": 0.5, "stall_next": 1,
                  "kill_mid_stream_after_tokens": 4, "kill_next": 1})
    assert faults.take_request() == RequestFault(fail_status=500)
    assert faults.take_request() == RequestFault(stall_s=0.5, kill_after_tokens=4)
    assert faults.take_request() == RequestFault()
    assert faults.state()["stall_first_byte_s"] == 0.0
    assert faults.state()["kill_mid_stream_after_tokens"] is None


def test_uncounted_stall_and_kill_hold_until_disarmed() -> None:
    faults = SimFaults()
    faults.apply({"stall_first_byte_s": 1, "kill_mid_stream_after_tokens": 0})
    assert [faults.take_request() for _ in range(3)] == [
        RequestFault(stall_s=1.0, kill_after_tokens=0)] * 3
    faults.apply({"stall_first_byte_s": 0, "kill_mid_stream_after_tokens": None})
    assert faults.take_request() == RequestFault()
    assert faults.state()["fired"]["requests_stalled"] == 3


def test_clear_disarms_and_keeps_the_fired_counters() -> None:
    faults = SimFaults()
    faults.apply({"drop_events": 5, "fail_next": 1})
    faults.take_drop()
    faults.apply({"clear": True, "stall_first_byte_s": 0.25})
    state = faults.state()
    assert (state["drop_events"], state["fail_next"], state["stall_first_byte_s"]) == (0, 0, 0.25)
    assert state["fired"]["events_dropped"] == 1


@pytest.mark.parametrize(("body", "message"), [
    ({"nope": 1}, r"unknown key\(s\) \['nope'\]; valid keys are"),
    ({"drop_events": -1}, "'drop_events' must be an integer >= 0"),
    ({"fail_next": 1.5}, "'fail_next' must be an integer >= 0"),
    ({"fail_next": True}, "'fail_next' must be an integer >= 0"),
    ({"status": 399}, "'status' must be an integer >= 400"),
    ({"status": 600}, "'status' must be 400-599"),
    ({"stall_first_byte_s": "1"}, "'stall_first_byte_s' must be seconds"),
    ({"stall_next": 0}, "'stall_next' must be an integer >= 1 or null"),
    ({"kill_mid_stream_after_tokens": -2}, "'kill_mid_stream_after_tokens' must be an integer"),
    ({"clear": 1}, "'clear' must be true or false"),
])
def test_bad_specs_name_the_key_and_change_nothing(body: dict[str, Any], message: str) -> None:
    faults = SimFaults()
    before = faults.state()
    with pytest.raises(FaultSpecError, match=message):
        faults.apply({"fail_next": 3, **body})
    assert faults.state() == before


def test_the_fleet_yaml_is_a_valid_kvroute_config() -> None:
    """What `kvroute sim fleet` prints pastes into a kvroute config as it is."""
    import yaml

    from kvroute.config import parse_config
    from kvroute.sim.launcher import ReplicaHandle, pools_yaml

    handles = [
        ReplicaHandle("s0", "small", "m-small", "http://127.0.0.1:8101", "tcp://127.0.0.1:5601",
                      "tcp://127.0.0.1:5602", 2048, 16),
        ReplicaHandle("s1", "small", "m-small", "http://127.0.0.1:8102", "tcp://127.0.0.1:5611",
                      None, 2048, 16),
        ReplicaHandle("l0", "large", "m-large", "http://127.0.0.1:8201", None, None, 8192, 16),
    ]
    config = parse_config(yaml.safe_load(pools_yaml(handles)), env={})
    assert [r.name for r in config.pools["small"].replicas] == ["s0", "s1"]
    assert config.pools["small"].replicas[0].kv_replay == "tcp://127.0.0.1:5602"
    assert config.pools["large"].model == "m-large"
    assert list(config.routes) == ["small", "large"]

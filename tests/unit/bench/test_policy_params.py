"""``--policy-param``: parsing, scoping, typing and the errors (``kvroute.bench.policy_params``)."""

from __future__ import annotations

import pytest

from kvroute.bench.policy_params import parse_policy_params
from kvroute.core.errors import ConfigError


def test_an_unscoped_parameter_goes_to_every_policy_run() -> None:
    assert parse_policy_params(["queue_weight=1.5"], ["llmd"]) == {"llmd": {"queue_weight": 1.5}}
    assert parse_policy_params([], ["kvroute", "dynamo"]) == {"kvroute": {}, "dynamo": {}}


def test_a_scoped_parameter_goes_to_its_policy_only_with_the_declared_type() -> None:
    params = parse_policy_params(
        ["kvroute.work_weight=0.3", "dynamo.predicted=true", "prefixaware.chunk_chars=64",
         "kvroute.step_tokens=2048"],
        ["kvroute", "dynamo", "prefixaware"],
    )
    assert params == {
        "kvroute": {"work_weight": 0.3, "step_tokens": 2048.0},
        "dynamo": {"predicted": True},
        "prefixaware": {"chunk_chars": 64},
    }
    assert isinstance(params["prefixaware"]["chunk_chars"], int)
    assert parse_policy_params(["dynamo.predicted=OFF"], ["dynamo"])["dynamo"]["predicted"] is False


def test_an_unknown_parameter_is_named_with_the_ones_the_policy_takes() -> None:
    with pytest.raises(ConfigError) as err:
        parse_policy_params(["bogus=1"], ["kvroute"])
    message = str(err.value)
    assert "--policy-param 'bogus=1': policy 'kvroute' has no parameter 'bogus'" in message
    assert "kvroute takes work_weight, decode_slowdown" in message


def test_an_unscoped_parameter_some_policies_lack_is_refused_with_the_scoped_form() -> None:
    with pytest.raises(ConfigError) as err:
        parse_policy_params(["work_weight=0.3"], ["kvroute", "dynamo", "round_robin"])
    message = str(err.value)
    assert "policies 'dynamo', 'round_robin' have no parameter 'work_weight'" in message
    assert "round_robin takes no parameters" in message
    assert "write kvroute.work_weight=0.3" in message


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ("work_weight", "takes KEY=VALUE or POLICY.KEY=VALUE"),
        ("=1", "takes KEY=VALUE or POLICY.KEY=VALUE"),
        ("llmd.kv_weight=1", "policy 'llmd' is not among the policies run"),
        ("kvroute.work_weight=fast", "work_weight takes a number, got 'fast'"),
        ("kvroute.work_weight=nan", "must be a number, not NaN"),
        ("prefixaware.chunk_chars=64.5", "chunk_chars takes an integer"),
        ("dynamo.predicted=maybe", "predicted is a bool; give true or false"),
        ("kvroute.work_weight=-1", "policy 'kvroute' refused parameters"),
    ],
)
def test_bad_items_say_what_was_wrong(item: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        parse_policy_params([item], ["kvroute", "dynamo", "prefixaware"])

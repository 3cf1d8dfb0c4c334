"""``kvroute bench sim --pd``: the layout string, the split mode and the link, checked."""

from __future__ import annotations

import pytest

from kvroute.bench.sim_bench import SimBenchSpec
from kvroute.core.disagg import DisaggSpec
from kvroute.core.errors import ConfigError


def test_a_layout_gives_each_replica_its_role_and_the_link_its_time() -> None:
    spec = SimBenchSpec(replicas=8, pd="2P6D", split="always", link_gbps=25.0)
    assert spec.roles() == ("prefill",) * 2 + ("decode",) * 6
    assert spec.disagg() == DisaggSpec("always", 131_072 / 25e9)
    assert SimBenchSpec(replicas=3, pd="1p1d1b").roles() == ("prefill", "decode", "both")
    assert SimBenchSpec().roles() == () and SimBenchSpec().disagg() is None


@pytest.mark.parametrize(("spec", "words"), [
    (SimBenchSpec(replicas=8, pd="2P5D"), "lays out 7 replicas"),
    (SimBenchSpec(replicas=8, pd="8P"), "no replica that can decode"),
    (SimBenchSpec(replicas=8, pd="two prefill"), "counts of P"),
    (SimBenchSpec(replicas=8, pd="8B", split="often"), "--split"),
])
def test_bad_layouts_say_what_to_write(spec: SimBenchSpec, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        spec.validate()

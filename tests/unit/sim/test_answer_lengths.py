"""Answer lengths of the simulated engines: deterministic per request, shaped like a model's."""

from __future__ import annotations

import statistics

import pytest

from kvroute.core.errors import ConfigError
from kvroute.sim.answer_lengths import AnswerLengths


def test_the_same_request_gets_the_same_length_and_others_differ() -> None:
    lengths = AnswerLengths()
    prompt = [1, 2, 3, 4]
    assert lengths.length_for(prompt) == lengths.length_for(list(prompt))
    drawn = {lengths.length_for([1, 2, 3, i]) for i in range(50)}
    assert len(drawn) > 30  # different prompts, different lengths
    assert lengths.length_for(prompt, request_seed=7) == lengths.length_for(prompt, request_seed=7)
    others = {lengths.length_for(prompt, request_seed=s) for s in range(20)}
    assert len(others) > 10
    one, two = AnswerLengths(seed=1), AnswerLengths(seed=2)
    assert sum(one.length_for([i]) != two.length_for([i]) for i in range(10)) >= 8


def test_distribution_has_its_median_and_a_long_tail_within_the_clip() -> None:
    lengths = AnswerLengths()
    drawn = [lengths.length_for([i, i * 7 % 13]) for i in range(4000)]
    assert 160 <= statistics.median(drawn) <= 200
    assert 230 <= statistics.fmean(drawn) <= 310
    assert max(drawn) > 1000 and min(drawn) < 40
    assert all(1 <= n <= 4096 for n in drawn)
    clipped = AnswerLengths(min_tokens=50, max_tokens=60)
    assert {clipped.length_for([i]) for i in range(200)} <= set(range(50, 61))


@pytest.mark.parametrize("kwargs", [{"median_tokens": 0.5}, {"sigma": -1.0},
                                    {"min_tokens": 0}, {"min_tokens": 10, "max_tokens": 5}])
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        AnswerLengths(**kwargs)  # type: ignore[arg-type]

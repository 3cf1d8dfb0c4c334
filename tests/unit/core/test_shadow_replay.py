"""The gate's shadow replay scoring (``core/shadow_replay.py``): transcripts, per-token
comparison, late-turn weighting, per-class verdicts, the cache-policy audit."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from kvroute.core.shadow_replay import (
    Thresholds,
    TokenStep,
    Transcript,
    TranscriptError,
    compare_turn,
    parse_thresholds,
    parse_transcripts,
    policy_changes,
    score_classes,
    turn_weight,
    verdict_scores,
)

T3 = Transcript("t", "code", None, ("a", "b", "c"))


def steps(*tokens: tuple[str, float, dict[str, float]]) -> list[TokenStep]:
    return [TokenStep(t, lp, top) for t, lp, top in tokens]


def test_the_bundled_sample_parses_with_three_classes_of_multi_turn_transcripts() -> None:
    text = resources.files("kvroute").joinpath("data/gate/transcripts.jsonl").read_text()
    items = parse_transcripts(text, "sample")
    assert {t.workload for t in items} == {"extraction", "code", "reasoning"}
    assert all(len(t.turns) >= 3 and t.system for t in items)


@pytest.mark.parametrize(("line", "error"), [
    ("not json", "line 1: not JSON"),
    ('{"id": "a", "turns": ["x"]}', "'class' must be a non-empty string"),
    ('{"id": "a", "class": "c", "turns": []}', "'turns' must be a list"),
    ('{"id": "a", "class": "c", "turns": ["x"], "temperature": 1}', "unknown field"),
    ('{"id": "a", "class": "c", "turns": ["x"], "max_tokens": 0}', "'max_tokens'"),
    ('{"id": "a", "class": "c", "turns": ["x"]}\n{"id": "a", "class": "c", "turns": ["y"]}',
     "line 2: id 'a' repeats"),
    ("# only a comment\n", "holds no transcript"),
])
def test_a_bad_transcript_file_names_the_line_and_the_fix(line: str, error: str) -> None:
    with pytest.raises(TranscriptError, match=error):
        parse_transcripts(line, "f.jsonl")


def test_identical_continuations_are_exact_with_no_drift() -> None:
    a = steps(("x", -0.1, {"x": -0.1, "y": -2.0}), ("z", -0.5, {"z": -0.5}))
    t = compare_turn(T3, 0, a, a)
    assert (t.exact, t.first_divergence, t.compared, t.top1_agree, t.max_dlogprob) == (
        True, None, 2, 2, 0.0)


def test_drift_is_measured_over_shared_top_k_and_stops_at_the_first_divergence() -> None:
    native = steps(("x", -0.1, {"x": -0.1, "y": -2.0}), ("z", -0.5, {"z": -0.5, "w": -1.0}),
                   ("q", -0.1, {"q": -0.1}))
    # Same first token with drift on a shared alternative; the second token differs; the
    # third (after the divergence, other context) must not count.
    candidate = steps(("x", -0.15, {"x": -0.15, "y": -2.5, "k": -3.0}),
                      ("w", -0.7, {"w": -0.7, "z": -0.9}), ("q", -9.0, {"q": -9.0}))
    t = compare_turn(T3, 1, native, candidate)
    assert not t.exact and t.first_divergence == 1
    assert (t.compared, t.top1_agree) == (2, 1)
    assert t.max_dlogprob == pytest.approx(0.5)  # y: |-2.0 - -2.5|, and z: 0.4, w: 0.3
    assert t.num_dlogprob == 4


def test_a_continuation_that_ends_early_diverges_where_it_ends() -> None:
    a = steps(("x", -0.1, {}), ("y", -0.1, {}))
    t = compare_turn(T3, 2, a, a[:1])
    assert not t.exact and t.first_divergence == 1 and t.compared == 1


def test_late_turns_weigh_more_and_each_class_is_judged_on_its_own() -> None:
    assert [turn_weight(i, 3) for i in range(3)] == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="outside"):
        turn_weight(3, 3)
    same = steps(("x", -0.1, {"x": -0.1}))
    other = steps(("y", -0.1, {"y": -0.1}))
    reasoning = Transcript("r", "reasoning", None, ("a", "b", "c"))
    turns = [compare_turn(T3, i, same, same) for i in range(3)]
    # reasoning diverges on its LAST turn only: 3 of 6 weight units lost, not 1 of 3 turns
    turns += [compare_turn(reasoning, i, same, same if i < 2 else other) for i in range(3)]
    code, reason = score_classes(turns, Thresholds(min_exact_match=0.6,
                                                   min_top1_agreement=0.0, max_dlogprob=10))
    assert (code.workload, code.passed, code.exact_match) == ("code", True, 1.0)
    assert reason.workload == "reasoning" and reason.exact_match == pytest.approx(0.5)
    assert not reason.passed and "exact match 0.500 < 0.6" in reason.failures[0]
    assert reason.earliest_divergence == 0 and code.earliest_divergence is None
    scores = verdict_scores([code, reason])
    assert scores["reasoning.exact_match"] == 0.5 and scores["code.turns"] == 3.0
    # the same divergence on the FIRST turn costs only 1 of 6 weight units
    early = [compare_turn(reasoning, i, same, other if i == 0 else same) for i in range(3)]
    (only,) = score_classes(early, Thresholds(min_exact_match=0.6, min_top1_agreement=0.0))
    assert only.exact_match == pytest.approx(5 / 6) and only.passed


def test_a_drift_above_the_threshold_fails_and_per_class_thresholds_override() -> None:
    a = steps(("x", -0.1, {"x": -0.1}))
    b = steps(("x", -0.3, {"x": -0.3}))
    turns = [compare_turn(T3, 0, a, b)]
    (strict,) = score_classes(turns, Thresholds(max_dlogprob=0.1))
    assert not strict.passed and "max |dlogprob| 0.2000 > 0.1" in strict.failures[0]
    default, per_class = parse_thresholds({"max_dlogprob": 0.1,
                                           "classes": {"code": {"max_dlogprob": 0.25}}})
    assert per_class["code"].min_exact_match == default.min_exact_match == 1.0
    (lenient,) = score_classes(turns, default, per_class)
    assert lenient.passed
    with pytest.raises(ValueError, match="no turn"):
        score_classes([], default)


@pytest.mark.parametrize(("data", "error"), [
    ({"max_dlogprobs": 1}, "unknown key"),
    ({"min_exact_match": 2}, r"within \[0, 1\]"),
    ({"max_dlogprob": "small"}, "must be a number"),
    ({"classes": {"code": {"classes": {}}}}, "unknown key"),
])
def test_bad_thresholds_say_which_key(data: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_thresholds(data)


def test_the_policy_audit_names_every_changed_setting() -> None:
    before = {"serving.block_size": "128", "serving.cache_dtype": "auto",
              "serving.weights": "w:1"}
    assert policy_changes(before, dict(before)) == []
    after = {**before, "serving.cache_dtype": "fp8", "serving.weights": "w:2"}
    del after["serving.block_size"]
    assert policy_changes(before, after) == [
        "serving.block_size: 128 -> <absent>", "serving.cache_dtype: auto -> fp8",
        "serving.weights: w:1 -> w:2"]
    json.dumps(before)  # the policy is what a verdict stores as JSON

"""kvroute prices a tier hit by what loading it costs against the prefill it saves."""

from __future__ import annotations

import random

import pytest

from kvroute.core.index import PrefixMatch
from kvroute.core.load import ReplicaLoad
from kvroute.core.policy import (
    CPU_LOAD_S_PER_TOKEN,
    STORAGE_LOAD_S_PER_TOKEN,
    Candidate,
    KvrouteCostPolicy,
    PolicyInput,
    tier_credit,
)
from kvroute.core.types import ReplicaId


def test_the_credit_is_the_prefill_saved_less_the_load() -> None:
    # Llama-3.1-8B from host memory at 25 GB/s on a replica prefilling 25k tokens/s
    assert tier_credit(CPU_LOAD_S_PER_TOKEN, 25_000) == pytest.approx(1 - 131_072 / 25e9 * 25e3)
    assert tier_credit(CPU_LOAD_S_PER_TOKEN, 25_000) == pytest.approx(0.869, abs=1e-3)
    # a 3 GB/s disk is slower than recomputing there: worth nothing, never negative
    assert tier_credit(STORAGE_LOAD_S_PER_TOKEN, 25_000) == 0.0
    # on a slow replica (2k tokens/s) the same disk hit is worth most of a device hit
    assert tier_credit(STORAGE_LOAD_S_PER_TOKEN, 2_000) == pytest.approx(0.913, abs=1e-3)
    assert tier_credit(0.0, 1e9) == 1.0


def _cand(name: str, *, gpu: int = 0, cpu: int = 0, queue: int = 0) -> Candidate:
    return Candidate(ReplicaId(name),
                     ReplicaLoad(outstanding_prefill_tokens=queue, prefill_rate_tps=25_000.0),
                     PrefixMatch(num_gpu_blocks=gpu, num_cpu_blocks=cpu))


def test_a_cheap_cpu_hit_beats_a_cold_replica_and_an_expensive_one_does_not() -> None:
    req = PolicyInput("r", num_prompt_tokens=8000, block_size=16)
    cheap = KvrouteCostPolicy(random.Random(0), decode_weight=0.0, harm_weight=0.0)
    sel = cheap.select(req, [_cand("cold"), _cand("tiered", cpu=490, queue=2000)])
    assert sel.replica == "tiered"
    # expected cached tokens: 490 blocks x 16 x 0.869
    assert sel.expected_cached_tokens[ReplicaId("tiered")] == int(
        490 * 16 * tier_credit(CPU_LOAD_S_PER_TOKEN, 25_000))
    # the same tier at 1 GB/s loads slower than the cold replica recomputes
    slow = KvrouteCostPolicy(random.Random(0), decode_weight=0.0, harm_weight=0.0,
                             cpu_load_s_per_token=131_072 / 1e9)
    assert slow.select(req, [_cand("cold"), _cand("tiered", cpu=490, queue=2000)]).replica \
        == "cold"
    # a device hit is never discounted
    assert slow.select(req, [_cand("cold"), _cand("gpu", gpu=490, queue=2000)]).replica == "gpu"


def test_predicted_ttft_prices_tiers_as_select_does() -> None:
    policy = KvrouteCostPolicy(random.Random(0), decode_weight=0.0, harm_weight=0.0,
                               work_weight=0.0, inflight_cost_s=0.0)
    req = PolicyInput("r", num_prompt_tokens=8000, block_size=16)
    c = _cand("tiered", cpu=490)
    ttft, _ = policy.predicted_ttft_s(req, c)
    assert policy.select(req, [c]).scores[ReplicaId("tiered")] == pytest.approx(ttft)


def test_negative_load_times_are_refused() -> None:
    with pytest.raises(ValueError, match="tier load times must be >= 0"):
        KvrouteCostPolicy(random.Random(0), cpu_load_s_per_token=-1.0)

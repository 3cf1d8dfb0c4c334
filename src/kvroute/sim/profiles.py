"""Named timing profiles for simulated engines: step-time constants plus a realistic engine shape.

Owns the table of profiles and nothing else; the step-time model itself
(``fixed + a·prefill_tokens + b·decode_seqs + c·context_tokens``) lives in
``kvroute.engine.model.StepTiming`` so that ``engine`` never depends on ``sim``.

Every profile says where its constants come from. No GPU was available to measure them, so the
GPU profiles are *derived* from published hardware figures with stated efficiency factors,
and cross-checked against the one public empirical fit we found (Dynamo's mocker). Treat them
as plausible orders of magnitude for comparing routing policies, not as predictions of a
particular deployment; calibrate against a real endpoint when one is available.

Hardware figures used (NVIDIA H100 SXM5 80 GB datasheet): 989 TFLOP/s dense BF16, 3.35 TB/s
HBM3. Model shapes from the Llama 3.1 model cards / ``config.json``: 8B = 32 layers, 8 KV heads
of 128, 8.03 B parameters; 70B = 80 layers, 8 KV heads of 128, 70.6 B parameters.

Cross-check: Dynamo's mocker (ai-dynamo/dynamo, ``lib/llm/src/mocker/protocols.rs``,
``PrefillCost::predict_prefill_compute``) models prefill as
``1.25e-6·t² + 7.41e-2·t + 26.2`` ms, i.e. 74 µs per prompt token plus 26 ms per step, for an
unstated model and GPU; it sits between our 8B (40 µs) and 70B-TP4 (85 µs) per-token costs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvroute.core.errors import ConfigError
from kvroute.engine.model import EngineConfig, StepTiming

__all__ = ["PROFILES", "TimingProfile", "get_profile", "profile_names"]


@dataclass(frozen=True, slots=True)
class TimingProfile:
    """A named engine profile: step timing, the engine shape it implies, and its sources.

    Attributes:
        name: the key in ``PROFILES``.
        timing: the step-time constants.
        model / hardware: what the constants describe.
        source: where each constant comes from (derivation or measurement).
        calibrated: True only when the constants were fitted to measurements of a real engine.
        block_size, num_gpu_blocks, max_model_len, max_num_seqs, max_num_batched_tokens: the
            engine arguments that go with this deployment (KV capacity from memory left after
            weights at ``gpu_memory_utilization=0.9``).
        cpu_offload_blocks, cpu_load_s_per_block: the engines' CPU tier (none by default;
            ``kvroute bench sim --cpu-tier`` sets them).
    """

    name: str
    timing: StepTiming
    model: str
    hardware: str
    source: str
    calibrated: bool
    block_size: int
    num_gpu_blocks: int
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    cpu_offload_blocks: int = 0
    cpu_load_s_per_block: float = 0.0

    def engine_config(
        self,
        *,
        num_gpu_blocks: int | None = None,
        max_model_len: int | None = None,
        block_size: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> EngineConfig:
        """An ``EngineConfig`` with this profile's shape and timing; any argument overrides.

        Raises:
            ConfigError: the resulting configuration is invalid (see ``EngineConfig``).
        """
        return EngineConfig(
            num_gpu_blocks=num_gpu_blocks if num_gpu_blocks is not None else self.num_gpu_blocks,
            max_model_len=max_model_len if max_model_len is not None else self.max_model_len,
            block_size=block_size if block_size is not None else self.block_size,
            max_num_seqs=max_num_seqs if max_num_seqs is not None else self.max_num_seqs,
            max_num_batched_tokens=(
                max_num_batched_tokens
                if max_num_batched_tokens is not None
                else self.max_num_batched_tokens
            ),
            timing=self.timing,
            cpu_offload_blocks=self.cpu_offload_blocks,
            cpu_load_s_per_block=self.cpu_load_s_per_block,
        )

    def with_timing(self, timing: StepTiming, *, source: str, calibrated: bool) -> TimingProfile:
        """A copy with new constants (e.g. after calibration), keeping the engine shape."""
        return dataclasses.replace(self, timing=timing, source=source, calibrated=calibrated)


_LLAMA_8B_H100 = TimingProfile(
    name="llama-3.1-8b-h100",
    timing=StepTiming(
        fixed_s=6.0e-3,
        prefill_token_s=40e-6,
        decode_seq_s=20e-6,
        context_token_s=5.0e-8,
    ),
    model="Llama-3.1-8B-Instruct, BF16",
    hardware="1x H100 SXM 80 GB, vLLM, TP1",
    source=(
        "Derived, not measured. fixed: 16.1 GB of weights read once per step at 3.35 TB/s = "
        "4.8 ms, plus ~1.2 ms launch/scheduler/sampler. a: 2 x 8.03e9 = 16.1 GFLOP per prompt "
        "token at 989 TFLOP/s x 40% MFU = 40 us (~25k prefill tok/s). b: one decode's share of "
        "the batch matmuls and sampling, ~half a prompt token. c: KV of one context token = "
        "2 x 32 layers x 8 heads x 128 x 2 B = 128 KiB, read at ~2.7 TB/s effective = 49 ns. "
        "KV capacity: 80 GB x 0.9 - 16.1 GB weights - ~4 GB activations = ~52 GB / 128 KiB = "
        "~396k tokens = 24,800 blocks of 16. Cross-checked against Dynamo mocker's prefill fit "
        "(74 us/token, unstated model)."
    ),
    calibrated=False,
    block_size=16,
    num_gpu_blocks=24_800,
    max_model_len=131_072,
)

_LLAMA_70B_H100_TP4 = TimingProfile(
    name="llama-3.1-70b-h100-tp4",
    timing=StepTiming(
        fixed_s=14.0e-3,
        prefill_token_s=85e-6,
        decode_seq_s=40e-6,
        context_token_s=3.0e-8,
    ),
    model="Llama-3.1-70B-Instruct, BF16",
    hardware="4x H100 SXM 80 GB, vLLM, TP4 (NVLink)",
    source=(
        "Derived, not measured. fixed: 141 GB of weights over 4 GPUs at 3.35 TB/s each = "
        "10.5 ms, plus 160 all-reduces and launch overhead ~3.5 ms. a: 2 x 70.6e9 = 141 GFLOP "
        "per prompt token at 4 x 989 TFLOP/s x 42% MFU = 85 us (~11.8k prefill tok/s; Dynamo "
        "mocker's fit gives 74 us). b: ~half a prompt token. c: KV of one context token = "
        "2 x 80 layers x 8 heads x 128 x 2 B = 320 KiB, read at 4 x ~2.7 TB/s = 30 ns. KV "
        "capacity: 4 x 72 GB - 141 GB weights - 4 x 4 GB activations = ~131 GB / 320 KiB = "
        "~400k tokens = 25,000 blocks of 16."
    ),
    calibrated=False,
    block_size=16,
    num_gpu_blocks=25_000,
    max_model_len=131_072,
)

_ZERO = TimingProfile(
    name="zero",
    timing=StepTiming(),
    model="any",
    hardware="none",
    source="All constants 0: every step takes no time. For throughput tests of the simulator "
    "and for order-only hit-rate studies; engine shape as llama-3.1-8b-h100.",
    calibrated=False,
    block_size=16,
    num_gpu_blocks=24_800,
    max_model_len=131_072,
)

_VLLM_CPU_TINY = TimingProfile(
    name="vllm-cpu-tiny",
    timing=StepTiming(
        fixed_s=1.8e-3,
        prefill_token_s=49e-6,
        decode_seq_s=0.18e-3,
        context_token_s=0.93e-6,
    ),
    model="tiny random Llama (hidden 256, 2 layers, 4 heads / 2 KV heads of 64), BF16",
    hardware="vllm-cpu 0.32.0 on 2 x86 cores (the project's CI machine)",
    source=(
        "CALIBRATED 2026-11-29 against a real vllm-cpu 0.32.0 engine serving the tiny model "
        "(tests/realvllm.py recipe: --max-model-len 2048, prefix caching, KV events), fitted "
        "with kvroute.sim.calibrate.fit_step_timing (what `kvroute sim calibrate` runs) on 74 "
        "observations pooled over 2 runs: 42 lone-request TTFTs (prompts of 58-1,930 tokens, "
        "max_tokens 1, unique prefix and cache_salt) from kvroute.sim.calibrate.calibrate, and "
        "32 decode ITLs (batch 1/2/4/8, 32 output tokens, context 72-14,600 tokens) read from "
        "the engine's own vllm:inter_token_latency_seconds sum/count, because on this loaded "
        "machine the client often reads a whole stream in one burst (client-side gaps of 5 us). "
        "`kvroute sim calibrate --url` could not be used as it was then (its prompts counted "
        "words as tokens and overflowed the 2,048 window); it now sizes prompts in token ids "
        "within the engine's window and reads ITL from the engine's histogram. Fit: R^2 0.916, median relative error 25% (TTFT) / 23% (ITL), max 73%; "
        "the HTTP overhead term (3.1 ms per request, not part of a step) is left to the sim's "
        "own server. Machine load average 4.7-7.9 on 2 cores during the fit (other engineers' "
        "jobs), so expect +-30%. Known model limits: real prefill cost is convex in the prompt "
        "length (attention), the model is linear. Reproduce: docs/sim-conformance.md. Shape: "
        "CPU backend block size 128, --max-model-len 2048, VLLM_CPU_KVCACHE_SPACE=1 GiB = "
        "1,048,576 tokens = 8,192 blocks of 128 (the engine's log); max_num_seqs/batched tokens "
        "are vLLM's defaults, not checked on the CPU backend."
    ),
    calibrated=True,
    block_size=128,
    num_gpu_blocks=8_192,
    max_model_len=2_048,
    max_num_seqs=256,
    max_num_batched_tokens=4_096,
)

PROFILES: dict[str, TimingProfile] = {
    p.name: p for p in (_LLAMA_8B_H100, _LLAMA_70B_H100_TP4, _ZERO, _VLLM_CPU_TINY)
}
"""Every named profile. Read-only by convention: build new ones with ``with_timing``."""


def profile_names() -> list[str]:
    """The names ``get_profile`` accepts, sorted."""
    return sorted(PROFILES)


def get_profile(name: str) -> TimingProfile:
    """Return the profile called ``name``.

    Raises:
        ConfigError: no such profile; the message lists the valid names.
    """
    try:
        return PROFILES[name]
    except KeyError:
        raise ConfigError(
            f"unknown timing profile {name!r}: choose one of {', '.join(profile_names())}"
        ) from None

"""What discovery keeps per replica: the copy it shows (``ReplicaInfo``) and its own record.

Shared by ``shell/discovery.py`` (which owns the records and their probes) and the helpers
it applies readings through (``shell/identity_reads.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvroute.config import PoolConfig, ReplicaConfig
from kvroute.core.health import ReplicaHealth
from kvroute.core.polling import ProbeSchedule

__all__ = ["ReplicaInfo", "ReplicaRecord"]


@dataclass(slots=True)
class ReplicaInfo:
    """What discovery knows about one replica (a copy; changing it changes nothing).

    Attributes:
        served_model: the pool's model as the replica serves it, once seen on ``/v1/models``.
        model_root: that model card's ``root`` (vLLM: the path or hub id it was started on),
            None when the card has none.
        max_model_len: its context window; None until read or after ``window_ttl_s``.
        block_size / hash_algo: from ``vllm:cache_config_info``; None until reported.
        healthy: in routing (healthy, right model, hashing consistent with its pool).
        last_ok_s: clock time of the last good ``/health``.
        running / waiting / kv_usage: the last engine load read from ``/metrics``.
        models_fetched_at_s: clock time of the last good ``/v1/models``.
        adapters: the LoRA adapters it lists on top of the pool's model: {name: path}.
        lora_running / lora_max: from ``vllm:lora_requests_info`` (None: not reported).
        consecutive_failures: ``/health`` failures in a row.
        consecutive_successes: ``/health`` successes in a row.
        excluded_reason: why a reachable replica is kept out of routing, or None.
        last_error: the last probe failure, for ``/admin/state`` and logs.
    """

    served_model: str | None = None
    model_root: str | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    hash_algo: str | None = None
    healthy: bool = False
    last_ok_s: float | None = None
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    models_fetched_at_s: float | None = None
    adapters: dict[str, str] = dataclasses.field(default_factory=dict)
    lora_running: tuple[str, ...] = ()
    lora_max: int | None = None
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    excluded_reason: str | None = None
    last_error: str | None = None


@dataclass(slots=True)
class ReplicaRecord:
    """Discovery's record of one replica: its config, health, probe schedule and the
    conclusions drawn so far (``info``, and why it is kept out, ``model_problem``)."""

    config: ReplicaConfig
    pool: PoolConfig
    health: ReplicaHealth
    schedule: ProbeSchedule
    # NOTE: info's health counts, last_ok_s and models_fetched_at_s are not kept here but
    # read from health and schedule by replica_info: one owner for each fact.
    info: ReplicaInfo = dataclasses.field(default_factory=ReplicaInfo)
    core_healthy: bool | None = None  # what RouterCore was last told
    window_read_s: float | None = None
    model_problem: str | None = None

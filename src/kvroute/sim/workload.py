"""The request record every workload produces and every simulated or live driver consumes.

Owns :class:`WorkloadRequest` only. It sits in ``sim`` rather than with the generators in
``bench/workloads.py`` because the fleet simulation (``sim/fleet.py``) takes these records
as input, and ``sim`` must not import ``bench`` (the rings point down only).

**Closed-loop turns.** A request with ``depends_on`` set is turn ``k+1`` of a session whose
turn ``k`` is the request of that id; a closed-loop driver releases it ``think_time_s`` after
that request *finishes* and ignores ``arrival_s``, which then only holds the lower bound
``arrival(previous) + think_time_s`` (``bench.workloads.release_time`` computes the release).
Requests without ``depends_on`` are released at ``arrival_s``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Message", "WorkloadRequest"]

Message = dict[str, str]
"""One OpenAI chat message: ``{"role": ..., "content": ...}``."""


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload, whatever produced it.

    ``prompt_token_ids`` is a tuple for generated workloads and a lazy
    :class:`~kvroute.bench.traces.BlockTokens` for trace replays (both ``Sequence[int]``).
    ``group`` names requests that share a prefix by construction (a GSP group, a hot prefix, a
    fan-out); ``turn`` counts from 0 within a session. ``depends_on``/``think_time_s`` describe
    closed-loop turns (see the module docstring); both are ``None`` for open-loop requests.
    """

    arrival_s: float
    request_id: str
    prompt_token_ids: Sequence[int]
    output_tokens: int
    session_id: str | None = None
    tenant: str | None = None
    group: str | None = None
    turn: int | None = None
    messages: list[Message] | None = None
    think_time_s: float | None = None
    depends_on: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

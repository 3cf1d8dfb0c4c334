"""What the tokenizer paths ask of the router's shell: which replicas to call, where to count.

The engine ``/tokenize`` path (``prompt.py``) and the tokenizer check (``check.py``) need a
pool's healthy replicas, their URLs and the model directory each was started on, and a place
to report outcomes and modes. They name only those calls, as protocols, so that ``tokenize``
sits below ``shell`` in the rings and never imports it. ``shell.discovery.Discovery`` and
``shell.metrics.RouterMetrics`` satisfy them as they are; the composition root
(``shell/runtime.py``) passes them in.
"""

from __future__ import annotations

from typing import Protocol

from kvroute.core.types import ReplicaId

__all__ = ["ReplicaCard", "ReplicaDirectory", "TokenizerMetrics"]


class ReplicaCard(Protocol):
    """What is known of one replica's model (``shell.discovery.ReplicaInfo``)."""

    @property
    def model_root(self) -> str | None:
        """The model card's ``root`` (the path or hub id the engine was started on), if any."""
        ...


class ReplicaDirectory(Protocol):
    """A pool's replicas as discovery sees them (``shell.discovery.Discovery``)."""

    def healthy_replicas(self, pool: str) -> list[ReplicaId]:
        """The pool's replicas currently in routing, in config order."""
        ...

    def replica_url(self, replica: str) -> str:
        """The replica's base URL."""
        ...

    def replica_info(self, replica: str) -> ReplicaCard:
        """What is known about the replica's model."""
        ...

    def report_failure(self, replica: str, reason: str) -> None:
        """Nothing answers on the replica's port: take it out of routing until it does."""
        ...


class TokenizerMetrics(Protocol):
    """The tokenizer's counters and gauges (``shell.metrics.RouterMetrics``)."""

    def tokenize(self, pool: str, outcome: str) -> None:
        """Count one prompt tokenization by outcome (``kvroute_tokenize_total``)."""
        ...

    def set_tokenizer_mode(self, pool: str, mode: str) -> None:
        """Export the pool's tokenizer mode (``kvroute_tokenizer_mode``)."""
        ...

    def set_tokenizer_check(self, pool: str, result: str) -> None:
        """Export the result of the pool's tokenizer check (``kvroute_tokenizer_check``)."""
        ...

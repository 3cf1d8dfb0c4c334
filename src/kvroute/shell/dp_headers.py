"""The ``X-data-parallel-rank`` header of a request sent to one rank of a DP engine.

A replica configured with ``data_parallel_size`` is routed as one target per rank
(``config.ReplicaConfig.dp_rank``); every request the router sends to such a target (the
client's request, a warm-up, a shadow warm-up) names the rank, so vLLM's API server hands it
to that rank's engine instead of its own load balancer's pick (docs/data-parallel.md).

A rank discovery found (a replica whose ``data_parallel_size`` is read from its engine,
``shell/dp_discovery.py``) is not in the config: its name, ``<engine>.dp<r>`` of a configured
``dp_auto`` replica ``<engine>``, says its rank (a configured name is looked up first, and
discovery never gives a rank a name the config uses).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from kvroute.config import RouterConfig
from kvroute.core.types import ReplicaId
from kvroute.wire.dp_rank import DP_RANK_HEADER

__all__ = ["DpRankHeaders"]

_NONE: Final[Mapping[str, str]] = MappingProxyType({})


class DpRankHeaders:
    """Each replica's rank header, read from one config once (module docstring).

    Built once per config by whoever sends requests (the forwarder, the picker, the warm
    senders): a lookup costs one dict get, where scanning every pool's replicas on each
    request cost a walk over the fleet's config. The headers returned are shared and
    read-only; a caller copies them into its own (``**headers``).

    Args:
        config: the router config (frozen: the table never goes stale).
    """

    __slots__ = ("_auto", "_found", "_headers")

    def __init__(self, config: RouterConfig) -> None:
        self._headers: dict[ReplicaId, Mapping[str, str]] = {}
        auto: set[str] = set()
        for pool in config.pools.values():
            for rep in pool.replicas:
                self._headers.setdefault(rep.name, _NONE if rep.dp_rank is None else
                                         MappingProxyType({DP_RANK_HEADER: str(rep.dp_rank)}))
                if rep.dp_auto:
                    auto.add(rep.name)
        self._auto = frozenset(auto)
        self._found: dict[ReplicaId, Mapping[str, str]] = {}
        """Discovered ranks' headers, parsed from their names once each (a rank name is
        ``<engine>.dp<r>`` of a configured ``dp_auto`` engine: bounded by their ranks)."""

    def of(self, replica: ReplicaId) -> Mapping[str, str]:
        """``{"X-data-parallel-rank": "r"}`` when ``replica`` is rank r of a DP engine, else
        empty (an engine without ranks, or a replica the config does not list: Kubernetes)."""
        known = self._headers.get(replica)
        if known is not None:
            return known
        found = self._found.get(replica)
        if found is None:
            found = self._parse(replica)
            if found:  # only ranks are kept: other unlisted names (Kubernetes pods) churn
                self._found[replica] = found
        return found

    def _parse(self, replica: ReplicaId) -> Mapping[str, str]:
        engine, sep, rank = replica.rpartition(".dp")
        if not sep or not rank.isdigit() or engine not in self._auto:
            return _NONE
        return MappingProxyType({DP_RANK_HEADER: str(int(rank))})

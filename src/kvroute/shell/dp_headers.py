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

from kvroute.config import RouterConfig
from kvroute.core.types import ReplicaId
from kvroute.wire.dp_rank import DP_RANK_HEADER

__all__ = ["dp_rank_headers"]


def dp_rank_headers(config: RouterConfig, replica: ReplicaId) -> dict[str, str]:
    """``{"X-data-parallel-rank": "r"}`` when ``replica`` is rank r of a DP engine, else
    empty (an engine without ranks, or a replica the config does not list: Kubernetes)."""
    for pool in config.pools.values():
        for rep in pool.replicas:
            if rep.name == replica:
                return {} if rep.dp_rank is None else {DP_RANK_HEADER: str(rep.dp_rank)}
    engine, sep, rank = replica.rpartition(".dp")
    if not sep or not rank.isdigit():
        return {}
    for pool in config.pools.values():
        for rep in pool.replicas:
            if rep.name == engine and rep.dp_auto:
                return {DP_RANK_HEADER: str(int(rank))}
    return {}

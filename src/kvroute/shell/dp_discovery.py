"""Data-parallel rank counts read from the engines, and the membership change they ask for.

A vLLM API server started with ``--data-parallel-size N`` labels every series of rank r on
``/metrics`` with ``engine="r"`` (``wire/dp_rank.rank_count``). A replica whose config leaves
``data_parallel_size`` unset (or writes ``auto``) is ``dp_auto``: it starts as one routing
target under its own name, and when its engine shows N > 1 ranks it becomes N targets
``<name>.dp0`` .. ``<name>.dp{N-1}`` (``config.expand_dp_ranks``: their event endpoints at
vLLM's per-rank offsets, their ``X-data-parallel-rank`` header from ``shell/dp_headers.py``).
An engine restarted with another N is a membership change like a Kubernetes scale: the old
entries leave (their index entries, load and subscriptions go), the new ones join, out of
routing until their first ``/health``. Back to one rank, the ranks fold into ``<name>``.

A replica whose config fixes ``data_parallel_size`` is never resized: when its engine shows
another count, an error says so once per count seen (``discovery_total`` outcome
``dp_size_mismatch``), since requests then go to ranks that do not exist or miss some.

``DpRankWatch`` holds the decisions; ``shell/discovery.py`` feeds it every ``/metrics``
reading and, between probe rounds when no probe is out, applies the resizes it returns with
``apply_resize``, telling its ``MembershipHook``s.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvroute.config import PoolConfig, ReplicaConfig, expand_dp_ranks
from kvroute.core.router import ReplicaSpec, RouterCore
from kvroute.core.types import PoolName, ReplicaId
from kvroute.shell.metrics import RouterMetrics
from kvroute.wire.dp_rank import DpRankError, rank_count

__all__ = ["DpRankWatch", "Members", "MembershipHook", "Resize", "apply_resize", "routed_names"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Resize:
    """One engine's entries to replace: ``leaving`` out, ``joining`` in (same pool)."""

    pool: PoolConfig
    engine: str
    leaving: tuple[ReplicaConfig, ...]
    joining: tuple[ReplicaConfig, ...]


@dataclass(slots=True)
class _Engine:
    configured: ReplicaConfig  # the YAML replica, unexpanded
    pool: PoolConfig
    members: tuple[ReplicaConfig, ...]


class DpRankWatch:
    """Learns each ``dp_auto`` engine's rank count and says which entries to swap.

    Args:
        pools: the pools whose configured replicas are watched.
        metrics: where mismatches and refused expansions are counted.
    """

    def __init__(self, pools: Iterable[PoolConfig], metrics: RouterMetrics) -> None:
        self._metrics = metrics
        self._engines: dict[str, _Engine] = {}
        self._pending: dict[str, int] = {}
        self._told: dict[str, int] = {}  # the count last logged per engine (once each)
        for pool in pools:
            for rep in pool.replicas:
                if rep.dp_auto:
                    self._engines[rep.name] = _Engine(rep, pool, (rep,))

    def size(self, engine: str) -> int | None:
        """How many ranks ``engine`` (a ``dp_auto`` replica's name) is routed as now."""
        known = self._engines.get(engine)
        return None if known is None else len(known.members)

    def observe(self, rep: ReplicaConfig, engines: Iterable[str]) -> None:
        """``rep``'s ``/metrics`` showed these ``engine`` label values."""
        engine = rep.engine if rep.dp_rank is not None and rep.engine is not None else rep.name
        try:
            seen = rank_count(engines)
        except DpRankError as exc:
            self._tell(engine, -1, rep.name, "dp_labels_unusable",
                       f"replica %s: {exc}; its rank count is left as it is", rep.name)
            return
        if seen is None:
            return  # the engine does not label its ranks: nothing to learn
        known = self._engines.get(engine)
        if known is None:  # a fixed count (config, or a Kubernetes member)
            if seen != rep.dp_size:
                self._tell(engine, seen, rep.name, "dp_size_mismatch",
                           "replica %s: its engine runs %d data-parallel rank(s) but the "
                           "config routes it as %d; requests %s. Set data_parallel_size: %d "
                           "(or auto, or remove it) on replica %s.", rep.name, seen,
                           rep.dp_size, "miss some ranks' caches" if seen > rep.dp_size
                           else "name ranks the engine refuses (400)", seen, engine)
            return
        if seen != len(known.members):
            self._pending[engine] = seen
        else:
            self._pending.pop(engine, None)

    def take_resizes(self, taken: frozenset[ReplicaId]) -> list[Resize]:
        """The resizes observed since the last call; ``taken``: every replica name in use
        now (a rank name that is taken by another replica refuses the resize)."""
        out = []
        pending, self._pending = self._pending, {}
        for engine, size in pending.items():
            known = self._engines[engine]
            try:
                joining = ((known.configured,) if size == 1
                           else expand_dp_ranks(known.configured, size))
            except DpRankError as exc:
                self._tell(engine, size, engine, "dp_expansion_refused",
                           "replica %s: its engine runs %d data-parallel ranks but they cannot "
                           "be followed: the event endpoint %s; it stays routed as %d. Give "
                           "kv_events a tcp endpoint and leave %d ports after kv_events and "
                           "after kv_replay, or set data_parallel_size.", engine, size, exc,
                           len(known.members), size)
                continue
            leaving = {rep.name for rep in known.members}
            clash = sorted(rep.name for rep in joining
                           if rep.name in taken and rep.name not in leaving)
            if clash:
                self._tell(engine, size, engine, "dp_expansion_refused",
                           "replica %s: its engine runs %d data-parallel ranks but the name "
                           "%s is another replica's; it stays routed as %d. Rename that "
                           "replica.", engine, size, clash[0], len(known.members))
                continue
            log.warning("replica %s: its engine runs %d data-parallel rank(s) (was routed as "
                        "%d): now %s", engine, size, len(known.members),
                        ", ".join(rep.name for rep in joining))
            self._metrics.discovery(engine, "dp_resized")
            out.append(Resize(known.pool, engine, known.members, joining))
            known.members = joining
            self._told.pop(engine, None)
        return out

    def _tell(self, engine: str, count: int, replica: str, outcome: str, message: str,
              *args: object) -> None:
        self._metrics.discovery(replica, outcome)
        if self._told.get(engine) != count:
            self._told[engine] = count
            log.error(message, *args)


class MembershipHook(Protocol):
    """Told when discovery changes the fleet (data-parallel ranks found or gone)."""

    def joined(self, pool: PoolName, replica: ReplicaConfig) -> None: ...
    def left(self, replica: ReplicaId) -> None: ...


class Members(Protocol):
    """The probed members a resize changes (``shell/discovery.Discovery``)."""

    def add_replica(self, pool: PoolName, rep: ReplicaConfig) -> None: ...
    def remove_replica(self, replica: ReplicaId) -> None: ...


def routed_names(core: RouterCore) -> list[ReplicaId]:
    """Every replica ``core`` routes to now (``DpRankWatch.take_resizes``'s ``taken``)."""
    return [rep.name for pool in core.pool_names() for rep in core.pool(pool).replicas]


def apply_resize(resize: Resize, core: RouterCore, members: Members,
                 hooks: Sequence[MembershipHook]) -> None:
    """Swap an engine's entries: the old ones leave as a scaled-in replica does, the new
    ones join out of routing, probed at once (``members``); ``hooks`` are told of each."""
    for old in resize.leaving:
        for hook in hooks:
            hook.left(old.name)
        members.remove_replica(old.name)
        core.remove_replica(old.name)
    for new in resize.joining:
        core.add_replica(resize.pool.name,
                         ReplicaSpec(new.name, new.prefill_rate_tps, role=new.role))
        if resize.pool.report_hits:
            core.set_hit_reports(new.name, True)
        members.add_replica(resize.pool.name, new)
        for hook in hooks:
            hook.joined(resize.pool.name, new)

"""Each engine pool's block hashing as discovery settles it, applied to ``RouterCore``.

Owns, per engine pool, the ``core.pool_hashing.PoolHashing`` record (the adopted
``(block_size, hash_algo)`` and the replicas that disagree with it) and whether the pool
routes approximately; and the effects of its decisions: ``RouterCore.set_pool_hashing``,
``kvroute_pool_approximate``, the ``hashing_mismatch``/``hashing_unusable`` counts of
``kvroute_discovery_total``, and the log lines that say what was adopted and how to fix a
replica that disagrees. The decisions themselves are pure and live in ``core/pool_hashing.py``.

A pool's hashing is never assumed. Until both values are known (config overrides, else the
engines' report) the pool routes in the declared approximate mode, and says so. The first
values read are adopted; when several replicas report in the same round, the most common
pair wins (ties: config order); when every reporting engine reports another pair (the fleet
was restarted with new settings), that pair is re-adopted. A replica whose hashing differs
from its pool's is kept out of routing until it reports correctly: ``problem`` says why,
and ``shell/discovery.py`` (which reads the reports and owns replica health) acts on it.

Called only from discovery's round task (and its start-up round), so every change to
``RouterCore`` is serialised by the event loop, as ``Discovery``'s invariant requires.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from kvroute.config import PoolConfig
from kvroute.core.errors import HashConfigError
from kvroute.core.pool_hashing import (
    Hashing,
    HashingSource,
    Mismatch,
    MismatchChange,
    PoolHashing,
    approximate_reason,
    reported_hashing,
)
from kvroute.core.router import RouterCore
from kvroute.core.types import PoolName, ReplicaId
from kvroute.shell.metrics import RouterMetrics

__all__ = ["HashingSettlement"]

# NOTE: discovery's logger, not this module's: these lines were discovery's before the
# settlement moved here, and operators filter on its name.
log = logging.getLogger("kvroute.shell.discovery")


class HashingSettlement:
    """The engine pools' block hashing: adopted, checked against each round's reports, and
    applied to ``RouterCore`` (see the module docstring).

    Args:
        pools: the engine pools (external pools have no block hashing).
        core: the router core whose pools' hashing this sets.
        metrics: where approximate mode and hashing problems are exported.
    """

    def __init__(self, pools: Iterable[PoolConfig], core: RouterCore,
                 metrics: RouterMetrics) -> None:
        self._core = core
        self._metrics = metrics
        # Each engine pool's adopted (block_size, hash_algo) and the replicas that disagree.
        self._hashing: dict[PoolName, PoolHashing] = {pool.name: PoolHashing() for pool in pools}
        self._approximate: dict[PoolName, bool] = {}
        # Replicas already warned that they report only one of the two values.
        self._warned_partial: set[ReplicaId] = set()

    # -- queries --------------------------------------------------------------------------

    def adopted(self, pool: str) -> Hashing | None:
        """The pool's adopted ``(block_size, hash_algo)``, or None while still unknown."""
        hashing = self._hashing.get(PoolName(pool))
        return None if hashing is None else hashing.adopted

    def approximate(self, pool: str) -> bool:
        """True while ``pool`` routes approximately (hashing unknown, or no tokenizer)."""
        return self._approximate.get(PoolName(pool), True)

    def problem(self, pool: PoolName, replica: ReplicaId) -> str | None:
        """Why ``replica``'s hashing keeps it out of routing, or None when it does not."""
        mismatch = self._hashing[pool].mismatch(replica)
        return None if mismatch is None else _mismatch_text(pool, mismatch)

    def reported(self, pool: PoolConfig, replica: ReplicaId, *, block_size: int | None,
                 hash_algo: str | None) -> Hashing | None:
        """The replica's hashing as this pool would use it (config overrides win).

        Args:
            block_size / hash_algo: what the replica's ``vllm:cache_config_info`` reports
                (None: not reported). A replica reporting only one is warned about once.
        """
        report = reported_hashing(
            configured_block_size=pool.block_size, configured_hash_algo=pool.hash_algo,
            block_size=block_size, hash_algo=hash_algo,
        )
        partial = block_size is not None or hash_algo is not None
        if report is None and partial and replica not in self._warned_partial:
            self._warned_partial.add(replica)
            log.warning(
                "replica %s reports block_size=%s prefix_caching_hash_algo=%s; both are "
                "needed for exact routing: set pools.%s.block_size/hash_algo if the engine "
                "cannot report them", replica, block_size, hash_algo, pool.name,
            )
        return report

    # -- changes --------------------------------------------------------------------------

    def start(self, pool: PoolConfig) -> None:
        """Before the first round: adopt the config's hashing when it gives both values,
        else tell the core to hash the pool approximately until the engines report."""
        if pool.block_size is not None and pool.hash_algo is not None:
            self._adopt(pool, (pool.block_size, pool.hash_algo), source=HashingSource.CONFIG)
        else:
            # Nothing adopted (PoolHashing starts unknown): the core hashes approximately.
            spec = self._core.pool(pool.name)
            self._core.set_pool_hashing(
                pool.name, block_size=spec.block_size, hash_algo=spec.hash_algo,
                hash_seed=spec.hash_seed, approximate=True,
            )
        self._set_approximate(pool)

    def settle(self, pool: PoolConfig, reports: Mapping[ReplicaId, Hashing | None]) -> None:
        """Settle ``pool`` from one round's reports (None: the replica is down or reports
        nothing usable): adopt what the engines agree on, and log and count each replica
        whose hashing starts or stops disagreeing with the pool's."""
        pool_hashing = self._hashing[pool.name]
        best = pool_hashing.choose([r for r in reports.values() if r is not None])
        if best is not None:
            # Not known yet, or every engine that reports now reports something else (the
            # fleet was restarted with new settings): adopt what the engines say.
            if pool_hashing.adopted is not None:
                log.warning("pool %s: its engines now report block_size=%d hash_algo=%s "
                            "(was %s); re-adopting", pool.name, best[0], best[1],
                            pool_hashing.adopted)
            self._adopt(pool, best, source=HashingSource.ENGINES)
        for replica, change in pool_hashing.check(reports):
            if change is MismatchChange.CLEARED:
                log.warning("replica %s now reports the pool's hashing %s", replica,
                            pool_hashing.adopted)
                continue
            log.error("replica %s %s; kept out of routing", replica,
                      self.problem(pool.name, replica))
            self._metrics.discovery(replica, "hashing_mismatch")

    def _adopt(self, pool: PoolConfig, hashing: Hashing, *, source: HashingSource) -> None:
        block_size, algo = hashing
        approximate = pool.tokenizer.mode == "none"
        try:
            self._core.set_pool_hashing(
                pool.name, block_size=block_size, hash_algo=algo, hash_seed=pool.hash_seed,
                approximate=approximate,
            )
        except HashConfigError as exc:
            if self._hashing[pool.name].unusable():
                log.error("pool %s: cannot hash like its engines (block_size=%s hash_algo=%s, "
                          "from %s): %s; routing stays approximate", pool.name, block_size, algo,
                          source, exc)
                self._metrics.discovery("*", "hashing_unusable")
            self._set_approximate(pool)
            return
        self._hashing[pool.name].adopt(hashing, source)
        log.info("pool %s: block_size=%d hash_algo=%s (from %s)", pool.name, block_size, algo,
                 source)
        self._set_approximate(pool)

    def _set_approximate(self, pool: PoolConfig) -> None:
        reason = approximate_reason(exact_tokens=pool.tokenizer.mode != "none",
                                    hashing=self._hashing[pool.name].adopted)
        on = reason is not None
        if self._approximate.get(pool.name) is on:
            return
        self._approximate[pool.name] = on
        self._metrics.set_approximate(pool.name, on)
        if on:
            log.warning("pool %s routes in APPROXIMATE mode: %s", pool.name, reason)
        else:
            log.info("pool %s routes on exact block hashes", pool.name)


def _mismatch_text(pool: PoolName, mismatch: Mismatch) -> str:
    """The replica's ``excluded_reason`` and log line for a hashing mismatch, with the fix."""
    reported, expected = mismatch.reported, mismatch.expected
    return (
        f"reports block_size={reported[0]} hash_algo={reported[1]} but pool "
        f"{pool!r} hashes with block_size={expected[0]} hash_algo={expected[1]}; "
        "run every engine of a pool with the same --block-size and "
        "--prefix-caching-hash-algo"
    )

"""A pool's block hashing, agreed from what its engines report and never assumed.

Owns one pool's adopted ``(block_size, hash_algo)``, where it came from, and which of its
replicas report something else (:class:`PoolHashing`), plus the rules that read one
replica's report (:func:`reported_hashing`) and pick among several (:func:`majority`).
Pure: no I/O, no logging; ``shell/discovery.py`` reads ``vllm:cache_config_info`` from each
engine, and ``shell/hashing_settlement.py`` hands the reports here, tells ``RouterCore`` what
to adopt, and logs and counts the changes it gets back.

Why never assume: a router hashing with another block size or algorithm than the engine
finds no block of the engine's events, and routes as if every cache were cold; worse, a
replica hashing differently from its pool would fill the pool's index with entries no
request ever matches. Until both values are known the pool routes approximately, and a
replica that disagrees with its pool is kept out of routing.

Rules, one settling round at a time:

* **A replica's report** is its engine's pair with the pool's config overriding each field
  (``pools.<name>.block_size`` / ``hash_algo``); None unless both are known.
* **Adoption** (:meth:`PoolHashing.choose`): when nothing is adopted yet, or the adopted pair
  came from the engines and no engine that reports now reports it (the fleet was restarted
  with new settings), the most common report of the round wins; a tie goes to the pair
  reported first in config order. A pair from the config is never replaced by reports.
* **Mismatch** (:meth:`PoolHashing.check`): a replica whose report differs from the adopted
  pair is recorded with both pairs; it is said (``MismatchChange.NEW``) once per distinct
  pair of pairs, and cleared (``CLEARED``) when its report equals the adopted pair again.
  While the pool has a hashing, a replica without a report keeps its mismatch: a replica
  that is down proves nothing.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvroute.core.types import ReplicaId

__all__ = [
    "Hashing",
    "HashingSource",
    "Mismatch",
    "MismatchChange",
    "PoolHashing",
    "approximate_reason",
    "majority",
    "reported_hashing",
]

Hashing = tuple[int, str]
"""``(block_size, hash_algo)``."""


class HashingSource(enum.StrEnum):
    """Where a pool's adopted hashing came from."""

    CONFIG = "config"
    ENGINES = "engines"


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A replica that hashes otherwise than its pool.

    Attributes:
        reported: the replica's report.
        expected: the pool's adopted hashing at the time.
    """

    reported: Hashing
    expected: Hashing


class MismatchChange(enum.Enum):
    """What :meth:`PoolHashing.check` found new about one replica."""

    NEW = "new"
    """It reports otherwise than the pool (or otherwise than last time): say it once."""
    CLEARED = "cleared"
    """It had a mismatch and now reports the pool's hashing."""


def reported_hashing(*, configured_block_size: int | None, configured_hash_algo: str | None,
                     block_size: int | None, hash_algo: str | None) -> Hashing | None:  # fmt: skip
    """A replica's hashing as its pool would use it: config overrides win per field.

    Args:
        configured_block_size / configured_hash_algo: the pool's config, None when unset.
        block_size / hash_algo: what the engine reported, None when it did not.

    Returns:
        ``(block_size, hash_algo)``, or None while either is unknown.
    """
    size = configured_block_size if configured_block_size is not None else block_size
    algo = configured_hash_algo if configured_hash_algo is not None else hash_algo
    if size is None or algo is None:
        return None
    return size, algo


def majority(reports: Sequence[Hashing]) -> Hashing:
    """The most common report; on a tie, the one that comes first in ``reports``.

    Raises:
        ValueError: ``reports`` is empty.
    """
    if not reports:
        raise ValueError("majority of no reports: there is nothing to adopt")
    counts = Counter(reports)
    # NOTE: max() returns the first of equal keys, so ties go to config order, which an
    # operator can read and change, rather than to whichever replica answered first.
    return max(reports, key=counts.__getitem__)


def approximate_reason(*, exact_tokens: bool, hashing: Hashing | None) -> str | None:
    """Why a pool routes approximately, or None when it routes on exact block hashes.

    Args:
        exact_tokens: the pool has a tokenizer (not ``tokenizer: none``).
        hashing: the pool's adopted hashing, None while unknown.
    """
    if not exact_tokens:
        return "tokenizer: none (no exact prompt tokens)"
    if hashing is None:
        return "block size and hash algorithm not yet read from its engines"
    return None


class PoolHashing:
    """One pool's adopted hashing and its replicas that disagree (module docstring).

    Attributes:
        adopted: the pool's ``(block_size, hash_algo)``; None while unknown (approximate).
        source: where ``adopted`` came from; the last source adopted, even after
            ``unusable`` cleared ``adopted``.
    """

    __slots__ = ("_mismatches", "_unusable", "adopted", "source")

    def __init__(self) -> None:
        self.adopted: Hashing | None = None
        self.source: HashingSource | None = None
        self._mismatches: dict[ReplicaId, Mismatch] = {}
        self._unusable = False

    def choose(self, reports: Sequence[Hashing]) -> Hashing | None:
        """The hashing to adopt now, or None to keep the pool's.

        Args:
            reports: the reports of the replicas that are up, in config order (replicas
                without a report left out).
        """
        if not reports:
            return None
        if self.adopted is None or (
            self.source is HashingSource.ENGINES and self.adopted not in reports
        ):
            return majority(reports)
        return None

    def adopt(self, hashing: Hashing, source: HashingSource) -> None:
        """The core now hashes the pool with ``hashing``."""
        self.adopted = hashing
        self.source = source
        self._unusable = False

    def unusable(self) -> bool:
        """The core cannot hash like the engines: the pool's hashing is unknown again.

        Returns:
            True for the first such failure since the last ``adopt`` (say it once).
        """
        self.adopted = None
        first = not self._unusable
        self._unusable = True
        return first

    def check(self, reports: Mapping[ReplicaId, Hashing | None],
              ) -> list[tuple[ReplicaId, MismatchChange]]:  # fmt: skip
        """Compare every replica's report with the adopted hashing.

        Args:
            reports: every replica of the pool, in config order; None for a replica that
                is down or reports no hashing.

        Returns:
            The replicas whose mismatch is new or cleared, in the order of ``reports``.
        """
        expected = self.adopted
        changes: list[tuple[ReplicaId, MismatchChange]] = []
        for replica, report in reports.items():
            if expected is None or report is None or report == expected:
                # NOTE: kept exactly as discovery always judged it: only a report equal to
                # the adopted pair clears a mismatch (None equals None while nothing is
                # adopted, so a replica that is down then loses its mismatch too).
                if report == expected and self._mismatches.pop(replica, None) is not None:
                    changes.append((replica, MismatchChange.CLEARED))
                continue
            mismatch = Mismatch(report, expected)
            if self._mismatches.get(replica) != mismatch:
                changes.append((replica, MismatchChange.NEW))
            self._mismatches[replica] = mismatch
        return changes

    def mismatch(self, replica: ReplicaId) -> Mismatch | None:
        """The replica's recorded mismatch, or None when it agrees (or never reported)."""
        return self._mismatches.get(replica)

"""Version groups: which replicas run the same weights, and which group a session stays in.

``RouterCore`` keeps one :class:`ReplicaVersions`: discovery (live) or the fleet (simulator)
tells it each replica's :class:`~kvroute.core.model_identity.ModelIdentity`; an identity that
differs from the one known before is an :class:`IdentityChange`, on which the router drops the
replica's index entries and learned rates at once (a restart on other weights, a hot weight
update: whatever the replica cached or measured belongs to weights it no longer runs).

A pool whose healthy replicas disagree is split into *version groups* (replicas of one
version). A request of a session is routed inside one group only (:func:`choose_group`), and
the session record remembers the group's version, so a conversation never alternates between
weights. Which group a session takes:

1. the group it was in, while that group still has a healthy replica — unless an upgrade
   moves sessions to the route's preferred (newest, ready) version at their next turn
   (a turn boundary: a request that arrives, never one in flight);
2. else the preferred version, when the route names one and it has replicas;
3. else, when the route does not salt by version, no group at all: a session with no
   version yet (or whose version left) may go to any replica, the cost policy chooses, and
   the version of the replica it lands on becomes its group (``any``);
4. else (salted: the hashes depend on the version, so it must be known before routing) the
   largest group (most healthy replicas), ties to the version seen first.

Every version is recorded with the order it was first seen in (``first_seen``), which is what
"newest" means for an upgrade (``core/scenarios.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvroute.core.model_identity import ModelIdentity
from kvroute.core.types import ReplicaId

__all__ = ["GroupChoice", "IdentityChange", "ReplicaVersions", "choose_group"]


@dataclass(frozen=True, slots=True)
class IdentityChange:
    """A replica's identity differs from the one known before: ``before`` → ``after``."""

    replica: ReplicaId
    before: ModelIdentity
    after: ModelIdentity


@dataclass(frozen=True, slots=True)
class GroupChoice:
    """The version group a request is routed in.

    Attributes:
        version: the group's version.
        replicas: the group's replicas (the request may go to these only); empty when
            the pool runs one version (every replica of the pool is in it).
        moved_from: the session's previous version when it changes group now, else None.
        why: ``stay``, ``only`` (one group), ``upgrade`` (moved to the preferred version),
            ``gone`` (the old group has no healthy replica left), ``preferred``,
            ``largest``, ``any`` (no group imposed: ``version`` is ``""`` and ``replicas``
            holds every group's).
    """

    version: str
    replicas: frozenset[ReplicaId]
    moved_from: str | None
    why: str


class ReplicaVersions:
    """Each replica's model identity and the order versions were first seen in."""

    __slots__ = ("_by_version", "_first_seen", "_identity", "_replaced_by")

    def __init__(self) -> None:
        self._identity: dict[ReplicaId, ModelIdentity] = {}
        self._first_seen: dict[str, int] = {}
        self._by_version: dict[str, ModelIdentity] = {}
        self._replaced_by: dict[str, set[str]] = {}

    def observe(self, replica: ReplicaId, identity: ModelIdentity) -> IdentityChange | None:
        """Record ``replica``'s identity; the change, when it had another one before."""
        before = self._identity.get(replica)
        self._identity[replica] = identity
        self._first_seen.setdefault(identity.version, len(self._first_seen))
        self._by_version[identity.version] = identity
        if before is None or before == identity:
            return None
        if before.version != identity.version:
            self._replaced_by.setdefault(before.version, set()).add(identity.version)
        return IdentityChange(replica, before, identity)

    def running(self) -> set[str]:
        """The versions some replica runs now."""
        return {identity.version for identity in self._identity.values()}

    def seen(self) -> list[str]:
        """Every version seen, oldest first."""
        return sorted(self._first_seen, key=self._first_seen.__getitem__)

    def identity_of(self, version: str) -> ModelIdentity | None:
        """The identity last seen with ``version`` (also after no replica runs it any more:
        a shared store may still hold blocks it wrote)."""
        return self._by_version.get(version)

    def earlier(self, version: str) -> list[str]:
        """The versions first seen before ``version``, newest first."""
        mine = self.first_seen(version)
        return sorted((v for v, order in self._first_seen.items() if order < mine),
                      key=lambda v: -self._first_seen[v])

    def predecessors(self, version: str) -> set[str]:
        """The versions some replica ran before it changed (directly or through others)
        to ``version``: what a verdict about ``version``'s replicas may have named before
        their weights changed."""
        out: set[str] = set()
        frontier = {version}
        while frontier:
            frontier = {old for old, new in self._replaced_by.items()
                        if new & frontier and old not in out and old != version}
            out |= frontier
        return out

    @property
    def known(self) -> bool:
        """Some replica's identity has been read (else there are no groups to keep)."""
        return bool(self._identity)

    def identity(self, replica: ReplicaId) -> ModelIdentity | None:
        return self._identity.get(replica)

    def replicas_of(self, version: str) -> list[ReplicaId]:
        """The replicas that run ``version`` now (sorted)."""
        return sorted(r for r, identity in self._identity.items() if identity.version == version)

    def version(self, replica: ReplicaId) -> str | None:
        """The replica's version, or None while no identity has been read."""
        identity = self._identity.get(replica)
        return None if identity is None else identity.version

    def first_seen(self, version: str) -> int:
        """The order ``version`` was first seen in (unseen versions sort last)."""
        return self._first_seen.get(version, len(self._first_seen))

    def groups(self, replicas: Iterable[ReplicaId]) -> dict[str, list[ReplicaId]]:
        """``replicas`` by version, in the order given. A replica whose identity is not
        known yet joins the pool's only group when there is one, else is left out: it is
        routed once its identity is read."""
        out: dict[str, list[ReplicaId]] = {}
        unknown: list[ReplicaId] = []
        for replica in replicas:
            version = self.version(replica)
            if version is None:
                unknown.append(replica)
            else:
                out.setdefault(version, []).append(replica)
        if not out:
            return {"": unknown} if unknown else {}
        if len(out) == 1:
            only = next(iter(out))
            out[only] = [*out[only], *unknown]
        return out

    def same_tokenizer(self, a: Iterable[ReplicaId], b: Iterable[ReplicaId]) -> bool:
        """Proven: every replica of ``a`` and ``b`` has a known tokenizer fingerprint, and
        they are all the same (so token ids of one are valid for the other)."""
        seen: set[str | None] = set()
        count = 0
        for replica in (*a, *b):
            identity = self._identity.get(replica)
            seen.add(None if identity is None else identity.tokenizer)
            count += 1
        return count > 0 and len(seen) == 1 and None not in seen

    def newest(self, versions: Iterable[str]) -> str | None:
        """The most recently first-seen of ``versions``."""
        return max(versions, key=self.first_seen, default=None)


def choose_group(groups: Mapping[str, Sequence[ReplicaId]], session_version: str | None, *,
                 preferred: str | None = None, move_sessions: bool = False,
                 first_seen: Mapping[str, int] | None = None,
                 pick_for_new: bool = True) -> GroupChoice | None:
    """The group a request is routed in (module docstring); None when ``groups`` is empty.

    Args:
        groups: the pool's healthy replicas by version (:meth:`ReplicaVersions.groups`).
        session_version: the version the session's record names, if any.
        preferred: the version new sessions should take (an upgrade's target once ready).
        move_sessions: move a session on another version to ``preferred`` at this turn.
        first_seen: version → order first seen (ties between equal groups go to the
            earliest: the version that was serving).
        pick_for_new: a session without a group gets the largest one (salted routes);
            False leaves it free (``any``).
    """
    if not groups:
        return None
    order = first_seen or {}

    def pick(version: str, moved_from: str | None, why: str) -> GroupChoice:
        return GroupChoice(version, frozenset(groups[version]), moved_from, why)

    if len(groups) == 1:
        only = next(iter(groups))
        moved = session_version if session_version not in (None, only) else None
        return pick(only, moved, "only" if moved is None else "gone")
    if session_version is not None and session_version in groups:
        if (move_sessions and preferred is not None and preferred in groups
                and preferred != session_version):
            return pick(preferred, session_version, "upgrade")
        return pick(session_version, None, "stay")
    gone = session_version  # the session's group has no healthy replica left (or none)
    if preferred is not None and preferred in groups:
        return pick(preferred, gone, "preferred" if gone is None else "gone")
    if not pick_for_new:
        every = frozenset(r for members in groups.values() for r in members)
        return GroupChoice("", every, gone, "any")
    largest = min(groups, key=lambda v: (-len(groups[v]), order.get(v, len(order)), v))
    return pick(largest, gone, "largest" if gone is None else "gone")

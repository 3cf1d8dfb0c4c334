"""The router's verdict book: may this request be served from state other weights computed?

``kvroute gate`` writes verdicts (``core/gate.py``, persisted by ``shell/gate_store.py``);
this book is how the router reads them while it routes. Wherever the walk would serve a
request from state the serving weights did not compute, it asks :meth:`VerdictBook.allows`
with both sides' versions (weights fingerprints) and the transfer path, and uses the path
only on ``pass``; every other answer recomputes (the fallback is the default, so it never
goes cold). The paths the router has:

* :data:`PD_PATH` (``cross-engine``): a disaggregated split whose prefill replica runs other
  weights than its decode replica (the KV one engine wrote, decoded on another's weights);
* :data:`SALT_PATH` (``shared-store``): on a version-salted route, a new version keeping an
  older version's ``cache_salt``, so the blocks the older weights wrote (in a shared CPU/disk
  store, or a replica's own cache after a hot update) serve the new version.

An answer (:class:`Ruling`) is one of

* ``pass`` / ``fail``: a verdict for exactly these two sides as they are now (versions and
  tokenizer fingerprints) says so;
* ``stale``: a verdict exists for these replicas but either side changed since: a replica
  that the verdict's version named now runs other weights (``ReplicaVersions.predecessors``),
  or the version is the same but its tokenizer fingerprint is not;
* ``none``: nothing was ever decided for the pair.

A verdict is also ``stale`` when it was measured under other cache settings than the
replicas of either side run now: the book keeps each replica's ``vllm:cache_config_info``
labels (:meth:`VerdictBook.observe_cache`, fed by discovery) and compares the block-changing
ones (``CACHE_POLICY_KEYS``: block size, KV dtype, prefix caching, hash algorithm...) with
those the verdict recorded for that side, as ``kvroute gate allows`` does; a side whose
version no replica runs now (a shared store still holds its blocks) is compared with the
settings it last ran under. A side the verdict recorded no cache settings for, and a
replica whose settings are not read yet, are not compared (nothing to compare with).

Pure: the verdicts come in as a :class:`~kvroute.core.gate.VerdictStore` the shell loaded
(and swaps on reload, :meth:`VerdictBook.load`); identities come from the router core's
:class:`~kvroute.core.versions.ReplicaVersions`, which discovery feeds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from kvroute.core.gate import PATHS, Verdict, VerdictStore
from kvroute.core.shadow_replay import CACHE_POLICY_KEYS
from kvroute.core.types import ReplicaId
from kvroute.core.versions import ReplicaVersions

__all__ = ["PD_PATH", "SALT_PATH", "STATUSES", "GateRefusal", "Ruling", "Status", "VerdictBook",
           "salt_version"]

Status = Literal["pass", "fail", "stale", "none"]
STATUSES: Final[tuple[Status, ...]] = ("pass", "fail", "stale", "none")

PD_PATH: Final = "cross-engine"
"""The gate path a cross-version prefill→decode split needs (state one engine's weights wrote,
decoded on another's)."""

SALT_PATH: Final = "shared-store"
"""The gate path a new version needs to keep an older version's ``cache_salt``."""


@dataclass(frozen=True, slots=True)
class Ruling:
    """The book's answer for one pair: ``status`` and, in words, why."""

    status: Status
    reason: str

    @property
    def allowed(self) -> bool:
        return self.status == "pass"


_NATIVE: Final = Ruling("pass", "same weights: native state, no verdict needed")


class VerdictBook:
    """Verdicts as the router reads them, against the replicas' identities now."""

    __slots__ = ("_cache", "_last_by_version", "_store", "_versions")

    def __init__(self, versions: ReplicaVersions, store: VerdictStore | None = None) -> None:
        self._versions = versions
        self._store = store if store is not None else VerdictStore()
        self._cache: dict[ReplicaId, dict[str, str]] = {}
        self._last_by_version: dict[str, tuple[ReplicaId, dict[str, str]]] = {}

    def observe_cache(self, replica: ReplicaId, cache_config: Mapping[str, str]) -> None:
        """Record ``replica``'s cache settings now (its ``vllm:cache_config_info`` labels;
        only ``CACHE_POLICY_KEYS`` are kept). An empty mapping (the engine does not report
        them) is not recorded."""
        if cache_config:
            settings = {k: str(cache_config[k]) for k in CACHE_POLICY_KEYS if k in cache_config}
            self._cache[replica] = settings
            version = self._versions.version(replica)
            if version is not None:  # what wrote that version's blocks, once it runs nowhere
                self._last_by_version[version] = (replica, settings)

    def forget_cache(self, replica: ReplicaId) -> None:
        """``replica`` left the fleet."""
        self._cache.pop(replica, None)

    def _settings_changed(self, verdict: Verdict, side: str, version: str) -> str | None:
        """How the replicas of ``version`` now differ from the cache settings ``verdict``
        recorded for ``side``, in words; None when they do not (or nothing to compare)."""
        recorded = {k[len(side) + 1:]: str(v) for k, v in verdict.cache_policy.items()
                    if k.startswith(side + ".") and k[len(side) + 1:] in CACHE_POLICY_KEYS}
        if not recorded:
            return None
        running = self._versions.replicas_of(version)
        seen = [(r, self._cache[r], "") for r in running if r in self._cache]
        if not running and version in self._last_by_version:
            # No replica runs it now (a shared store still holds what it wrote): the
            # settings it last ran under are the ones its blocks were written with.
            replica, settings = self._last_by_version[version]
            seen = [(replica, settings, f" when it last ran {version}")]
        for replica, now, when in seen:
            changed = sorted(k for k in recorded.keys() | now.keys()
                             if recorded.get(k) != now.get(k))
            if changed:
                return ", ".join(f"{side}.{k}: {recorded.get(k)} -> {now.get(k)}"
                                 for k in changed) + f" on {replica}{when}"
        return None

    def load(self, store: VerdictStore) -> None:
        """Use ``store``'s verdicts from now on (the shell reloaded the file)."""
        self._store = store

    def __len__(self) -> int:
        return len(self._store)

    def allows(self, serving: str, source: str, path: str) -> Ruling:
        """May ``path`` serve the weights of version ``serving`` from state version
        ``source``'s weights computed? (module docstring). Same version: native, ``pass``.

        Raises:
            ValueError: ``path`` is not one of the gate's paths.
        """
        if path not in PATHS:
            raise ValueError(f"unknown transfer path {path!r}; use one of {', '.join(PATHS)}")
        if serving == source:
            return _NATIVE
        a, b = self._versions.identity_of(serving), self._versions.identity_of(source)
        tok_a = None if a is None else a.tokenizer
        tok_b = None if b is None else b.tokenizer
        same_versions: Verdict | None = None
        for verdict in self._store:
            k = verdict.key
            if k.path != path or k.serving_version != serving or k.source_version != source:
                continue
            if k.serving_tokenizer == tok_a and k.source_tokenizer == tok_b:
                drift = (self._settings_changed(verdict, "serving", serving)
                         or self._settings_changed(verdict, "source", source))
                if drift is not None:
                    return Ruling("stale", f"{path} {serving} <- {source}: the verdict was "
                                  f"measured under other cache settings ({drift}); run "
                                  "`kvroute gate replay` on the replicas as they are now")
                word: Status = "pass" if verdict.passed else "fail"
                return Ruling(word, f"{path} {serving} <- {source}: {verdict.reason}")
            same_versions = verdict
        if same_versions is not None:
            return Ruling("stale", f"{path} {serving} <- {source}: the verdict names other "
                          "tokenizer fingerprints than the replicas have now; run "
                          "`kvroute gate replay` again")
        before_a = self._versions.predecessors(serving) | {serving}
        before_b = self._versions.predecessors(source) | {source}
        for verdict in self._store:
            k = verdict.key
            if (k.path == path and k.serving_version in before_a
                    and k.source_version in before_b):
                changed = [f"{side} {old} -> {new}" for side, old, new in (
                    ("serving", k.serving_version, serving),
                    ("source", k.source_version, source)) if old != new]
                return Ruling("stale", f"{path} {serving} <- {source}: the verdict was for "
                              f"weights since replaced ({', '.join(changed)}); run "
                              "`kvroute gate replay` on the replicas as they are now")
        return Ruling("none", f"{path} {serving} <- {source}: no verdict for this pair; "
                      "recompute")


@dataclass(frozen=True, slots=True)
class GateRefusal:
    """A path the router would have used but the book refused: counted on ``/metrics``
    (``kvroute_gate_refusals_total{path,reason}``) with the tokens recomputed because of it.

    Attributes:
        path: the gate path (:data:`PD_PATH`, :data:`SALT_PATH`).
        status: the ruling's status (``fail``, ``stale`` or ``none``).
        serving / source: the two versions.
        reason: the ruling's words.
        recomputed_tokens: prompt tokens computed natively instead of taken from the
            refused state (0 when the fallback recomputes nothing extra, e.g. a split
            paired within the version group).
    """

    path: str
    status: Status
    serving: str
    source: str
    reason: str
    recomputed_tokens: int = 0


def salt_version(version: str, versions: ReplicaVersions,
                 book: VerdictBook) -> tuple[str, GateRefusal | None]:
    """The version whose ``cache_salt`` requests served by ``version`` carry on a
    version-salted route, and the refusal when an older version's salt was not allowed.

    Versions sharing a salt share blocks both ways, in a shared store and in an engine's
    cache: every version that writes under the salt serves every other one. So, taking the
    versions oldest first, a version joins an older version's salt class only when, for
    every member ``m`` of the class, the book passes ``(version, m, shared-store)`` (it may
    be served from what ``m`` wrote) and, for every member still running on a replica,
    ``(m, version, shared-store)`` too (``m`` would be served from what it writes). Classes
    are tried newest first; a version that joins none keeps its own salt (fail closed:
    recompute). Deterministic: every router process assigns the same classes from the same
    verdicts and identities.
    """
    order = versions.seen()
    if version not in order or order[0] == version:
        return version, None  # unknown, or the oldest (a fleet on one version: every request)
    running = versions.running()
    classes: list[list[str]] = []  # each class: its members, oldest first; salt = members[0]
    refusal: GateRefusal | None = None
    for v in order[: order.index(version) + 1]:
        joined = False
        first_no: Ruling | None = None
        for members in reversed(classes):
            ruling = _may_share(v, members, running, book)
            if ruling.allowed:
                members.append(v)
                joined = True
                break
            if first_no is None:
                first_no = ruling
        if not joined:
            classes.append([v])
        if v == version:
            if not joined and first_no is not None:
                nearest = classes[-2][-1] if len(classes) > 1 else version
                refusal = GateRefusal(SALT_PATH, first_no.status, version, nearest,
                                      first_no.reason)
            return (next(c[0] for c in classes if v in c)), refusal
    return version, None  # unreachable: version is in order


def _may_share(v: str, members: list[str], running: set[str], book: VerdictBook) -> Ruling:
    """``pass`` when ``v`` may share the salt of ``members`` (:func:`salt_version`), else the
    first ruling that refuses it."""
    for m in reversed(members):
        ruling = book.allows(v, m, SALT_PATH)
        if not ruling.allowed:
            return ruling
        if m in running:
            back = book.allows(m, v, SALT_PATH)
            if not back.allowed:
                return Ruling(back.status, f"{back.reason} ({m} still runs and would be "
                              f"served from what {v} writes)")
    return Ruling("pass", f"{SALT_PATH}: {v} shares the salt of {', '.join(members)}")

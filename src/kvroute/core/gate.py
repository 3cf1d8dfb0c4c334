"""The transfer-fidelity gate's verdicts: keyed by both sides' fingerprints, stale on any change.

A *pair* is (serving model version, state source version, transfer path): may a request be
served on the serving weights from state the source weights (or a lossy path) computed,
instead of recomputing it? The router has no such path today (every move recomputes,
``core/scenarios.py``), and this module is what must exist before anyone adds one
(docs/model-bound-caches.md, "The gate"):

* :func:`tokenizer_verdict`: the first check of any evaluation. Two sides whose tokenizer
  fingerprints differ (vocabulary, merges, added and special tokens, chat template:
  ``core/model_identity.tokenizer_fingerprint``) fail at once, and the evaluation ends there;
  unknown fingerprints fail too (unproven is not identical).
* :class:`Verdict`: a decision for one pair, with the engines' cache settings it was measured
  under (the cache-policy audit) and its scores per workload class.
* :class:`VerdictStore`: verdicts keyed by :class:`PairKey`, whose parts are the two sides'
  *versions* (weights fingerprints) and tokenizer fingerprints: when either side's weights
  change, the key changes and no verdict is found, so a verdict is stale by construction.
  :meth:`VerdictStore.allows` is the only question a router asks: a current, passing verdict
  whose recorded cache settings equal the engines' settings now. Anything else recomputes;
  the fallback never goes cold because it is the default.

The shadow replay that produces a passing or failing verdict after identity is scored in
``core/shadow_replay.py`` and run by ``shell/shadow_replay.py`` (``kvroute gate replay``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

from kvroute.core.model_identity import ModelIdentity

__all__ = [
    "PATHS",
    "PairKey",
    "Verdict",
    "VerdictStore",
    "tokenizer_verdict",
]

PATHS: Final = ("prefix-cache-hit", "cross-engine", "shared-store", "lossy-kv")
"""Transfer paths a verdict can be about: a prefix-cache hit versus recompute on one engine,
state computed by another engine (other weights), a shared KV store (CPU offload, LMCache,
disaggregated prefill), a lossy KV setting (e.g. an FP8 KV cache)."""


@dataclass(frozen=True, slots=True)
class PairKey:
    """What a verdict is about: both sides' versions and tokenizers, and the path."""

    serving_version: str
    serving_tokenizer: str | None
    source_version: str
    source_tokenizer: str | None
    path: str

    @classmethod
    def of(cls, serving: ModelIdentity, source: ModelIdentity, path: str) -> PairKey:
        """The key of ``(serving, source, path)``.

        Raises:
            ValueError: ``path`` is not one of ``PATHS``.
        """
        if path not in PATHS:
            raise ValueError(f"unknown transfer path {path!r}; use one of {', '.join(PATHS)}")
        return cls(serving.version, serving.tokenizer, source.version, source.tokenizer, path)


@dataclass(frozen=True, slots=True)
class Verdict:
    """One decision for a pair.

    Attributes:
        key: the pair.
        passed: the path may be used.
        reason: why, in words (``tokenizer mismatch: ...``, ``replay passed ...``).
        cache_policy: the engines' cache settings it was measured under (block size, hash
            algorithm, KV dtype, eviction, ...); a verdict is void once they change.
        scores: per workload class, the fidelity measured (empty for a verdict that ended
            before the replay).
        decided_at: when (seconds since the epoch, from the caller).
    """

    key: PairKey
    passed: bool
    reason: str
    cache_policy: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    scores: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    decided_at: float = 0.0


def tokenizer_verdict(serving: ModelIdentity, source: ModelIdentity, path: str, *,
                      decided_at: float = 0.0) -> Verdict | None:
    """The gate's first check: a failing verdict when the tokenizers are not proven
    identical (the evaluation ends), None when they are (the replay decides)."""
    key = PairKey.of(serving, source, path)
    if serving.tokenizer is None or source.tokenizer is None:
        missing = [name for name, side in (("serving", serving), ("source", source))
                   if side.tokenizer is None]
        return Verdict(key, False, f"tokenizer unknown on the {' and '.join(missing)} side: "
                       "identity cannot be proven (read a local model directory with "
                       "tokenizer.json)", decided_at=decided_at)
    if serving.tokenizer != source.tokenizer:
        return Verdict(key, False, f"tokenizer mismatch: {serving.tokenizer} (serving) != "
                       f"{source.tokenizer} (source); the evaluation ends here",
                       decided_at=decided_at)
    return None


class VerdictStore:
    """Verdicts by pair (module docstring). Pure: persistence is the shell's."""

    __slots__ = ("_verdicts",)

    def __init__(self, verdicts: Iterable[Verdict] = ()) -> None:
        self._verdicts: dict[PairKey, Verdict] = {}
        for verdict in verdicts:
            self.record(verdict)

    def __len__(self) -> int:
        return len(self._verdicts)

    def __iter__(self) -> Any:
        return iter(self._verdicts.values())

    def record(self, verdict: Verdict) -> None:
        """Keep ``verdict``, replacing the pair's older one."""
        self._verdicts[verdict.key] = verdict

    def current(self, serving: ModelIdentity, source: ModelIdentity,
                path: str) -> Verdict | None:
        """The verdict for the pair as the two sides are *now*; None when none was made
        for these versions (a weight change on either side makes the old one stale)."""
        return self._verdicts.get(PairKey.of(serving, source, path))

    def allows(self, serving: ModelIdentity, source: ModelIdentity, path: str,
               cache_policy: Mapping[str, Any]) -> bool:
        """May ``path`` serve ``serving`` from ``source``'s state? Only with a current,
        passing verdict measured under the cache settings in force now."""
        return self.decide(serving, source, path, cache_policy)[0]

    def decide(self, serving: ModelIdentity, source: ModelIdentity, path: str,
               cache_policy: Mapping[str, Any]) -> tuple[bool, str]:
        """:meth:`allows`, with the reason in words (what an operator is told)."""
        verdict = self.current(serving, source, path)
        if verdict is None:
            return False, ("no verdict for this pair as it is now (never evaluated, or either "
                           "side's weights changed since: stale); recompute")
        if not verdict.passed:
            return False, f"the verdict fails: {verdict.reason}; recompute"
        now = dict(cache_policy)
        changed = sorted(k for k in verdict.cache_policy.keys() | now.keys()
                         if verdict.cache_policy.get(k) != now.get(k))
        if changed:
            return False, ("void: the cache settings changed since the verdict ("
                           + ", ".join(f"{k}: {verdict.cache_policy.get(k)} -> {now.get(k)}"
                                       for k in changed) + "); recompute")
        return True, f"allowed: {verdict.reason}"

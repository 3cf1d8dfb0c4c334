"""A replica's ``/v1/models`` answer read: the model it serves, its window, its LoRA
adapters, and its model identity.

``shell/discovery.py`` fetches ``/v1/models`` and hands the cards here (``ModelReads.on_cards``),
which records what they say on the replica's record and tells ``RouterCore``:

* the pool's model missing: the replica is kept out of routing (``model_problem``), its
  adapters and window forgotten, until it serves the model again;
* its window (``max_model_len``), read with a time (discovery trusts it for ``window_ttl_s``);
* its LoRA adapters (cards whose ``parent`` is the pool's model) ->
  ``RouterCore.set_replica_adapters``;
* its model identity (served name, the card's ``root``, and the weights and tokenizer
  fingerprints of that directory when it is on this host, ``shell/model_files.py``) ->
  ``RouterCore.set_identity``: a changed identity drops the replica's index entries and
  learned rates (docs/model-bound-caches.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvroute.core.router import RouterCore
from kvroute.shell.discovery_records import ReplicaRecord
from kvroute.shell.metrics import RouterMetrics
from kvroute.shell.model_files import ModelFilesError, read_identity
from kvroute.wire.model_list import adapter_roots, card_window

__all__ = ["ModelReads"]

# Discovery's logger: these lines were discovery's before the split, and operators filter
# a replica's story by that name.
log = logging.getLogger("kvroute.shell.discovery")


class ModelReads:
    """Applies a replica's model cards to its record and to ``RouterCore``.

    Args:
        core: the router core told of adapters and identities.
        metrics: where outcomes are counted (``discovery_total``, scenario identities).
    """

    __slots__ = ("_core", "_metrics")

    def __init__(self, core: RouterCore, metrics: RouterMetrics) -> None:
        self._core = core
        self._metrics = metrics

    async def on_cards(self, rep: ReplicaRecord, cards: Mapping[str, Mapping[str, Any]],
                       now: float) -> None:
        """Read ``cards`` (``/v1/models`` by model id, answered at ``now``) for ``rep``."""
        name = rep.config.name
        wanted = rep.pool.model
        card = cards.get(wanted)
        if card is None:
            problem = (
                f"serves {sorted(cards)} but pool {rep.pool.name!r} expects model {wanted!r}; "
                f"fix pools.{rep.pool.name}.model or the engine's --served-model-name"
            )
            if rep.model_problem != problem:
                log.error("replica %s %s; kept out of routing", name, problem)
            rep.model_problem = problem
            rep.info.served_model = None
            rep.info.max_model_len = None
            rep.info.adapters = {}
            self._core.set_replica_adapters(name, {})
            rep.window_read_s = None
            self._metrics.discovery(name, "model_mismatch")
            return
        if rep.model_problem is not None:
            log.warning("replica %s serves %r again", name, wanted)
        rep.model_problem = None
        window = card_window(card)
        old = rep.info.max_model_len
        rep.info.served_model = wanted
        adapters = adapter_roots(cards, wanted)
        if adapters != rep.info.adapters:
            log.info("replica %s serves LoRA adapters %s", name, sorted(adapters))
            rep.info.adapters = adapters
            self._core.set_replica_adapters(name, adapters)
        root = card.get("root")
        rep.info.model_root = root if isinstance(root, str) and root else None
        if window is not None:
            rep.info.max_model_len = window
            rep.window_read_s = now
            if old is not None and old != window:
                log.warning("replica %s: window of %r changed from %d to %d tokens", name,
                            wanted, old, window)
        else:
            log.warning("replica %s: /v1/models gives no usable max_model_len for %r (%r)",
                        name, wanted, card.get("max_model_len"))
        self._metrics.discovery(name, "models_ok")
        await self.read_identity(rep)

    async def read_identity(self, rep: ReplicaRecord) -> None:
        """The replica's model identity from its card and local model directory; a change
        resets what the router believed of it (``RouterCore.set_identity``)."""
        name, info = rep.config.name, rep.info
        try:
            identity = await read_identity(rep.pool.model, info.model_root)
        except ModelFilesError as exc:
            self._metrics.discovery(name, "identity_error")
            log.warning("replica %s: %s; its model identity is unchanged", name, exc)
            return
        change = self._core.set_identity(name, identity)
        self._metrics.scenarios.identity(name, identity.version, changed=change is not None)
        if change is not None:
            log.warning("replica %s runs other weights (%s → %s): its index entries and "
                        "learned rates are dropped", name, change.before.version,
                        change.after.version)

"""The router's verdict file: ``gate.verdicts`` loaded into the core's verdict book, and
loaded again whenever it changes.

``kvroute gate replay``/``check`` write the file (``shell/gate_store.py``, atomically: a
temporary file renamed over it), so a reader sees the old document or the new one, never
half. :meth:`VerdictFile.poll` runs after every discovery round: it compares the file's
modification time and size with the last load's and, when they differ, reads it again and
swaps the book's verdicts (``core/verdict_book.VerdictBook.load``). The core never touches
the file.

A file that is not a verdict file is an error naming it: at start the router does not start
(:class:`~kvroute.shell.gate_store.GateStoreError` from :meth:`VerdictFile.load_now`);
later the error is logged, counted (``kvroute_gate_verdict_loads_total{outcome="error"}``)
and the book is emptied, so every transfer path recomputes until the file is fixed (fail
closed: a verdict the router cannot read is no verdict). A missing file is an empty store.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kvroute.core.gate import VerdictStore
from kvroute.core.verdict_book import VerdictBook
from kvroute.shell.gate_store import GateStoreError, load_store
from kvroute.shell.scenario_metrics import ScenarioMetrics

__all__ = ["VerdictFile"]

log = logging.getLogger("kvroute.gate")


class VerdictFile:
    """``path``'s verdicts kept in ``book`` (module docstring)."""

    __slots__ = ("_book", "_metrics", "_stamp", "num_loads", "path")

    def __init__(self, path: Path, book: VerdictBook, metrics: ScenarioMetrics) -> None:
        self.path = path
        self._book = book
        self._metrics = metrics
        self._stamp: tuple[int, int] | None = None
        self.num_loads = 0

    def load_now(self) -> int:
        """Load the file (the router's start): the number of verdicts.

        Raises:
            GateStoreError: the file exists but is not a verdict file.
        """
        self._stamp = self._read_stamp()
        store = load_store(self.path)
        self._use(store, ok=True)
        if self._stamp is None:
            log.warning("gate.verdicts %s does not exist yet: no verdict, every transfer "
                        "path recomputes until `kvroute gate replay --store %s` writes one",
                        self.path, self.path)
        return len(store)

    def poll(self) -> None:
        """Reload when the file changed since the last load (``num_loads`` counts loads)."""
        stamp = self._read_stamp()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            store = load_store(self.path)
        except GateStoreError as exc:
            log.error("gate.verdicts: %s; every transfer path recomputes until it is fixed",
                      exc)
            self._use(VerdictStore(), ok=False)
            return
        log.info("gate.verdicts %s reloaded: %d verdicts", self.path, len(store))
        self._use(store, ok=True)

    def _use(self, store: VerdictStore, *, ok: bool) -> None:
        self._book.load(store)
        self.num_loads += 1
        self._metrics.gate_loaded(len(store), ok=ok)

    def _read_stamp(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return st.st_mtime_ns, st.st_size

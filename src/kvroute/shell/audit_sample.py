"""The router's opt-in sample of request bodies, for ``kvroute audit``.

Owns appending every ``every``-th request (``config.AuditSampleConfig``) to a JSONL file as
``{"body": <the client's body>, "session": <its session id or null>}``, the form
``kvroute audit`` reads. The file is opened once, line-buffered; a sampled request costs one
re-encode and one small write on the event loop (the other ``every - 1`` a counter). A write
that fails is logged and turns the sample off, so a full disk never fails a request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from kvroute.config import AuditSampleConfig

__all__ = ["AuditSampler"]

log = logging.getLogger(__name__)


class AuditSampler:
    """Appends one request in ``config.every`` to ``config.path`` (module docstring)."""

    def __init__(self, config: AuditSampleConfig) -> None:
        self.path = Path(config.path)
        self.every = config.every
        self._seen = 0
        self.written = 0
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8", buffering=1)

    def offer(self, body: Mapping[str, Any], session: str | None) -> None:
        """Count one request; write it when it is the sample's turn."""
        self._seen += 1
        if self._file is None or (self._seen - 1) % self.every:
            return
        try:
            self._file.write(json.dumps({"body": body, "session": session},
                                        separators=(",", ":")) + "\n")
        except (OSError, TypeError, ValueError) as exc:
            log.error("audit sample %s: write failed (%s); sampling stopped", self.path, exc)
            self.close()
            return
        self.written += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

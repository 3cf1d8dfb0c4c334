"""The gate's verdicts on disk: one JSON file (``core/gate.py`` decides, this persists).

The file holds ``{"verdicts": [...]}``, each verdict with its pair key (both sides' versions
and tokenizer fingerprints, the path), ``passed``, ``reason``, the cache settings it was
measured under, its scores per workload class and when it was decided. Written whole to a
temporary file and renamed, so a reader never sees half a file. A file that is not such a
document is an error naming the file, never an empty store.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvroute.core.gate import PairKey, Verdict, VerdictStore

__all__ = ["GateStoreError", "load_store", "save_store"]


class GateStoreError(ValueError):
    """The verdict file cannot be read as verdicts (the message says which and why)."""


def load_store(path: Path) -> VerdictStore:
    """The verdicts in ``path``; an empty store when the file does not exist.

    Raises:
        GateStoreError: the file exists but is not a verdict file.
    """
    if not path.exists():
        return VerdictStore()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return VerdictStore(_verdict(item) for item in data["verdicts"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GateStoreError(f"{path}: not a kvroute gate verdict file ({exc}); move it "
                             "away or pass another --store") from exc


def save_store(path: Path, store: VerdictStore) -> None:
    """Write every verdict of ``store`` to ``path`` (atomically: temporary file, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"verdicts": [_encode(v) for v in store]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _encode(v: Verdict) -> dict[str, Any]:
    k = v.key
    return {"serving_version": k.serving_version, "serving_tokenizer": k.serving_tokenizer,
            "source_version": k.source_version, "source_tokenizer": k.source_tokenizer,
            "path": k.path, "passed": v.passed, "reason": v.reason,
            "cache_policy": dict(v.cache_policy), "scores": dict(v.scores),
            "decided_at": v.decided_at}


def _verdict(item: dict[str, Any]) -> Verdict:
    key = PairKey(str(item["serving_version"]), item["serving_tokenizer"],
                  str(item["source_version"]), item["source_tokenizer"], str(item["path"]))
    passed = item["passed"]
    if not isinstance(passed, bool):
        raise TypeError(f"'passed' must be true or false, got {passed!r}")
    scores = {str(c): float(s) for c, s in dict(item.get("scores", {})).items()}
    return Verdict(key, passed, str(item["reason"]),
                   MappingProxyType(dict(item.get("cache_policy", {}))),
                   MappingProxyType(scores), float(item.get("decided_at", 0.0)))

"""``gate.verdicts`` in the config, and the router's verdict file (``shell/verdict_file.py``):
loaded at start, loaded again when it changes, a bad file a clear error (fail closed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvroute.config import parse_config
from kvroute.core.errors import ConfigError
from kvroute.core.gate import PairKey, Verdict, VerdictStore
from kvroute.core.model_identity import ModelIdentity
from kvroute.core.types import ReplicaId
from kvroute.core.verdict_book import PD_PATH, VerdictBook
from kvroute.core.versions import ReplicaVersions
from kvroute.shell.gate_store import GateStoreError, save_store
from kvroute.shell.scenario_metrics import ScenarioMetrics
from kvroute.shell.verdict_file import VerdictFile

BASE = {"pools": {"main": {"model": "m", "replicas": [
    {"name": "r0", "url": "http://127.0.0.1:8101"}]}}, "routes": {"chat": {"pools": ["main"]}}}


def test_the_config_names_the_verdict_file_and_rejects_unknown_keys() -> None:
    assert parse_config(BASE).gate.verdicts is None
    assert parse_config({**BASE, "gate": {"verdicts": "/v.json"}}).gate.verdicts == "/v.json"
    with pytest.raises(ConfigError, match="gate.store: unknown key 'store'. Allowed keys here: verdicts"):
        parse_config({**BASE, "gate": {"store": "/v.json"}})
    with pytest.raises(ConfigError, match="gate.verdicts"):
        parse_config({**BASE, "gate": {"verdicts": 3}})


def passing(serving: str, source: str) -> Verdict:
    return Verdict(PairKey(serving, "t:1", source, "t:1", PD_PATH), True, "replay passed")


def setup(tmp_path: Path) -> tuple[VerdictFile, VerdictBook, CollectorRegistry, Path]:
    versions = ReplicaVersions()
    versions.observe(ReplicaId("a"), ModelIdentity("m", "/m", "w:1", "t:1"))
    versions.observe(ReplicaId("b"), ModelIdentity("m", "/m", "w:2", "t:1"))
    book = VerdictBook(versions)
    registry = CollectorRegistry()
    path = tmp_path / "verdicts.json"
    return VerdictFile(path, book, ScenarioMetrics(registry, "kvroute")), book, registry, path


def bump(path: Path, step: int) -> None:
    """A distinct modification time (file systems may keep coarse ones)."""
    ns = 1_700_000_000_000_000_000 + step * 1_000_000_000
    os.utime(path, ns=(ns, ns))


def loads(registry: CollectorRegistry, outcome: str) -> float:
    value = registry.get_sample_value("kvroute_gate_verdict_loads_total",
                                      {"outcome": outcome})
    return 0.0 if value is None else value


def test_a_missing_file_is_no_verdict_and_a_written_one_is_picked_up(tmp_path: Path) -> None:
    watch, book, registry, path = setup(tmp_path)
    assert watch.load_now() == 0
    assert book.allows("w:2", "w:1", PD_PATH).status == "none"
    watch.poll()
    assert watch.num_loads == 1  # unchanged: not read again
    save_store(path, VerdictStore([passing("w:2", "w:1")]))
    bump(path, 1)
    watch.poll()
    assert watch.num_loads == 2 and book.allows("w:2", "w:1", PD_PATH).allowed
    assert registry.get_sample_value("kvroute_gate_verdicts") == 1.0
    save_store(path, VerdictStore())  # the verdict withdrawn
    bump(path, 2)
    watch.poll()
    assert book.allows("w:2", "w:1", PD_PATH).status == "none"
    assert loads(registry, "ok") == 3.0


def test_a_bad_file_stops_the_start_and_later_empties_the_book(tmp_path: Path) -> None:
    watch, book, registry, path = setup(tmp_path)
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(GateStoreError, match="not a kvroute gate verdict file"):
        watch.load_now()
    save_store(path, VerdictStore([passing("w:2", "w:1")]))
    bump(path, 1)
    assert watch.load_now() == 1 and book.allows("w:2", "w:1", PD_PATH).allowed
    path.write_text('{"verdicts": [{"passed": "yes"}]}', encoding="utf-8")
    bump(path, 2)
    watch.poll()  # logged and counted; nothing it cannot read is trusted
    assert book.allows("w:2", "w:1", PD_PATH).status == "none"
    assert loads(registry, "error") == 1.0
    assert registry.get_sample_value("kvroute_gate_verdicts") == 0.0

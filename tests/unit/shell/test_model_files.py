"""Reading a local model directory for its identity (``shell/model_files.py``)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from kvroute.shell.model_files import ModelFilesError, read_identity_sync


def safetensors(path: Path, header: dict[str, object], payload: bytes = b"\0" * 16) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + payload)


def model(tmp_path: Path, **config: object) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    safetensors(tmp_path / "model.safetensors",
                {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}})
    (tmp_path / "tokenizer.json").write_text(json.dumps(
        {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "added_tokens": []}))
    return tmp_path


def test_a_path_that_is_not_a_local_directory_gives_no_fingerprint() -> None:
    identity = read_identity_sync("m", "meta-llama/Llama-3.1-8B")
    assert identity.fingerprint is None and identity.version == "meta-llama/Llama-3.1-8B"
    assert read_identity_sync("m", None).version == "m"


def test_a_declared_version_wins_over_the_files(tmp_path: Path) -> None:
    identity = read_identity_sync("m", str(model(tmp_path, version="2025-01")))
    assert identity.version == "v:2025-01" and identity.tokenizer is not None


def test_new_weights_in_place_change_the_fingerprint_and_the_tokenizer_stays(
        tmp_path: Path) -> None:
    root = str(model(tmp_path))
    before = read_identity_sync("m", root)
    assert before.fingerprint is not None and before.fingerprint.startswith("w:")
    assert read_identity_sync("m", root) == before  # stable while nothing changes
    weights = tmp_path / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    after = read_identity_sync("m", root)
    assert after.fingerprint != before.fingerprint and after.tokenizer == before.tokenizer


def test_another_tensor_layout_changes_the_fingerprint(tmp_path: Path) -> None:
    a = read_identity_sync("m", str(model(tmp_path / "a")))
    model(tmp_path / "b")
    safetensors(tmp_path / "b" / "model.safetensors",
                {"w": {"dtype": "F16", "shape": [2, 4], "data_offsets": [0, 16]}})
    b = read_identity_sync("m", str(tmp_path / "b"))
    assert a.fingerprint != b.fingerprint


def test_a_corrupt_directory_is_an_error_that_names_the_file(tmp_path: Path) -> None:
    root = model(tmp_path)
    (root / "config.json").write_text("{not json")
    with pytest.raises(ModelFilesError, match=r"config\.json is not valid JSON"):
        read_identity_sync("m", str(root))
    (root / "config.json").write_text("{}")
    (root / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(ModelFilesError, match="not safetensors"):
        read_identity_sync("m", str(root))

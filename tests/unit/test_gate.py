"""The gate's verdicts (``core/gate.py``), their file (``shell/gate_store.py``) and
``kvroute gate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvroute.cli import app
from kvroute.core.gate import PairKey, Verdict, VerdictStore, tokenizer_verdict
from kvroute.core.model_identity import ModelIdentity
from kvroute.shell.gate_store import GateStoreError, load_store, save_store

A = ModelIdentity("m", "/a", "w:aaaa", "t:1")
A2 = ModelIdentity("m", "/a", "w:bbbb", "t:1")  # the same path, new weights
B_SAME_TOK = ModelIdentity("m", "/b", "w:cccc", "t:1")
B_OTHER_TOK = ModelIdentity("m", "/b", "w:dddd", "t:2")


def test_a_tokenizer_mismatch_or_unknown_fails_and_identity_leaves_it_to_the_replay() -> None:
    failed = tokenizer_verdict(A, B_OTHER_TOK, "cross-engine")
    assert failed is not None and not failed.passed and "mismatch" in failed.reason
    unknown = tokenizer_verdict(A, ModelIdentity("m"), "cross-engine")
    assert unknown is not None and not unknown.passed and "source side" in unknown.reason
    assert tokenizer_verdict(A, B_SAME_TOK, "cross-engine") is None
    with pytest.raises(ValueError, match="unknown transfer path"):
        tokenizer_verdict(A, B_SAME_TOK, "telepathy")


def test_a_verdict_goes_stale_with_new_weights_and_void_with_new_cache_settings() -> None:
    policy = {"block_size": 16, "kv_dtype": "auto"}
    store = VerdictStore([Verdict(PairKey.of(A, B_SAME_TOK, "cross-engine"), True,
                                  "replay passed", policy)])
    assert store.allows(A, B_SAME_TOK, "cross-engine", policy)
    assert not store.allows(A, B_SAME_TOK, "cross-engine", {**policy, "kv_dtype": "fp8"})
    assert not store.allows(A2, B_SAME_TOK, "cross-engine", policy)  # serving side changed
    assert store.current(A2, B_SAME_TOK, "cross-engine") is None
    assert not store.allows(A, B_SAME_TOK, "shared-store", policy)  # another path
    allowed, why = store.decide(A, B_SAME_TOK, "cross-engine", {**policy, "block_size": 32})
    assert not allowed and why.startswith("void") and "block_size: 16 -> 32" in why
    assert "stale" in store.decide(A2, B_SAME_TOK, "cross-engine", policy)[1]
    assert store.decide(A, B_SAME_TOK, "cross-engine", policy) == (True, "allowed: replay passed")
    store.record(Verdict(PairKey.of(A, B_SAME_TOK, "cross-engine"), False, "replay drifted"))
    assert "the verdict fails: replay drifted" in store.decide(
        A, B_SAME_TOK, "cross-engine", policy)[1]
    assert not store.allows(A, B_SAME_TOK, "cross-engine", policy) and len(store) == 1


def test_the_store_round_trips_and_a_foreign_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "v.json"
    assert len(load_store(path)) == 0
    verdict = Verdict(PairKey.of(A, B_SAME_TOK, "lossy-kv"), False, "drift", {"kv": "fp8"},
                      {"code": 0.91}, 12.5)
    save_store(path, VerdictStore([verdict]))
    assert list(load_store(path)) == [verdict]
    path.write_text(json.dumps({"something": "else"}))
    with pytest.raises(GateStoreError, match="not a kvroute gate verdict file"):
        load_store(path)


def _model(path: Path, vocab: dict[str, int]) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "tokenizer.json").write_text(json.dumps(
        {"model": {"type": "BPE", "vocab": vocab, "merges": []}, "added_tokens": []}))
    return path


def test_gate_check_records_a_mismatch_and_show_marks_it_stale_after_new_weights(
        tmp_path: Path) -> None:
    runner = CliRunner()
    a = _model(tmp_path / "a", {"x": 0})
    b = _model(tmp_path / "b", {"x": 1})
    same = _model(tmp_path / "c", {"x": 0})
    store = tmp_path / "verdicts.json"
    ok = runner.invoke(app, ["gate", "check", str(a), str(same), "--store", str(store)])
    assert ok.exit_code == 0, ok.output
    assert "shadow replay decides" in ok.output and not store.exists()
    bad = runner.invoke(app, ["gate", "check", str(a), str(b), "--store", str(store)])
    assert bad.exit_code == 1 and "tokenizer mismatch" in bad.output
    assert len(load_store(store)) == 1
    shown = runner.invoke(app, ["gate", "show", "--store", str(store), "--serving", str(a),
                                "--source", str(b)])
    assert shown.exit_code == 0 and "yes" in shown.output
    (a / "config.json").write_text(json.dumps({"model_type": "llama", "version": "2"}))
    stale = runner.invoke(app, ["gate", "show", "--store", str(store), "--serving", str(a),
                                "--source", str(b)])
    assert stale.exit_code == 0 and "stale" in stale.output
    wrong = runner.invoke(app, ["gate", "check", str(a), str(tmp_path / "nope")])
    assert wrong.exit_code == 2


@pytest.mark.parametrize(("args", "config", "error"), [
    (["--path", "telepathy"], None, "is not a transfer path"),
    ([], "gate: {thresholds: {max_dlogprobs: 1}}", "unknown key"),
    ([], "gate: {top_k: 50}", "top_k must be an integer from 1 to 20"),
    ([], "gate: {treshold: {}}", "unknown key(s) treshold"),
    (["--transcripts", "BAD"], None, "line 1: not JSON"),
])
def test_gate_replay_rejects_bad_input_before_any_request(
        tmp_path: Path, args: list[str], config: str | None, error: str) -> None:
    extra = [a if a != "BAD" else str(tmp_path / "t.jsonl") for a in args]
    (tmp_path / "t.jsonl").write_text("{not json\n")
    if config is not None:
        (tmp_path / "gate.yaml").write_text(config)
        extra += ["--config", str(tmp_path / "gate.yaml")]
    # Port 9 (discard) on loopback: nothing answers there, and nothing may be asked.
    result = CliRunner().invoke(app, ["gate", "replay", "--serving", "http://127.0.0.1:9",
                                      "--store", str(tmp_path / "v.json"), *extra])
    said = " ".join(result.output.split())  # the console wraps long lines
    assert result.exit_code == 2 and error in said, result.output
    assert not (tmp_path / "v.json").exists()


def test_gate_replay_names_an_engine_that_does_not_answer(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["gate", "replay", "--serving", "http://127.0.0.1:9",
                                      "--store", str(tmp_path / "v.json")])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "GET http://127.0.0.1:9/v1/models failed" in said, said

"""Model identity and fingerprints (``core/model_identity.py``), version groups
(``core/versions.py``), and the identity change that resets a replica (``RouterCore``)."""

from __future__ import annotations

import json
import random

import pytest

from kvroute.core.clock import ManualClock
from kvroute.core.events import BlockStored, EventBatch
from kvroute.core.index import TenantScope
from kvroute.core.model_identity import (
    ModelIdentity,
    TokenizerFingerprintError,
    declared_version,
    tokenizer_fingerprint,
    weights_fingerprint,
)
from kvroute.core.peer_policies import make_policy
from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore, RouteRequest
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName
from kvroute.core.versions import ReplicaVersions, choose_group

R0, R1, R2 = ReplicaId("r0"), ReplicaId("r1"), ReplicaId("r2")


def test_a_declared_version_names_the_identity_and_a_corrupt_config_is_an_error() -> None:
    assert declared_version(b'{"version": "2024-06", "hidden_size": 8}') == "v:2024-06"
    assert declared_version(b'{"model_version": 3}') == "v:3"
    assert declared_version(b'{"hidden_size": 8}') is None
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        declared_version(b"{not json")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        declared_version(b"[1, 2]")


def test_the_weights_fingerprint_changes_with_any_file_and_not_with_order() -> None:
    a = {"config.json": b'{"a": 1}', "model.safetensors": b"size=10;mtime_ns=1"}
    same = dict(reversed(list(a.items())))
    other = {**a, "model.safetensors": b"size=10;mtime_ns=2"}
    assert weights_fingerprint(a) == weights_fingerprint(same)
    assert weights_fingerprint(a) != weights_fingerprint(other)
    assert weights_fingerprint(a).startswith("w:")
    with pytest.raises(ValueError, match="at least one file"):
        weights_fingerprint({})


def _tokenizer(vocab: dict[str, int], *, template: str = "{{ m }}") -> tuple[bytes, bytes]:
    tok = {"model": {"type": "BPE", "vocab": vocab, "merges": ["a b"]}, "added_tokens": []}
    cfg = {"chat_template": template, "eos_token": "</s>"}
    return json.dumps(tok).encode(), json.dumps(cfg).encode()


def test_the_tokenizer_fingerprint_sees_vocabulary_and_template_not_formatting() -> None:
    tok, cfg = _tokenizer({"a": 0, "b": 1})
    base = tokenizer_fingerprint(tok, cfg)
    reformatted = json.dumps(json.loads(tok), indent=2).encode()
    assert tokenizer_fingerprint(reformatted, cfg) == base
    assert tokenizer_fingerprint(*_tokenizer({"a": 0, "b": 2})) != base
    assert tokenizer_fingerprint(*_tokenizer({"a": 0, "b": 1}, template="other")) != base
    with pytest.raises(TokenizerFingerprintError, match="no 'model' object"):
        tokenizer_fingerprint(b'{"added_tokens": []}', None)


def test_the_version_falls_back_from_fingerprint_to_root_to_name() -> None:
    assert ModelIdentity("m", "/models/a", "w:1").version == "w:1"
    assert ModelIdentity("m", "/models/a").version == "/models/a"
    assert ModelIdentity("m").version == "m"


def test_versions_group_replicas_and_unknown_ones_join_an_only_group() -> None:
    versions = ReplicaVersions()
    assert versions.observe(R0, ModelIdentity("m", fingerprint="v1")) is None
    assert versions.groups([R0, R1]) == {"v1": [R0, R1]}  # r1 unknown: joins the only group
    versions.observe(R2, ModelIdentity("m", fingerprint="v2"))
    assert versions.groups([R0, R1, R2]) == {"v1": [R0], "v2": [R2]}  # r1 left out
    change = versions.observe(R0, ModelIdentity("m", fingerprint="v2"))
    assert change is not None and change.before.version == "v1"
    assert versions.newest(["v1", "v2"]) == "v2"


def test_a_session_stays_in_its_group_until_an_upgrade_moves_it() -> None:
    groups = {"v1": [R0, R1], "v2": [R2]}
    stay = choose_group(groups, "v1")
    assert stay is not None and stay.version == "v1" and stay.moved_from is None
    moved = choose_group(groups, "v1", preferred="v2", move_sessions=True)
    assert moved is not None and (moved.version, moved.moved_from, moved.why) == (
        "v2", "v1", "upgrade")
    kept = choose_group(groups, "v1", preferred="v2", move_sessions=False)
    assert kept is not None and kept.version == "v1"
    new = choose_group(groups, None)
    assert new is not None and new.version == "v1" and new.why == "largest"
    gone = choose_group({"v2": [R2]}, "v1")
    assert gone is not None and (gone.version, gone.moved_from) == ("v2", "v1")
    assert choose_group({}, "v1") is None


def _core() -> RouterCore:
    clock = ManualClock(10.0)
    rng = random.Random(0)
    return RouterCore([PoolSpec(PoolName("p"), (ReplicaSpec(R0, 1000.0), ReplicaSpec(R1, 1000.0)),
                                block_size=4)],
                      lambda: make_policy("kvroute", rng), clock=clock)


def test_an_identity_change_drops_the_replicas_entries_and_learned_rate() -> None:
    core = _core()
    tokens = list(range(17))
    request = RouteRequest(RequestId("q"), PoolName("p"), TenantScope(TenantName("t")),
                           len(tokens), prompt_token_ids=tokens)
    hashes, _ = core.block_hashes(request)
    core.apply_events(R0, EventBatch(0, 0.0, (BlockStored(
        block_hashes=tuple(hashes), parent_block_hash=None, token_ids=tuple(tokens[:16]),
        block_size=4, lora_id=None, medium="GPU"),)))
    core.set_identity(R0, ModelIdentity("m", "/m", "w:a"))
    assert core.cached_tokens_on(R0, request) == 16
    core.load._replicas[R0].rate_tps = 10.0  # learned: slow
    assert core.set_identity(R0, ModelIdentity("m", "/m", "w:a")) is None  # same weights
    assert core.cached_tokens_on(R0, request) == 16
    change = core.set_identity(R0, ModelIdentity("m", "/m", "w:b"))  # other weights
    assert change is not None
    assert core.cached_tokens_on(R0, request) == 0
    assert core.load.snapshot(R0).prefill_rate_tps == 1000.0

"""The router's verdict book (``core/verdict_book.py``): pass, fail, stale and none against
the replicas' identities now, and which salt a version may share."""

from __future__ import annotations

import pytest

from kvroute.core.gate import PairKey, Verdict, VerdictStore
from kvroute.core.model_identity import ModelIdentity
from kvroute.core.types import ReplicaId
from kvroute.core.verdict_book import PD_PATH, SALT_PATH, VerdictBook, salt_version
from kvroute.core.versions import ReplicaVersions


def ident(version: str, tokenizer: str | None = "t:1") -> ModelIdentity:
    return ModelIdentity("m", "/m", version, tokenizer)


def verdict(serving: str, source: str, path: str, *, passed: bool = True,
            tokenizers: tuple[str | None, str | None] = ("t:1", "t:1")) -> Verdict:
    key = PairKey(serving, tokenizers[0], source, tokenizers[1], path)
    return Verdict(key, passed, "replay passed" if passed else "replay failed: code")


def book_with(*verdicts: Verdict, **replicas: str) -> tuple[VerdictBook, ReplicaVersions]:
    versions = ReplicaVersions()
    for replica, version in replicas.items():
        versions.observe(ReplicaId(replica), ident(version))
    return VerdictBook(versions, VerdictStore(verdicts)), versions


def test_same_weights_are_native_and_need_no_verdict() -> None:
    book, _ = book_with(a="w:1")
    assert book.allows("w:1", "w:1", PD_PATH).status == "pass"


def test_pass_fail_and_none_for_the_pair_as_it_is_now() -> None:
    book, _ = book_with(verdict("w:2", "w:1", PD_PATH),
                        verdict("w:1", "w:2", PD_PATH, passed=False), a="w:1", b="w:2")
    assert book.allows("w:2", "w:1", PD_PATH).allowed
    failed = book.allows("w:1", "w:2", PD_PATH)
    assert failed.status == "fail" and "replay failed" in failed.reason
    assert book.allows("w:2", "w:1", SALT_PATH).status == "none"  # another path
    assert book.allows("w:3", "w:1", PD_PATH).status == "none"


def test_a_weight_change_on_either_side_makes_the_verdict_stale() -> None:
    book, versions = book_with(verdict("w:2", "w:1", PD_PATH), a="w:1", b="w:2")
    versions.observe(ReplicaId("a"), ident("w:1b"))  # the source replica's weights change
    stale = book.allows("w:2", "w:1b", PD_PATH)
    assert stale.status == "stale" and "source w:1 -> w:1b" in stale.reason
    versions.observe(ReplicaId("b"), ident("w:2b"))  # and then the serving one's
    assert book.allows("w:2b", "w:1b", PD_PATH).status == "stale"
    assert book.allows("w:2b", "w:9", PD_PATH).status == "none"  # never related


def test_a_tokenizer_change_under_the_same_version_is_stale() -> None:
    book, versions = book_with(verdict("v:2", "v:1", PD_PATH), a="v:1", b="v:2")
    versions.observe(ReplicaId("a"), ident("v:1", "t:other"))
    assert book.allows("v:2", "v:1", PD_PATH).status == "stale"


def test_reloading_the_store_changes_the_answers() -> None:
    book, _ = book_with(a="w:1", b="w:2")
    assert book.allows("w:2", "w:1", PD_PATH).status == "none"
    book.load(VerdictStore([verdict("w:2", "w:1", PD_PATH)]))
    assert book.allows("w:2", "w:1", PD_PATH).allowed
    with pytest.raises(ValueError, match="unknown transfer path"):
        book.allows("w:2", "w:1", "teleport")


def test_a_new_version_keeps_its_own_salt_without_a_passing_verdict() -> None:
    book, versions = book_with(a="v1", b="v2")
    salted, refusal = salt_version("v2", versions, book)
    assert salted == "v2"
    assert refusal is not None and (refusal.path, refusal.status, refusal.source) == (
        SALT_PATH, "none", "v1")
    book.load(VerdictStore([verdict("v2", "v1", SALT_PATH, passed=False),
                            verdict("v1", "v2", SALT_PATH)]))
    salted, refusal = salt_version("v2", versions, book)
    assert salted == "v2" and refusal is not None and refusal.status == "fail"
    assert salt_version("v1", versions, book) == ("v1", None)  # the oldest: nothing to share


def test_sharing_a_salt_needs_both_directions_while_the_old_version_runs() -> None:
    book, versions = book_with(verdict("v2", "v1", SALT_PATH), a="v1", b="v2")
    salted, refusal = salt_version("v2", versions, book)
    assert salted == "v2" and refusal is not None  # v1 still runs and would read v2's blocks
    versions.observe(ReplicaId("a"), ident("v2"))  # the upgrade finished: v1 runs nowhere
    assert salt_version("v2", versions, book) == ("v1", None)


def test_a_third_version_joins_a_shared_salt_only_with_verdicts_against_every_member() -> None:
    two = [verdict("v2", "v1", SALT_PATH), verdict("v3", "v2", SALT_PATH)]
    book, versions = book_with(*two, a="v1")
    versions.observe(ReplicaId("a"), ident("v2"))
    versions.observe(ReplicaId("a"), ident("v3"))
    assert salt_version("v2", versions, book)[0] == "v1"
    salted, refusal = salt_version("v3", versions, book)
    assert salted == "v3" and refusal is not None  # v1 wrote under that salt too: no verdict
    book.load(VerdictStore([*two, verdict("v3", "v1", SALT_PATH)]))
    assert salt_version("v3", versions, book) == ("v1", None)


def test_a_verdict_measured_under_other_cache_settings_is_stale() -> None:
    policy = {"serving.block_size": "16", "serving.cache_dtype": "auto",
              "serving.weights": "w:2", "source.block_size": "16",
              "source.cache_dtype": "auto", "source.root": "/m"}
    key = PairKey("w:2", "t:1", "w:1", "t:1", PD_PATH)
    book, _ = book_with(Verdict(key, True, "replay passed", cache_policy=policy),
                        a="w:1", b="w:2")
    assert book.allows("w:2", "w:1", PD_PATH).allowed  # no replica's settings read yet
    same = {"block_size": "16", "cache_dtype": "auto", "num_gpu_blocks": "900"}
    book.observe_cache(ReplicaId("a"), same)  # memory sizes are not cache settings
    book.observe_cache(ReplicaId("b"), same)
    assert book.allows("w:2", "w:1", PD_PATH).allowed
    book.observe_cache(ReplicaId("a"), {**same, "cache_dtype": "fp8"})  # the source side
    stale = book.allows("w:2", "w:1", PD_PATH)
    assert stale.status == "stale", stale
    assert "source.cache_dtype: auto -> fp8 on a" in stale.reason
    book.observe_cache(ReplicaId("a"), same)
    book.observe_cache(ReplicaId("b"), {**same, "block_size": "128"})  # the serving side
    assert "serving.block_size: 16 -> 128 on b" in book.allows("w:2", "w:1", PD_PATH).reason
    book.forget_cache(ReplicaId("b"))  # left: nothing to compare with
    assert book.allows("w:2", "w:1", PD_PATH).allowed
    # A verdict that recorded no settings (a stand-in written by hand) is not audited.
    bare, _ = book_with(verdict("w:2", "w:1", PD_PATH), a="w:1", b="w:2")
    bare.observe_cache(ReplicaId("b"), {"block_size": "128"})
    assert bare.allows("w:2", "w:1", PD_PATH).allowed


def test_a_version_no_replica_runs_is_audited_against_the_settings_it_last_ran_under() -> None:
    policy = {"source.cache_dtype": "fp8"}
    key = PairKey("w:2", "t:1", "w:1", "t:1", PD_PATH)
    book, versions = book_with(Verdict(key, True, "replay passed", cache_policy=policy),
                               a="w:1")
    book.observe_cache(ReplicaId("a"), {"cache_dtype": "auto"})
    versions.observe(ReplicaId("a"), ident("w:2"))  # a hot update: w:1 runs nowhere now
    stale = book.allows("w:2", "w:1", PD_PATH)
    assert stale.status == "stale"
    assert "source.cache_dtype: fp8 -> auto on a when it last ran w:1" in stale.reason

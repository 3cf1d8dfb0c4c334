"""``SegmentEncoder`` gives the whole-prompt ids, for the bundled byte-level BPE and for a
Metaspace tokenizer whose first piece is encoded differently (``prepend_scheme: first``)."""

from __future__ import annotations

import gc
import logging
from array import array
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvroute.tokenize.hf import HFTokenizer, bundled_tokenizer_dir
from kvroute.tokenize.segments import SegmentEncoder

_MARKERS = ["<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
_WORDS = ["the", "cache", " prefix", "router", "  ", "\n", "\t", "é", "漢字", "🙂", ",", "a.b",
          "Hello", "x" * 40, " "]


def _bundled() -> tuple[Callable[[str], Sequence[int]], dict[str, int]]:
    tok = HFTokenizer.from_dir(bundled_tokenizer_dir())
    return (lambda t: tok.encode(t, add_special_tokens=False)), tok.split_tokens()


def _metaspace_first() -> tuple[Callable[[str], Sequence[int]], dict[str, int]]:
    """A SentencePiece-style BPE (Metaspace, prepend_scheme first) with special markers."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *_MARKERS],
                                  show_progress=False)
    corpus = [" ".join(_WORDS[(i * 7 + j) % len(_WORDS)] for j in range(12)) for i in range(200)]
    tok.train_from_iterator(corpus, trainer=trainer)
    ids = {m: tok.token_to_id(m) for m in _MARKERS}
    return (lambda t: tok.encode(t, add_special_tokens=False).ids), ids


_TOKENIZERS = {"bundled_bpe": _bundled(), "metaspace_first": _metaspace_first()}
_BUNDLED_TOK = HFTokenizer.from_dir(bundled_tokenizer_dir())

_texts = st.lists(st.sampled_from(_WORDS + _MARKERS), min_size=0, max_size=40).map("".join)


@pytest.mark.parametrize("name", sorted(_TOKENIZERS))
@settings(max_examples=200, deadline=None)
@given(texts=st.lists(_texts, min_size=1, max_size=5))
def test_piecewise_ids_equal_whole_ids(name: str, texts: list[str]) -> None:
    encode, split = _TOKENIZERS[name]
    seg = SegmentEncoder(encode, split, verify_every=0)
    assert seg.enabled
    for text in texts * 2:  # the second round is served from the cache
        assert seg.encode(text).tolist() == list(encode(text))


def _counting_bundled() -> tuple[Callable[[str], Sequence[int]], dict[str, int], list[str]]:
    """The bundled tokenizer's whole encoding, recording each text it is given."""
    encode, split = _TOKENIZERS["bundled_bpe"]
    calls: list[str] = []

    def counting(text: str) -> Sequence[int]:
        calls.append(text)
        return encode(text)

    return counting, split, calls


def test_shared_system_prompt_is_encoded_once() -> None:
    encode, _ = _TOKENIZERS["bundled_bpe"]
    counting, split, calls = _counting_bundled()
    seg = SegmentEncoder(counting, split, verify_every=0)
    calls.clear()
    system = "You are a careful assistant. " * 40
    for question in ("What is a block?", "Why route by prefix?", "How big is the cache?"):
        text = f"<s><|system|>\n{system}<|end|>\n<|user|>\n{question}<|end|>\n<|assistant|>\n"
        assert seg.encode(text).tolist() == list(encode(text))
    system_calls = [c for c in calls if system in c]
    assert len(system_calls) == 1
    assert seg.hits > 0 and seg.cached_tokens > 0


def test_encode_returns_packed_ids_equal_to_the_whole_prompt_encode() -> None:
    """The bundled tokenizer's chat prompt: an ``array('I')`` from the cache (first and
    second time) and with the cache off, equal as a list to the whole-prompt ids."""
    tok = HFTokenizer.from_dir(bundled_tokenizer_dir())
    system = "You are a careful assistant who answers in short sentences. " * 30
    text = tok.render_chat([{"role": "system", "content": system},
                            {"role": "user", "content": "Why route by prefix?"}])
    plain = Tokenizer.from_file(str(bundled_tokenizer_dir() / "tokenizer.json"))
    whole = list(plain.encode(text, add_special_tokens=False).ids)
    assert tok.pieces.enabled
    for _ in range(2):  # a miss, then cached pieces
        ids = tok.encode(text, add_special_tokens=False)
        assert isinstance(ids, array) and ids.typecode == "I"
        assert ids.tolist() == whole
    assert tok.pieces.hits > 0
    encode, split = _TOKENIZERS["bundled_bpe"]
    off = SegmentEncoder(encode, split, max_tokens=0)
    assert not off.enabled
    assert off.encode(text).tolist() == whole and off.encode(text).typecode == "I"


def test_cached_pieces_are_nothing_the_collector_walks() -> None:
    """A full cache is thousands of long-lived pieces: held as arrays, each was a tracked
    object that every full collection walked with the event loop stopped."""
    encode, split = _TOKENIZERS["bundled_bpe"]
    seg = SegmentEncoder(encode, split, verify_every=0)
    texts = [f"<|user|>\nquestion number {i} about the cache<|end|>\n" for i in range(30)]
    for text in texts * 2:  # the second round is served from the cache
        assert seg.encode(text).tolist() == list(encode(text))
    pieces = list(seg._cache.values())
    assert len(pieces) >= 30 and seg.hits >= 30
    assert not any(gc.is_tracked(piece) for piece in pieces)
    assert seg.cached_tokens == sum(len(piece) for piece in pieces) // array("I").itemsize


def test_memory_bound_evicts_least_recent() -> None:
    encode, split = _TOKENIZERS["bundled_bpe"]
    seg = SegmentEncoder(encode, split, max_tokens=200, verify_every=0)
    for i in range(50):
        seg.encode(f"<|user|>\nquestion number {i} " * 5)
    assert 0 < seg.cached_tokens <= 200


def test_a_mismatch_turns_the_cache_off_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    encode, split = _TOKENIZERS["bundled_bpe"]
    lie = {"active": False}

    def sometimes_wrong(text: str) -> Sequence[int]:
        ids = list(encode(text))
        # Whole prompts that contain a marker get one id changed once the check below is on:
        # the piecewise path (which never sends a marker-plus-rest prompt starting with <s>)
        # then disagrees with the whole-prompt path.
        if lie["active"] and text.startswith("<s>"):
            ids[-1] = 999
        return ids

    seg = SegmentEncoder(sometimes_wrong, split, verify_every=2)
    assert seg.enabled
    lie["active"] = True
    text = "<s><|user|>\nhello there<|end|>\n"
    with caplog.at_level(logging.ERROR):
        first = seg.encode(text)   # call 1: not verified
        second = seg.encode(text)  # call 2: verified, differs, cache off
    assert first != second
    assert second.tolist() == sometimes_wrong(text)
    assert not seg.enabled and seg.mismatches == 1
    assert "token cache is now off" in caplog.text
    assert f"at token {len(second) - 1} of {len(second)}" in caplog.text  # the last id differs
    off = seg.encode(text)
    assert isinstance(off, array) and off.typecode == "I"
    assert off.tolist() == sometimes_wrong(text)


def test_no_markers_or_zero_budget_means_whole_encoding() -> None:
    encode, split = _TOKENIZERS["bundled_bpe"]
    assert not SegmentEncoder(encode, {}).enabled
    assert not SegmentEncoder(encode, split, max_tokens=0).enabled
    with pytest.raises(ValueError, match="max_tokens"):
        SegmentEncoder(encode, split, max_tokens=-1)
    with pytest.raises(ValueError, match="verify_every"):
        SegmentEncoder(encode, split, verify_every=-1)


def test_a_marker_that_merges_with_its_neighbour_fails_the_self_check(
        caplog: pytest.LogCaptureFixture) -> None:
    encode, split = _TOKENIZERS["bundled_bpe"]
    wrong = {"<|user|>": 12345, **{k: v for k, v in split.items() if k != "<|user|>"}}
    with caplog.at_level(logging.WARNING):
        seg = SegmentEncoder(encode, wrong)
    assert not seg.enabled
    assert "token cache is off" in caplog.text


@settings(max_examples=200, deadline=None)
@given(text=_texts)
def test_the_unlocked_whole_encoding_gives_the_same_ids(text: str) -> None:
    """``encode_plain_unlocked`` (``encode_batch``, off the GIL, for the check thread) is the
    whole-prompt encoding the piece cache is checked against."""
    tok = _BUNDLED_TOK
    assert tok.encode_plain_unlocked(text) == list(tok._tok.encode(text, add_special_tokens=False).ids)


def test_deferred_checks_leave_the_caller_and_report_through_check(
        caplog: pytest.LogCaptureFixture) -> None:
    encode, _ = _TOKENIZERS["bundled_bpe"]
    counting, split, whole_calls = _counting_bundled()
    seg = SegmentEncoder(counting, split, verify_every=2)
    submitted: list[tuple[str, array[int]]] = []
    seg.defer_checks(lambda text, ids: submitted.append((text, ids)))
    text = "<s><|user|>\nhello there<|end|>\n"
    seg.encode(text)
    whole_calls.clear()
    second = seg.encode(text)  # due: handed over, not encoded whole here
    assert [t for t, _ in submitted] == [text] and submitted[0][1] == second
    assert text not in whole_calls and seg.checks == 0
    # the worker reports agreement, then a disagreement
    assert seg.check(text, array("I", encode(text)), second) and seg.checks == 1
    wrong = array("I", encode(text))
    wrong[-1] = 999
    with caplog.at_level(logging.ERROR):
        assert not seg.check(text, wrong, second)
    assert not seg.enabled and seg.mismatches == 1 and seg.checks == 2
    assert "token cache is now off" in caplog.text
    # a late report after the switch-off is counted, but is no second mismatch
    assert not seg.check(text, wrong, second)
    assert seg.mismatches == 1 and seg.checks == 3
    # None: checks run inline again
    seg2 = SegmentEncoder(counting, split, verify_every=1)
    seg2.defer_checks(lambda text, ids: submitted.append((text, ids)))
    seg2.defer_checks(None)
    whole_calls.clear()
    seg2.encode(text)
    assert text in whole_calls and seg2.checks == 1


def _overlapping_markers() -> tuple[Callable[[str], Sequence[int]], dict[str, int]]:
    """The byte-level BPE with markers that overlap one another (one is another's prefix, one
    ends where another starts): where a split falls depends on the characters that follow."""
    tok = Tokenizer.from_file(str(bundled_tokenizer_dir() / "tokenizer.json"))
    extra = ["<|u|>", "<|u|>>", "|><|"]
    tok.add_special_tokens(extra)
    ids = {**_BUNDLED_TOK.split_tokens(), **{t: tok.token_to_id(t) for t in extra}}
    return (lambda t: tok.encode(t, add_special_tokens=False).ids), ids


_GROWING = {**_TOKENIZERS, "overlapping": _overlapping_markers()}
_pieces = st.sampled_from(_WORDS + _MARKERS + ["<|u|>", "<|u|>>", "|><|", ">", "<|", "|"])
_edits = st.lists(st.tuples(st.sampled_from(["grow", "edit", "cut", "other"]),
                            st.lists(_pieces, max_size=12).map("".join),
                            st.integers(0, 10_000)), min_size=1, max_size=12)


@pytest.mark.parametrize("name", sorted(_GROWING))
@settings(max_examples=150, deadline=None)
@given(start=st.lists(_pieces, max_size=30).map("".join), edits=_edits,
       max_checkpoints=st.sampled_from([1, 2, 64]))
def test_checkpoints_give_the_whole_ids_of_grown_edited_and_cut_prompts(
        name: str, start: str, edits: list[tuple[str, str, int]], max_checkpoints: int) -> None:
    """A conversation that grows (the checkpoint's case), is edited anywhere (an earlier turn
    changed), cut, or replaced: every prompt's ids equal its whole encoding."""
    encode, split = _GROWING[name]
    seg = SegmentEncoder(encode, split, verify_every=0, max_checkpoints=max_checkpoints,
                         min_checkpoint_tokens=0)
    assert seg.enabled
    text, seen = start, []
    for kind, piece, at in edits:
        if kind == "grow":
            text += piece
        elif kind == "edit":
            at %= len(text) + 1
            text = text[:at] + piece + text[at + 1 :]
        elif kind == "cut":
            text = text[: at % (len(text) + 1)]
        else:
            text = piece
        seen.append(text)
        assert seg.encode(text).tolist() == list(encode(text)), (kind, text)
    for again in seen:  # older prompts again, against newer checkpoints
        assert seg.encode(again).tolist() == list(encode(again))


def test_a_growing_conversation_is_served_from_its_checkpoint() -> None:
    """Each turn of a growing chat starts with the one before: after the first, the encoder
    resumes from a checkpoint, and only the new turn's text is split and looked up."""
    encode, split = _TOKENIZERS["bundled_bpe"]
    seg = SegmentEncoder(encode, split, verify_every=0, min_checkpoint_tokens=0)
    text = "<s><|system|>\nYou are terse.<|end|>\n<|user|>\nquestion<|end|>\n<|assistant|>\n"
    for turn in range(30):  # the answer follows the last prompt's generation prompt
        text += f"answer {turn}<|end|>\n<|user|>\nquestion {turn}<|end|>\n<|assistant|>\n"
        assert seg.encode(text).tolist() == list(encode(text))
    assert seg.checkpoint_hits == 29
    edited = text.replace("question 3", "question three")
    assert seg.encode(edited).tolist() == list(encode(edited))  # an earlier turn changed


def test_short_prompts_leave_no_checkpoint_and_long_ones_do() -> None:
    """Below ``min_checkpoint_tokens`` a prompt is encoded exactly but leaves no checkpoint
    (unique short prompts must not crowd out a long session's); a growing prompt that passes
    the bound is checkpointed and resumed from, still exact."""
    encode, split = _TOKENIZERS["bundled_bpe"]
    seg = SegmentEncoder(encode, split, verify_every=0, min_checkpoint_tokens=200)
    for i in range(20):
        short = f"<s><|system|>\nYou are terse.<|end|>\n<|user|>\nq{i} words<|end|>\n<|assistant|>\n"
        assert seg.encode(short).tolist() == list(encode(short))
    assert not seg._checkpoints and seg.checkpoint_hits == 0
    text = "<s><|system|>\n" + "a long system prompt " * 60 + "<|end|>\n<|assistant|>\n"
    for turn in range(5):
        text += f"answer {turn}<|end|>\n<|user|>\nquestion {turn}<|end|>\n<|assistant|>\n"
        assert seg.encode(text).tolist() == list(encode(text))
    assert len(seg._checkpoints) == 1 and seg.checkpoint_hits == 4
    with pytest.raises(ValueError, match="min_checkpoint_tokens=-1"):
        SegmentEncoder(encode, split, min_checkpoint_tokens=-1)

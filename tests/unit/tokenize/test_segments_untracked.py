"""The piece cache and its checkpoints hold their ids as bytes, which the garbage collector
never tracks (``tokenize.segments``; why: ``docs/benchmarks.md#garbage-collection-pauses``)."""

from __future__ import annotations

import gc

from kvroute.tokenize.hf import HFTokenizer, bundled_tokenizer_dir


def test_cached_pieces_and_checkpoint_ids_are_untracked_and_counted() -> None:
    tok = HFTokenizer.from_dir(bundled_tokenizer_dir())
    seg = tok.pieces
    seg._min_checkpoint_tokens = 0  # these prompts are short: checkpoint them all the same
    text = "<s><|system|>\nyou route requests<|end|>\n"
    for turn in range(6):  # a growing conversation: each prompt leaves a checkpoint
        text += f"<|user|>\nquestion {turn} about caches<|end|>\n<|assistant|>\n"
        ids = seg.encode(text)
        assert ids.tolist() == list(tok.encode_plain_unlocked(text))
        text += f"answer {turn}<|end|>\n"
    checkpoints = list(seg._checkpoints.values())
    assert checkpoints and seg.checkpoint_hits >= 4
    assert not [c for c in checkpoints if gc.is_tracked(c.ids)]
    assert not [v for v in seg._cache.values() if gc.is_tracked(v)]
    assert seg._checkpoint_tokens == sum(len(c.ids) // 4 for c in checkpoints)

"""The piece cache's misses go through ``encode_batch_fast``: the same ids as ``encode``."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("tokenizers", reason="the local tokenizer needs kvroute[hf]")

from kvroute.tokenize.hf import HFTokenizer, bundled_tokenizer_dir

TOK = HFTokenizer.from_dir(bundled_tokenizer_dir())
MARKERS = list(TOK.split_tokens())


def test_the_fast_path_is_taken_when_the_library_has_it() -> None:
    assert TOK._encode_fast is not None  # tokenizers >= 0.21 in the test extra


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=80), st.sampled_from(MARKERS or [""])), max_size=8))
def test_fast_ids_equal_encode_ids(parts: list[str]) -> None:
    text = "".join(parts)
    assert TOK._encode_plain(text) == list(TOK._tok.encode(text, add_special_tokens=False).ids)

"""tokenize/words.py: one word per id, stable, injective, and ``from_text`` inverts it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.core.errors import ConfigError
from kvroute.tokenize.words import from_text, to_text, token_word


def test_to_text_is_one_word_per_id_and_stable() -> None:
    ids = [100, 101, 31999, 100]
    text = to_text(ids)
    assert len(text.split(" ")) == 4
    assert text.split()[0] == text.split()[3] != text.split()[1]
    assert text == to_text(tuple(ids))
    assert all(word.isascii() and word.isalpha() and word.islower() for word in text.split())
    assert token_word(0) == "ba" and token_word(80) == "beba"


@given(st.lists(st.integers(0, 2**32 - 1), max_size=40))
def test_from_text_inverts_to_text(ids: list[int]) -> None:
    assert from_text(to_text(ids)) == tuple(ids)


@given(st.integers(0, 2**40), st.integers(0, 2**40))
def test_words_are_injective(a: int, b: int) -> None:
    assert (token_word(a) == token_word(b)) == (a == b)


@pytest.mark.parametrize("word", ["xyz", "bab", "baba", "bex", "Ba"])
def test_from_text_rejects_foreign_words(word: str) -> None:
    with pytest.raises(ConfigError, match="not produced by to_text"):
        from_text(f"be {word}")


def test_negative_ids_have_no_word() -> None:
    with pytest.raises(ConfigError, match=">= 0"):
        token_word(-1)

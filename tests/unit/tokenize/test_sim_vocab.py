"""The simulated engine's tokenizers: the built-in one's documented contract, and HF loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.core.errors import ConfigError
from kvroute.tokenize.sim_vocab import (
    FIRST_WORD_ID,
    BuiltinTokenizer,
    ChatTemplateError,
    HFTokenizer,
    load_tokenizer,
)
from kvroute.tokenize.words import from_text, to_text, token_word

TOK = BuiltinTokenizer(32000)


@given(st.lists(st.integers(min_value=0, max_value=10**7), max_size=64))
@settings(max_examples=300, deadline=None)
def test_workload_text_round_trips_exactly(ids: list[int]) -> None:
    text = to_text(ids)
    assert TOK.encode(text) == ids
    assert tuple(TOK.encode(text)) == from_text(text)
    assert TOK.decode(TOK.encode(text)) == " ".join(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"][t] if t < 3 else token_word(t) for t in ids
    )


@pytest.mark.parametrize("word", ["hello", "Hello,", "bababa", "ba1", "a", "über", "{\"x\":"])
def test_other_words_hash_stably_into_the_word_range(word: str) -> None:
    (first,) = TOK.encode(word)
    assert FIRST_WORD_ID <= first < 32000
    assert BuiltinTokenizer(32000).encode(word) == [first]  # stable across instances
    assert BuiltinTokenizer(1000).encode(word)[0] < 1000


def test_special_tokens_are_recognised_even_glued_to_words() -> None:
    ids = TOK.encode("<|im_start|>user\nbe da<|im_end|>\n<|endoftext|>")
    assert ids == [1, TOK.encode("user")[0], from_text("be")[0], from_text("da")[0], 2, 0]


def test_chat_template_wraps_messages_and_adds_the_generation_prompt() -> None:
    messages = [{"role": "system", "content": "be"}, {"role": "user", "content": "da di"}]
    text = TOK.render_chat(messages)
    assert text == (
        "<|im_start|>system\nbe<|im_end|>\n<|im_start|>user\nda di<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    user, system, assistant = (TOK.encode(w)[0] for w in ("user", "system", "assistant"))
    assert TOK.encode(text) == [1, system, *from_text("be"), 2, 1, user, *from_text("da di"),
                                2, 1, assistant]
    no_gen = TOK.encode(TOK.render_chat(messages, add_generation_prompt=False))
    assert no_gen == TOK.encode(text)[:-2]
    cont = TOK.render_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert cont.endswith("<|im_start|>user\nda di")


def test_chat_template_renders_tools_and_content_parts() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    parts = [{"type": "text", "text": "be"}, {"type": "image_url", "image_url": {"url": "x"}}]
    text = TOK.render_chat([{"role": "user", "content": parts}], tools=tools)
    assert text.startswith("<|im_start|>system\n# Tools\n{")
    assert "be\n<image_url><|im_end|>" in text
    with pytest.raises(ChatTemplateError, match="role"):
        TOK.render_chat([{"content": "x"}])


def test_small_vocab_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match="vocab_size > 100"):
        BuiltinTokenizer(100)


def _write_hf_dir(root: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "<|im_start|>": 2, "<|im_end|>": 3, "hello": 4, "world": 5,
             "user": 6, "assistant": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<s>"])
    tok.save(str(root / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
        "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    (root / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "bos_token": "<s>"})
    )


def test_hf_tokenizer_directory_is_loaded_and_its_template_applied(tmp_path: Path) -> None:
    _write_hf_dir(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world") == [4, 5]
    text = tok.render_chat([{"role": "user", "content": "hello"}])
    assert list(tok.encode(text, add_special_tokens=False)) == [2, 6, 4, 3, 2, 7]
    assert tok.decode([4, 5]) == "hello world"
    assert tok.token_strs([4]) == ["hello"]


def test_hf_directory_without_tokenizer_json_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_hf_template_exception_is_a_chat_template_error(tmp_path: Path) -> None:
    _write_hf_dir(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ raise_exception('roles must alternate') }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        load_tokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}])


def test_max_chars_per_token_is_the_longest_vocabulary_string(tmp_path: Path) -> None:
    """vLLM's factor for its character pre-check; the built-in tokenizer has no bound."""
    _write_hf_dir(tmp_path)
    assert load_tokenizer(tmp_path).max_chars_per_token == len("<|im_start|>")
    assert BuiltinTokenizer(32000).max_chars_per_token is None

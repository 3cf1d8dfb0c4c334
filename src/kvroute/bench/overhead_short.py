"""Short unique chat prompts for ``kvroute bench overhead``'s ``u<workers>`` phases: a closed
loop of requests nobody sent before, the traffic where a router's cache of earlier work
(tokenizer pieces, block hashes, the prefix index) cannot help and every request pays in full.

Each request is one chat: a short system prompt every request shares (as real deployments
have) and a user message of ``words`` words nobody sent before, ~600 tokens of the bundled
tokenizer once the chat template is rendered (``SHORT_WORDS``), 8 output tokens, not
streamed. The text is words of one vocabulary drawn with Zipf weights
(``overhead_long.Language``: common words recur, as in prose, so the tokenizer's word cache
behaves as it does on real text); each user message opens with a tag naming its run and its
number, so no two requests share a block beyond the system prompt's, within a run or
across the runs of one benchmark (each router, pass and phase draws with its own ``label``).

Token counts are real: every prompt is rendered with the chat template and encoded by the
bundled tokenizer (the engines' own), in one ``encode_batch_fast`` call (Rust threads, the
GIL released): ~0.15 ms a prompt, paid before the phase starts, never during it.
"""

from __future__ import annotations

import json
import random
from typing import Final

from tokenizers import Tokenizer

from kvroute.bench.live_client import LiveRequest
from kvroute.bench.overhead_long import Language
from kvroute.core.errors import ConfigError
from kvroute.tokenize.hf import HFTokenizer, bundled_tokenizer_dir

__all__ = ["SHORT_SYSTEM", "SHORT_WORDS", "short_unique_requests"]

SHORT_WORDS: Final = 100
"""User-message words: with the shared system prompt and the template, ~600 tokens."""
SHORT_SYSTEM: Final = "You are a helpful assistant. Answer briefly and exactly."
_OUTPUT_TOKENS: Final = 8


def short_unique_requests(count: int, *, model: str, label: str, seed: int = 0,
                          words: int = SHORT_WORDS, max_tokens: int = _OUTPUT_TOKENS,
                          stream: bool = False) -> list[LiveRequest]:
    """``count`` chat requests no other call with another ``label`` (or ``seed``) sends, all
    arriving at 0 (a closed loop sends them as its workers free up).

    Raises:
        ConfigError: ``count``, ``words`` or ``max_tokens`` below 1, or an empty label.
    """
    if count < 1 or words < 1 or max_tokens < 1 or not label:
        raise ConfigError(f"short unique prompts: count={count}, words={words} and "
                          f"max_tokens={max_tokens} must be >= 1, label={label!r} non-empty")
    rng = random.Random(f"short-{seed}-{label}")
    language = Language(seed)
    tag = f"{label}-{seed}"
    all_messages = [[{"role": "system", "content": SHORT_SYSTEM},
                     {"role": "user", "content": f"[{tag}-{i}] "
                      + " ".join(rng.choices(language.words, cum_weights=language.cum_weights,
                                             k=words))}]
                    for i in range(count)]
    tokenizer = HFTokenizer.from_dir(bundled_tokenizer_dir())
    encoder = Tokenizer.from_file(str(bundled_tokenizer_dir() / "tokenizer.json"))
    tokens = [len(e.ids) for e in encoder.encode_batch_fast(
        [tokenizer.render_chat(m) for m in all_messages], add_special_tokens=False)]
    out = []
    for i, (messages, prompt_tokens) in enumerate(zip(all_messages, tokens)):
        body = {"model": model, "messages": messages, "max_tokens": max_tokens,
                "stream": stream, "temperature": 0.0}
        out.append(LiveRequest(f"{label}-{i}", 0.0, json.dumps(body).encode(), prompt_tokens,
                               max_tokens, None, stream))
    return out

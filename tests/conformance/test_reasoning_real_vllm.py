"""What real vLLM 0.32 (CPU) answers with a reasoning parser and a thinking budget.

The tiny test model has no think delimiters, so the test copies it and maps two of its
vocabulary entries (ids 1022, 1023) to ``<think>`` / ``</think>`` as special tokens (their
merges dropped), then starts the engine with ``--reasoning-parser deepseek_r1``. The random
model never opens a thought, so the request opens it as an assistant prefill
(``continue_final_message``), as a thinking chat template does at the end of the prompt.

Recorded 2026-12-01: the budget is enforced (the engine forces ``</think>`` after it) and
``message.reasoning`` / ``content`` are split there when the delimiters survive detokenizing
(``skip_special_tokens: false``); ``completion_tokens`` counts the forced ``</think>`` too;
``completion_tokens_details.reasoning_tokens`` is 0, because vLLM counts only tokens between
a ``<think>`` and a ``</think>`` *in the output*, and here ``<think>`` is in the prompt.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import realvllm
from realvllm import RealVllmEngine, RealVllmInstall

pytestmark = [pytest.mark.realvllm, pytest.mark.slow]

THINK, END = 1022, 1023
BUDGET = 4


def _thinking_copy(model: Path, into: Path) -> Path:
    """The tiny model with ids ``THINK``/``END`` renamed to ``<think>``/``</think>``."""
    shutil.copytree(model, into)
    path = into / "tokenizer.json"
    tok = json.loads(path.read_text(encoding="utf-8"))
    bpe = tok["model"]
    names = {i: s for s, i in bpe["vocab"].items()}
    old = {names[THINK], names[END]}

    def parts(merge: str | list[str]) -> list[str]:
        return merge.split(" ") if isinstance(merge, str) else merge

    bpe["merges"] = [m for m in bpe["merges"]
                     if not (set(parts(m)) & old or "".join(parts(m)) in old)]
    for token_id, text in ((THINK, "<think>"), (END, "</think>")):
        del bpe["vocab"][names[token_id]]
        bpe["vocab"][text] = token_id
        tok["added_tokens"].append({"id": token_id, "content": text, "single_word": False,
                                    "lstrip": False, "rstrip": False, "normalized": False,
                                    "special": True})
    path.write_text(json.dumps(tok), encoding="utf-8")
    return into


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealVllmEngine]:
    install = realvllm.require_real_vllm()
    model = _thinking_copy(install.model_dir, tmp_path_factory.mktemp("think") / "model")
    with realvllm.real_vllm_engines(
        1, install=RealVllmInstall(python=install.python, model_dir=model),
        extra_args=("--reasoning-parser", "deepseek_r1"),
    ) as started:
        yield started[0]


def _think(engine: RealVllmEngine, **extra: object) -> dict[str, object]:
    body = {"model": realvllm.SERVED_MODEL, "max_tokens": 12, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True, "skip_special_tokens": False,
            "messages": [{"role": "user", "content": "hello there"},
                         {"role": "assistant", "content": "<think>"}],
            "continue_final_message": True, "add_generation_prompt": False, **extra}
    status, answer = realvllm.http_json("POST", engine.url + "/v1/chat/completions", body,
                                        timeout_s=120.0)
    assert status == 200, answer
    assert isinstance(answer, dict)
    return answer


def test_the_budget_ends_the_thinking_and_the_parser_splits_there(
        engine: RealVllmEngine) -> None:
    answer = _think(engine, thinking_token_budget=BUDGET)
    choice = answer["choices"][0]  # type: ignore[index]
    ids = choice["token_ids"]
    assert ids.index(END) == BUDGET  # the engine forced the end of thinking at the budget
    message = choice["message"]
    assert message["reasoning"] and message["content"]  # vLLM 0.32's field: `reasoning`
    assert "reasoning_content" not in message
    usage = answer["usage"]  # type: ignore[index]
    assert usage["completion_tokens"] == 12  # the forced </think> included
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 0}  # <think> in prompt
    free = _think(engine)["choices"][0]  # type: ignore[index]
    assert END not in free["token_ids"] and free["message"]["content"] is None

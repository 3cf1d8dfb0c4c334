"""A route's reasoning settings applied to a chat body: the think switch and the budget.

Hybrid reasoning models switch thinking on or off through their chat template, each family
under its own ``chat_template_kwargs`` key (Qwen3: ``enable_thinking``; DeepSeek-V3.1:
``thinking``), and vLLM 0.32 caps the thinking with ``thinking_token_budget`` (which the
engine accepts only when started with a reasoning parser, ``--reasoning-parser``). A route
can fix the switch (or leave it to a difficulty classifier, ``auto``), give a default budget
and a ceiling on what a client may ask for; ``reasoning_fields`` says which fields of a body
change.

The classifier is pluggable (``CLASSIFIERS``: a name -> a function of the chat body that says
whether to think). The one shipped, ``rules``, thinks when the last user message is long,
holds code or arithmetic, or asks for proof, derivation, debugging or step-by-step work, and
answers directly otherwise. Rules first: they cost microseconds and can be read; a
model-based classifier can be registered under another name.

Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "CLASSIFIERS",
    "THINK_SWITCHES",
    "ReasoningSettings",
    "needs_thinking",
    "reasoning_fields",
    "reasoning_tokens",
]

THINK_SWITCHES: Final[dict[str, str]] = {
    "qwen3": "enable_thinking",
    "deepseek-v3.1": "thinking",
}
"""The family -> its ``chat_template_kwargs`` key for thinking on/off."""


@dataclass(frozen=True, slots=True)
class ReasoningSettings:
    """A route's reasoning settings.

    Attributes:
        switch: the family whose template key turns thinking on/off (``THINK_SWITCHES``).
        thinking: force thinking on (True) or off (False) unless the client set the key
            itself; None leaves it to the client and the template's default.
        auto: the classifier decides per request, unless the client set the key itself
            (``thinking`` must then be None).
        classifier: the classifier's name in ``CLASSIFIERS``.
        budget: ``thinking_token_budget`` added when the client gives none and thinking is
            not off; None adds none.
        max_budget: the most a client may ask for (a larger or unlimited ``-1`` request is
            lowered to it); None: no ceiling.

    Raises:
        ValueError: an unknown switch, or a budget below 1 or above the ceiling.
    """

    switch: str = "qwen3"
    thinking: bool | None = None
    budget: int | None = None
    max_budget: int | None = None
    auto: bool = False
    classifier: str = "rules"

    def __post_init__(self) -> None:
        if self.auto and self.thinking is not None:
            raise ValueError("reasoning thinking is set and auto is on: choose one")
        if self.classifier not in CLASSIFIERS:
            raise ValueError(f"reasoning classifier {self.classifier!r} is not one of "
                             f"{', '.join(CLASSIFIERS)}")
        if self.switch not in THINK_SWITCHES:
            raise ValueError(f"reasoning switch {self.switch!r} is not one of "
                             f"{', '.join(THINK_SWITCHES)}")
        for name in ("budget", "max_budget"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"reasoning {name} must be a whole number >= 1, got {value!r}")
        if self.budget is not None and self.max_budget is not None \
                and self.budget > self.max_budget:
            raise ValueError(f"reasoning budget {self.budget} is above max_budget "
                             f"{self.max_budget}")

    @property
    def output_reserve(self) -> int:
        """Output tokens the thinking may take when the route turns it on (the tier planner
        adds them to the route's output floor: vLLM counts reasoning in ``max_tokens``)."""
        if self.thinking is False:
            return 0
        return self.budget or 0


def reasoning_fields(body: Mapping[str, Any], settings: ReasoningSettings) -> dict[str, Any]:
    """The chat body fields ``settings`` set or change (empty: the body stays as it is).

    The client's own switch wins over the route's; its budget is kept up to the ceiling.
    """
    out: dict[str, Any] = {}
    key = THINK_SWITCHES[settings.switch]
    kwargs = body.get("chat_template_kwargs")
    own = kwargs if isinstance(kwargs, Mapping) else {}
    thinking = own.get(key)
    decided = settings.thinking
    if settings.auto and key not in own:
        decided = CLASSIFIERS[settings.classifier](body)
    if decided is not None and key not in own:
        out["chat_template_kwargs"] = {**own, key: decided}
        thinking = decided
    asked = body.get("thinking_token_budget")
    if thinking is False:
        return out
    ceiling = settings.max_budget
    if isinstance(asked, int) and not isinstance(asked, bool):
        if ceiling is not None and (asked == -1 or asked > ceiling):
            out["thinking_token_budget"] = ceiling
    elif asked is None and settings.budget is not None:
        out["thinking_token_budget"] = settings.budget
    return out


def expected_thinking(body: Mapping[str, Any], settings: ReasoningSettings | None) -> int:
    """The thinking tokens the engine will be allowed for this chat body once the route's
    fields are set (``reasoning_fields``): its ``thinking_token_budget`` when thinking is not
    switched off, 0 when it is off, when no route settings apply, or when the budget is
    unlimited (``-1``, no ceiling: nothing bounds it but ``max_tokens``, which the learned
    lengths already follow). The walk's output prediction uses it as a floor."""
    if settings is None:
        return 0
    final = {**body, **reasoning_fields(body, settings)}
    kwargs = final.get("chat_template_kwargs")
    if isinstance(kwargs, Mapping) and kwargs.get(THINK_SWITCHES[settings.switch]) is False:
        return 0
    budget = final.get("thinking_token_budget")
    if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0:
        return budget
    return 0


def reasoning_tokens(usage: Mapping[str, Any] | None) -> int | None:
    """``usage.completion_tokens_details.reasoning_tokens`` when the engine reported it (vLLM
    with a reasoning parser), else None."""
    details = usage.get("completion_tokens_details") if usage is not None else None
    value = details.get("reasoning_tokens") if isinstance(details, Mapping) else None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


_HARD_WORDS: Final = re.compile(
    r"\b(?:prove|proof|derive|derivation|step[- ]by[- ]step|debug|stack ?trace|traceback|"
    r"optimi[sz]e|algorithm|complexity|theorem|lemma|integral|equation|solve|calculate|"
    r"compute|why does|why is|explain why|analy[sz]e|refactor|edge cases?)\b", re.IGNORECASE)
_ARITHMETIC: Final = re.compile(r"\d\s*[=<>^*/+-]\s*\d|\\(?:frac|sum|int)\b")
_LONG_CHARS: Final = 2000
"""A last user message this long (about 500 tokens) is taken as a task, not a question."""


def _last_user_text(body: Mapping[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ""
    for message in reversed(messages):
        if isinstance(message, Mapping) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return " ".join(p.get("text", "") for p in content
                                if isinstance(p, Mapping) and isinstance(p.get("text"), str))
            return ""
    return ""


def needs_thinking(body: Mapping[str, Any]) -> bool:
    """The ``rules`` classifier (module docstring) on a chat body's last user message."""
    text = _last_user_text(body)
    return (len(text) >= _LONG_CHARS or "```" in text or bool(_HARD_WORDS.search(text))
            or bool(_ARITHMETIC.search(text)))


CLASSIFIERS: Final[dict[str, Callable[[Mapping[str, Any]], bool]]] = {"rules": needs_thinking}
"""Difficulty classifiers by name: chat body -> think or not. Register another here."""

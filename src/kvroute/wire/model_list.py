"""An OpenAI ``/v1/models`` body as the router reads it: model id -> model card.

Owns the reading of a model list an engine or an external provider answers with (discovery
reads a replica's served model and context window from it, and a provider's catalog), and
the one error such a read raises. Writing the router's own list is ``wire/openai.py``'s
``models_response``.

Pure: no I/O. Only the list's shape is checked (a ``data`` list of cards with a string
``id``); a card's other fields are read by the caller, which decides what an odd value means.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import msgspec

from kvroute.core.errors import RouterError

__all__ = ["ModelListError", "adapter_roots", "card_window", "model_cards"]

_JSON: Final = msgspec.json.Decoder()


class ModelListError(RouterError):
    """A ``/v1/models`` body is not an OpenAI model list; the message says what is wrong."""


def model_cards(body: bytes) -> dict[str, Mapping[str, Any]]:
    """``/v1/models`` body -> {model id: card}, the first card of an id winning.

    Entries that are not objects with a string ``id`` are skipped.

    Raises:
        ModelListError: the body is not JSON, or has no ``data`` list.
    """
    try:
        doc = _JSON.decode(body)
    except msgspec.DecodeError as exc:
        raise ModelListError(f"/v1/models is not JSON: {exc}") from exc
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ModelListError("/v1/models has no 'data' list")
    cards: dict[str, Mapping[str, Any]] = {}
    for card in data:
        if isinstance(card, dict) and isinstance(card.get("id"), str):
            cards.setdefault(card["id"], card)
    return cards


def card_window(card: Mapping[str, Any]) -> int | None:
    """The card's ``max_model_len`` when it is a positive integer (vLLM gives one; most
    clouds give none), else None. A JSON ``true`` is not a window."""
    window = card.get("max_model_len")
    if isinstance(window, int) and not isinstance(window, bool) and window > 0:
        return window
    return None


def adapter_roots(cards: Mapping[str, Mapping[str, Any]], parent: str) -> dict[str, str]:
    """The LoRA adapters served on top of ``parent``: {adapter name: the path it was loaded
    from}.

    vLLM lists an adapter as a card whose ``parent`` is the base model's served name and whose
    ``root`` is the adapter's path (``--lora-modules name=path`` or
    ``/v1/load_lora_adapter``); both the name and that path enter every block hash of the
    adapter's requests. A card without a non-empty string ``root`` cannot be hashed and is
    left out.
    """
    found: dict[str, str] = {}
    for name, card in cards.items():
        root = card.get("root")
        if card.get("parent") == parent and name != parent and isinstance(root, str) and root:
            found[name] = root
    return found

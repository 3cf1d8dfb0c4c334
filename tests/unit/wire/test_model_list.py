"""Reading a ``/v1/models`` body: cards by id, the one error, and which windows count."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest

from kvroute.wire.model_list import ModelListError, card_window, model_cards
from kvroute.wire.openai import model_card, models_response


def test_reads_the_router_and_simulated_engines_own_list_back() -> None:
    cards = [
        model_card(id="m", created=1, permission_id="p", max_model_len=4096, root="/models/m"),
        model_card(id="n", created=1, permission_id="q", max_model_len=None),
    ]
    read = model_cards(msgspec.json.encode(models_response(cards)))
    assert list(read) == ["m", "n"]
    assert read["m"]["root"] == "/models/m"
    assert card_window(read["m"]) == 4096
    assert card_window(read["n"]) is None


def test_the_first_card_of_an_id_wins_and_cards_without_a_string_id_are_skipped() -> None:
    body = (b'{"data": [{"id": "m", "max_model_len": 1}, {"id": "m", "max_model_len": 2},'
            b' {"id": 3}, "m", {"object": "model"}]}')
    read = model_cards(body)
    assert list(read) == ["m"]
    assert card_window(read["m"]) == 1


@pytest.mark.parametrize(("body", "message"), [
    (b"<html>", "/v1/models is not JSON: "),
    (b"[]", "/v1/models has no 'data' list"),
    (b'{"data": {}}', "/v1/models has no 'data' list"),
    (b'{"object": "list"}', "/v1/models has no 'data' list"),
])
def test_a_body_that_is_not_a_model_list_raises_model_list_error(body: bytes,
                                                                  message: str) -> None:
    with pytest.raises(ModelListError, match="^" + re.escape(message)):
        model_cards(body)


@pytest.mark.parametrize("window", [None, 0, -1, True, 4096.0, "4096"])
def test_only_a_positive_integer_is_a_window(window: Any) -> None:
    assert card_window({"id": "m", "max_model_len": window}) is None
    assert card_window({"id": "m"}) is None

"""``core/pseudonyms.py``: keyed names equal under one secret, apart under two."""

from __future__ import annotations

import pytest

from kvroute.core.pseudonyms import Pseudonyms

SECRET = "cluster-secret-for-tests-" + "0" * 16


def test_one_secret_gives_one_name_and_another_secret_another() -> None:
    a, b, other = Pseudonyms(SECRET, ["acme"]), Pseudonyms(SECRET), Pseudonyms(SECRET + "x")
    for kind in ("tenant", "session", "request", "state_key"):
        assert getattr(a, kind)("acme") == getattr(b, kind)("acme")
        assert getattr(a, kind)("acme") != getattr(other, kind)("acme")
        assert "acme" not in getattr(a, kind)("acme")
    # each kind has its own names: a session's pseudonym on the bus is not its Redis key
    assert len({a.tenant("x"), a.session("x"), a.request("x"), a.state_key("x")}) == 4
    assert a.tenant_of(a.tenant("acme")) == "acme"
    assert a.tenant_of(a.tenant("globex")) is None and b.tenant_of(b.tenant("acme")) is None
    assert len(a.session("s")) == 32


def test_a_short_secret_is_refused_without_being_echoed_and_a_long_one_is_folded() -> None:
    with pytest.raises(ValueError, match="at least 16") as info:
        Pseudonyms("too-short")
    assert "too-short" not in str(info.value)
    long = Pseudonyms("k" * 200)
    assert long.session("s") != Pseudonyms("k" * 201).session("s")
    assert "k" * 16 not in repr(long)

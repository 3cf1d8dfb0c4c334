"""Session records in memory (``core/session.SessionTable``): expiry, bound, keys."""

from __future__ import annotations

import pytest

from kvroute.config import parse_config
from kvroute.core.errors import ConfigError
from kvroute.core.session import SessionRecord, SessionTable, SessionUsage, session_key
from kvroute.core.types import ReplicaId


def record(pin: str) -> SessionRecord:
    return SessionRecord(pin=ReplicaId(pin), tier=1, usage=SessionUsage(10, 2, 1))


def test_a_record_lives_its_ttl_from_its_last_write() -> None:
    table = SessionTable(ttl_s=10.0)
    table.put("k", record("r0"), now_s=0.0)
    assert table.get("k", now_s=9.9) == record("r0")
    table.put("k", record("r1"), now_s=9.9)
    assert table.get("k", now_s=19.8) == record("r1")
    assert table.get("k", now_s=19.9) is None
    assert len(table) == 0  # dropped when met


def test_the_least_recently_used_record_goes_first() -> None:
    table = SessionTable(max_sessions=2, ttl_s=60.0)
    table.put("a", record("ra"), 0.0)
    table.put("b", record("rb"), 0.0)
    assert table.get("a", 1.0) is not None  # a is now the most recently used
    table.put("c", record("rc"), 2.0)
    assert table.get("b", 3.0) is None
    assert [table.get(k, 3.0) for k in ("a", "c")] == [record("ra"), record("rc")]


def test_a_write_may_carry_its_own_ttl() -> None:
    table = SessionTable(ttl_s=60.0)
    table.put("k", record("r0"), 0.0, ttl_s=1.0)
    assert table.get("k", 1.0) is None


def test_keys_never_cross_tenants_routes_or_sessions() -> None:
    """Tenant and route names (from the config) hold no separator; a client's session id,
    last in the key, may hold anything and still never reaches another triple's key."""
    triples = [(t, r, s) for t in ("a", "ab") for r in ("m", "mm")
               for s in ("s", "x", "s\x1fm", "\x1fs")]
    keys = {session_key(*triple) for triple in triples}
    assert len(keys) == len(triples)


def test_bad_bounds_say_which_setting_to_fix() -> None:
    with pytest.raises(ConfigError, match="state.max_pins must be >= 1"):
        SessionTable(max_sessions=0)
    with pytest.raises(ConfigError, match="state.session_ttl_s"):
        SessionTable(ttl_s=0)


def test_a_route_name_that_could_forge_a_session_key_is_refused() -> None:
    with pytest.raises(ConfigError, match="without control characters"):
        parse_config({"pools": {"p": {"model": "m", "replicas": [
            {"name": "r0", "url": "http://127.0.0.1:9"}]}},
            "routes": {"m\x1fx": {"pools": ["p"]}}}, env={})

"""MemoryState: session records with TTLs on an injected clock, bounded LRU maps, warm
cooldowns, and build_state."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.config import RouterConfig, StateConfig, parse_config
from kvroute.core.clock import ManualClock
from kvroute.core.errors import ConfigError
from kvroute.core.session import SessionRecord, SessionUsage
from kvroute.core.types import ReplicaId
from kvroute.shell.state import (
    MemoryState,
    RedisState,
    build_state,
    decode_record,
    encode_record,
)

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def set_pin(state: MemoryState, key: str, replica: str, ttl_s: float) -> None:
    await state.put_session(key, SessionRecord(pin=ReplicaId(replica)), ttl_s)


async def get_pin(state: MemoryState, key: str) -> str | None:
    record = await state.get_session(key)
    return None if record is None else record.pin


def test_record_expires_after_ttl_and_a_write_refreshes_it() -> None:
    clock = ManualClock()
    state = MemoryState(clock=clock)

    async def go() -> None:
        await set_pin(state, "s1", "r0", ttl_s=10)
        clock.advance(9.9)
        assert await get_pin(state, "s1") == "r0"
        await set_pin(state, "s1", "r1", ttl_s=10)  # refresh: new replica, TTL from now
        clock.advance(9.9)
        assert await get_pin(state, "s1") == "r1"
        clock.advance(0.1)
        assert await get_pin(state, "s1") is None
        assert len(state) == 0  # the expired entry was dropped when met

    run(go())


def test_records_are_bounded_lru() -> None:
    state = MemoryState(max_pins=3, clock=ManualClock())

    async def go() -> None:
        for key in ("a", "b", "c"):
            await set_pin(state, key, f"r-{key}", ttl_s=60)
        assert await get_pin(state, "a") == "r-a"  # a is now the most recently used
        await set_pin(state, "d", "r-d", ttl_s=60)  # evicts b, the least recently used
        assert len(state) == 3
        assert await get_pin(state, "b") is None
        assert [await get_pin(state, k) for k in ("a", "c", "d")] == ["r-a", "r-c", "r-d"]

    run(go())


def test_warm_at_most_once_per_cooldown() -> None:
    clock = ManualClock()
    state = MemoryState(clock=clock)

    async def go() -> None:
        assert await state.try_start_warm("s1", cooldown_s=300) is True
        assert await state.try_start_warm("s1", cooldown_s=300) is False
        assert await state.try_start_warm("s2", cooldown_s=300) is True
        clock.advance(299.9)
        assert await state.try_start_warm("s1", cooldown_s=300) is False
        clock.advance(0.1)
        assert await state.try_start_warm("s1", cooldown_s=300) is True
        assert await state.try_start_warm("s1", cooldown_s=300) is False

    run(go())


def test_warm_cooldowns_are_bounded() -> None:
    state = MemoryState(max_warm=2, clock=ManualClock())

    async def go() -> None:
        assert await state.try_start_warm("a", 300)
        assert await state.try_start_warm("b", 300)
        assert await state.try_start_warm("c", 300)  # evicts a
        assert state.num_warm == 2
        assert await state.try_start_warm("a", 300) is True  # a's cooldown was forgotten
        assert await state.try_start_warm("c", 300) is False

    run(go())


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["set", "get", "tick"]),
            st.integers(0, 6),
            st.floats(0.0, 5.0, allow_nan=False),
        ),
        max_size=60,
    )
)
def test_memory_state_matches_a_naive_model(ops: list[tuple[str, int, float]]) -> None:
    """Against a dict + recency list reference model with the same bound and clock."""
    bound = 4
    clock = ManualClock()
    state = MemoryState(max_pins=bound, clock=clock)
    model: dict[str, tuple[str, float]] = {}
    recency: list[str] = []

    def touch(key: str) -> None:
        if key in recency:
            recency.remove(key)
        recency.append(key)

    async def go() -> None:
        for n, (op, k, amount) in enumerate(ops):
            key = f"k{k}"
            if op == "tick":
                clock.advance(amount)
            elif op == "set":
                await set_pin(state, key, f"r{n}", ttl_s=2.0)
                model[key] = (f"r{n}", clock.now() + 2.0)
                touch(key)
                while len(recency) > bound:
                    model.pop(recency.pop(0))
            else:
                got = await get_pin(state, key)
                entry = model.get(key)
                if entry is None or clock.now() >= entry[1]:
                    if entry is not None:
                        del model[key]
                        recency.remove(key)
                    assert got is None
                else:
                    assert got == entry[0]
                    touch(key)
            assert len(state) == len(model) <= bound

    run(go())


def test_bad_arguments_raise_clear_errors() -> None:
    with pytest.raises(ConfigError, match="max_pins=0"):
        MemoryState(max_pins=0)
    state = MemoryState()
    with pytest.raises(ValueError, match="ttl_s must be a positive number of seconds"):
        run(set_pin(state, "k", "r", ttl_s=0))
    with pytest.raises(ValueError, match="cooldown_s must be a positive"):
        run(state.try_start_warm("k", cooldown_s=-1))


def config(**sections: Any) -> RouterConfig:
    doc: dict[str, Any] = {
        "pools": {"p": {"model": "m", "replicas": [{"name": "r0", "url": "http://127.0.0.1:9"}]}},
        "routes": {"m": {"pools": ["p"]}},
        **sections,
    }
    return parse_config(doc, env={})


def test_build_state_backends() -> None:
    mem = build_state(config())
    assert isinstance(mem, MemoryState)
    assert (mem.max_pins, mem.max_warm) == (100_000, 256)
    mem = build_state(config(state={"backend": "memory", "max_pins": 7, "max_warm": 3}))
    assert isinstance(mem, MemoryState)
    assert (mem.max_pins, mem.max_warm) == (7, 3)
    redis_state = build_state(
        config(state={"backend": "redis", "url": "redis://127.0.0.1:1/0", "namespace": "fleet-a"})
    )
    assert isinstance(redis_state, RedisState)
    assert redis_state.session_key("s") == "fleet-a:session:s"
    assert redis_state.warm_key("s") == "fleet-a:warm:s"
    run(redis_state.close())
    with pytest.raises(ConfigError, match="state.url is missing"):
        build_state(replace(config(), state=StateConfig(backend="redis")))
    with pytest.raises(ConfigError, match="not a Redis URL"):
        RedisState.from_url("http://x")


def test_a_whole_record_round_trips_through_memory_and_the_redis_encoding() -> None:
    record = SessionRecord(pin=ReplicaId("r2"), tier=1, usage=SessionUsage(900, 40, 7),
                           version="v:2", arm="candidate", prompt_tokens=900)
    state = MemoryState(clock=ManualClock())
    run(state.put_session("t\x1fm\x1fs", record, ttl_s=30))
    assert run(state.get_session("t\x1fm\x1fs")) == record
    assert decode_record(encode_record(record)) == record
    assert decode_record(encode_record(SessionRecord())) == SessionRecord()


@pytest.mark.parametrize("stored", [b"r3", b"{not json", b'{"tier": -1}', b'{"usage": [1, 2]}',
                                    b'{"pin": 5}', b'{"prompt_tokens": -3}'])
def test_a_stored_value_this_router_did_not_write_reads_as_no_record(stored: bytes) -> None:
    assert decode_record(stored) is None

"""The official OpenAI Python SDK (``openai`` on PyPI) as a client of kvroute, directly.

Agents and apps point ``OpenAI(base_url=...)`` at the router; whatever the SDK sends and
parses must work: chat and completions, streamed and not, ``extra_body`` fields the SDK does
not know (vLLM's ``cache_salt``), and errors mapped to the SDK's exception classes with the
router's message intact.

One kvroute router (on its own thread: the SDK client used here is the blocking one) and two
``kvroute sim serve`` engines with ``--enable-prompt-tokens-details`` are started once for
the module, so ``usage.prompt_tokens_details.cached_tokens`` shows what the *engine* found
in its cache (the proof that ``cache_salt`` reached it).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from gateway import RouterThread

from kvroute.config import parse_config
from kvroute.sim.launcher import ReplicaSpec, start_fleet

pytestmark = pytest.mark.integration

TIMING = "0.001,0.00005,0.0002,0"
ROUTE = "assistant"
MODEL = "sim-model"
BLOCK = 16  # the sim's default block size: cached counts are whole blocks


def words(rng: random.Random, n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{rng.getrandbits(40):x}" for _ in range(n))


@pytest.fixture(scope="module")
def router() -> Iterator[RouterThread]:
    specs = [ReplicaSpec(name=f"s{i}", pool="main", model=MODEL,
                         enable_prompt_tokens_details=True, extra_args=("--timing", TIMING))
             for i in range(2)]
    fleet = start_fleet(specs, timeout_s=30.0)
    try:
        replicas = [{"name": r.name, "url": r.url, "kv_events": r.kv_events,
                     "kv_replay": r.kv_replay, "prefill_rate_tps": 20_000.0}
                    for r in fleet.replicas]
        config = parse_config({
            "listen": {"host": "127.0.0.1", "port": 0},
            "pools": {"main": {"model": MODEL, "replicas": replicas}},
            "routes": {ROUTE: {"pools": ["main"]}},
            "policy": {"name": "kvroute", "seed": 3},
            "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 0.5,
                          "models_interval_s": 5, "timeout_s": 1.0},
            "timeouts": {"connect_s": 1.0, "first_byte_s": 10.0, "total_s": 20.0},
            "log_level": "warning",
        }, env={})
        with RouterThread(config) as rt:
            yield rt
    finally:
        fleet.stop()


@pytest.fixture
def client(router: RouterThread) -> Iterator[openai.OpenAI]:
    # max_retries=0: every call in a test is exactly one HTTP exchange with kvroute.
    with openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0,
                       timeout=20.0) as sdk:
        yield sdk


def user(content: str) -> list[Any]:
    return [{"role": "user", "content": content}]


# --------------------------------------------------------------------------------------------
# Chat and completions
# --------------------------------------------------------------------------------------------


def test_models_list_shows_the_route(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == [ROUTE]


def test_chat_completion(client: openai.OpenAI) -> None:
    rng = random.Random(1)
    raw = client.chat.completions.with_raw_response.create(
        model=ROUTE, messages=user(words(rng, 80)), max_tokens=5, temperature=0.0)
    assert raw.headers["x-kvroute-pool"] == "main"
    assert raw.headers["x-kvroute-replica"] in {"s0", "s1"}
    reply = raw.parse()
    assert reply.object == "chat.completion"
    assert reply.model == MODEL  # the route name was mapped to the served model
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content is not None and len(choice.message.content.split()) == 5
    assert choice.finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 5
    assert reply.usage.prompt_tokens >= 80
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 5


def test_chat_completion_streaming(client: openai.OpenAI) -> None:
    rng = random.Random(2)
    stream = client.chat.completions.create(
        model=ROUTE, messages=user(words(rng, 40)), max_tokens=7, stream=True,
        stream_options={"include_usage": True})
    with stream:
        chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 7
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 7


def test_completion(client: openai.OpenAI) -> None:
    rng = random.Random(3)
    reply = client.completions.create(model=ROUTE, prompt=words(rng, 30), max_tokens=4)
    assert reply.object == "text_completion"
    assert len(reply.choices[0].text.split()) == 4
    assert reply.usage is not None and reply.usage.prompt_tokens == 30
    assert reply.usage.completion_tokens == 4


def test_completion_streaming(client: openai.OpenAI) -> None:
    rng = random.Random(4)
    stream = client.completions.create(model=ROUTE, prompt=words(rng, 30), max_tokens=6,
                                       stream=True)
    with stream:
        chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len(text.split()) == 6
    assert chunks[-1].choices[0].finish_reason == "length"


# --------------------------------------------------------------------------------------------
# extra_body: cache_salt reaches the router and the engine
# --------------------------------------------------------------------------------------------


def _cached(client: openai.OpenAI, content: str, salt: str | None) -> tuple[int, int, str]:
    """(engine's cached tokens, kvroute's expected cached tokens, replica) for one call."""
    extra = {"cache_salt": salt} if salt is not None else None
    raw = client.chat.completions.with_raw_response.create(
        model=ROUTE, messages=user(content), max_tokens=1, extra_body=extra)
    reply = raw.parse()
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    engine = reply.usage.prompt_tokens_details.cached_tokens or 0
    return engine, int(raw.headers["x-kvroute-cached-tokens"]), raw.headers["x-kvroute-replica"]


def test_extra_body_cache_salt_partitions_the_cache(client: openai.OpenAI) -> None:
    rng = random.Random(5)
    prompt = words(rng, 300)
    salt_a, salt_b = f"team-a-{rng.getrandbits(32):x}", f"team-b-{rng.getrandbits(32):x}"

    first_engine, _, first_replica = _cached(client, prompt, salt_a)
    assert first_engine == 0  # a fresh prompt
    # Same salt: kvroute sends it back where it is cached, and the engine hits.
    again_engine, again_router, again_replica = _cached(client, prompt, salt_a)
    assert again_replica == first_replica
    assert again_engine >= 18 * BLOCK  # nearly all of ~300 tokens, in whole blocks
    assert again_router > 0
    # Another salt: the same text shares nothing, at the engine (hash of block 0 differs).
    other_engine, other_router, _ = _cached(client, prompt, salt_b)
    assert other_engine == 0
    assert other_router == 0
    # And no salt at all is yet another partition.
    unsalted_engine, _, _ = _cached(client, prompt, None)
    assert unsalted_engine == 0


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_bad_request_raises_bad_request_error_with_kvroute_message(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=ROUTE, messages=user("hello"), max_tokens=0)
    err = caught.value
    assert err.status_code == 400
    assert "max_tokens must be at least 1" in err.message
    assert err.response.headers["x-kvroute-replica"] == "none"  # refused before routing


def test_bad_cache_salt_in_extra_body_is_a_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=ROUTE, messages=user("hello"), max_tokens=2,
                                       extra_body={"cache_salt": "a/b"})
    assert "Parameter 'cache_salt'" in caught.value.message


def test_unknown_model_raises_not_found_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-9", messages=user("hello"), max_tokens=2)
    err = caught.value
    assert err.status_code == 404
    assert f"The model `gpt-9` does not exist. This router serves: {ROUTE}" in err.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hello", max_tokens=2)


def test_streaming_request_error_is_raised_before_any_chunk(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=ROUTE, messages=[{"content": "no role"}],  # type: ignore[list-item]
                                       max_tokens=2, stream=True)
    assert "messages[0] has no 'role'" in caught.value.message

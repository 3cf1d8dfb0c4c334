"""kvroute in front of two real vLLM 0.32 CPU engines: what the router believes vs the engines.

Each check compares the router's view with what the engines themselves report:

1. hash parity: the block hashes the router computed for a chat request (with the block size
   and hash algorithm it discovered on the engines' ``/metrics``) equal the ``BlockStored``
   hashes the chosen engine published for it, and ``/admin/index`` shows them as stored;
2. agreement: over a scripted workload (multi-turn sessions, a shared system prompt, unique
   prompts, repeats; requests one at a time) the router's ``x-kvroute-cached-tokens`` equals
   the chosen engine's Δ``vllm:prefix_cache_hits_total`` for every request;
3. stream faults: a router started after requests were served catches up through the replay
   socket and its index equals the engine's truth (the fold of the engine's whole replay
   buffer); a second router started later does the same; ``POST /reset_prefix_cache``'s
   ``AllBlocksCleared`` empties that replica; an engine restarted under the router is taken out,
   its entries dropped, and rebuilt from the new process's events;
4. tenants: two salted tenants sending the same prompt never hit each other's blocks;
5. tiers: a 1,024-token engine and a 2,048-token engine as two pools of one route (a growing
   session crosses the small window without a failed request; warm-ahead makes the escalated
   request a cache hit; a real over-long 400 is parsed and recovered).

Engines. One pair per module, started in parallel: ``e0`` with ``--max-model-len 1024`` and
``e1`` with 2048, both with ``VLLM_SERVER_DEV_MODE=1`` (for ``/reset_prefix_cache``). The
session pair of ``conftest.py`` cannot be reused: its engines' events endpoints are plain
``tcp://127.0.0.1:<port>``, which vLLM *connects* to, and the router must bind them itself
(``kv_events_bind: true``), one binder at a time; the windows differ too. To iterate, keep a
suitable pair running and attach to it::

    .venv/bin/python tests/realvllm.py --count 2 --max-model-len 1024 2048 \\
        --env VLLM_SERVER_DEV_MODE=1 --out /tmp/router-engines.json
    KVROUTE_REALVLLM_ENGINES=/tmp/router-engines.json .venv/bin/python -m pytest \\
        tests/conformance/test_router_real_vllm.py -m realvllm -s

(attached engines are used only when their windows are 1,024 and 2,048; the restart test
needs engines this module started, since it must own the process it restarts).

Every router runs in the test's event loop (``RouterRuntime``) and talks to the engines over
loopback; engine helpers are called through ``asyncio.to_thread`` or aiohttp so the router's
loop never blocks. Every prompt starts with a fresh nonce, so no test depends on what an
earlier one left in the caches; the index-vs-truth checks fold the engine's *whole* replay
buffer, so they hold whatever earlier tests did.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import realvllm
from realvllm import RealVllmEngine, RealVllmEngines, metric_samples

from kvroute.config import RouterConfig, derive_cache_salt, parse_config
from kvroute.core.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvroute.core.hashing import BlockHasher
from kvroute.core.index import AdminCapability
from kvroute.core.router import RouteRequest, RoutingDecision
from kvroute.core.types import ReplicaId, WireHash
from kvroute.shell.runtime import RouterRuntime
from kvroute.wire.openai import parse_request
from kvroute.wire.vllm_events import decode_replay_reply

pytestmark = pytest.mark.realvllm

SMALL_WINDOW = 1024
LARGE_WINDOW = 2048
ROUTE = "assistant"
ADMIN_KEY = "admin-key-for-tests"
ENV = {
    "KVROUTE_TEST_ADMIN": ADMIN_KEY,
    "KVROUTE_TEST_ACME": "acme-key",
    "KVROUTE_TEST_GLOBEX": "globex-key",
    "KVROUTE_SALT_SECRET": "salt-secret-for-tests",
}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"


# ---------------------------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair() -> Iterator[list[RealVllmEngine]]:
    """``[e0 (window 1024), e1 (window 2048)]``, dev mode on, started once for the module."""
    attach = os.environ.get("KVROUTE_REALVLLM_ENGINES")
    if attach:
        engines = realvllm.load_engines(Path(attach))[:2]
        if [e.max_model_len for e in engines] == [SMALL_WINDOW, LARGE_WINDOW]:
            yield engines
            return
    with realvllm.real_vllm_engines(
        2,
        max_model_len=(SMALL_WINDOW, LARGE_WINDOW),
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
    ) as started:
        yield started


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------

def user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


# ---------------------------------------------------------------------------------------------
# The router
# ---------------------------------------------------------------------------------------------


def replica_config(name: str, engine: RealVllmEngine) -> dict[str, Any]:
    return {
        "name": name,
        "url": engine.url,
        "kv_events": engine.events_endpoint,
        "kv_events_bind": True,  # vLLM connects its PUB to a concrete tcp endpoint
        "kv_replay": engine.replay_endpoint,
        "kv_topic": engine.topic,
    }


def router_config(
    pools: Mapping[str, list[tuple[str, RealVllmEngine]]],
    *,
    tenants: list[dict[str, Any]] | None = None,
    warm_ahead: bool = False,
    pool_extra: Mapping[str, Mapping[str, Any]] | None = None,
) -> RouterConfig:
    """One route over ``pools`` (in order); block size and hash algorithm left to discovery."""
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {
            name: {
                "model": reps[0][1].model,
                "replicas": [replica_config(rname, eng) for rname, eng in reps],
                **(pool_extra or {}).get(name, {}),
            }
            for name, reps in pools.items()
        },
        "routes": {ROUTE: {"pools": list(pools)}},
        "policy": {"name": "kvroute", "seed": 7},
        "admin_key_env": "KVROUTE_TEST_ADMIN",
        "discovery": {
            "health_interval_s": 0.5,
            "metrics_interval_s": 1.0,
            "models_interval_s": 5.0,
            "timeout_s": 2.0,
        },
        "timeouts": {"connect_s": 2.0, "first_byte_s": 60.0, "total_s": 120.0},
        "warm_ahead": {"enabled": warm_ahead, "cooldown_s": 0},
        "log_level": "warning",
    }
    if tenants is not None:
        data["tenants"] = tenants
    return parse_config(data, env={})


class RecordingRuntime(RouterRuntime):
    """A router that also keeps every decision, KV-event batch and index reset it saw."""

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config, env=ENV)
        self.decisions: list[RoutingDecision] = []
        self.batches: list[tuple[ReplicaId, EventBatch]] = []
        self.resets: list[tuple[ReplicaId, str]] = []
        route = self.core.route

        def recording_route(request: RouteRequest) -> RoutingDecision:
            decision = route(request)
            self.decisions.append(decision)
            return decision

        self.core.route = recording_route  # type: ignore[method-assign]

    def _on_batch(self, replica: ReplicaId, batch: EventBatch) -> None:
        self.batches.append((replica, batch))
        super()._on_batch(replica, batch)

    def _on_reset(self, replica: ReplicaId, reason: str) -> None:
        self.resets.append((replica, reason))
        super()._on_reset(replica, reason)

    def entries(self, replica: str) -> int:
        return self.core.index.stats().num_entries_by_replica.get(ReplicaId(replica), 0)

    def stored_run(self, replica: str, hashes: list[WireHash]) -> int:
        """Leading blocks of ``hashes`` the index holds as *stored* (from events) on ``replica``."""
        scope = AdminCapability().fleet_scope()
        match = self.core.index.match(hashes, scope).get(ReplicaId(replica))
        return 0 if match is None else match.num_gpu_blocks


@dataclass(slots=True)
class Client:
    """aiohttp against the router and the engines (never blocks the router's loop)."""

    session: aiohttp.ClientSession
    url: str

    async def chat(
        self,
        messages: list[dict[str, str]],
        *,
        headers: Mapping[str, str] | None = None,
        **params: Any,
    ) -> tuple[int, Mapping[str, str], Any]:
        body = {"model": ROUTE, "messages": messages, "max_tokens": 8, **params}
        async with self.session.post(
            self.url + "/v1/chat/completions", json=body, headers=dict(headers or {})
        ) as resp:
            return resp.status, resp.headers.copy(), await resp.json(content_type=None)

    async def get_json(self, path: str) -> Any:
        async with self.session.get(self.url + path, headers=ADMIN) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def engine_chat(self, engine: RealVllmEngine, messages: list[dict[str, str]],
                          **params: Any) -> Any:
        body = {"model": engine.model, "messages": messages, "max_tokens": 4, **params}
        async with self.session.post(engine.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def metric(self, engine: RealVllmEngine, name: str) -> float:
        async with self.session.get(engine.url + "/metrics") as resp:
            return sum(v for _, v in metric_samples(await resp.text(), name))


async def with_router(
    config: RouterConfig,
    body: Callable[[RecordingRuntime, Client], Awaitable[None]],
    *,
    engines: list[RealVllmEngine],
) -> None:
    async with RecordingRuntime(config) as rt:
        timeout = aiohttp.ClientTimeout(total=150)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            client = Client(session, rt.url)
            await wait_live(rt, client, engines)
            await body(rt, client)


def run(coro: Awaitable[None], timeout_s: float = 240.0) -> None:
    async def main() -> None:
        await asyncio.wait_for(coro, timeout_s)

    asyncio.run(main())


async def poll(predicate: Callable[[], Awaitable[bool] | bool], what: str,
               timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


async def wait_live(rt: RecordingRuntime, client: Client, engines: list[RealVllmEngine]) -> None:
    """Until each engine's PUB has connected to the router's SUB and a batch went through.

    vLLM's PUB drops what it publishes before the subscription reaches it, so a stream is
    proven live only by a batch that arrived: send one-block probes straight to the engine.
    The first batch also makes the subscriber catch up on the engine's whole replay buffer.
    """
    by_url = {e.url: e for e in engines}
    for name, sub in rt.subscribers.items():
        engine = by_url[rt.config.replica(name).url]
        for n in itertools.count():
            if sub.stats.batches > 0:
                break
            assert n < 40, f"{name}: no KV event reached the router from {engine.events_endpoint}"
            probe = f"probe {realvllm.nonce()} " + realvllm.filler_text(n, 7)  # > 1 block
            await client.engine_chat(engine, [user(probe)], max_tokens=1)
            await asyncio.sleep(0.25)


# ---------------------------------------------------------------------------------------------
# The engine's truth
# ---------------------------------------------------------------------------------------------


def engine_truth(engine: RealVllmEngine) -> tuple[set[int], int]:
    """The blocks an engine holds per its own event history: (hashes, last seq).

    Folds every batch the engine's replay socket still buffers, from seq 0, as a
    reference-counting consumer must (vLLM keeps duplicate copies under one hash).
    """
    counts: Counter[int] = Counter()
    last = -1
    replies = realvllm.replay(engine, start_seq=0)
    for frames in replies:
        reply = decode_replay_reply(frames)
        batch = reply.batch  # type: ignore[union-attr]
        assert batch.seq == last + 1, f"{engine.name}: replay not contiguous at {batch.seq}"
        last = batch.seq
        for event in batch.events:
            if isinstance(event, BlockStored):
                counts.update(int(h) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                counts.subtract(int(h) for h in event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                counts.clear()
    return {h for h, c in counts.items() if c > 0}, last


def applied_seq(rt: RecordingRuntime, replica: str) -> int:
    """The last sequence number the router applied for ``replica`` (-1: none yet)."""
    last = rt.subscribers[ReplicaId(replica)].stats.last_seq
    return -1 if last is None else last


async def assert_index_is_truth(rt: RecordingRuntime, replica: str,
                                engine: RealVllmEngine) -> int:
    """The router's stored entries for ``replica`` are exactly the engine's truth."""
    truth, last = await asyncio.to_thread(engine_truth, engine)
    await poll(lambda: applied_seq(rt, replica) >= last, f"{replica} to apply up to seq {last}")
    held = {h for h in truth if rt.stored_run(replica, [WireHash(h)]) == 1}
    assert held == truth, f"{replica}: index lacks {len(truth - held)} of {len(truth)} blocks"
    assert rt.entries(replica) == len(truth), (
        f"{replica}: index holds {rt.entries(replica)} entries, engine truth {len(truth)}"
    )
    return len(truth)


# ---------------------------------------------------------------------------------------------
# One request, measured on both sides
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Sample:
    kind: str
    replica: str
    prompt_tokens: int
    expected_cached: int
    engine_hits: int
    latency_s: float
    answer: str = ""
    decision: RoutingDecision | None = field(default=None, repr=False)


async def measured_chat(
    rt: RecordingRuntime,
    client: Client,
    engines_by_replica: Mapping[str, RealVllmEngine],
    hasher: BlockHasher,
    kind: str,
    messages: list[dict[str, str]],
    *,
    headers: Mapping[str, str] | None = None,
    cache_salt: str | None = None,
    **params: Any,
) -> Sample:
    """Send one chat request through the router and read the chosen engine's hit delta.

    Waits, before returning, until the router has applied the events of this request (every
    full block of prompt + output is held as stored on the chosen replica), so the next
    request is routed on a complete index: the comparison is then exact, not racy.
    """
    before = {r: (await client.metric(e, HITS), await client.metric(e, QUERIES))
              for r, e in engines_by_replica.items()}
    n_decisions = len(rt.decisions)
    started = time.perf_counter()
    status, headers_out, body = await client.chat(
        messages, headers=headers, return_token_ids=True, **params
    )
    latency = time.perf_counter() - started
    assert status == 200, body
    replica = headers_out["x-kvroute-replica"]
    engine = engines_by_replica[replica]
    prompt_ids = body["prompt_token_ids"]
    output_ids = body["choices"][0]["token_ids"] or []

    async def counted() -> bool:
        return await client.metric(engine, QUERIES) - before[replica][1] >= len(prompt_ids)

    await poll(counted, f"{replica}'s prefix-cache query counter")
    hits = int(await client.metric(engine, HITS) - before[replica][0])
    for other, other_engine in engines_by_replica.items():
        if other != replica:
            assert await client.metric(other_engine, QUERIES) == before[other][1], (
                f"{other} served something while {replica} was measured"
            )
    # The last sampled token is never computed, so it cannot complete a block.
    all_ids = prompt_ids + output_ids
    num_blocks = (len(all_ids) - 1) // hasher.block_size
    hashes = hasher.wire_hashes(all_ids, cache_salt=cache_salt)[:num_blocks]
    await poll(lambda: rt.stored_run(replica, hashes) == len(hashes),
               f"{replica}'s events for {kind} request in the router's index")
    decision = rt.decisions[n_decisions] if len(rt.decisions) > n_decisions else None
    return Sample(
        kind=kind,
        replica=replica,
        prompt_tokens=len(prompt_ids),
        expected_cached=int(headers_out["x-kvroute-cached-tokens"]),
        engine_hits=hits,
        latency_s=latency,
        answer=body["choices"][0]["message"]["content"] or "",
        decision=decision,
    )


async def discovered_hasher(client: Client, pool: str, engine: RealVllmEngine) -> BlockHasher:
    """The router's hashing for ``pool`` as it discovered it, checked against the engine.

    The config fixes neither block size nor algorithm, so both come from the engine's
    ``vllm:cache_config_info`` (128 and sha256 for the CPU backend, which is why a router
    must never assume vLLM's GPU default of 16).
    """
    state = await client.get_json("/admin/state")
    spec = state["pools"][pool]
    async with client.session.get(engine.url + "/metrics") as resp:
        (info,) = [labels for labels, _ in
                   metric_samples(await resp.text(), "vllm:cache_config_info")]
    reported = (int(info["block_size"]), info["prefix_caching_hash_algo"])
    assert (spec["block_size"], spec["hash_algo"], spec["approximate"]) == (*reported, False)
    return BlockHasher(algo=spec["hash_algo"], block_size=spec["block_size"])


def both(pair: list[RealVllmEngine]) -> dict[str, list[tuple[str, RealVllmEngine]]]:
    return {"both": [("r0", pair[0]), ("r1", pair[1])]}


# ---------------------------------------------------------------------------------------------
# 1. hash parity
# ---------------------------------------------------------------------------------------------


def test_auto_tokenizer_adopts_the_engines_directory_and_gives_their_ids(
        pair: list[RealVllmEngine]) -> None:
    """``tokenizer: auto`` (the default) finds the directory the engines were started on (the
    ``root`` of their model card), checks it against their ``/tokenize`` and adopts it; its ids
    then equal the engine's own for chat shapes beyond the check's probes."""
    filler = realvllm.filler_text(3, 40)
    conversations: list[list[dict[str, str]]] = [
        [{"role": "system", "content": "You answer briefly. " + filler},
         user("What is a prefix cache?")],
        [user("Hello"), {"role": "assistant", "content": "Hi! How can I help?"},
         user("Tell me about caches: café, naïve, 你好, emoji-free.\n\tIndented line.")],
        [user(filler + " " + realvllm.nonce())],
    ]

    async def body(rt: RecordingRuntime, client: Client) -> None:
        check = rt.tokenizer_checks["both"]
        await poll(lambda: check.rounds > 0, "the tokenizer check's first round", 60.0)
        assert check.result == "verified", check.detail
        tokenizer = rt.tokenizers["both"]
        assert tokenizer.mode == "local"
        for messages in conversations:
            parsed = parse_request(json.dumps({"model": ROUTE, "messages": messages}).encode(),
                                   "chat")
            mine = await tokenizer.token_ids(parsed)
            async with client.session.post(pair[0].url + "/tokenize", json={
                    "model": pair[0].model, "messages": messages}) as resp:
                assert resp.status == 200, await resp.text()
                theirs = (await resp.json())["tokens"]
            assert mine is not None and list(mine) == theirs, messages[-1]["content"][:60]

    config = router_config(both(pair))
    assert config.pools["both"].tokenizer.mode == "auto"  # nothing set: the default
    run(with_router(config, body, engines=pair))


def test_router_hashes_equal_the_engines_block_stored_hashes(pair: list[RealVllmEngine]) -> None:
    async def body(rt: RecordingRuntime, client: Client) -> None:
        hasher = await discovered_hasher(client, "both", pair[0])
        messages = [
            {"role": "system", "content": f"Nonce {realvllm.nonce()}. " + realvllm.filler_text(1, 30)},
            user(realvllm.filler_text(2, 10)),
        ]
        n_batches = len(rt.batches)
        sample = await measured_chat(rt, client, {"r0": pair[0], "r1": pair[1]}, hasher,
                                     "parity", messages, max_tokens=1)
        decision = sample.decision
        assert decision is not None and not decision.approximate
        num_blocks = (sample.prompt_tokens - 1) // hasher.block_size
        assert num_blocks >= 5, f"prompt too short: {sample.prompt_tokens} tokens"
        published = [
            h
            for replica, batch in rt.batches[n_batches:]
            if replica == sample.replica
            for event in batch.events
            if isinstance(event, BlockStored)
            for h in event.block_hashes
        ]
        # The router routed on exactly the hashes the engine then published, block for block.
        assert list(decision.block_hashes[:num_blocks]) == published[:num_blocks]
        assert len(published) == num_blocks  # max_tokens=1: prompt blocks only
        # /admin/index, asked for the router's hashes, shows them stored on the chosen replica.
        query = ",".join(str(h) for h in decision.block_hashes)
        index = await client.get_json(f"/admin/index?hashes={query}")
        assert index["match"][sample.replica]["gpu"] == num_blocks, index

    run(with_router(router_config(both(pair)), body, engines=pair))


# ---------------------------------------------------------------------------------------------
# 2. expected cached tokens vs the engines' hit counters
# ---------------------------------------------------------------------------------------------


def workload(rng: random.Random) -> list[tuple[str, Any]]:
    """52 steps: 6 sessions x 4 turns, 12 shared-system, 12 unique, 4 exact repeats.

    Session steps are ``("session", i)`` (the conversation is grown at run time with the
    engine's own answers); the others carry their messages. The order is shuffled with the
    sessions' turns kept in order.
    """
    system = {"role": "system", "content": f"Nonce {realvllm.nonce()}. You are a helpful assistant. "
              + realvllm.filler_text(5, 17)}
    steps: list[tuple[str, Any]] = []
    steps += [("session", i) for i in range(6) for _ in range(4)]
    steps += [("shared", [system, user(f"Question {realvllm.nonce()}: " + realvllm.filler_text(6 + i, 2))])
              for i in range(12)]
    uniques = [[user(f"Nonce {realvllm.nonce()}. " + realvllm.filler_text(20 + i, rng.randrange(3, 30)))]
               for i in range(12)]
    steps += [("unique", m) for m in uniques]
    steps += [("repeat", uniques[i]) for i in range(4)]
    rng.shuffle(steps)
    # Repeats after their original, so they are repeats.
    firsts = {id(m): k for k, (kind, m) in enumerate(steps) if kind == "unique"}
    for k, (kind, m) in enumerate(steps):
        if kind == "repeat" and firsts[id(m)] > k:
            j = firsts[id(m)]
            steps[k], steps[j] = steps[j], steps[k]
            firsts[id(m)] = k
    sessions = [[system, user(f"Session {i} {realvllm.nonce()}: " + realvllm.filler_text(40 + i, 3))] for i in range(6)]
    return [("session", sessions[x]) if kind == "session" else (kind, x) for kind, x in steps]


def test_expected_cached_tokens_equal_engine_prefix_hits(pair: list[RealVllmEngine]) -> None:
    samples: list[Sample] = []

    async def body(rt: RecordingRuntime, client: Client) -> None:
        hasher = await discovered_hasher(client, "both", pair[0])
        engines = {"r0": pair[0], "r1": pair[1]}
        rng = random.Random(11)
        turns: Counter[int] = Counter()
        steps = workload(rng)
        # Both engines must serve part of the workload, by construction rather than by the
        # engines' relative speed (learned speeds decide between two idle engines, and on
        # some machines everything went to one): one session's opening turn is computed on
        # each engine, straight on the engine, so each session's turns are drawn by the
        # cache to where it began (the shared system prompt is then on both).
        openings: list[list[dict[str, Any]]] = []
        for kind, messages in steps:
            if kind == "session" and all(messages is not o for o in openings):
                openings.append(messages)
        for (name, engine), opening in zip(((r, engines[r]) for r in ("r0", "r1")), openings,
                                           strict=False):
            await client.engine_chat(engine, list(opening), max_tokens=1)
            await all_events_applied(rt, name, engine)
        started = time.perf_counter()
        for kind, messages in steps:
            sid = id(messages)
            sample = await measured_chat(rt, client, engines, hasher, kind, messages,
                                         max_tokens=16, temperature=0.0)
            samples.append(sample)
            if kind == "session":  # grow the conversation with the engine's own answer
                turns[sid] += 1
                messages.append({"role": "assistant", "content": sample.answer})
                messages.append(user(f"Follow-up {turns[sid]}: " + realvllm.filler_text(60 + turns[sid], 3)))
        elapsed = time.perf_counter() - started
        _report_agreement(samples, elapsed)
        # No request may be left with a disagreement.
        wrong = [s for s in samples if s.expected_cached != s.engine_hits]
        assert not wrong, "\n".join(
            f"{s.kind} on {s.replica}: router expected {s.expected_cached}, engine hit "
            f"{s.engine_hits} of {s.prompt_tokens}" for s in wrong
        )
        # The workload exercised what it means to: both engines, real hits, real misses.
        assert {s.replica for s in samples} == {"r0", "r1"}
        assert sum(1 for s in samples if s.engine_hits > 0) >= 20
        assert all(s.engine_hits > 0 for s in samples if s.kind in ("repeat",))
        for replica, engine in engines.items():
            await assert_index_is_truth(rt, replica, engine)

    run(with_router(router_config(both(pair)), body, engines=pair), timeout_s=420.0)


def _report_agreement(samples: list[Sample], elapsed_s: float) -> None:
    agree = sum(1 for s in samples if s.expected_cached == s.engine_hits)
    by_kind: dict[str, list[Sample]] = {}
    for s in samples:
        by_kind.setdefault(s.kind, []).append(s)
    lat = sorted(s.latency_s for s in samples)
    print(f"\nagreement: {agree}/{len(samples)} requests; hit tokens router "
          f"{sum(s.expected_cached for s in samples)} engine {sum(s.engine_hits for s in samples)}"
          f" of {sum(s.prompt_tokens for s in samples)} prompt tokens; placed "
          f"{dict(Counter(s.replica for s in samples))}; {elapsed_s:.1f} s wall, latency p50 "
          f"{statistics.median(lat) * 1e3:.0f} ms p90 {lat[int(0.9 * len(lat))] * 1e3:.0f} ms")
    for kind, group in sorted(by_kind.items()):
        print(f"  {kind:8s} n={len(group):2d} prompt {sum(s.prompt_tokens for s in group):6d} "
              f"expected {sum(s.expected_cached for s in group):6d} "
              f"hits {sum(s.engine_hits for s in group):6d}")


# ---------------------------------------------------------------------------------------------
# 3. stream faults
# ---------------------------------------------------------------------------------------------


def test_a_router_started_late_catches_up_through_replay(pair: list[RealVllmEngine]) -> None:
    """Requests served while no router listens are recovered from the replay socket, twice."""
    engine = pair[1]
    config = router_config({"solo": [("r1", engine)]})

    def serve_unseen(tag: str) -> None:
        for i in range(3):
            realvllm.chat(engine, [user(f"{tag} {realvllm.nonce()} " + realvllm.filler_text(70 + i, 12))], max_tokens=2)

    async def body(rt: RecordingRuntime, client: Client) -> None:
        stats = rt.subscribers[ReplicaId("r1")].stats
        assert stats.replays >= 1 and stats.replayed_batches >= 3, stats
        assert stats.resets == 0 and not rt.resets
        await assert_index_is_truth(rt, "r1", engine)

    serve_unseen("before the first router")
    run(with_router(config, body, engines=[engine]))
    # The router is gone; the engine keeps serving; a new router catches up again.
    serve_unseen("between routers")
    run(with_router(config, body, engines=[engine]))


def test_reset_prefix_cache_empties_the_replica(pair: list[RealVllmEngine]) -> None:
    engine = pair[0]

    async def body(rt: RecordingRuntime, client: Client) -> None:
        hasher = await discovered_hasher(client, "solo", engine)
        messages = [user(f"Nonce {realvllm.nonce()}. " + realvllm.filler_text(80, 20))]
        first = await measured_chat(rt, client, {"r0": engine}, hasher, "first", messages)
        again = await measured_chat(rt, client, {"r0": engine}, hasher, "again", messages)
        assert again.expected_cached == again.engine_hits > 0
        assert rt.entries("r0") > 0
        held = rt.entries("r0")
        batches = rt.subscribers[ReplicaId("r0")].stats.batches
        n_seen = len(rt.batches)
        async with client.session.post(engine.url + "/reset_prefix_cache") as resp:
            assert resp.status == 200, await resp.text()
        # vLLM 0.32 queues AllBlocksCleared with the block pool's events, which the scheduler
        # publishes only at its next step: an idle engine says nothing about the reset.
        await asyncio.sleep(1.0)
        assert (rt.subscribers[ReplicaId("r0")].stats.batches, rt.entries("r0")) == (
            batches, held), "AllBlocksCleared now arrives without a step: update docs"
        # Any request makes a step; this one is shorter than a block, so it stores nothing.
        await client.engine_chat(engine, [user("a short one")], max_tokens=1)
        await poll(lambda: rt.entries("r0") == 0, "AllBlocksCleared to empty r0")
        cleared = [b for r, b in rt.batches[n_seen:] if r == "r0"
                   and any(isinstance(e, AllBlocksCleared) for e in b.events)]
        assert len(cleared) == 1
        after = await measured_chat(rt, client, {"r0": engine}, hasher, "after", messages)
        assert (after.expected_cached, after.engine_hits) == (0, 0), after
        assert first.prompt_tokens == after.prompt_tokens
        await assert_index_is_truth(rt, "r0", engine)

    run(with_router(router_config({"solo": [("r0", engine)]}), body, engines=[engine]))


def test_an_engine_restarted_under_the_router_is_dropped_and_rebuilt(
    pair: list[RealVllmEngine],
) -> None:
    if not isinstance(pair, RealVllmEngines):
        pytest.skip(
            "the engines were attached with KVROUTE_REALVLLM_ENGINES and belong to another "
            "process, which this test cannot restart; run without it to start owned engines"
        )
    async def body(rt: RecordingRuntime, client: Client) -> None:
        hasher = await discovered_hasher(client, "both", pair[0])
        for i in range(4):  # several batches, so the new process's seqs run below the old
            await client.engine_chat(pair[0], [user(f"Nonce {realvllm.nonce()}. " + realvllm.filler_text(90 + i, 12))])
        await assert_index_is_truth(rt, "r0", pair[0])
        old = rt.subscribers[ReplicaId("r0")].stats
        assert rt.entries("r0") > 0 and old.last_seq is not None and old.last_seq >= 4
        old_pid = pair[0].pid

        restart = asyncio.create_task(asyncio.to_thread(pair.restart, 0))
        try:
            # Discovery sees the engine go and drops its entries at once...
            await poll(lambda: not rt.core.is_healthy(ReplicaId("r0")), "r0 taken out", 30.0)
            assert rt.entries("r0") == 0
            # ...and requests go to the other engine meanwhile, without a failure.
            down = await measured_chat(rt, client, {"r1": pair[1]}, hasher, "down",
                                       [user(f"Nonce {realvllm.nonce()}. " + realvllm.filler_text(95, 8))])
            assert down.replica == "r1"
        finally:
            new_engine = await restart
        assert new_engine.pid != old_pid and pair[0] is new_engine
        await poll(lambda: rt.core.is_healthy(ReplicaId("r0")), "r0 back in", 30.0)
        # The new process publishes from seq 0 again: the subscriber notices and resets.
        messages = [user(f"Nonce {realvllm.nonce()}. " + realvllm.filler_text(96, 12))]
        await client.engine_chat(pair[0], messages)
        await poll(lambda: any(r == "r0" for r, _ in rt.resets), "the subscriber's reset")
        reason = next(reason for r, reason in rt.resets if r == "r0")
        assert "restarted" in reason, reason
        # Rebuilt from the new process's events only, equal to its truth.
        size = await assert_index_is_truth(rt, "r0", pair[0])
        assert size > 0
        hashes = hasher.wire_hashes(
            await asyncio.to_thread(realvllm.tokenize_chat, pair[0], messages))
        assert rt.stored_run("r0", hashes[:2]) == 2

    run(with_router(router_config(both(pair)), body, engines=pair),
        timeout_s=realvllm.DEFAULT_READY_TIMEOUT_S + 120.0)


# ---------------------------------------------------------------------------------------------
# 4. tenants
# ---------------------------------------------------------------------------------------------


def test_salted_tenants_never_share_cached_blocks(pair: list[RealVllmEngine]) -> None:
    engine = pair[1]
    # Salted by default; the routing headers the measurement reads must be allowed.
    tenants = [
        {"name": "acme", "api_key_env": "KVROUTE_TEST_ACME", "routing_headers": True},
        {"name": "globex", "api_key_env": "KVROUTE_TEST_GLOBEX", "routing_headers": True},
    ]
    acme = {"Authorization": "Bearer acme-key"}
    globex = {"Authorization": "Bearer globex-key"}

    async def body(rt: RecordingRuntime, client: Client) -> None:
        hasher = await discovered_hasher(client, "solo", engine)
        salts = {t: derive_cache_salt(ENV["KVROUTE_SALT_SECRET"], t) for t in ("acme", "globex")}
        messages = [{"role": "system", "content": f"Nonce {realvllm.nonce()}. " + realvllm.filler_text(100, 25)},
                    user("The same question from both tenants.")]
        engines = {"r1": engine}

        async def ask(kind: str, headers: Mapping[str, str], tenant: str) -> Sample:
            return await measured_chat(rt, client, engines, hasher, kind, messages,
                                       headers=headers, cache_salt=salts[tenant])

        a1 = await ask("acme-1", acme, "acme")
        g1 = await ask("globex-1", globex, "globex")
        a2 = await ask("acme-2", acme, "acme")
        g2 = await ask("globex-2", globex, "globex")
        # Same prompt, same engine: the second tenant's first request hits nothing.
        assert (a1.engine_hits, g1.engine_hits) == (0, 0)
        assert (a1.expected_cached, g1.expected_cached) == (0, 0)
        # Each tenant hits its own blocks, and the router expected exactly that.
        block = hasher.block_size
        whole = (a1.prompt_tokens - 1) // block * block
        assert a2.engine_hits == a2.expected_cached == whole > 0
        assert g2.engine_hits == g2.expected_cached == whole
        stored = {h for r, batch in rt.batches if r == "r1" for e in batch.events
                  if isinstance(e, BlockStored) for h in e.block_hashes}
        assert a1.decision is not None and g1.decision is not None
        assert not set(a1.decision.block_hashes) & set(g1.decision.block_hashes)
        assert set(a1.decision.block_hashes[: whole // block]) <= set(stored)
        assert set(g1.decision.block_hashes[: whole // block]) <= set(stored)

    run(with_router(router_config({"solo": [("r1", engine)]}, tenants=tenants), body,
                    engines=[engine]))


# ---------------------------------------------------------------------------------------------
# 5. context-window tiers and warm-ahead
# ---------------------------------------------------------------------------------------------


def tiers(pair: list[RealVllmEngine]) -> dict[str, list[tuple[str, RealVllmEngine]]]:
    return {"small": [("s0", pair[0])], "large": [("l0", pair[1])]}


def warm_count(rt: RecordingRuntime, outcome: str) -> float:
    """``kvroute_warm_total`` summed over reasons."""
    return sum(
        sample.value
        for family in rt.metrics.registry.collect()
        for sample in family.samples
        if sample.name == "kvroute_warm_total" and sample.labels.get("outcome") == outcome
    )


def warm_settled(rt: RecordingRuntime) -> bool:
    """No warm-up work left: every sent one ended and no session has one still to send (a
    later stage deferred behind the one in flight counts as fired only once it is sent, so
    the counters alone settle early and that stage then ran beside the next turn, adding
    its hits to the large engine's counter: seen once in CI)."""
    assert rt.app is not None, "the router is running"
    warm = rt.app.router.warm
    assert warm is not None, "warm-ahead is on in this test"
    return not warm.tasks and (
        warm_count(rt, "fired") == warm_count(rt, "completed") + warm_count(rt, "failed"))


async def all_events_applied(rt: RecordingRuntime, replica: str, engine: RealVllmEngine) -> None:
    """Until the router has applied every batch the engine has published so far."""
    _, last = await asyncio.to_thread(engine_truth, engine)
    await poll(lambda: applied_seq(rt, replica) >= last, f"{replica} to apply up to seq {last}")


def test_a_growing_session_crosses_the_small_window_warm(pair: list[RealVllmEngine]) -> None:
    """Every turn 200; small while it fits, then large; the escalated prefill is mostly a hit
    on the large engine (warmed ahead), exactly as many tokens as the router expected."""
    large = pair[1]
    messages: list[dict[str, str]] = [
        # ~680 prompt tokens: over 0.6 x 1,024, so warm-ahead fires on turn 1.
        {"role": "system", "content": f"Nonce {realvllm.nonce()}. " + realvllm.filler_text(110, 28)},
        user("First question."),
    ]

    session_id = f"grow-{realvllm.nonce()}"

    async def body(rt: RecordingRuntime, client: Client) -> None:
        pools: list[str] = []
        escalated: tuple[int, int, int] | None = None  # (prompt, expected, large hits)
        for turn in range(6):
            # Let the warm-ups fired so far finish and be indexed (the router's own count of
            # them; the engine side is checked by its hit counter below).
            await poll(lambda: warm_settled(rt), "the warm-ups to finish", 60.0)
            await all_events_applied(rt, "l0", large)
            before = await client.metric(large, HITS)
            queried = await client.metric(large, QUERIES)
            status, headers, reply = await client.chat(
                messages, headers={"x-session-id": session_id}, max_tokens=16, temperature=0.0)
            assert status == 200, reply
            pools.append(headers["x-kvroute-pool"])
            if pools[-1] == "large" and escalated is None:
                prompt = reply["usage"]["prompt_tokens"]

                async def counted(before: float = queried, n: int = prompt) -> bool:
                    return await client.metric(large, QUERIES) - before >= n

                await poll(counted, "the large engine's prefix-cache query counter")
                hits = int(await client.metric(large, HITS) - before)
                escalated = (prompt, int(headers["x-kvroute-cached-tokens"]), hits)
            messages.append({"role": "assistant", "content":
                             reply["choices"][0]["message"]["content"] or ""})
            messages.append(user(f"Follow-up {turn}: " + realvllm.filler_text(120 + turn, 5)))
        print(f"\ntiers: pools per turn {pools}; escalated request (prompt, router expected, "
              f"large-engine hits) = {escalated}")
        assert pools[0] == "small" and pools[-1] == "large", pools
        assert pools == sorted(pools, key=lambda p: p == "large"), f"session flapped: {pools}"
        assert escalated is not None
        prompt, expected, hits = escalated
        assert hits == expected, f"router expected {expected} cached, engine hit {hits}"
        assert hits >= prompt // 2, f"escalated prefill only {hits}/{prompt} from cache"
        assert warm_count(rt, "fired") >= 1 and warm_count(rt, "failed") == 0
        assert rt.metrics.value("kvroute_upstream_errors_total",
                                {"replica": "s0", "kind": "overflow"}) in (None, 0.0)

    run(with_router(router_config(tiers(pair), warm_ahead=True), body, engines=pair))


def test_a_real_overflow_400_is_parsed_and_recovered(pair: list[RealVllmEngine]) -> None:
    """Without a tokenizer the router under-estimates dense text and places it on the small
    engine; vLLM's own 400 comes back, is parsed, and the request is served by the large one."""
    large = pair[1]
    rng = random.Random(5)
    letters = "abcdefghijklmnopqrstuvwxyz"
    # Random two-letter words: about 1.5 bytes per token with this tokenizer, so the router's
    # byte-based estimate is far too low; the prompt still fits the large window.
    dense = " ".join(rng.choice(letters) + rng.choice(letters) for _ in range(700))
    messages = [user(f"Nonce {realvllm.nonce()}. {dense}")]
    config = router_config(tiers(pair), pool_extra={"small": {"tokenizer": "none"},
                                                    "large": {"tokenizer": "none"}})

    async def body(rt: RecordingRuntime, client: Client) -> None:
        true_len = len(await asyncio.to_thread(realvllm.tokenize_chat, large, messages))
        assert SMALL_WINDOW < true_len < LARGE_WINDOW, true_len
        served = await client.metric(large, "vllm:request_success_total")
        status, headers, reply = await client.chat(messages, max_tokens=8)
        assert status == 200, reply
        assert headers["x-kvroute-pool"] == "large"
        assert reply["usage"]["prompt_tokens"] == true_len
        assert await client.metric(large, "vllm:request_success_total") == served + 1
        # The small engine really refused it: one overflow answer, parsed as such.
        assert rt.metrics.value("kvroute_upstream_errors_total",
                                {"replica": "s0", "kind": "overflow"}) == 1.0

    run(with_router(config, body, engines=pair))

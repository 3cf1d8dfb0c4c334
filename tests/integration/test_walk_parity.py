"""The live router and the simulator walk the same steps for the same requests.

One scripted scenario, run twice: once through ``kvroute``'s HTTP server in front of
simulated engines on loopback (``shell/forward.py`` drives the walk with awaits), once
through ``FleetSimulation`` in virtual time (``sim/fleet.py`` drives it with delays). The
walk's recorder (``Walker.recorder``) writes every step of every request as a line of text;
the two stories must be the same, line for line.

The scenario: one session grows turn by turn across the small pool's 2,048-token window,
with the ``session`` policy (so replica choices depend on the session and the fleet's
health, not on timing). Proactively, the walk asks for exact counts, warms the large pool
ahead and escalates before the window is crossed; reactively, the small engine rejects the
first prompt over its window and the walk escalates on the engine's numbers. Then the
replica the session is pinned to stops answering: the walk retries on the other large
replica, takes the failed one out, and the session is pinned anew.
"""

from __future__ import annotations

import asyncio
import random
import string
from collections.abc import Sequence
from typing import Any

import aiohttp
import pytest

from kvroute.config import RouterConfig, parse_config
from kvroute.core.types import RequestId
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.fleet import FleetConfig, FleetSimulation, Outage, SimPool, TierMode
from kvroute.sim.launcher import inprocess_fleet
from kvroute.sim.profiles import get_profile
from kvroute.sim.server import SimServerConfig
from kvroute.sim.workload import WorkloadRequest
from kvroute.tokenize.hf import HFTokenizer, bundled_tokenizer_dir

pytestmark = pytest.mark.integration

SMALL, LARGE = "small", "large"
WINDOWS = {SMALL: 2048, LARGE: 8192}
MODELS = {SMALL: "sim-small", LARGE: "sim-large"}
ROUTE = "sim"  # the simulator's route name: session records are keyed by it
SESSION = "grow"
TURNS = 6
FAIL_BEFORE = 4  # the replica that served turn FAIL_BEFORE - 1 stops before this turn
MAX_TOKENS = 32
THINK_S = 10.0
TOKENIZER_DIR = bundled_tokenizer_dir()
"""The engines' tokenizer, and the router's own copy of it (``tokenizer: {local: ...}``):
tokenizing never touches a replica, so the failed one is met by the walk itself."""
Step = tuple[str, str]


def words(rng: random.Random, n: int) -> str:
    """``n`` three-letter words (about three tokens each for the bundled tiny BPE)."""
    return " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(3))
                    for _ in range(n))


def conversation() -> list[list[dict[str, str]]]:
    """Each turn's messages: a 480-word system prompt (about 1,480 tokens), then about 250
    tokens more a turn (a scripted 10-word answer and a 70-word question), so the fourth
    turn no longer fits 2,048."""
    rng = random.Random(5)
    messages = [{"role": "system", "content": words(rng, 480)},
                {"role": "user", "content": words(rng, 5)}]
    turns = []
    for _ in range(TURNS):
        turns.append(list(messages))
        messages += [{"role": "assistant", "content": words(rng, 10)},
                     {"role": "user", "content": words(rng, 70)}]
    return turns


def request_id(turn: int) -> str:
    return f"{SESSION}-t{turn}"


def replica_names(pool: str) -> list[str]:
    return [f"{pool}-r{i}" for i in range(2)]


# -- the simulator's run ----------------------------------------------------------------------


def simulate(mode: TierMode, outages: Sequence[Outage] = ()) -> list[Step]:
    tokenizer = HFTokenizer.from_dir(TOKENIZER_DIR)
    workload = []
    for turn, messages in enumerate(conversation()):
        ids = tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=True),
                               add_special_tokens=False)
        workload.append(WorkloadRequest(
            arrival_s=0.0, request_id=request_id(turn), prompt_token_ids=tuple(ids),
            output_tokens=MAX_TOKENS, session_id=SESSION, messages=messages,
            think_time_s=THINK_S if turn else None,
            depends_on=request_id(turn - 1) if turn else None))
    profile = get_profile("zero")
    pools = [SimPool(name, profile, 2, max_model_len=WINDOWS[name], served_model=MODELS[name])
             for name in (SMALL, LARGE)]
    config = FleetConfig.tiered(pools, tier_mode=mode, policy="session", seed=7,
                                outages=tuple(outages))
    steps: list[Step] = []
    sim = FleetSimulation(config, workload)
    sim.walker.recorder = lambda rid, step: steps.append((rid, step))
    result = sim.run()
    assert all(r.finish_s is not None for r in result.records), "a turn did not finish"
    return steps


# -- the live run -----------------------------------------------------------------------------


def router_config(servers: dict[str, Any], mode: TierMode) -> RouterConfig:
    pools = {
        pool: {"model": MODELS[pool], "tokenizer": {"local": str(TOKENIZER_DIR)},
               "replicas": [{"name": name, "url": servers[name].url}
                            for name in replica_names(pool)]}
        for pool in (SMALL, LARGE)
    }
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": pools,
        "routes": {ROUTE: {"pools": [SMALL, LARGE], "proactive": mode is not TierMode.REACTIVE}},
        "policy": {"name": "session", "seed": 7},
        # Health checks far apart: the failed replica must be found by the request that
        # meets it, as in the simulator, not by a probe that happens to run first.
        "discovery": {"health_interval_s": 60, "metrics_interval_s": 60,
                      "models_interval_s": 60, "timeout_s": 1.0},
        "timeouts": {"connect_s": 1.0, "first_byte_s": 8.0, "total_s": 10.0},
        "warm_ahead": {"enabled": mode is TierMode.PROACTIVE_WARM},
        "log_level": "warning",
    }, env={})


async def live(mode: TierMode) -> list[Step]:
    configs = [SimServerConfig(model=MODELS[pool], max_model_len=WINDOWS[pool], profile="zero",
                               kv_events=None, tokenizer=str(TOKENIZER_DIR))
               for pool in (SMALL, LARGE) for _ in range(2)]
    names = [name for pool in (SMALL, LARGE) for name in replica_names(pool)]
    steps: list[Step] = []
    async with inprocess_fleet(configs) as started:
        servers = dict(zip(names, started, strict=True))
        config = router_config(servers, mode)
        async with RouterRuntime(config, env={}) as rt, aiohttp.ClientSession() as client:
            assert rt.app is not None
            walker = rt.app.router.forwarder.walker
            walker.recorder = lambda rid, step: steps.append((rid, step))
            served = ""
            for turn, messages in enumerate(conversation()):
                if turn == FAIL_BEFORE:
                    await servers[served].stop()
                body = {"model": ROUTE, "messages": messages, "max_tokens": MAX_TOKENS}
                headers = {"x-session-id": SESSION, "x-request-id": request_id(turn)}
                async with client.post(rt.url + "/v1/chat/completions", json=body,
                                       headers=headers) as reply:
                    text = await reply.text()
                    assert reply.status == 200, text[:300]
                    served = reply.headers["x-kvroute-replica"]
                if mode is TierMode.PROACTIVE_WARM:
                    await asyncio.wait_for(_warm_ups_done(rt), 5.0)
    return steps


async def _warm_ups_done(rt: RouterRuntime) -> None:
    """Warm-ups are sent in the background: let them end before the next turn, as the
    simulator's think time does."""
    assert rt.app is not None and rt.app.router.warm is not None
    while rt.app.router.warm.tasks:
        await asyncio.sleep(0.01)


def served_by(steps: Sequence[Step], turn: int) -> str:
    answered = [step for rid, step in steps if rid == RequestId(request_id(turn))
                and step.startswith("answered ")]
    assert len(answered) == 1, answered
    return answered[0].split()[1]


@pytest.mark.parametrize("mode", [TierMode.REACTIVE, TierMode.PROACTIVE_WARM],
                         ids=["reactive", "proactive-warm"])
def test_the_live_router_and_the_simulator_take_the_same_steps(mode: TierMode) -> None:
    # The simulator is deterministic: a first run says which replica serves the turn before
    # the outage, and the second run takes exactly that replica down before the next turn.
    first = simulate(mode)
    down = served_by(first, FAIL_BEFORE - 1)
    outage = Outage(down, start_s=(FAIL_BEFORE - 0.5) * THINK_S)
    simulated = simulate(mode, [outage])
    lived = asyncio.run(asyncio.wait_for(live(mode), 60.0))
    assert lived == simulated, "\n".join(
        f"{'=' if a == b else '≠'} live {a}  sim {b}"
        for a, b in zip(lived + [("", "")] * len(simulated),
                        simulated + [("", "")] * len(lived), strict=False)
        if a != ("", "") or b != ("", ""))
    story = [step for _, step in simulated]
    # What the scenario is for, so that a story both drivers got wrong the same way fails too.
    assert any(s.startswith("send large") for s in story), "the session never escalated"
    assert f"failed {down} connect" in story, "the failed replica was never met"
    later = [served_by(simulated, t) for t in range(FAIL_BEFORE, TURNS)]
    assert down not in later and len(set(later)) == 1, later  # pinned anew, and kept
    if mode is TierMode.REACTIVE:
        assert any(s.startswith("overflowed small") for s in story)
    else:
        assert any(" warm=large" in s for s in story)
        assert any(s.startswith("need_tokens small") for s in story)
        assert not any(s.startswith("overflowed") for s in story)

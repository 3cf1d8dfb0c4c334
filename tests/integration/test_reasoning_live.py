"""A route's reasoning settings on the live path, against a simulated vLLM 0.32 engine.

The simulated engine, like vLLM started without ``--reasoning-parser``, refuses a
``thinking_token_budget`` with vLLM's own 400 (checked against vLLM 0.32.0 on CPU,
docs/reference/vllm-engine-contract.md §3.5). That makes the engine's answer the proof of what
the router forwarded: a thinking route's default budget reaches the engine; a route that
turns thinking off adds none, unless the client turns thinking back on itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway import RouterThread, one_engine_router

from kvroute.config import parse_config
from kvroute.sim.launcher import ReplicaSpec, start_fleet

pytestmark = pytest.mark.integration

MODEL = "sim-model"


@pytest.fixture(scope="module")
def router() -> Iterator[RouterThread]:
    with one_engine_router(model=MODEL, routes={
        "think": {"pools": ["main"], "reasoning": {"switch": "qwen3", "thinking": True,
                                                   "budget": 512}},
        "fast": {"pools": ["main"], "reasoning": {"switch": "qwen3", "thinking": False,
                                                  "budget": 512}},
    }) as rt:
        yield rt


def _chat(router: RouterThread, model: str, **extra: Any) -> tuple[int, Any]:
    body = {"model": model, "max_tokens": 2,
            "messages": [{"role": "user", "content": "what is two and two"}], **extra}
    request = urllib.request.Request(router.url + "/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=20) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_thinking_routes_budget_reaches_the_engine(router: RouterThread) -> None:
    status, answer = _chat(router, "think")
    assert status == 400
    assert "thinking_token_budget is set but reasoning_config is not configured" in \
        answer["error"]["message"]


def test_a_route_with_thinking_off_adds_no_budget(router: RouterThread) -> None:
    status, answer = _chat(router, "fast")
    assert status == 200, answer
    status, _ = _chat(router, "fast", chat_template_kwargs={"enable_thinking": True})
    assert status == 400  # the client turned thinking on: the route's budget applies


@pytest.fixture(scope="module")
def parsing_router() -> Iterator[RouterThread]:
    """The same routes before an engine started with a reasoning parser."""
    fleet = start_fleet([ReplicaSpec(name="s0", pool="main", model=MODEL,
                                     extra_args=("--timing", "0.001,0.00005,0.0002,0",
                                                 "--reasoning-parser", "qwen3"))],
                        timeout_s=30.0)
    try:
        replicas = [{"name": r.name, "url": r.url, "kv_events": r.kv_events,
                     "kv_replay": r.kv_replay} for r in fleet.replicas]
        config = parse_config({
            "listen": {"host": "127.0.0.1", "port": 0},
            "pools": {"main": {"model": MODEL, "replicas": replicas}},
            "routes": {
                "think": {"pools": ["main"], "reasoning": {"thinking": True, "budget": 3}},
                "fast": {"pools": ["main"], "reasoning": {"thinking": False}},
                "auto": {"pools": ["main"], "reasoning": {"thinking": "auto", "budget": 4}},
            },
            "log_level": "warning",
        }, env={})
        with RouterThread(config) as rt:
            yield rt
    finally:
        fleet.stop()


def _reasoning_series(router: RouterThread) -> dict[str, float]:
    with urllib.request.urlopen(router.url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(("kvroute_reasoning_tokens_sum", "kvroute_reasoning_tokens_count"))}


def test_reasoning_lengths_are_a_histogram_per_route(parsing_router: RouterThread) -> None:
    status, answer = _chat(parsing_router, "think", max_tokens=6)
    assert status == 200, answer
    assert answer["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    status, answer = _chat(parsing_router, "think", max_tokens=6, thinking_token_budget=-1)
    assert status == 200 and answer["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6
    body = {"model": "fast", "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "what is two and two"}]}
    request = urllib.request.Request(parsing_router.url + "/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=20) as reply:
        streamed = reply.read().decode()
    assert '"completion_tokens_details":{"reasoning_tokens":0}' in streamed.replace(" ", "")
    status, answer = _chat(parsing_router, "think", thinking_token_budget=-5)
    assert status == 400 and "non-negative integer or -1" in answer["error"]["message"]
    series = _reasoning_series(parsing_router)
    assert series['kvroute_reasoning_tokens_count{route="think"}'] == 2.0
    assert series['kvroute_reasoning_tokens_sum{route="think"}'] == 9.0
    assert series['kvroute_reasoning_tokens_count{route="fast"}'] == 1.0
    assert series['kvroute_reasoning_tokens_sum{route="fast"}'] == 0.0


def test_auto_thinks_on_hard_questions_only(parsing_router: RouterThread) -> None:
    def thought(question: str) -> int:
        body = {"model": "auto", "max_tokens": 6,
                "messages": [{"role": "user", "content": question}]}
        request = urllib.request.Request(parsing_router.url + "/v1/chat/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=20) as reply:
            answer = json.loads(reply.read())
        return int(answer["usage"]["completion_tokens_details"]["reasoning_tokens"])

    assert thought("Prove that there are infinitely many primes.") == 4
    assert thought("hello there") == 0


def _serve(fleet_url: str, tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``kvroute serve`` at debug level, its logs on stderr, and its URL (from the ready line)."""
    path = tmp_path / "kvroute.yaml"
    path.write_text(json.dumps({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {"main": {"model": MODEL, "replicas": [{"name": "s0", "url": fleet_url}]}},
        "routes": {"think": {"pools": ["main"], "reasoning": {"thinking": True, "budget": 3}},
                   "fast": {"pools": ["main"], "reasoning": {"thinking": False}}},
        "log_level": "debug",
    }))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    proc = subprocess.Popen(
        [sys.executable, "-c", "from kvroute.cli import main; main()", "serve", "-c", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    assert info["ready"] is True
    return proc, str(info["url"])


def _post(url: str, body: dict[str, Any]) -> bytes:
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=20) as reply:
        return bytes(reply.read())


def _deltas(raw: bytes) -> list[dict[str, Any]]:
    events = [line.removeprefix(b"data: ") for line in raw.splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [choice["delta"] for event in events[:-1] for choice in json.loads(event)["choices"]]


def test_the_thinking_is_split_off_relayed_and_never_logged(tmp_path: Path) -> None:
    fleet = start_fleet([ReplicaSpec(name="s0", pool="main", model=MODEL,
                                     extra_args=("--timing", "0.001,0.00005,0.0002,0",
                                                 "--reasoning-parser", "qwen3"))],
                        timeout_s=30.0)
    proc: subprocess.Popen[bytes] | None = None
    try:
        engine = fleet.replicas[0].url
        question = {"messages": [{"role": "user", "content": "what is two and two"}],
                    "max_tokens": 6, "ignore_eos": True, "seed": 7}
        direct = json.loads(_post(engine, {"model": MODEL, "thinking_token_budget": 3,
                                           **question}))
        thought = direct["choices"][0]["message"]
        assert thought["reasoning"] and thought["content"]  # vLLM 0.32's name: `reasoning`
        assert direct["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
        proc, url = _serve(engine, tmp_path)
        answer = json.loads(_post(url, {"model": "think", **question}))
        message = answer["choices"][0]["message"]
        assert message["reasoning"] == thought["reasoning"]  # the engine's split, relayed
        assert message["content"] == thought["content"]
        assert answer["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
        deltas = _deltas(_post(url, {"model": "think", "stream": True, **question}))
        kinds = [tuple(k for k in ("reasoning", "content") if d.get(k)) for d in deltas]
        kinds = [k for k in kinds if k]
        first_answer = next(i for i, k in enumerate(kinds) if "content" in k)
        assert kinds[0] == ("reasoning",) and all("reasoning" not in k
                                                  for k in kinds[first_answer + 1:])
        streamed = "".join(d.get("reasoning") or "" for d in deltas)
        assert streamed == message["reasoning"]
        assert "".join(d.get("content") or "" for d in deltas) == message["content"]
        fast = json.loads(_post(url, {"model": "fast", **question}))
        assert fast["choices"][0]["message"]["reasoning"] is None
        assert fast["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
        proc.send_signal(signal.SIGTERM)
        _, logs = proc.communicate(timeout=10)
        assert b"kvroute.decision" in logs  # the router logged each request at debug level
        assert message["reasoning"].encode() not in logs
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        fleet.stop()

"""The router's side of ``kvroute audit``: the opt-in sample it writes, which the audit
reads, and the live ``kvroute_prefix_divergence_block`` histogram per route."""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway import RouterThread, one_engine_router

from kvroute.commands.audit import read_sample
from kvroute.core.prefix_audit import audit

pytestmark = pytest.mark.integration

MODEL = "sim-model"
SHARED = " ".join(f"policy{i}" for i in range(300))


@pytest.fixture(scope="module")
def sample_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("audit") / "sample.jsonl"


@pytest.fixture(scope="module")
def router(sample_path: Path) -> Iterator[RouterThread]:
    with one_engine_router(model=MODEL, settings={
            "audit_sample": {"path": str(sample_path), "every": 1}}) as rt:
        yield rt


def _chat(router: RouterThread, system: str, user: str) -> dict[str, str]:
    body = {"model": "assistant", "max_tokens": 1,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    request = urllib.request.Request(router.url + "/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=20) as reply:
        reply.read()
        return dict(reply.headers.items())


def _divergence_buckets(router: RouterThread) -> dict[str, float]:
    with urllib.request.urlopen(router.url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith('kvroute_prefix_divergence_block_bucket{') and \
                'route="assistant"' in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[le] = float(line.rsplit(" ", 1)[1])
    return out


def test_the_sample_feeds_the_audit_and_metrics_show_where_reuse_breaks(
        router: RouterThread, sample_path: Path) -> None:
    rng = random.Random(3)
    for i in range(4):  # a timestamp first: nothing is ever shared
        _chat(router, f"Now is 2026-12-01T10:00:0{i}Z. {SHARED}", f"q{rng.getrandbits(30)}")
    before = _divergence_buckets(router)
    assert before["0.0"] == 4.0
    for _ in range(3):  # a stable system prompt: the repeats share its blocks
        _chat(router, SHARED, f"q{rng.getrandbits(30)}")
    after = _divergence_buckets(router)
    assert after["+Inf"] == 7.0
    assert after["0.0"] == 5.0  # only the first stable request found nothing held
    report = audit(read_sample(sample_path), block_size=16)
    assert report.requests == 7
    kinds = {f.kind: f for f in report.findings}
    assert kinds["volatile:timestamp"].requests == 3
    assert kinds["volatile:timestamp"].first_block == 0

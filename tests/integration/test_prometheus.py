"""kvroute's Prometheus rules and Grafana dashboard against a real Prometheus.

``deploy/prometheus/kvroute-rules.yml`` passes ``promtool check rules`` and its unit tests
(``kvroute-rules.test.yml``: every alert fires on the series meant to set it off). Then a
real Prometheus (Debian's ``prometheus`` 2.42) scrapes a running router every second in
front of a two-tier simulated fleet carrying a bounded mix (``tests/tiered_fleet.py``), with
the rules loaded: every rule is evaluated without error, every recording rule and every
alert's condition (its expression without the threshold) returns series, and every query of
``deploy/grafana/kvroute-dashboard.json`` (Grafana's ``$pool``/``$replica`` as ``.*``,
``$__rate_interval`` as ``1m``) returns series. Skipped with the reason when ``prometheus``
or ``promtool`` is not installed (``apt-get install -y prometheus``; ``.ci/run`` installs it).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import aiohttp
import pytest
import yaml
from tiered_fleet import fleet_config, mixed_traffic, tier_specs

from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.launcher import Fleet, start_fleet

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "kvroute-rules.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "kvroute-rules.test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "kvroute-dashboard.json"
THRESHOLD = re.compile(r"\s*(==|!=|<=|>=|<|>)\s*[0-9.]+\s*$")


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (apt-get install -y prometheus; .ci/run installs "
                    "it)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dashboard_queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in doc["panels"] for target in panel["targets"]]
    assert len(queries) >= 15
    return [q.replace("$__rate_interval", "1m").replace("$pool", ".*")
            .replace("$replica", ".*") for q in queries]


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_rules_pass_promtool_check_and_their_unit_tests() -> None:
    promtool = tool("promtool")
    checked = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True,
                             text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout
    tested = subprocess.run([promtool, "test", "rules", str(RULE_TESTS)], capture_output=True,
                            text=True, timeout=60, cwd=RULE_TESTS.parent, check=False)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    alerts = {r["alert"] for r in rules() if "alert" in r}
    tested_alerts = {t["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
                     for t in case["alert_rule_test"]}
    assert alerts == tested_alerts  # every alert has a unit test


class Prometheus:
    """A real Prometheus scraping ``target`` every second with kvroute's rules (bounded:
    stopped, and its data directory removed, on exit)."""

    def __init__(self, target: str) -> None:
        self.binary = tool("prometheus")
        self.dir = tempfile.TemporaryDirectory(prefix="kvroute-prometheus-")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        root = Path(self.dir.name)
        shutil.copy(RULES, root / RULES.name)
        (root / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [RULES.name],
            "scrape_configs": [{"job_name": "kvroute", "static_configs": [
                {"targets": [target]}]}],
        }))
        self.log = (root / "prometheus.log").open("w")
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        root = Path(self.dir.name)
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={root / 'prometheus.yml'}",
             f"--storage.tsdb.path={root / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=root)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        self.dir.cleanup()

    def log_tail(self) -> str:
        return (Path(self.dir.name) / "prometheus.log").read_text()[-3000:]


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    started = start_fleet(tier_specs(), timeout_s=30.0)
    try:
        yield started
    finally:
        started.stop()


async def api(session: aiohttp.ClientSession, url: str, path: str,
              **params: str) -> Any:
    async with session.get(url + path, params=params) as resp:
        doc = await resp.json()
        assert doc.get("status") == "success", doc
        return doc["data"]


async def series_of(session: aiohttp.ClientSession, url: str, query: str) -> list[Any]:
    return list((await api(session, url, "/api/v1/query", query=query))["result"])


def test_every_rule_and_dashboard_query_returns_series_from_a_live_router(fleet: Fleet) -> None:
    queries = dashboard_queries()
    recorded = [r["record"] for r in rules() if "record" in r]
    alerts = [r for r in rules() if "alert" in r]
    conditions = {r["alert"]: THRESHOLD.sub("", r["expr"]) for r in alerts}
    assert all(conditions[r["alert"]] != r["expr"] for r in alerts)  # each has a threshold

    async def body() -> None:
        async with RouterRuntime(fleet_config(fleet), env={}) as rt, \
                aiohttp.ClientSession() as session:
            host = rt.url.removeprefix("http://")
            with Prometheus(host) as prom:
                await mixed_traffic(rt.url)
                await asyncio.sleep(1.5)  # scrapes after the last request
                await mixed_traffic(rt.url, seed=12)  # rates over two bursts
                deadline = time.monotonic() + 60
                empty: list[str] = []
                while time.monotonic() < deadline:
                    try:
                        empty = [q for q in [*queries, *recorded, *conditions.values()]
                                 if not await series_of(session, prom.url, q)]
                    except aiohttp.ClientError:
                        empty = ["(prometheus not answering yet)"]
                    if not empty:
                        break
                    await asyncio.sleep(0.5)
                assert not empty, f"no series for {empty}\n{prom.log_tail()}"
                groups = (await api(session, prom.url, "/api/v1/rules"))["groups"]
                evaluated = {r.get("name"): r for g in groups for r in g["rules"]}
                assert set(evaluated) == {*recorded, *conditions}
                for name, rule in evaluated.items():
                    assert rule["health"] == "ok", (name, rule.get("lastError"))

    asyncio.run(asyncio.wait_for(body(), 150))

"""CPU time, children and pinning read from ``/proc`` (``bench/procfs.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvroute.bench.procfs import (
    apparatus_cpus,
    cpu_wait_s,
    descendants,
    parse_cpus,
    pin_process_tree,
    pinned_self,
    process_cpu_s,
    process_run_delay_s,
    process_tree_cpu_s,
    renice_process_tree,
    stat_fields,
    tree_cpus,
)
from kvroute.core.errors import ConfigError

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def _spin(seconds: float) -> None:
    deadline = time.process_time() + seconds
    while time.process_time() < deadline:
        pass


def test_stat_fields_start_after_the_command_name() -> None:
    fields = stat_fields(os.getpid())
    assert fields is not None
    assert fields[0] in "RSD"  # this process's state: running (or just descheduled)
    assert int(fields[1]) == os.getppid()


def test_a_process_that_is_gone_reads_as_none() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    assert stat_fields(proc.pid) is None
    assert process_cpu_s(proc.pid) is None
    assert process_cpu_s(None) is None


def test_cpu_seconds_grow_with_work() -> None:
    before, tree_before = process_cpu_s(os.getpid()), process_tree_cpu_s(os.getpid())
    assert before is not None
    _spin(0.05)
    after = process_cpu_s(os.getpid())
    assert after is not None and after >= before + 0.03
    assert process_tree_cpu_s(os.getpid()) >= tree_before + 0.03


def test_descendants_and_pinning_reach_a_grandchild() -> None:
    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)']); print(p.pid, flush=True); p.wait()")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        assert descendants(child.pid) == [grandchild]
        assert {child.pid, grandchild} <= set(descendants(os.getpid()))
        cpus = frozenset(os.sched_getaffinity(0))
        assert pin_process_tree(child.pid, cpus) >= 2  # a thread each, at least
        one = frozenset({min(cpus)})
        pin_process_tree(grandchild, one)
        assert tree_cpus([grandchild]) == [min(cpus)]
        assert tree_cpus([child.pid]) == sorted(cpus)  # the union over the tree
    finally:
        for pid in descendants(child.pid):
            os.kill(pid, 9)
        child.wait(30)
        if child.stdout is not None:
            child.stdout.close()


def test_the_run_queue_wait_is_read_per_thread_and_never_goes_back() -> None:
    if not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat").exists():
        pytest.skip("this kernel keeps no schedstats")
    first = process_run_delay_s(os.getpid())
    _spin(0.02)
    second = process_run_delay_s(os.getpid())
    assert first is not None and second is not None
    assert 0.0 <= first <= second
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    assert process_run_delay_s(proc.pid) is None


def test_router_cpus_leave_the_others_to_the_apparatus_and_never_all_or_foreign_ones() -> None:
    assert parse_cpus(" 0, 2,") == frozenset({0, 2})
    with pytest.raises(ConfigError, match="not a CPU number"):
        parse_cpus("1-2")
    usable = frozenset(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match="some, not all"):
        apparatus_cpus(usable)
    with pytest.raises(ConfigError, match="some, not all"):
        apparatus_cpus(frozenset({max(usable) + 1}))
    if len(usable) < 2:
        pytest.skip("one CPU: nothing to split")
    router = frozenset({max(usable)})
    assert apparatus_cpus(router) == usable - router


def test_pinned_self_moves_this_process_and_gives_its_cpus_back() -> None:
    before = frozenset(os.sched_getaffinity(0))
    one = frozenset({min(before)})
    with pinned_self(one):
        assert frozenset(os.sched_getaffinity(0)) == one
    assert frozenset(os.sched_getaffinity(0)) == before
    with pinned_self(None):
        assert frozenset(os.sched_getaffinity(0)) == before


def test_steal_and_iowait_are_read_per_cpu_in_seconds() -> None:
    stat = ("cpu  100 0 50 900 30 0 1 12 0 0\n"
            "cpu0 60 0 30 400 10 0 1 2 0 0\n"
            "cpu1 40 0 20 500 20 0 0 10 0 0\n"
            "intr 12345\nctxt 999\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert cpu_wait_s(stat) == {"0": {"steal": 2 / tick, "iowait": 10 / tick},
                                "1": {"steal": 10 / tick, "iowait": 20 / tick}}
    live = cpu_wait_s()
    assert set(live) == {str(c) for c in range(os.cpu_count() or 1)}
    assert all(v["steal"] >= 0 and v["iowait"] >= 0 for v in live.values())


def test_a_process_tree_is_reniced_thread_by_thread() -> None:
    child = subprocess.Popen([sys.executable, "-c", ("import threading, time; "
                              "threading.Thread(target=time.sleep, args=(30,)).start(); "
                              "time.sleep(30)")])
    try:
        for _ in range(200):
            if len(os.listdir(f"/proc/{child.pid}/task")) == 2:
                break
            time.sleep(0.01)
        assert renice_process_tree(child.pid, 7) == 2
        assert {os.getpriority(os.PRIO_PROCESS, int(tid))
                for tid in os.listdir(f"/proc/{child.pid}/task")} == {7}
    finally:
        child.kill()
        child.wait()

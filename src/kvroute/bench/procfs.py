"""What a benchmark reads about running processes from ``/proc``: CPU time, children, pinning.

Shared by every live benchmark that reports the CPU a router or an engine used during a
phase (``bench/live_routers.py``, ``bench/overhead.py``, ``bench/soak.py``,
``bench/tiers_live.py``) or gives the router cores of its own (``bench/overhead.py``,
``bench/soak.py``: ``--router-cpus``), so they all parse ``/proc/<pid>/stat`` and place
processes one way. Linux only; a process that has gone is skipped or reported as None, never
an error.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Final

from kvroute.core.errors import ConfigError

__all__ = ["apparatus_cpus", "cpu_wait_s", "descendants", "parse_cpus", "pin_process_tree", "pinned_self",
           "process_cpu_s", "process_run_delay_s", "process_tree_cpu_s", "renice_process_tree",
           "stat_fields",
           "tree_cpus"]

_CLK_TCK: Final = os.sysconf("SC_CLK_TCK")


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None when
    the process is gone or there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its last ")".
    return raw[raw.rfind(")") + 2:].split()


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children...), parents first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = stat_fields(int(entry))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    out: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            out.append(child)
            stack.append(child)
    return out


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of one live process (its threads, not its children), or None
    when it is gone or ``pid`` is None. ``utime`` and ``stime`` are fields 11 and 12 of
    ``stat_fields``."""
    fields = None if pid is None else stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def process_tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) of ``pid`` and all its descendants.

    Live descendants are read one by one; descendants already reaped are in the parents'
    ``cutime``/``cstime``. Fields of ``stat_fields``: utime is index 11, stime 12, cutime 13,
    cstime 14.
    """
    total = 0
    for p in (pid, *descendants(pid)):
        fields = stat_fields(p)
        if fields is not None:
            total += sum(int(x) for x in fields[11:15])
    return total / _CLK_TCK


def process_run_delay_s(pid: int) -> float | None:
    """Seconds the threads of ``pid`` have spent runnable but waiting for a CPU, summed
    (``/proc/<pid>/task/<tid>/schedstat``, its second field, in ns), or None when the process
    is gone or the kernel keeps no schedstats.

    Why: on a machine shared with other jobs, a router's tail can be its own work or its
    wait for a CPU; this is the wait, as the kernel counted it. A thread that ends while the
    threads are read is skipped (its wait is lost from the sum: read it as a lower bound).
    """
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total_ns = 0
    read_any = False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                fields = f.read().split()
        except OSError:
            continue
        if len(fields) >= 2:
            total_ns += int(fields[1])
            read_any = True
    return total_ns / 1e9 if read_any else None


def cpu_wait_s(stat_text: str | None = None) -> dict[str, dict[str, float]]:
    """Per CPU (``"0"``, ``"1"``...), the seconds it has been stolen by the hypervisor
    (``steal``) and idle with I/O outstanding (``iowait``) since boot, from ``/proc/stat``
    (or ``stat_text``, its contents); empty where there is no ``/proc``.

    Why: on a virtual machine a vCPU the hypervisor gives to another guest stops every
    process on it, router, engines and load generator alike, and nothing inside the guest
    sees it but this counter; a window whose latency spiked with steal in it is the
    machine's. Resolution: one clock tick (10 ms with USER_HZ 100).
    """
    if stat_text is None:
        try:
            with open("/proc/stat") as f:
                stat_text = f.read()
        except OSError:
            return {}
    out: dict[str, dict[str, float]] = {}
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        fields = rest.split()  # user nice system idle iowait irq softirq steal ...
        if len(fields) < 8:
            continue
        out[name.removeprefix("cpu")] = {"steal": int(fields[7]) / _CLK_TCK,
                                         "iowait": int(fields[4]) / _CLK_TCK}
    return out


def pin_process_tree(pid: int, cpus: frozenset[int]) -> int:
    """Bind every thread of ``pid`` and of its descendants to ``cpus``; returns how many.

    Threads and processes started later inherit the binding of the thread that starts them.
    A thread that ends while the tree is walked is skipped.

    Raises:
        OSError: ``cpus`` names no CPU this process may use (``EINVAL``).
    """
    pinned = 0
    for tid in _tree_threads(pid):
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue
        pinned += 1
    return pinned


def renice_process_tree(pid: int, niceness: int) -> int:
    """Set the nice value of every thread of ``pid`` and of its descendants; returns how many.

    Linux applies ``setpriority(PRIO_PROCESS, id)`` to one thread, so each thread is set
    (threads started later inherit their starter's value). A thread that ends meanwhile is
    skipped.

    Raises:
        PermissionError: lowering a nice value without the privilege to.
    """
    done = 0
    for p in (pid, *descendants(pid)):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{p}/task")]
        except FileNotFoundError:
            continue
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
            except ProcessLookupError:
                continue
            done += 1
    return done


def tree_cpus(pids: Iterable[int]) -> list[int]:
    """Every CPU that some thread of ``pids`` or of their descendants may run on, sorted: what
    a report records as a side's CPUs, as the kernel has them (a thread or process that ends
    while they are read is skipped)."""
    cpus: set[int] = set()
    for top in pids:
        for tid in _tree_threads(top):
            try:
                cpus |= os.sched_getaffinity(tid)
            except ProcessLookupError:
                continue
    return sorted(cpus)


def _tree_threads(pid: int) -> Iterator[int]:
    """The thread ids of ``pid`` and of its descendants, process by process (parents first);
    a process that ends before its threads are listed is skipped. A thread may still end
    before the caller acts on it (``ProcessLookupError``): the caller skips it."""
    for p in (pid, *descendants(pid)):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{p}/task")]
        except FileNotFoundError:
            continue
        yield from tids


def parse_cpus(text: str) -> frozenset[int]:
    """``1`` or ``2,3`` -> CPU numbers; raises ``ConfigError`` naming a bad item."""
    cpus: set[int] = set()
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if not item.isdigit():
            raise ConfigError(f"CPU {item!r} is not a CPU number; give e.g. --router-cpus 1 "
                              "(CPUs as numbered by the kernel, 0 first)")
        cpus.add(int(item))
    if not cpus:
        raise ConfigError("--router-cpus needs at least one CPU number, e.g. 1")
    return frozenset(cpus)


def apparatus_cpus(router_cpus: frozenset[int]) -> frozenset[int]:
    """The CPUs this process may use that ``router_cpus`` leaves to the engines and the load
    generator; raises ``ConfigError`` when ``router_cpus`` are not some, but not all, of
    them (a router pinned to a CPU it may not use, or one that leaves the rest none)."""
    usable = frozenset(os.sched_getaffinity(0))
    if not router_cpus <= usable or router_cpus == usable:
        raise ConfigError(
            f"router_cpus={sorted(router_cpus)} must be some, not all, of the CPUs this "
            f"process may use ({sorted(usable)}): the engines and the load generator need "
            "the others")
    return usable - router_cpus


@contextlib.contextmanager
def pinned_self(cpus: frozenset[int] | None) -> Iterator[None]:
    """Run this process (the load generator, and the children it starts) on ``cpus``, then
    give it back the CPUs it had; None leaves it where it is."""
    if cpus is None:
        yield
        return
    before = frozenset(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)

"""What a benchmark reads about running processes from ``/proc``: CPU time, children, pinning.

Shared by every live benchmark that reports the CPU a router or an engine used during a
phase (``bench/live_routers.py``, ``bench/overhead.py``, ``bench/soak.py``,
``bench/tiers_live.py``) or pins a process tree to some cores (``bench/overhead.py``), so
they all parse ``/proc/<pid>/stat`` one way. Linux only; a process that has gone is skipped
or reported as None, never an error.
"""

from __future__ import annotations

import os
from typing import Final

__all__ = ["descendants", "pin_process_tree", "process_cpu_s", "process_run_delay_s",
           "process_tree_cpu_s", "stat_fields"]

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


def pin_process_tree(pid: int, cpus: frozenset[int]) -> int:
    """Bind every thread of ``pid`` and of its descendants to ``cpus``; returns how many.

    Threads and processes started later inherit the binding of the thread that starts them.
    A thread that ends while the tree is walked is skipped.

    Raises:
        OSError: ``cpus`` names no CPU this process may use (``EINVAL``).
    """
    pinned = 0
    for p in (pid, *descendants(pid)):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{p}/task")]
        except FileNotFoundError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:
                continue
            pinned += 1
    return pinned

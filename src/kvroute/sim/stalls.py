"""The simulated engine's own stalls: how late its stepping loop ran, and how long its
collector stopped it, exported beside vLLM's series on ``/metrics``.

Owns two histograms per server process and their exposition:

* ``kvroute_sim_step_lateness_seconds``: for every step, how long after its modelled end
  (its start plus its modelled duration; with the ``zero`` profile, its start) the stepping
  task ran again: the simulator's own overrun, from computing the step (pure Python) to a
  stall of the process (the scheduler giving its core to others, a collection, a long
  handler), which makes every step due meanwhile late by as much;
* ``kvroute_sim_gc_pause_seconds``: every garbage collection of the process (any
  generation), in wall time.

Why: a simulated engine answers in its modelled time only while its event loop runs; when a
benchmark's latency spikes with the router's own time steady, these tell whether the
engines (the apparatus, not the router) stalled, and why. The names are kvroute's, not
vLLM's: a real vLLM serves neither, and readers of vLLM's series are not disturbed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from kvroute.shell.heap import watch_gc_pauses
from kvroute.wire.prom import HistogramValues

__all__ = ["STALL_BOUNDS_S", "EngineStalls"]

STALL_BOUNDS_S: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Bucket bounds of both histograms, seconds: from a loop turn (~1 ms) to a second."""

_SERIES: Final = (
    ("kvroute_sim_step_lateness_seconds",
     "How long after it was due each step of the simulated engine ran (its loop's stalls)."),
    ("kvroute_sim_gc_pause_seconds",
     "Garbage collections of the simulated engine's process, wall time each."),
)


class EngineStalls:
    """The two histograms of one server process (module docstring)."""

    def __init__(self) -> None:
        self.step_lateness = HistogramValues(STALL_BOUNDS_S)
        self.gc_pause = HistogramValues(STALL_BOUNDS_S)
        self._stop_gc_watch: Callable[[], None] | None = None

    def watch_gc(self) -> None:
        """Start timing this process's collections (until ``stop``)."""
        if self._stop_gc_watch is None:
            self._stop_gc_watch = watch_gc_pauses(
                lambda _generation, seconds: self.gc_pause.observe(seconds))

    def stop(self) -> None:
        if self._stop_gc_watch is not None:
            self._stop_gc_watch()
            self._stop_gc_watch = None

    def render(self) -> str:
        """Both histograms as Prometheus exposition text (cumulative buckets, sum, count)."""
        lines: list[str] = []
        for (name, help_text), hist in zip(_SERIES, (self.step_lateness, self.gc_pause),
                                           strict=True):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
            cumulative = 0
            for bound, count in zip(hist.bounds, hist.counts, strict=False):
                cumulative += count
                lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
            lines.append(f'{name}_bucket{{le="+Inf"}} {hist.count}')
            lines.append(f"{name}_sum {hist.total}")
            lines.append(f"{name}_count {hist.count}")
        return "\n".join(lines) + "\n"

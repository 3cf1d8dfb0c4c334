"""kvroute: a KV-cache-aware router for LLM inference fleets.

The package has three rings (see ``docs/architecture.md``):

* ``kvroute.core``  pure decisions: no sockets, asyncio, environment, wall clock or global RNG;
* ``kvroute.wire``  pure codecs between bytes and core values;
* ``kvroute.shell`` the asyncio I/O around them;

plus ``kvroute.sim`` (simulated engines) and ``kvroute.bench`` (workloads and reports).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

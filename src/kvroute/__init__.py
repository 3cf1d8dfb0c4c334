"""kvroute: a KV-cache-aware router for LLM inference fleets.

The package is a set of rings, lowest first (see ``docs/architecture.md``); a module imports
its own ring and the rings below it, never one above (``tests/unit/test_layering.py`` enforces
it, with the exact order):

* ``kvroute.core``      pure decisions: no sockets, asyncio, environment, wall clock or global RNG;
* ``kvroute.wire``      pure codecs between bytes and core values;
* ``kvroute.engine``    the pure model of a vLLM engine (blocks, prefix cache, scheduling);
* ``kvroute.config``    the router's YAML configuration;
* ``kvroute.http``      the lean HTTP/1.1 server and client;
* ``kvroute.tokenize``  every tokenizer path (local HF, piece cache, engine ``/tokenize``);
* ``kvroute.shell``     the router's asyncio I/O around core;
* ``kvroute.sim``       simulated engines and the virtual-time fleet;
* ``kvroute.bench``     workloads, traces, drivers and reports;
* ``kvroute.commands``, ``kvroute.cli``  the command line.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

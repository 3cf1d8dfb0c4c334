"""The vLLM-faithful engine model: paged blocks, prefix cache, batching, KV events, timing.

Pure, like ``core``: no I/O, no clock, no environment, no global random generator. Only the
simulator (``sim``), the benchmarks (``bench``) and the CLI (``commands``) drive it;
``tests/unit/test_layering.py`` enforces both.
"""

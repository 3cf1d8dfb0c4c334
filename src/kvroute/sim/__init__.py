"""Engines without GPUs: the network server around ``engine.model`` and the virtual-time
fleet simulation used by the benchmarks."""

"""Engines without GPUs: the network server around ``core.engine_model`` and the virtual-time
fleet simulation used by the benchmarks."""

"""Workloads (traces and generators), replay drivers and reports for the benchmarks."""

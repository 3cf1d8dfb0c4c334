"""Pure routing logic. Nothing in this package may do I/O, read the environment or the wall
clock, or use the global random generator; ``tests/unit/test_layering.py`` enforces it."""

"""Session fixtures for conformance tests against real vLLM CPU engines.

Two engines are started once per test session, in parallel, the first time a test asks for
one of these fixtures (about 60-80 s, 3-5 min on a loaded machine) and stopped at the end of
the session. Tests that do not ask for them cost nothing. Where the cached install is missing
the fixtures skip with the reason (``tests/realvllm.py``: ``require_real_vllm``).

The ``realvllm`` helper module is importable because pytest puts ``tests/`` on the path
(``pythonpath`` in ``pyproject.toml``).
"""

from __future__ import annotations

import pytest
import realvllm

real_vllm_pair = realvllm.engines_fixture(2, scope="session")
"""``list[RealVllmEngine]`` of two engines (``e0``, ``e1``), shared by the whole session."""


@pytest.fixture(scope="session")
def real_vllm_engine(real_vllm_pair: list[realvllm.RealVllmEngine]) -> realvllm.RealVllmEngine:
    """The first engine of the session pair."""
    return real_vllm_pair[0]


@pytest.fixture(scope="session")
def real_vllm_other(real_vllm_pair: list[realvllm.RealVllmEngine]) -> realvllm.RealVllmEngine:
    """The second engine of the session pair (its cache sees no traffic from the first)."""
    return real_vllm_pair[1]

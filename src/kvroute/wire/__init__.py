"""Pure codecs: bytes and JSON shapes of vLLM, OpenAI and Prometheus to and from core values.
Like ``core``, nothing here may do I/O (enforced by ``tests/unit/test_layering.py``)."""

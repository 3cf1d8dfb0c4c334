"""Builds kvroute's one optional C extension, ``kvroute.core._blockhash`` (vLLM's default
sha256 block hash chain; docs/long-contexts.md). Everything else is in pyproject.toml.

``optional=True``: where no C compiler is found the install goes on without it, and
``kvroute.core.native_hashing`` uses the pure-Python loop, which gives the same hashes.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvroute.core._blockhash", ["src/kvroute/core/_blockhash.c"],
                             optional=True, extra_compile_args=["-O2"])])

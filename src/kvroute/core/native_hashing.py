"""vLLM's default block hash over a run of plain blocks, in C when the extension is built.

Owns ``sha256_chain``: the sha256 digests (and their 64-bit wire forms) of every full block of
a token array, each block chained from the one before, as
``hashlib.sha256(pickle.dumps((parent, tuple(block), None), 5))`` computes them. "Plain"
means no extra keys (no ``cache_salt`` on the block, no LoRA, no multimodal items) and no
lookahead: ``BlockHasher.hash_blocks`` sends only those here, the rest stays in its Python
loop.

``kvroute.core._blockhash`` (``_blockhash.c``, built by ``pip install -e .`` through
``setup.py``; optional) writes the exact protocol-5 pickle bytes CPython writes for that
tuple and digests them with its own SHA-256: ~0.5 µs a block against ~4 µs for
``pickle.dumps`` + ``hashlib`` in a Python loop (docs/long-contexts.md). Without it (no
compiler at install time) ``sha256_chain_python`` serves, with the same results: the
property tests compare the two on random blocks, block sizes and ids across every pickle
opcode boundary (``tests/unit/core/test_native_hashing.py``).
"""

from __future__ import annotations

import hashlib
import importlib
import pickle
from array import array
from types import ModuleType

from kvroute.core.types import BlockHash, WireHash, to_wire_hash

__all__ = ["NATIVE", "sha256_chain", "sha256_chain_python"]

_native: ModuleType | None
try:
    _native = importlib.import_module("kvroute.core._blockhash")
except ImportError:  # not built: the Python loop gives the same digests
    _native = None

NATIVE: bool = _native is not None
"""Whether the C extension is in use."""


def sha256_chain(parent: bytes, tokens: array[int],
                 block_size: int) -> tuple[list[BlockHash], list[WireHash]]:
    """Digests and wire hashes of ``tokens``' full blocks of ``block_size``, block 0 chained
    from ``parent`` (a 32-byte digest: ``NONE_HASH`` or the block before). ``tokens`` is an
    array of unsigned ids (``'I'``, ``'L'`` or ``'Q'``); a trailing partial block is not
    hashed."""
    if _native is not None and tokens.typecode in "ILQ" and tokens.itemsize in (4, 8):
        digests, wires = _native.sha256_chain(parent, tokens, tokens.itemsize, block_size)
        return digests, wires
    return sha256_chain_python(parent, tokens, block_size)


def sha256_chain_python(parent: bytes, tokens: array[int],
                        block_size: int) -> tuple[list[BlockHash], list[WireHash]]:
    """``sha256_chain`` in Python: the reference the C extension is tested against."""
    ints = tokens.tolist()
    dumps, sha256 = pickle.dumps, hashlib.sha256
    prev = parent
    digests: list[BlockHash] = []
    for s in range(0, len(ints) - block_size + 1, block_size):
        prev = sha256(dumps((prev, tuple(ints[s : s + block_size]), None), 5)).digest()
        digests.append(BlockHash(prev))
    return digests, [to_wire_hash(d) for d in digests]

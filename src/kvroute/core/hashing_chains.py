"""Per-session block-hash chains: a growing conversation hashes only the blocks it added.

Owns ``SessionChains``. For each active session (its tenant scope, pool and session id) it
keeps the previous prompt's hashed token ids, their wire hashes and the digest of the last
hashed block. When the next prompt of the session *starts with* those ids, under the same
hashing basis, only the blocks after them are hashed (``BlockHasher.hash_blocks`` from that
block, chained from that digest) and the stored hashes are extended; otherwise the prompt is
hashed from scratch (through the pool's ``BlockHashMemo``) and replaces the entry.

Why it is exact: vLLM's hash of block ``i`` is a function of exactly the digest of block
``i - 1``, the block's tokens and its extra keys (``cache_salt`` on block 0, the LoRA
adapter's name on every block), under the hasher's algorithm, block size and seed
(``core/hashing.py``). The entry is reused only when every one of those is the same: the
*basis* (algorithm, block size, seed, lookahead, salt, LoRA key) compares equal, and the new
ids begin with the stored ids byte for byte. So an edited earlier turn, a changed system
prompt, another tenant or salt, another adapter or another tokenizer's ids all fail the check
and are hashed from scratch; nothing is assumed from the session id alone. Requests with
multimodal items or prompt embeddings never come here (their extra keys are per item). The
property tests compare the chain with ``BlockHasher`` on random edits.

Why the check is cheap: the ids are compared as raw bytes (``bytes.startswith``: one
``memcmp``), the new prompt's ``array('I')`` (the local tokenizer's output) gives its bytes in
one copy; a list of ids (a completion sent as token ids) is converted once
(``array('I', ids)``; ids outside ``0..2**32-1`` skip the chains).

Memory: an entry holds 4 bytes a token of ids, one 64-bit wire hash (a Python int, ~32 bytes,
plus an 8-byte list slot) a block and one digest: about 6.8 bytes a token at block size 16
(~0.9 MB for a 128K-token session). Entries are kept in LRU order within ``max_tokens`` in
total (``state.max_chain_tokens``); a prompt longer than the whole bound is not kept; 0 turns
the chains off. Pure: no I/O, no clock.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Final

from kvroute.core.hash_memo import BlockHashMemo
from kvroute.core.hashing import LoraKey
from kvroute.core.types import BlockHash, WireHash

__all__ = ["BYTES_PER_TOKEN", "DEFAULT_CHAIN_TOKENS", "ChainStats", "SessionChains"]

DEFAULT_CHAIN_TOKENS: Final = 4_000_000
"""About 30 sessions at 128K tokens, ~27 MB at ``BYTES_PER_TOKEN`` (the piece cache's bound
too)."""

BYTES_PER_TOKEN: Final = 6.8
"""Measured size of an entry per token at block size 16 (``tracemalloc``, 4 sessions of 128K
tokens: 6.77 bytes a token)."""

_Basis = tuple[str, int, str | None, int, str | None, LoraKey | None]


class _Chain:
    """One session's last prompt as hashed: its ids (bytes of ``array('I')``), the wire
    hashes of its full blocks, the digest of the last one, and the basis they were hashed on."""

    __slots__ = ("basis", "last", "tokens", "wires")

    def __init__(self, basis: _Basis, tokens: bytes, wires: list[WireHash],
                 last: BlockHash | None) -> None:
        self.basis = basis
        self.tokens = tokens
        self.wires = wires
        self.last = last


class ChainStats:
    """Counters of ``SessionChains``: prompts that extended their session's chain, prompts
    hashed from scratch (new session, or the check failed), blocks reused and hashed."""

    __slots__ = ("blocks_hashed", "blocks_reused", "extended", "rebuilt")

    def __init__(self) -> None:
        self.extended = 0
        self.rebuilt = 0
        self.blocks_reused = 0
        self.blocks_hashed = 0


class SessionChains:
    """The sessions' block-hash chains, bounded by their total tokens (module docstring).

    Args:
        max_tokens: bound on the tokens held over all entries (0: off, every prompt goes to
            the memo).
    """

    __slots__ = ("_chains", "_held", "max_tokens", "stats")

    def __init__(self, max_tokens: int = DEFAULT_CHAIN_TOKENS) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens={max_tokens!r} must be an int >= 0 (0 turns the "
                             "session chains off)")
        self.max_tokens = max_tokens
        self._chains: OrderedDict[Hashable, _Chain] = OrderedDict()
        self._held = 0
        self.stats = ChainStats()

    def __len__(self) -> int:
        return len(self._chains)

    @property
    def held_tokens(self) -> int:
        """Tokens held over all entries (at most ``max_tokens``)."""
        return self._held

    def forget(self, key: Hashable) -> None:
        """Drop ``key``'s entry, if any."""
        chain = self._chains.pop(key, None)
        if chain is not None:
            self._held -= len(chain.tokens) // 4

    def wire_hashes(self, key: Hashable | None, memo: BlockHashMemo, token_ids: Sequence[int],
                    *, cache_salt: str | None = None,
                    lora: LoraKey | None = None) -> list[WireHash]:
        """The wire hashes of ``token_ids``' full blocks under ``memo``'s hasher, as
        ``BlockHasher.wire_hashes`` gives them; ``key`` names the session (its scope, pool
        and id), None for a request of no session (the memo alone). The returned list is
        the caller's (the entry keeps its own).

        Every input of the hash is a parameter here and part of the basis compared before
        reuse; a new one (multimodal keys, prompt embeddings) must join both, or bypass."""
        hasher = memo.hasher
        if key is None or not self.max_tokens or hasher.lookahead_tokens:
            return memo.wire_hashes(token_ids, cache_salt=cache_salt, lora=lora)
        raw = _raw_ids(token_ids)
        if raw is None:
            return memo.wire_hashes(token_ids, cache_salt=cache_salt, lora=lora)
        basis: _Basis = (hasher.algo, hasher.block_size, hasher.seed, hasher.lookahead_tokens,
                         cache_salt, lora)
        num_blocks = hasher.num_hashable_blocks(len(token_ids))
        hashed = raw[: num_blocks * hasher.block_size * 4]
        chain = self._chains.get(key)
        if chain is not None and chain.basis == basis and hashed.startswith(chain.tokens):
            start = len(chain.wires)
            if start:
                new, new_wires = hasher.hash_blocks_and_wires(
                    token_ids, cache_salt=cache_salt, lora=lora, start_block=start,
                    parent=chain.last)
            else:
                new, new_wires = hasher.hash_blocks_and_wires(token_ids, cache_salt=cache_salt,
                                                              lora=lora)
            wires = chain.wires  # the entry is replaced below: extend its list in place
            wires += new_wires
            last = new[-1] if new else chain.last
            self.stats.extended += 1
            self.stats.blocks_reused += start
            self.stats.blocks_hashed += len(new)
        else:
            digests, wires = memo.hash_chain(token_ids, cache_salt=cache_salt, lora=lora)
            last = digests[-1] if digests else None
            self.stats.rebuilt += 1
            self.stats.blocks_hashed += len(digests)
        self._store(key, _Chain(basis, hashed, wires, last))
        return list(wires)

    def _store(self, key: Hashable, chain: _Chain) -> None:
        self.forget(key)
        size = len(chain.tokens) // 4
        if size > self.max_tokens:
            return
        chains = self._chains
        chains[key] = chain
        self._held += size
        while self._held > self.max_tokens:
            _, dropped = chains.popitem(last=False)
            self._held -= len(dropped.tokens) // 4


def _raw_ids(token_ids: Sequence[int]) -> bytes | None:
    """The ids as the bytes of an ``array('I')``; None when one does not fit in 32 bits."""
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        return token_ids.tobytes()
    try:
        return array("I", token_ids).tobytes()
    except (OverflowError, TypeError):
        return None

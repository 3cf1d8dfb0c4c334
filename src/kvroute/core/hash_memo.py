"""A bounded memo of block hashes, so a prefix shared by many requests is hashed once.

Owns ``BlockHashMemo``, which answers ``BlockHasher.wire_hashes`` for the router's common case
(no LoRA adapter, no lookahead) from a memo keyed by ``(parent, block tokens)``: a block's
hash is a function of exactly its parent's digest, its tokens and its extra keys, and the only
extra key in that case is the ``cache_salt`` of block 0, which stands in for the parent there.
So a memo hit is the value ``BlockHasher`` would compute, bit for bit; the property tests
compare the two on random sequences with shared prefixes and salts.

Why: hashing is the router's largest per-token cost (sha256 of a pickled block, ~1.4 µs for
16 tokens, ~7 µs for 128), and most of a prompt's blocks (system prompt, earlier turns) were
hashed for an earlier request. A memo lookup costs a tuple slice and a dict probe.

Inputs are token ids the caller has already validated as ints (the tokenizer's ids, or a
completion's checked ``prompt``): a key made of equal-comparing non-ints (``1.0``) could hit.
Memory: at most ``max_entries`` blocks, each a key tuple and two small values, evicted
oldest-inserted first. Hits do not refresh an entry (that costs a third of a hit): a hot
prefix that ages out is re-inserted by the next request that misses it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

from kvroute.core.hashing import BlockHasher, LoraKey
from kvroute.core.types import BlockHash, WireHash, to_wire_hash

__all__ = ["DEFAULT_MEMO_BLOCKS", "BlockHashMemo"]

DEFAULT_MEMO_BLOCKS: Final = 262_144
"""About 4 M tokens of prefixes at block size 16, some tens of MB."""

_Key = tuple[object, tuple[int, ...]]


class BlockHashMemo:
    """``wire_hashes`` of one ``BlockHasher``, memoised per block.

    Args:
        hasher: the engine configuration's hasher (its result is the truth).
        max_entries: bound on memoised blocks, oldest-inserted evicted first (0: no memo).
    """

    __slots__ = ("_memo", "hasher", "hits", "max_entries", "misses")

    def __init__(self, hasher: BlockHasher, max_entries: int = DEFAULT_MEMO_BLOCKS) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries={max_entries} must be >= 0 (0 turns the memo off)")
        self.hasher = hasher
        self.max_entries = max_entries
        self._memo: OrderedDict[_Key, tuple[BlockHash, WireHash]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._memo)

    def wire_hashes(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
                    lora: LoraKey | None = None) -> list[WireHash]:
        """The wire hashes of ``token_ids``' full blocks, as ``BlockHasher.wire_hashes``."""
        hasher = self.hasher
        if lora is not None or hasher.lookahead_tokens or not self.max_entries:
            return hasher.wire_hashes(token_ids, cache_salt=cache_salt, lora=lora)
        return [wire for _, wire in self._walk(token_ids, cache_salt)]

    def hash_blocks(self, token_ids: Sequence[int], *,
                    cache_salt: str | None = None) -> list[BlockHash]:
        """The digests of ``token_ids``' full blocks, as ``BlockHasher.hash_blocks`` (what an
        engine keeps; the simulated engine hashes each prompt through this)."""
        hasher = self.hasher
        if hasher.lookahead_tokens or not self.max_entries:
            return hasher.hash_blocks(token_ids, cache_salt=cache_salt)
        return [digest for digest, _ in self._walk(token_ids, cache_salt)]

    def _walk(self, token_ids: Sequence[int],
              cache_salt: str | None) -> list[tuple[BlockHash, WireHash]]:
        bs = self.hasher.block_size
        num_blocks = self.hasher.num_hashable_blocks(len(token_ids))
        tokens = tuple(token_ids[: num_blocks * bs])  # slices of a tuple are tuples
        get = self._memo.get
        out: list[tuple[BlockHash, WireHash]] = []
        append = out.append
        parent: object = ("salt", cache_salt)  # block 0's only extra key stands in for NONE_HASH
        for start in range(0, num_blocks * bs, bs):
            found = get((parent, tokens[start : start + bs]))
            if found is None:
                digest = out[-1][0] if out else None
                self._fill(tokens, start // bs, digest, cache_salt, num_blocks, out)
                return out
            append(found)
            parent = found[0]
        self.hits += num_blocks
        return out

    def _fill(self, tokens: tuple[int, ...], start: int, parent: BlockHash | None,
              cache_salt: str | None, num_blocks: int,
              out: list[tuple[BlockHash, WireHash]]) -> None:
        """Hash blocks ``start..`` of ``tokens`` (the hashable prefix, as a tuple) with the
        hasher, append them to ``out`` and memoise them."""
        hasher = self.hasher
        self.hits += start
        self.misses += num_blocks - start
        if start == 0:
            digests = hasher.hash_blocks(tokens, cache_salt=cache_salt)
        else:
            digests = hasher.hash_blocks(tokens, start_block=start, parent=parent)
        bs = hasher.block_size
        memo = self._memo
        prev: object = ("salt", cache_salt) if start == 0 else parent
        for offset, digest in enumerate(digests):
            index = start + offset
            entry = (digest, to_wire_hash(digest))
            memo[(prev, tokens[index * bs : (index + 1) * bs])] = entry
            out.append(entry)
            prev = digest
        while len(memo) > self.max_entries:
            memo.popitem(last=False)

"""A bounded memo of block hashes, so a prefix shared by many requests is hashed once.

Owns ``BlockHashMemo``, which answers ``BlockHasher.wire_hashes`` for the router's common case
(no LoRA adapter, no lookahead) from a memo keyed by ``(parent, tokens)``: a block's hash is a
function of exactly its parent's digest, its tokens and its extra keys, and the only extra key
in that case is the ``cache_salt`` of block 0, which stands in for the parent there. So a memo
hit is the value ``BlockHasher`` would compute, bit for bit; the property tests compare the two
on random sequences with shared prefixes and salts.

Two granularities share the memo: single blocks, and *spans* of ``SPAN_BLOCKS`` blocks that
start at a multiple of ``SPAN_BLOCKS`` (so two prompts sharing a prefix share its spans). The
walk tries a span first and falls back to single blocks from the first span that misses; a
span is memoised once all its blocks are known. A long shared prefix (a system prompt of ~90
blocks) then costs about a dozen dict probes instead of ninety, the per-block Python loop
being most of what a memo hit costs.

Spans only, when the C hasher serves (``core/native_hashing.py``: ``sha256`` built with the
extension): hashing a block there (~0.5 µs) costs less than memoising it (a key, two tuples
and a dict write) and about what a lookup costs, so the walk then keeps and probes spans only
and hashes everything from the first span that misses (at most ``SPAN_BLOCKS - 1`` blocks of
a diverging span are hashed again). ``per_block`` chooses; the results are the same.

Why: hashing is the router's largest per-token cost (sha256 of a pickled block), and most of a
prompt's blocks (system prompt, earlier turns) were hashed for an earlier request, while a memo
lookup costs a slice and a dict probe (figures:
``docs/benchmarks.md#block-hashing-through-a-memo``).

Two key forms: an ``array('I')`` (what the local tokenizer's piece cache returns) is keyed by
slices of its raw bytes (``tobytes()``, one memcpy; a block is ``itemsize * block_size``
bytes), any other sequence by tuples of its ints. A bytes slice hashes and compares in C over
contiguous memory, where a tuple key needs an int object per token and hashes them one by one
(building the prompt's tuple and hashing its slices were most of a warm walk: same section
of ``docs/benchmarks.md``). The forms never meet: a bytes key never equals a tuple key, so the
same tokens as a list and as an array are memoised apart, each exactly. Only type code ``'I'``
takes the bytes form: with one item size, a block key and a span key always differ in length;
another type code could make one array's span the bytes of another's block. The hasher itself
always reads the ids as ints.

Inputs are token ids the caller has already validated as ints (the tokenizer's ids, or a
completion's checked ``prompt``): a tuple key made of equal-comparing non-ints (``1.0``) could
hit (an ``array('I')`` holds only ints in ``0..2**32-1``).
Memory: at most ``max_entries`` entries (blocks and spans), each a key and its digests, in
``_SEGMENTS`` dicts written in turn (``_Segments``): entries leave with the oldest one, a few at
each write, and an entry found in an older one is copied into the one being written, so a hot
prefix stays while cold ones age out.

Why segments and not one ordered dict: under varied traffic the memo is full within minutes
(``kvroute bench soak``) and every miss evicts, and a dict that keeps deleting its oldest keys
while adding new ones rebuilds its whole table every few hundred thousand writes, holding the
event loop for as long (``benchmarks/micro/bench_memo_churn.py``;
``docs/benchmarks.md#the-block-hash-memo-under-churn``). A dict that only grows and then
empties by ``popitem`` never rebuilds; the newest segment's growth copies at most one eighth
of the memo, once. Plain dicts also hold less than an ordered one's linked entries.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from typing import Final

from kvroute.core.hashing import BlockHasher, LoraKey
from kvroute.core.native_hashing import NATIVE
from kvroute.core.types import BlockHash, WireHash, to_wire_hash

__all__ = ["DEFAULT_MEMO_BLOCKS", "BlockHashMemo"]

DEFAULT_MEMO_BLOCKS: Final = 262_144
"""About 4 M tokens of prefixes at block size 16, which a router under varied traffic fills
within minutes (``kvroute bench soak``). Each entry holds its key tuple and token bytes and its
digest and wire-hash tuples; what that costs at this bound is measured by
``benchmarks/micro/bench_cache_memory.py`` (``docs/benchmarks.md#long-run-memory-and-p99``)."""

SPAN_BLOCKS: Final = 8
"""Blocks per memoised span (128 tokens at block size 16)."""

_Tokens = tuple[int, ...] | bytes
"""The hashable prefix as keys slice it: a tuple of ints, or the raw bytes of an ``array('I')``."""
_Key = tuple[object, _Tokens]
_Entry = tuple[tuple[BlockHash, ...], tuple[WireHash, ...]]
"""Digests and wire hashes of a block (one each) or of a span (``SPAN_BLOCKS`` each)."""

_SEGMENTS: Final = 8
"""Segments the bound is split into (``_Segments``): more make each one's growth and its
eviction smaller, and a lookup that misses probe more dicts."""


class _Segments:
    """A map of at most ``bound`` entries, kept in segments: a FIFO by segment, in O(1) a write.

    Invariants: ``len(self) <= bound`` after every ``put``; ``segments[-1]`` is the one written,
    and a new one starts once it holds ``bound // _SEGMENTS`` entries (at least one); eviction
    takes entries from ``segments[0]`` only (``dict.popitem``: O(1), and a dict that only loses
    entries never rebuilds its table), one for each entry written beyond the bound, and drops
    a segment once it is empty. ``get`` looks in the newest segment first; an entry found in an
    older one is copied into the newest (it may then be counted twice until the older copy is
    evicted, which the bound includes).
    """

    __slots__ = ("_bound", "_per", "_size", "segments")

    def __init__(self, bound: int) -> None:
        self._bound = bound
        self._per = max(1, bound // _SEGMENTS)
        self._size = 0
        self.segments: deque[dict[_Key, _Entry]] = deque([{}])

    def __len__(self) -> int:
        return self._size

    def get(self, key: _Key) -> _Entry | None:
        segments = self.segments
        found = segments[-1].get(key)
        if found is not None or len(segments) == 1:
            return found
        for i in range(len(segments) - 2, -1, -1):
            found = segments[i].get(key)
            if found is not None:
                self.put(key, found)
                return found
        return None

    def put(self, key: _Key, value: _Entry) -> None:
        segments = self.segments
        newest = segments[-1]
        before = len(newest)
        newest[key] = value
        if len(newest) == before:
            return  # replaced an entry of the newest segment
        self._size += 1
        if len(newest) >= self._per:
            segments.append({})
        while self._size > self._bound:
            oldest = segments[0]
            oldest.popitem()
            self._size -= 1
            if not oldest:
                segments.popleft()


class BlockHashMemo:
    """``wire_hashes`` of one ``BlockHasher``, memoised per block and per span.

    Args:
        hasher: the engine configuration's hasher (its result is the truth).
        max_entries: bound on memoised entries (blocks and spans), evicted a segment at a
            time, oldest first, hits refreshed (module doc; 0: no memo).
        per_block: memoise single blocks as well as spans (None: unless the C hasher serves
            this hasher, module doc).
    """

    __slots__ = ("_memo", "hasher", "hits", "max_entries", "misses", "per_block")

    def __init__(self, hasher: BlockHasher, max_entries: int = DEFAULT_MEMO_BLOCKS, *,
                 per_block: bool | None = None) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries={max_entries} must be >= 0 (0 turns the memo off)")
        self.hasher = hasher
        self.per_block = (not (NATIVE and hasher.algo == "sha256") if per_block is None
                          else per_block)
        self.max_entries = max_entries
        self._memo = _Segments(max_entries)
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
        return self._walk(token_ids, cache_salt)[1]

    def hash_blocks(self, token_ids: Sequence[int], *,
                    cache_salt: str | None = None) -> list[BlockHash]:
        """The digests of ``token_ids``' full blocks, as ``BlockHasher.hash_blocks`` (what an
        engine keeps; the simulated engine hashes each prompt through this)."""
        hasher = self.hasher
        if hasher.lookahead_tokens or not self.max_entries:
            return hasher.hash_blocks(token_ids, cache_salt=cache_salt)
        return self._walk(token_ids, cache_salt)[0]

    def hash_chain(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
                   lora: LoraKey | None = None) -> tuple[list[BlockHash], list[WireHash]]:
        """Digests and wire hashes of ``token_ids``' full blocks together (what a session's
        chain keeps, ``core/hashing_chains.py``), memoised as ``wire_hashes`` is."""
        hasher = self.hasher
        if lora is not None or hasher.lookahead_tokens or not self.max_entries:
            digests = hasher.hash_blocks(token_ids, cache_salt=cache_salt, lora=lora)
            return digests, [to_wire_hash(d) for d in digests]
        return self._walk(token_ids, cache_salt)

    def _walk(self, token_ids: Sequence[int],
              cache_salt: str | None) -> tuple[list[BlockHash], list[WireHash]]:
        """Digests and wire hashes of every full block: spans while they hit, then blocks,
        then the hasher for the first block not memoised and everything after it."""
        num_blocks = self.hasher.num_hashable_blocks(len(token_ids))
        tokens, step = self._key_tokens(token_ids, num_blocks)
        get = self._memo.get
        digests: list[BlockHash] = []
        wires: list[WireHash] = []
        root: object = ("salt", cache_salt)  # block 0's only extra key stands in for NONE_HASH
        parent = root
        span_step = SPAN_BLOCKS * step
        block = 0
        while block + SPAN_BLOCKS <= num_blocks:
            start = block * step
            found = get((parent, tokens[start : start + span_step]))
            if found is None:
                break
            digests += found[0]
            wires += found[1]
            parent = found[0][-1]
            block += SPAN_BLOCKS
        first_missed_span = block
        while block < num_blocks:
            start = block * step
            found = get((parent, tokens[start : start + step])) if self.per_block else None
            if found is None:
                self._fill(token_ids, tokens, step, block, cache_salt, digests, wires)
                break
            digests += found[0]
            wires += found[1]
            parent = found[0][0]
            block += 1
        else:
            self.hits += num_blocks
        self._add_spans(tokens, step, first_missed_span, root, digests, wires)
        return digests, wires

    def _key_tokens(self, token_ids: Sequence[int], num_blocks: int) -> tuple[_Tokens, int]:
        """What keys slice (see the module docstring) and its length per block: the bytes of
        an ``array('I')`` (``itemsize * block_size`` a block), else a tuple of the hashable
        prefix (``block_size`` a block)."""
        bs = self.hasher.block_size
        if isinstance(token_ids, array) and token_ids.typecode == "I":
            return token_ids.tobytes(), token_ids.itemsize * bs
        return tuple(token_ids[: num_blocks * bs]), bs

    def _fill(self, token_ids: Sequence[int], tokens: _Tokens, step: int, start: int,
              cache_salt: str | None, digests: list[BlockHash], wires: list[WireHash]) -> None:
        """Hash blocks ``start..`` with the hasher, append them to ``digests``/``wires`` and
        (``per_block``) memoise them under slices of ``tokens`` (``step`` a block).

        The hasher reads ints: the tuple of the hashable prefix when keys are tuples (already
        built; a lazy sequence is not materialised twice), else the ``array('I')`` itself (it
        converts only the blocks it hashes)."""
        hasher = self.hasher
        ints = tokens if isinstance(tokens, tuple) else token_ids
        if start == 0:
            new, new_wires = hasher.hash_blocks_and_wires(ints, cache_salt=cache_salt)
        else:
            new, new_wires = hasher.hash_blocks_and_wires(ints, start_block=start,
                                                          parent=digests[-1])
        self.hits += start
        self.misses += len(new)
        if not self.per_block:
            digests += new
            wires += new_wires
            return
        put = self._memo.put
        prev: object = ("salt", cache_salt) if start == 0 else digests[-1]
        for offset, (digest, wire) in enumerate(zip(new, new_wires, strict=True)):
            at = (start + offset) * step
            put((prev, tokens[at : at + step]), ((digest,), (wire,)))
            digests.append(digest)
            wires.append(wire)
            prev = digest

    def _add_spans(self, tokens: _Tokens, step: int, first: int, root: object,
                   digests: list[BlockHash], wires: list[WireHash]) -> None:
        """Memoise the full spans from block ``first`` on (the walk found none of them)."""
        put = self._memo.put
        for block in range(first, len(digests) - SPAN_BLOCKS + 1, SPAN_BLOCKS):
            parent = digests[block - 1] if block else root
            end = block + SPAN_BLOCKS
            put((parent, tokens[block * step : end * step]),
                (tuple(digests[block:end]), tuple(wires[block:end])))

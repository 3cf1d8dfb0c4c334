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
extension): hashing a block there (~0.5 µs) costs less than memoising it (a key, a value
and a dict write) and about what a lookup costs, so the walk then keeps and probes spans only
and hashes everything from the first span that misses (at most ``SPAN_BLOCKS - 1`` blocks of
a diverging span are hashed again). ``per_block`` chooses; the results are the same.

Why: hashing is the router's largest per-token cost (sha256 of a pickled block), and most of a
prompt's blocks (system prompt, earlier turns) were hashed for an earlier request, while a memo
lookup costs a slice and a dict probe (figures:
``docs/benchmarks.md#block-hashing-through-a-memo``).

Keys and values are bytes, so the garbage collector never tracks them, nor the dicts that
hold only them (a dict is tracked only once it holds a tracked object). A memo of tuples added
tracked tuples on every miss and freed as many on every eviction, so the collector's counts
stayed low while its tracked objects piled up in the old generation, and every full collection
walked them and the dicts' hundreds of thousands of entries with the event loop stopped
(``docs/benchmarks.md#garbage-collection-pauses``).

A key is ``tokens + parent``: the block's (or span's) token ids as the raw bytes of an
``array('I')``, or of an ``array('Q')`` when an id does not fit 32 bits (an ``array('I')`` is
what the local tokenizer's piece cache returns and is sliced as it is, one ``tobytes()``; any
other sequence is copied into one, checked in C), then the parent's code, whose last byte says
which kind it is: ``digest + b"d"``, ``salt + len(salt) (4 bytes) + b"s"`` (the salt in UTF-8),
or ``b"n"`` (no salt). The code reads back from the end, and a token part is ``4 *
block_size``, ``8 * block_size`` (a block of each form), ``32 * block_size`` or ``64 *
block_size`` bytes (a span), all different, so two keys are equal exactly when form,
granularity, tokens and parent are: a hit is the hasher's answer for those. The same tokens as
a list and as an ``array('I')`` share entries. A bytes slice hashes and compares in C over
contiguous memory, where a tuple key needed an int object per token (building the prompt's
tuple and hashing its slices were most of a warm walk:
``docs/benchmarks.md#block-hashing-through-a-memo``). The hasher itself always reads the ids as
ints (the array).

A value is the digests concatenated: one digest for a block, ``SPAN_BLOCKS`` for a span; a hit
unpacks them, and their wire hashes (each digest's last 8 bytes, big-endian), with one
``struct`` call each.

Inputs are token ids: what an ``array('Q')`` cannot hold (a float, a negative id, text) is
never keyed; the hasher answers it (with its ``ValueError``).
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
from struct import Struct
from typing import Final

from kvroute.core.hashing import BlockHasher, LoraKey, digest_size, validate_cache_salt
from kvroute.core.native_hashing import NATIVE
from kvroute.core.types import BlockHash, WireHash, to_wire_hash

__all__ = ["DEFAULT_MEMO_BLOCKS", "BlockHashMemo"]

DEFAULT_MEMO_BLOCKS: Final = 262_144
"""About 4 M tokens of prefixes at block size 16, which a router under varied traffic fills
within minutes (``kvroute bench soak``). Each entry is a bytes key (its tokens' bytes and its
parent's code) and a bytes value (its digests); what that costs at this bound is measured by
``benchmarks/micro/bench_cache_memory.py`` (``docs/benchmarks.md#long-run-memory-and-p99``)."""

SPAN_BLOCKS: Final = 8
"""Blocks per memoised span (128 tokens at block size 16)."""

_DIGEST: Final = b"d"
"""Last byte of a parent's code that is a digest (module docstring, keys)."""
_SALT: Final = b"s"
"""Last byte of a root's code with a ``cache_salt``."""
_NO_SALT: Final = b"n"
"""The root's code without a ``cache_salt``."""

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
    evicted, which the bound includes). Keys and values are bytes, so no segment is ever
    tracked by the garbage collector.
    """

    __slots__ = ("_bound", "_per", "_size", "segments")

    def __init__(self, bound: int) -> None:
        self._bound = bound
        self._per = max(1, bound // _SEGMENTS)
        self._size = 0
        self.segments: deque[dict[bytes, bytes]] = deque([{}])

    def __len__(self) -> int:
        return self._size

    def get(self, key: bytes) -> bytes | None:
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

    def put(self, key: bytes, value: bytes) -> None:
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


def _root_code(cache_salt: str | None) -> bytes:
    """Block 0's parent code (module docstring): its only extra key, the salt, stands in for
    ``NONE_HASH`` there. A salt that is not a string is refused as the hasher refuses it."""
    if cache_salt is None:
        return _NO_SALT
    if not isinstance(cache_salt, str):
        validate_cache_salt(cache_salt)  # raises its ValueError
    raw = cache_salt.encode("utf-8", "surrogatepass")
    return raw + len(raw).to_bytes(4, "big") + _SALT


def _id_array(token_ids: Sequence[int], num_tokens: int) -> array[int] | None:
    """The first ``num_tokens`` ids as an ``array('I')`` (as they are when already one), an
    ``array('Q')`` when one does not fit 32 bits, or None when they are not ids (the hasher
    then answers, or names the bad one)."""
    if isinstance(token_ids, array) and token_ids.typecode in "IQ":
        return token_ids
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)):
        return None  # an array would take bytes as raw items
    head = token_ids[:num_tokens]
    try:
        return array("I", head)
    except OverflowError:
        pass
    except TypeError:
        return None
    try:
        return array("Q", head)
    except (OverflowError, TypeError):
        return None


class BlockHashMemo:
    """``wire_hashes`` of one ``BlockHasher``, memoised per block and per span.

    Args:
        hasher: the engine configuration's hasher (its result is the truth).
        max_entries: bound on memoised entries (blocks and spans), evicted a segment at a
            time, oldest first, hits refreshed (module doc; 0: no memo).
        per_block: memoise single blocks as well as spans (None: unless the C hasher serves
            this hasher, module doc).
    """

    __slots__ = ("_memo", "_span_digests", "_span_wires", "hasher", "hits", "max_entries",
                 "misses", "per_block")

    def __init__(self, hasher: BlockHasher, max_entries: int = DEFAULT_MEMO_BLOCKS, *,
                 per_block: bool | None = None) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries={max_entries} must be >= 0 (0 turns the memo off)")
        self.hasher = hasher
        self.per_block = (not (NATIVE and hasher.algo == "sha256") if per_block is None
                          else per_block)
        self.max_entries = max_entries
        self._memo = _Segments(max_entries)
        size = digest_size(hasher.algo)
        self._span_digests = Struct(f">{f'{size}s' * SPAN_BLOCKS}")
        """A span's value as its digests."""
        self._span_wires = Struct(f">{f'{size - 8}xQ' * SPAN_BLOCKS}")
        """A span's value as its wire hashes (``to_wire_hash`` of each digest)."""
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
        hasher = self.hasher
        num_blocks = hasher.num_hashable_blocks(len(token_ids))
        ids = _id_array(token_ids, num_blocks * hasher.block_size)
        if ids is None:  # not ids: never keyed (module docstring)
            hashed = hasher.hash_blocks_and_wires(token_ids, cache_salt=cache_salt)
            self.misses += len(hashed[0])
            return hashed
        root = _root_code(cache_salt)
        tokens = ids.tobytes()
        step = ids.itemsize * hasher.block_size
        get = self._memo.get
        digests: list[BlockHash] = []
        wires: list[WireHash] = []
        parent = root
        span_step = SPAN_BLOCKS * step
        block = 0
        while block + SPAN_BLOCKS <= num_blocks:
            start = block * step
            found = get(tokens[start : start + span_step] + parent)
            if found is None:
                break
            digests += self._span_digests.unpack(found)
            wires += self._span_wires.unpack(found)
            parent = digests[-1] + _DIGEST
            block += SPAN_BLOCKS
        first_missed_span = block
        while block < num_blocks:
            start = block * step
            found = get(tokens[start : start + step] + parent) if self.per_block else None
            if found is None:
                self._fill(ids, tokens, step, block, cache_salt, root, digests, wires)
                break
            digests.append(BlockHash(found))
            wires.append(to_wire_hash(found))
            parent = found + _DIGEST
            block += 1
        else:
            self.hits += num_blocks
        self._add_spans(tokens, step, first_missed_span, root, digests)
        return digests, wires

    def _fill(self, ids: array[int], tokens: bytes, step: int, start: int,
              cache_salt: str | None, root: bytes, digests: list[BlockHash],
              wires: list[WireHash]) -> None:
        """Hash blocks ``start..`` of ``ids`` with the hasher, append them to
        ``digests``/``wires`` and (``per_block``) memoise them under slices of ``tokens``
        (``step`` bytes a block)."""
        hasher = self.hasher
        if start == 0:
            new, new_wires = hasher.hash_blocks_and_wires(ids, cache_salt=cache_salt)
        else:
            new, new_wires = hasher.hash_blocks_and_wires(ids, start_block=start,
                                                          parent=digests[-1])
        self.hits += start
        self.misses += len(new)
        digests += new
        wires += new_wires
        if not self.per_block:
            return
        put = self._memo.put
        parent = root if start == 0 else digests[start - 1] + _DIGEST
        at = start * step
        for digest in new:
            put(tokens[at : at + step] + parent, digest)
            parent = digest + _DIGEST
            at += step

    def _add_spans(self, tokens: bytes, step: int, first: int, root: bytes,
                   digests: list[BlockHash]) -> None:
        """Memoise the full spans from block ``first`` on (the walk found none of them)."""
        put = self._memo.put
        for block in range(first, len(digests) - SPAN_BLOCKS + 1, SPAN_BLOCKS):
            parent = digests[block - 1] + _DIGEST if block else root
            end = block + SPAN_BLOCKS
            put(tokens[block * step : end * step] + parent, b"".join(digests[block:end]))

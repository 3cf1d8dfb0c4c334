"""vLLM-exact prefix-cache block hashing (vLLM 0.32.0 / 0.33.0, v1 engine).

Owns the reproduction of ``vllm/utils/hashing.py`` and the block-hash half of
``vllm/v1/core/kv_cache_utils.py``: the four hash algorithms, the root parent ``NONE_HASH``,
the chained ``hash_block_tokens``, the extra keys (LoRA, multimodal, ``cache_salt``, prompt
embeds), lookahead hashing (0.33.0) and the coarser-group view of hybrid models. It must not
import from ``wire``/``shell`` or read ambient state: the seed, block size and algorithm are
explicit constructor inputs, because the router hashes for many engines that may be configured
differently (vLLM itself reads ``PYTHONHASHSEED`` and a module global ``NONE_HASH``; we do not).

Contract (pinned to vLLM 0.32.0, unchanged in 0.33.0 except lookahead):

* block ``i`` hash = ``H((parent, tuple(tokens[i*bs:(i+1)*bs]), extra_keys))`` where ``parent``
  is block ``i-1``'s digest, or ``NONE_HASH = H(seed_string)`` for block 0;
* ``H`` serialises with ``pickle.dumps(obj, protocol=5)`` (``sha256``, ``xxhash``) or
  ``cbor2.dumps(obj, canonical=True)`` (``*_cbor``) and digests with SHA-256 (32 bytes) or
  ``xxh3_128`` (16 bytes);
* ``extra_keys`` is ``None`` or a tuple of tagged tuples in the fixed order
  ``lora + mm + cache_salt + prompt_embeds``; the salt enters only the block starting at token 0;
* only full blocks get a hash; with lookahead ``L`` a block waits for its ``L`` next tokens.

Error policy. Configuration errors (unknown algorithm, bad block size, missing or malformed
seed, negative lookahead) raise :class:`~kvroute.core.errors.HashConfigError`: they are the
operator's to fix. Errors in the arguments of one call (negative or non-integer token ids, a
salt vLLM would reject, unsorted multimodal items, ``start_block > 0`` without ``parent``...)
raise :class:`ValueError`: they are the caller's (usually the client request's) to fix.

Performance. Plain blocks under ``sha256`` (vLLM's default: no extra keys, no lookahead) go
to ``core/native_hashing.py``, whose C extension writes CPython's pickle bytes itself and
digests them (~0.5 µs a block against ~4 µs here; the Python loop there is the fallback and
the tests' reference). Every other case uses ``pickle.dumps`` directly, the token ids validated
in C (``array('Q')`` plus conversion to exact ``int``, see :func:`_validated_tokens`); a
hand-built pickle byte string *in Python* was slower than the C pickler. Figures:
``benchmarks/micro/bench_hashing.py``,
``docs/benchmarks.md#micro-benchmarks-hashing-index-handler``.

Pickle memo caveat (docs/reference/vllm-engine-contract.md §1.4). Pickle writes the second
occurrence of the *same* object in one payload as a memo reference, so identity changes the
bytes. vLLM's normal inputs never
repeat a caller-supplied string object inside one block key, so every caller-supplied string
(LoRA name and path, salt, multimodal identifier) is re-created as an independent object before
it enters a key (:func:`_fresh_str`). Tag literals (``"lora"``, ``"mm"``...) are interned
constants here as in vLLM, so a repeated ``"mm"`` tag memoises identically on both sides.
"""

from __future__ import annotations

import hashlib
import pickle
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, TypeAlias

import cbor2
import xxhash

from kvroute.core.errors import HashConfigError
from kvroute.core.native_hashing import sha256_chain
from kvroute.core.types import BlockHash, WireHash, to_wire_hash

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "HASH_ALGOS",
    "MAX_CACHE_SALT_CHARS",
    "PICKLE_PROTOCOL",
    "BlockHasher",
    "ExtraKeys",
    "HashFn",
    "LoraKey",
    "MultiModalItem",
    "coarser_view",
    "digest_size",
    "extra_keys_for_block",
    "get_hash_fn_by_name",
    "get_serialize_fn_by_name",
    "hash_block_tokens",
    "none_hash",
    "to_event_extra_keys",
    "validate_cache_salt",
]

HASH_ALGOS: tuple[str, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
"""The values of vLLM's ``--prefix-caching-hash-algo``; ``sha256`` is vLLM's default."""

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""Seed string of ``NONE_HASH`` for ``sha256*`` when the engine has no ``PYTHONHASHSEED``."""

PICKLE_PROTOCOL: Final = 5
"""``pickle.HIGHEST_PROTOCOL`` on the Python versions vLLM 0.32/0.33 support; pinned, not read."""

MAX_CACHE_SALT_CHARS: Final = 128
"""vLLM's ``validate_cache_salt`` limit (stricter than the declared ``max_length=1024``)."""

_FORBIDDEN_SALT_CHARS: Final = ("@", "/", "\\", "\x00")
_MAX_PYTHONHASHSEED: Final = 4294967295
_MAX_TOKEN_ID: Final = (1 << 64) - 1

HashFn: TypeAlias = Callable[[object], bytes]
"""A vLLM hash function: serialise an object, return the raw digest."""

ExtraKeys: TypeAlias = tuple[tuple[object, ...], ...]
"""vLLM's tagged extra keys of one block: ``(("lora", name, path), ("mm", id, off), ...)``."""

# Tags, exactly as vLLM spells them. Module constants are interned, like vLLM's literals.
_TAG_LORA: Final = "lora"
_TAG_MM: Final = "mm"
_TAG_SALT: Final = "cache_salt"
_TAG_EMBEDS: Final = "prompt_embeds"


def _pickle_dumps(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=PICKLE_PROTOCOL)


def _cbor_dumps(obj: object) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def _sha256(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=PICKLE_PROTOCOL)).digest()


def _sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash(obj: object) -> bytes:
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=PICKLE_PROTOCOL))


def _xxhash_cbor(obj: object) -> bytes:
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


_HASH_FNS: Final[dict[str, HashFn]] = {
    "sha256": _sha256,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash,
    "xxhash_cbor": _xxhash_cbor,
}
_SERIALIZE_FNS: Final[dict[str, HashFn]] = {
    "sha256": _pickle_dumps,
    "sha256_cbor": _cbor_dumps,
    "xxhash": _pickle_dumps,
    "xxhash_cbor": _cbor_dumps,
}
_DIGEST_SIZES: Final[dict[str, int]] = {
    "sha256": 32,
    "sha256_cbor": 32,
    "xxhash": 16,
    "xxhash_cbor": 16,
}


def _check_algo(name: str) -> str:
    if name not in _HASH_FNS:
        raise HashConfigError(
            f"unknown hash algorithm {name!r}: use one of {', '.join(HASH_ALGOS)} "
            "(the engine's --prefix-caching-hash-algo, also shown as prefix_caching_hash_algo "
            "in vllm:cache_config_info on /metrics)"
        )
    return name


def get_hash_fn_by_name(name: str) -> HashFn:
    """Return vLLM's hash function for ``--prefix-caching-hash-algo`` ``name``.

    Raises:
        HashConfigError: ``name`` is not one of :data:`HASH_ALGOS`.
    """
    return _HASH_FNS[_check_algo(name)]


def get_serialize_fn_by_name(name: str) -> HashFn:
    """Return the serialiser ``name`` feeds to its digest (pickle protocol 5 or canonical CBOR).

    Exposed so conformance tests can compare the exact bytes that are hashed.

    Raises:
        HashConfigError: ``name`` is not one of :data:`HASH_ALGOS`.
    """
    return _SERIALIZE_FNS[_check_algo(name)]


def digest_size(name: str) -> int:
    """Digest length in bytes of algorithm ``name``: 32 for ``sha256*``, 16 for ``xxhash*``."""
    return _DIGEST_SIZES[_check_algo(name)]


def _check_seed(seed: str) -> None:
    if not isinstance(seed, str):
        raise HashConfigError(
            f"hash seed must be the PYTHONHASHSEED string, got {type(seed).__name__} {seed!r}"
        )
    if seed == "random":
        return  # vLLM then uses the literal string "random" as the seed string
    if not (seed.isascii() and seed.isdigit() and int(seed) <= _MAX_PYTHONHASHSEED):
        raise HashConfigError(
            f"hash seed {seed!r} is not a value PYTHONHASHSEED can hold: pass exactly the "
            f"engine's PYTHONHASHSEED ('random' or an integer 0..{_MAX_PYTHONHASHSEED}), or "
            "no seed when the engine runs without PYTHONHASHSEED"
        )


def none_hash(algo: str, seed: str | None = None) -> BlockHash:
    """Return vLLM's ``NONE_HASH``, the parent of block 0: ``H(seed_string)``.

    Args:
        algo: one of :data:`HASH_ALGOS`.
        seed: the engine's ``PYTHONHASHSEED`` string, verbatim (``"0"`` and ``"00"`` differ),
            or ``None`` when the engine runs without ``PYTHONHASHSEED``.

    Raises:
        HashConfigError: unknown ``algo``; a seed Python itself would refuse; or ``seed`` is
            ``None`` for an ``xxhash*`` algorithm, whose engines then draw a random per-process
            seed that no one else can reproduce.
    """
    fn = get_hash_fn_by_name(algo)
    if seed is None:
        if algo.startswith("xxhash"):
            raise HashConfigError(
                f"{algo} needs the engines' PYTHONHASHSEED: without it vLLM seeds NONE_HASH "
                "with os.urandom per process, so no router (or other engine) can reproduce its "
                "block hashes. Start every engine with PYTHONHASHSEED=<value> and pass the same "
                "value as the seed (or use --prefix-caching-hash-algo sha256)"
            )
        seed = DEFAULT_NONE_HASH_SEED
    else:
        _check_seed(seed)
    return BlockHash(fn(seed))


def hash_block_tokens(
    hash_fn: HashFn,
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None,
    *,
    root: BlockHash,
) -> BlockHash:
    """Hash one block exactly as vLLM's ``hash_block_tokens``.

    The digest is ``hash_fn((parent or root, tuple(token_ids), extra_keys))``; a ``None`` or
    empty ``parent`` means block 0, whose parent is ``root`` (``NONE_HASH``). ``root`` is
    explicit because vLLM's module-global ``NONE_HASH`` differs per algorithm and seed.

    The caller owns validation: token ids must be plain non-negative ``int`` and
    ``extra_keys`` ``None`` or a non-empty tuple (vLLM never passes an empty tuple).
    """
    return BlockHash(hash_fn((parent or root, tuple(token_ids), extra_keys)))


# --------------------------------------------------------------------------- request inputs


@dataclass(frozen=True, slots=True)
class LoraKey:
    """The LoRA adapter of a request, as vLLM hashes it: ``("lora", name, path)``.

    ``path`` is where the engine loaded the adapter from (``--lora-modules`` or
    ``/v1/load_lora_adapter``); ``/v1/models`` shows it as ``root`` on the LoRA card. The int
    adapter id is instance-specific and is deliberately not part of the key.
    """

    name: str
    path: str

    def __post_init__(self) -> None:
        for field, value in (("name", self.name), ("path", self.path)):
            if not isinstance(value, str) or not value:
                raise ValueError(
                    f"LoraKey.{field} must be a non-empty string, got {value!r}: use the "
                    "adapter's name and the path it was loaded from (root on /v1/models)"
                )


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """One multimodal placeholder range: ``length`` tokens from token ``offset``.

    ``identifier`` is vLLM's ``MultiModalFeatureSpec.identifier`` (the item's content hash,
    LoRA-prefixed when applicable).
    """

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str) or not self.identifier:
            raise ValueError(
                f"MultiModalItem.identifier must be a non-empty string, got {self.identifier!r}"
            )
        if type(self.offset) is not int or self.offset < 0:
            raise ValueError(
                f"MultiModalItem.offset must be an int >= 0 (a token index), got {self.offset!r}"
            )
        if type(self.length) is not int or self.length < 1:
            raise ValueError(
                f"MultiModalItem.length must be an int >= 1 (placeholder tokens), "
                f"got {self.length!r}"
            )


def validate_cache_salt(cache_salt: str) -> str:
    """Return ``cache_salt`` if vLLM's API would accept it, else raise ``ValueError``.

    vLLM's ``validate_cache_salt`` requires a non-empty string of at most 128 characters with
    none of ``@``, ``/``, ``\\`` or NUL; the engine answers 400 otherwise, so such a salt can
    never reach an engine's cache and hashing it would only produce an unmatched key.
    """
    if not isinstance(cache_salt, str):
        # NOTE: ValueError, not TypeError: every bad call argument raises one documented type.
        raise ValueError(  # noqa: TRY004
            f"cache_salt must be a string, got {type(cache_salt).__name__}"
        )
    if not cache_salt:
        raise ValueError("cache_salt must not be empty: omit it (None) for no salt")
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(
            f"cache_salt has {len(cache_salt)} characters; vLLM accepts at most "
            f"{MAX_CACHE_SALT_CHARS}: shorten it (e.g. use a digest of the tenant id)"
        )
    for char in _FORBIDDEN_SALT_CHARS:
        if char in cache_salt:
            raise ValueError(
                f"cache_salt contains {char!r}, which vLLM rejects ('@', '/', '\\\\' and NUL "
                "are not allowed): remove or replace it"
            )
    return cache_salt


def _fresh_str(value: str) -> str:
    """Return an equal string that is a distinct object (see the pickle memo caveat).

    CPython shares the empty and one-character Latin-1 strings process-wide; those come back
    as the same singleton here exactly as they would inside vLLM, so memoisation still agrees.
    """
    return value.encode("utf-8", "surrogatepass").decode("utf-8", "surrogatepass")


def _validated_tokens(token_ids: Sequence[int]) -> tuple[int, ...]:
    """Return ``token_ids`` as a tuple of plain ints, or raise ``ValueError``.

    ``array('Q', ...)`` checks every element in C (an integer, 0..2^64-1) in about a tenth of
    the time of a Python loop; ``tolist`` then turns ``bool``/numpy integers into plain ints,
    whose pickle bytes are the ones vLLM hashes.
    """
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)):
        raise ValueError(  # noqa: TRY004 (one documented error type for bad arguments)
            f"token_ids must be a sequence of ints, got {type(token_ids).__name__}: pass the "
            "tokenizer's ids (list[int]), not text or raw bytes"
        )
    try:
        return tuple(array("Q", token_ids).tolist())
    except (TypeError, OverflowError) as exc:
        for index, token in enumerate(token_ids):
            if not isinstance(token, int) or not 0 <= token <= _MAX_TOKEN_ID:
                raise ValueError(
                    f"token id at position {index} is {token!r}: token ids must be "
                    "non-negative integers (vocabulary indices)"
                ) from exc
        raise ValueError(f"token ids are not a sequence of integers: {exc}") from exc


def _token_array(token_ids: Sequence[int]) -> array[int]:
    """``token_ids`` as an array of unsigned ids for ``native_hashing.sha256_chain``: an
    ``array('I')`` as it is (the local tokenizer's output), anything else through
    ``array('Q')`` (the same C check as :func:`_validated_tokens`, whose error it raises)."""
    if isinstance(token_ids, array) and token_ids.typecode in "ILQ":
        return token_ids
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)):
        _validated_tokens(token_ids)  # raises its ValueError
    try:
        return array("Q", token_ids)
    except (TypeError, OverflowError):
        _validated_tokens(token_ids)  # raises the ValueError that names the bad id
        raise


class _MultiModalScan:
    """The cursor of vLLM's ``_gen_mm_extra_hash_keys`` over blocks taken in order.

    Reproduced literally, not as "items overlapping the block": vLLM advances past an item
    only in the block whose window reaches the item's end, and stops scanning at the first item
    that continues past the window, so nested items (and, with lookahead, an item ending inside
    the lookahead window) are keyed differently from a plain overlap rule.

    NOTE: vLLM restarts the cursor at its *last* item when it hashes decode-filled blocks of a
    running request; a decode block starting exactly where the last item ends then gets that
    item's key again. This class always scans from the first block, which is what an engine
    computes for a *new* request with these tokens, i.e. what a router looks up.
    """

    __slots__ = ("_index", "_items")

    def __init__(self, items: Sequence[MultiModalItem]) -> None:
        self._items = items
        self._index = 0

    def keys(self, start: int, end: int) -> list[tuple[object, ...]]:
        items = self._items
        last = items[-1]
        if last.offset + last.length < start:
            return []
        found: list[tuple[object, ...]] = []
        index = self._index
        while index < len(items):
            item = items[index]
            if end <= item.offset:
                break
            if start > item.offset + item.length:
                index += 1
                continue
            found.append((_TAG_MM, _fresh_str(item.identifier), item.offset - start))
            if end >= item.offset + item.length:
                index += 1
            else:
                break
        self._index = index
        return found

    def advance(self, start: int, end: int) -> None:
        """Move the cursor past the window ``[start, end)`` without building keys."""
        self.keys(start, end)


class _KeyPlan:
    """Extra keys of one request, prepared once per call and produced block by block."""

    __slots__ = ("_embeds", "_lora", "_mm", "_salt")

    def __init__(
        self,
        cache_salt: str | None,
        lora: LoraKey | None,
        mm_items: Sequence[MultiModalItem],
        prompt_embeds: Sequence[bytes] | None,
    ) -> None:
        self._salt: tuple[object, ...] | None = None
        if cache_salt is not None:
            self._salt = (_TAG_SALT, _fresh_str(validate_cache_salt(cache_salt)))
        self._lora: tuple[object, ...] | None = None
        if lora is not None:
            if not isinstance(lora, LoraKey):
                raise ValueError(f"lora must be a LoraKey(name, path), got {lora!r}")
            self._lora = (_TAG_LORA, _fresh_str(lora.name), _fresh_str(lora.path))
        self._mm: _MultiModalScan | None = None
        if mm_items:
            mm_items = tuple(mm_items)
            previous = -1
            for item in mm_items:
                if not isinstance(item, MultiModalItem):
                    raise ValueError(  # noqa: TRY004 (one error type for bad arguments)
                        f"mm_items must hold MultiModalItem values, got {item!r}"
                    )
                if item.offset < previous:
                    raise ValueError(
                        f"mm_items must be sorted by offset (vLLM assumes it); offset "
                        f"{item.offset} comes after {previous}: sort them"
                    )
                previous = item.offset
            self._mm = _MultiModalScan(mm_items)
        self._embeds = prompt_embeds

    @property
    def empty(self) -> bool:
        return (
            self._salt is None and self._lora is None and self._mm is None and self._embeds is None
        )

    def skip(self, start: int, end: int) -> None:
        """Account for a block that is not hashed in this call (only the mm cursor moves)."""
        if self._mm is not None:
            self._mm.advance(start, end)

    def keys(self, start: int, end: int) -> ExtraKeys | None:
        """vLLM's ``generate_block_hash_extra_keys`` for the window ``[start, end)``."""
        found: list[tuple[object, ...]] = []
        if self._lora is not None:
            found.append(self._lora)
        if self._mm is not None:
            found.extend(self._mm.keys(start, end))
        if start == 0 and self._salt is not None:
            found.append(self._salt)
        if self._embeds is not None:
            try:
                raw = b"".join(self._embeds[start:end])
            except TypeError as exc:
                raise ValueError(
                    "prompt_embeds must be a sequence of bytes, one embedding row per token "
                    "(the row's raw bytes, e.g. tensor[i].contiguous().view(torch.uint8))"
                ) from exc
            found.append((_TAG_EMBEDS, hashlib.sha256(raw).digest()))
        return tuple(found) if found else None


def extra_keys_for_block(
    block_index: int,
    block_size: int,
    *,
    cache_salt: str | None = None,
    lora: LoraKey | None = None,
    mm_items: Sequence[MultiModalItem] = (),
    prompt_embeds: Sequence[bytes] | None = None,
    lookahead_tokens: int = 0,
) -> ExtraKeys | None:
    """Return vLLM's tagged extra keys of block ``block_index`` of a new request.

    Order ``lora + mm + cache_salt + prompt_embeds``; ``None`` when there are none (never an
    empty tuple). The salt is only in the block starting at token 0. With lookahead ``L`` the
    keys are computed over the window ``[start, end + L)`` (vLLM 0.33.0); the lookahead token
    ids themselves are appended by the hasher, not here.

    Raises:
        ValueError: a negative index, or request inputs vLLM would reject.
        HashConfigError: ``block_size < 1`` or ``lookahead_tokens < 0``.
    """
    _check_block_size(block_size)
    _check_lookahead(lookahead_tokens)
    if type(block_index) is not int or block_index < 0:
        raise ValueError(f"block_index must be an int >= 0, got {block_index!r}")
    plan = _KeyPlan(cache_salt, lora, mm_items, prompt_embeds)
    for index in range(block_index):  # the multimodal cursor depends on earlier blocks
        plan.skip(index * block_size, (index + 1) * block_size + lookahead_tokens)
    start = block_index * block_size
    return plan.keys(start, start + block_size + lookahead_tokens)


def to_event_extra_keys(extra_keys: ExtraKeys | None) -> tuple[object, ...] | None:
    """Untag extra keys as vLLM's ``to_event_extra_keys`` does for ``BlockStored.extra_keys``.

    ``("mm", identifier, offset)`` becomes ``(identifier, offset)``; every other key becomes
    its bare value (LoRA name, salt, embeds digest). The LoRA path is dropped, so an event's
    keys cannot be re-hashed without the path from ``/v1/models``.

    Raises:
        ValueError: a key is not one of the four tagged shapes.
    """
    if extra_keys is None:
        return None
    out: list[object] = []
    for key in extra_keys:
        if not isinstance(key, tuple) or not key:
            raise ValueError(f"extra key {key!r} is not a tagged tuple like ('lora', name, path)")
        tag = key[0]
        if tag == _TAG_MM and len(key) == 3:
            out.append((key[1], key[2]))
        elif (tag == _TAG_LORA and len(key) == 3) or (
            tag in (_TAG_SALT, _TAG_EMBEDS) and len(key) == 2
        ):
            out.append(key[1])
        else:
            raise ValueError(
                f"unknown extra key {key!r}: expected ('lora', name, path), ('mm', id, offset), "
                "('cache_salt', salt) or ('prompt_embeds', digest)"
            )
    return tuple(out)


def coarser_view(
    hashes: Sequence[BlockHash], hash_block_size: int, group_block_size: int
) -> list[BlockHash]:
    """Return the hashes of a KV group whose blocks span several hash units (hybrid models).

    A group block of ``k * hash_block_size`` tokens has no hash of its own: vLLM uses the
    chained hash at its last unit, so the view is ``hashes[k-1::k]`` (a trailing partial group
    block has none).

    Raises:
        HashConfigError: a size below 1, or ``group_block_size`` not a multiple of
            ``hash_block_size``.
    """
    _check_block_size(hash_block_size)
    _check_block_size(group_block_size)
    if group_block_size % hash_block_size:
        raise HashConfigError(
            f"group block size {group_block_size} is not a multiple of the hash block size "
            f"{hash_block_size}: vLLM's hash unit is the gcd of the group block sizes; pass "
            "that as hash_block_size"
        )
    ratio = group_block_size // hash_block_size
    return list(hashes[ratio - 1 :: ratio])


def _check_block_size(block_size: int) -> None:
    if type(block_size) is not int or block_size < 1:
        raise HashConfigError(
            f"block size must be an int >= 1, got {block_size!r}: use the engine's effective "
            "block size (block_size label of vllm:cache_config_info, or BlockStored.block_size)"
        )


def _check_lookahead(lookahead_tokens: int) -> None:
    if type(lookahead_tokens) is not int or lookahead_tokens < 0:
        raise HashConfigError(
            f"lookahead_tokens must be an int >= 0, got {lookahead_tokens!r}: 0 unless the "
            "engine is vLLM >= 0.33 with EAGLE/MTP block drop (then 1 for EAGLE, "
            "num_speculative_tokens for multi-module MTP)"
        )


# --------------------------------------------------------------------------------- hasher


class BlockHasher:
    """Hashes token sequences into vLLM block hashes for one engine configuration.

    Invariants: ``root`` is ``NONE_HASH`` for (``algo``, ``seed``); every returned digest is
    ``digest_size(algo)`` bytes; the hashes of a sequence do not depend on how it was split
    into calls (``hash_blocks(t)[k:] == hash_blocks(t, start_block=k, parent=h[k-1])``).

    One instance is immutable and may be shared; it keeps no per-request state, so a request's
    hashes are recomputed per call (vLLM caches them on its ``Request``; the router hashes each
    prompt once per routing decision).
    """

    __slots__ = (
        "_digest_size",
        "_hash_fn",
        "algo",
        "block_size",
        "lookahead_tokens",
        "root",
        "seed",
    )

    algo: str
    block_size: int
    root: BlockHash
    seed: str | None
    lookahead_tokens: int

    def __init__(
        self,
        algo: str = "sha256",
        block_size: int = 16,
        seed: str | None = None,
        lookahead_tokens: int = 0,
    ) -> None:
        """Configure hashing like one engine.

        Args:
            algo: the engine's ``--prefix-caching-hash-algo`` (one of :data:`HASH_ALGOS`).
            block_size: the engine's effective hash block size (not vLLM's default 16: the CPU
                backend uses 128, and attention backends may raise it).
            seed: the engine's ``PYTHONHASHSEED`` string, or ``None`` if unset.
            lookahead_tokens: vLLM 0.33 ``num_hash_lookahead_tokens`` (0 when off).

        Raises:
            HashConfigError: any argument the engine could not have (see :func:`none_hash`).
        """
        _check_block_size(block_size)
        _check_lookahead(lookahead_tokens)
        self._hash_fn = get_hash_fn_by_name(algo)
        self._digest_size = _DIGEST_SIZES[algo]
        self.algo = algo
        self.block_size = block_size
        self.seed = seed
        self.lookahead_tokens = lookahead_tokens
        self.root = none_hash(algo, seed)

    def __repr__(self) -> str:
        return (
            f"BlockHasher(algo={self.algo!r}, block_size={self.block_size}, seed={self.seed!r}, "
            f"lookahead_tokens={self.lookahead_tokens})"
        )

    def num_hashable_blocks(self, num_tokens: int) -> int:
        """Number of blocks of a ``num_tokens`` sequence that have a hash."""
        return max(0, (num_tokens - self.lookahead_tokens) // self.block_size)

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: LoraKey | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        prompt_embeds: Sequence[bytes] | None = None,
        start_block: int = 0,
        parent: BlockHash | None = None,
    ) -> list[BlockHash]:
        """Return the hashes of the full blocks of ``token_ids`` from ``start_block`` on.

        Args:
            token_ids: the whole sequence (prompt plus any generated tokens); only tokens from
                block ``start_block`` on are read (and validated).
            cache_salt: the request's ``cache_salt`` (hashed into block 0 only).
            lora: the request's adapter, or ``None``.
            mm_items: multimodal placeholder ranges, sorted by offset.
            prompt_embeds: with prompt embeds, the raw bytes of each position's embedding row
                (those positions carry token id 0); a block's key is the SHA-256 of its rows.
            start_block: first block to hash (incremental hashing while tokens are appended).
            parent: the digest of block ``start_block - 1``; required iff ``start_block > 0``.

        Returns:
            One digest per full block ``start_block..n-1``. A trailing partial block never has
            a hash; with lookahead ``L`` a block needs its ``L`` following tokens too.

        Raises:
            ValueError: invalid token ids or request inputs, or a missing/unexpected parent.
        """
        return self._hash(token_ids, cache_salt, lora, mm_items, prompt_embeds, start_block,
                          parent)[0]

    def hash_blocks_and_wires(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: LoraKey | None = None,
        start_block: int = 0,
        parent: BlockHash | None = None,
    ) -> tuple[list[BlockHash], list[WireHash]]:
        """:meth:`hash_blocks` and :meth:`wire_hashes` of the same blocks in one pass (what a
        session's chain and the memo keep)."""
        digests, wires = self._hash(token_ids, cache_salt, lora, (), None, start_block, parent)
        return digests, [to_wire_hash(d) for d in digests] if wires is None else wires

    def _hash(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None,
        lora: LoraKey | None,
        mm_items: Sequence[MultiModalItem],
        prompt_embeds: Sequence[bytes] | None,
        start_block: int,
        parent: BlockHash | None,
    ) -> tuple[list[BlockHash], list[WireHash] | None]:
        """The digests of ``hash_blocks``, and their wire hashes when the C chain computed them
        on the way (None: the caller converts)."""
        if type(start_block) is not int or start_block < 0:
            raise ValueError(f"start_block must be an int >= 0, got {start_block!r}")
        if start_block > 0:
            if parent is None:
                raise ValueError(
                    f"start_block={start_block} needs parent=<digest of block "
                    f"{start_block - 1}>; pass it, or hash from start_block=0"
                )
            if not isinstance(parent, bytes) or len(parent) != self._digest_size:
                raise ValueError(
                    f"parent must be a {self._digest_size}-byte {self.algo} digest returned by "
                    f"this hasher, got {parent!r}"
                )
        elif parent is not None:
            raise ValueError(
                "parent was given with start_block=0: block 0's parent is NONE_HASH; pass "
                "start_block=<index of the block after parent> or drop parent"
            )
        bs = self.block_size
        lookahead = self.lookahead_tokens
        num_blocks = self.num_hashable_blocks(len(token_ids))
        plan = _KeyPlan(cache_salt, lora, mm_items, prompt_embeds)
        if start_block >= num_blocks:
            return [], []
        base = start_block * bs
        if plan.empty and lookahead == 0 and self.algo == "sha256":
            # The default: C when built (core/native_hashing.py), ~8x the Python loop.
            return sha256_chain(parent or self.root,
                                _token_array(token_ids[base : num_blocks * bs]), bs)
        # Only the tokens actually hashed (including lookahead tokens) are read and validated.
        tokens = _validated_tokens(token_ids[base : num_blocks * bs + lookahead])
        prev = parent or self.root
        out: list[BlockHash] = []
        if plan.empty and lookahead == 0:
            fn = self._hash_fn
            for s in range(0, (num_blocks - start_block) * bs, bs):
                prev = BlockHash(fn((prev, tokens[s : s + bs], None)))
                out.append(prev)
            return out, None
        fn = self._hash_fn
        for index in range(start_block):  # advance the multimodal cursor only
            plan.skip(index * bs, (index + 1) * bs + lookahead)
        for index in range(start_block, num_blocks):
            start = index * bs
            end = start + bs
            extra: tuple[object, ...] | None = plan.keys(start, end + lookahead)
            s = start - base
            if lookahead:
                extra = (extra, *tokens[s + bs : s + bs + lookahead])
            prev = BlockHash(fn((prev, tokens[s : s + bs], extra)))
            out.append(prev)
        return out, None

    def wire_hashes(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: LoraKey | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        prompt_embeds: Sequence[bytes] | None = None,
        start_block: int = 0,
        parent: BlockHash | None = None,
    ) -> list[WireHash]:
        """:meth:`hash_blocks`, in the 64-bit form vLLM's KV events carry (last 8 bytes, BE)."""
        digests, wires = self._hash(token_ids, cache_salt, lora, mm_items, prompt_embeds,
                                    start_block, parent)
        return [to_wire_hash(d) for d in digests] if wires is None else wires

"""Text-prefix structures that peer routers use instead of engine block hashes.

Two peers match prompts on text rather than on the engine's cache:

* SGLang's router (and vllm-router, its fork) keeps a character-level radix tree per model;
  every node records which workers were sent text through it and when
  (``CharRadixTree``).
* vLLM production-stack's ``prefixaware`` logic hashes consecutive 128-character chunks and
  keeps a trie of chunk chains with the endpoints that were sent each chain, never evicted
  (``ChunkHashTrie``).

They are reimplemented here from the peers' documented behaviour (see
``docs/reference/peer-routers.md``) so that every comparison runs in one harness. Both are pure and
deterministic.
"""

from __future__ import annotations

import xxhash

from kvroute.core.types import ReplicaId


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``.

    Binary search over slice equality: each comparison runs in C, so this costs
    O(n log n) character compares without a Python-level loop per character.
    """
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Node:
    __slots__ = ("children", "edge", "parent", "tenants")

    def __init__(self, edge: str, parent: _Node | None) -> None:
        self.edge = edge
        self.children: dict[str, _Node] = {}
        # tenant -> last access time; the last inserted tenant is the dict's last key.
        self.tenants: dict[ReplicaId, float] = {}
        self.parent = parent


class CharRadixTree:
    """SGLang's approximate cache model: a character radix tree tagged with workers.

    Invariants: the root has an empty edge; every other node's edge is non-empty and no two
    children of a node start with the same character; a tenant recorded on a node is also
    recorded on all its ancestors (insertion walks the whole path).
    """

    def __init__(self) -> None:
        self._root = _Node("", None)
        self._chars_by_tenant: dict[ReplicaId, int] = {}

    def chars_of(self, tenant: ReplicaId) -> int:
        """Characters attributed to ``tenant`` (the quantity SGLang's eviction bounds)."""
        return self._chars_by_tenant.get(tenant, 0)

    def match(self, text: str) -> tuple[int, ReplicaId | None]:
        """Return ``(matched_chars, tenant)`` for the longest stored prefix of ``text``.

        The tenant is the one most recently recorded at the deepest node reached (SGLang
        returns the node's last tenant), or ``None`` when nothing matched.
        """
        node = self._root
        pos = 0
        tenant: ReplicaId | None = None
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            n = common_prefix_len(child.edge, text[pos : pos + len(child.edge)])
            if n == 0:
                break
            pos += n
            if child.tenants:
                tenant = next(reversed(child.tenants))
            if n < len(child.edge):
                break
            node = child
        return pos, tenant

    def insert(self, text: str, tenant: ReplicaId, now_s: float) -> None:
        """Record that ``text`` was sent to ``tenant`` at ``now_s``."""
        node = self._root
        pos = 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                leaf = _Node(text[pos:], node)
                node.children[text[pos]] = leaf
                self._tag(leaf, tenant, now_s, len(leaf.edge))
                return
            n = common_prefix_len(child.edge, text[pos : pos + len(child.edge)])
            if n < len(child.edge):
                child = self._split(child, n)
            self._tag(child, tenant, now_s, len(child.edge))
            pos += n
            node = child

    def remove_tenant(self, tenant: ReplicaId) -> None:
        """Forget ``tenant`` everywhere and prune nodes no tenant holds."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            node.tenants.pop(tenant, None)
            stack.extend(node.children.values())
        self._chars_by_tenant.pop(tenant, None)
        self._prune(self._root)

    def evict(self, max_chars_per_tenant: int) -> None:
        """Trim every tenant to ``max_chars_per_tenant`` by dropping its least recent leaves."""
        for tenant, total in list(self._chars_by_tenant.items()):
            if total <= max_chars_per_tenant:
                continue
            leaves = [node for node in self._nodes() if tenant in node.tenants and not any(
                tenant in c.tenants for c in node.children.values())]
            leaves.sort(key=lambda node: node.tenants[tenant])
            for leaf in leaves:
                if self._chars_by_tenant.get(tenant, 0) <= max_chars_per_tenant:
                    break
                del leaf.tenants[tenant]
                self._chars_by_tenant[tenant] -= len(leaf.edge)
            self._prune(self._root)

    def _nodes(self) -> list[_Node]:
        out: list[_Node] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _tag(self, node: _Node, tenant: ReplicaId, now_s: float, chars: int) -> None:
        if tenant not in node.tenants:
            self._chars_by_tenant[tenant] = self._chars_by_tenant.get(tenant, 0) + chars
        else:
            del node.tenants[tenant]  # re-insert so it becomes the most recent tenant
        node.tenants[tenant] = now_s

    def _split(self, child: _Node, at: int) -> _Node:
        parent = child.parent
        assert parent is not None, "the root is never split"
        head = _Node(child.edge[:at], parent)
        head.tenants = dict(child.tenants)
        parent.children[head.edge[0]] = head
        child.edge = child.edge[at:]
        child.parent = head
        head.children[child.edge[0]] = child
        return head

    def _prune(self, node: _Node) -> None:
        for key, child in list(node.children.items()):
            self._prune(child)
            if not child.tenants and not child.children:
                del node.children[key]


class ChunkHashTrie:
    """vLLM production-stack's ``prefixaware`` index: chains of hashed 128-char chunks.

    Chunk ``i``'s key is the xxhash64 of the previous key and the chunk's text, so a key
    identifies the whole chain up to it. Each key maps to the endpoints that were sent that
    chain. Nothing is ever evicted (production-stack assumes no eviction).
    """

    def __init__(self, chunk_chars: int = 128) -> None:
        if chunk_chars < 1:
            raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
        self.chunk_chars = chunk_chars
        self._endpoints: dict[int, set[ReplicaId]] = {}

    def _keys(self, text: str) -> list[int]:
        keys: list[int] = []
        prev = 0
        for start in range(0, len(text), self.chunk_chars):
            chunk = text[start : start + self.chunk_chars]
            prev = xxhash.xxh64_intdigest(chunk.encode("utf-8"), seed=prev)
            keys.append(prev)
        return keys

    def longest_match(self, text: str, live: set[ReplicaId]) -> tuple[int, set[ReplicaId]]:
        """Return ``(matched_chunks, endpoints)`` holding the longest chain among ``live``."""
        best: set[ReplicaId] = set()
        depth = 0
        for i, key in enumerate(self._keys(text)):
            holders = self._endpoints.get(key)
            if not holders:
                break
            alive = holders & live
            if not alive:
                break
            best, depth = alive, i + 1
        return depth, best

    def insert(self, text: str, endpoint: ReplicaId) -> None:
        for key in self._keys(text):
            self._endpoints.setdefault(key, set()).add(endpoint)

    def remove_endpoint(self, endpoint: ReplicaId) -> None:
        for key in list(self._endpoints):
            holders = self._endpoints[key]
            holders.discard(endpoint)
            if not holders:
                del self._endpoints[key]

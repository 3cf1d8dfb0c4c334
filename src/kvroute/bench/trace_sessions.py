"""Sessions recovered from the hash ids of an agentic trace whose rows do not name them.

The bundled agentic trace (``claude_code_agentic_64``, converted from kv-cache-tester's Claude
Code sessions to Mooncake's four keys) keeps no session column, but its ids carry the
sessions in two documented-by-construction ways:

* **the shared prefix is positional**: the Claude Code system + tool prompt keeps the global
  ids ``0..k``, so id ``p`` sits at position ``p``. A row's leading run of ``hash_ids[p] == p``
  is that shared prefix, whatever its length in this session;
* **every other id is local to one session** and numbered ``session × stride + counter``
  (``stride`` = 10,000,000). Sub-agents, flattened into their session, start chains of their
  own under the same tag.

So a row's session is the tag (``id // stride``) of the ids after its positional prefix. The
rule is checked, not trusted: every such id of one row must carry the same tag, and no tag
may be below 1 (tag 0 would be a global id out of place); otherwise :class:`SessionRecoveryError`
says which row broke it. On the bundled file the rule finds 60 tags, the 60 sessions the
conversion reports, and each of the 133 chains of shared local ids (main threads and
sub-agents) lies inside one tag.

Rows whose ids are all in the shared prefix (30 of 1,924: parallel sub-agent starts whose
prompt is the system prompt plus a short tail) carry no session evidence and stay unmarked
(``None``); guessing them from arrival times would invent affinity the ids do not show.

Why recover at all: a coding agent sends its session with every turn, so a router sees it;
the Mooncake traces are different (no local ids, every request shares block 0), and their
sessions are not inferred (``bench.workloads.mooncake``). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from kvroute.core.errors import RouterError

__all__ = ["LOCAL_ID_STRIDE", "SessionRecoveryError", "sessions_from_local_ids"]

LOCAL_ID_STRIDE: Final = 10_000_000
"""Session-local ids are ``session × stride + counter`` in the converted agentic trace."""


class SessionRecoveryError(RouterError):
    """The ids do not follow the positional-prefix / session-tag layout; names the row."""


def _shared_prefix_length(hash_ids: Sequence[int]) -> int:
    k = 0
    while k < len(hash_ids) and hash_ids[k] == k:
        k += 1
    return k


def sessions_from_local_ids(
    rows: Sequence[tuple[int, Sequence[int]]],
    *,
    stride: int = LOCAL_ID_STRIDE,
    prefix: str = "s",
) -> list[str | None]:
    """Each row's session id (``f"{prefix}{tag}"``), or ``None`` for a row with no local id.

    Args:
        rows: ``(line, hash_ids)`` per row; ``line`` only names a row in an error.
        stride: the tag spacing of local ids.
        prefix: prepended to the tag to make the session id.

    Raises:
        SessionRecoveryError: a row mixes tags, or has a local id below ``stride``.
    """
    if stride < 1:
        raise SessionRecoveryError(f"stride must be >= 1, got {stride}")
    sessions: list[str | None] = []
    for line, hash_ids in rows:
        local = hash_ids[_shared_prefix_length(hash_ids) :]
        if not local:
            sessions.append(None)
            continue
        tags = {h // stride for h in local}
        if len(tags) != 1 or 0 in tags:
            raise SessionRecoveryError(
                f"line {line}: the ids after the shared prefix carry session tags "
                f"{sorted(tags)[:5]} (id // {stride}); a row must carry exactly one tag >= 1. "
                "This trace does not number its ids per session: load it without session "
                "recovery"
            )
        sessions.append(f"{prefix}{tags.pop()}")
    return sessions

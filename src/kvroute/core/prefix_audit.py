"""What breaks prefix reuse in a sample of requests (``kvroute audit``'s analysis).

A prefix cache only helps when a request starts with exactly the blocks an earlier one
started with. Three habits of clients break that from the first block on, and no routing can
repair them: a volatile value (a timestamp, a date, a request id, a random nonce) early in the
prompt; tools or earlier messages sent in another order (or edited) from one turn to the
next; a system prompt made per request. This module replays a sample in arrival order and,
for every request, measures:

* **reused**: the leading blocks some earlier request of the sample already had (what a
  perfect fleet-wide cache could have served);
* **reusable**: the same after the request is *canonicalised* (volatile values replaced by a
  placeholder, tools sorted by name by the caller): the leading blocks it would share had the
  client kept those parts stable;
* the **divergence block**: the first block that is not reused (the histogram ``/metrics``
  shows live per route as ``kvroute_prefix_divergence_block``);
* the findings: which volatile values sit inside the blocks that would otherwise have been
  reused, sessions whose tools were reordered or whose history was rewritten, and system
  prompts that differ per request.

Blocks are ``block_chars`` characters of the rendered prompt (about ``block_size`` tokens at
four characters a token): the audit reads bodies, not token ids, so its token counts are
estimates and are reported as such. Chained chunk hashes make "the leading blocks an earlier
request had" one set lookup per block.

Pure: no I/O; the caller parses and renders the bodies (``commands/audit.py``).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

import xxhash

__all__ = [
    "VOLATILE_PATTERNS",
    "AuditReport",
    "AuditRequest",
    "Finding",
    "audit",
    "canonical_text",
    "chunk_hashes",
]

VOLATILE_PATTERNS: Final[tuple[tuple[str, re.Pattern[str]], ...]] = (
    ("uuid", re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                        r"[0-9a-fA-F]{12}\b")),
    ("timestamp", re.compile(r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?"
                             r"(?:Z|[+-]\d{2}:?\d{2})?")),
    ("unix_time", re.compile(r"\b1[5-9]\d{8}(?:\d{3})?(?:\.\d+)?\b")),
    ("date", re.compile(r"\b\d{4}-\d{2}-\d{2}\b|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|"
                        r"Nov|Dec)[a-z]*\.? \d{1,2},? \d{4}\b|\b\d{1,2}/\d{1,2}/\d{2,4}\b")),
    ("time", re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?(?:\s?[AaPp][Mm])?\b")),
    ("request_id", re.compile(r"\b(?:req|request|trace|span|msg|call|run|chatcmpl|toolu|sess|"
                              r"session)[-_][A-Za-z0-9_-]{6,}\b")),
    ("nonce", re.compile(r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{16,}\b")),
)
"""Values that change from request to request, most specific first (the first that matches a
span wins)."""

_PLACEHOLDER: Final = "\x00"


@dataclass(frozen=True, slots=True)
class AuditRequest:
    """One sampled request, rendered by the caller.

    Attributes:
        route: the model it named (the route).
        text: the prompt as the engine would see it (tools, then messages in order).
        tools_sorted_text: the same with the tools sorted by name (equal to ``text`` when
            there are none).
        system: the system prompt's text, if any.
        tool_names: the tools' names in the order sent.
        messages: each message rendered (``role: content``), in order.
        session: what ties the turns of one conversation (an explicit id, else the first
            user message).
    """

    route: str
    text: str
    tools_sorted_text: str
    system: str | None = None
    tool_names: tuple[str, ...] = ()
    messages: tuple[str, ...] = ()
    session: str | None = None


@dataclass(frozen=True, slots=True)
class Finding:
    """One reuse breaker.

    Attributes:
        kind: ``volatile:<pattern>``, ``tools_reordered``, ``history_rewritten``,
            ``per_request_system_prompt``.
        requests: how many requests it hit.
        first_block: the earliest block it broke (the lowest seen).
        lost_tokens: estimated prompt tokens it cost (reusable but not reused), summed over
            those requests (a request's loss counts once, for its earliest breaker).
        example: a short excerpt around one occurrence.
    """

    kind: str
    requests: int
    first_block: int
    lost_tokens: int
    example: str


@dataclass(slots=True)
class AuditReport:
    """The audit of a sample (``audit``'s answer); token counts are estimates."""

    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    reusable_tokens: int = 0
    block_chars: int = 64
    divergence_blocks: Counter[int] = field(default_factory=Counter)
    findings: list[Finding] = field(default_factory=list)

    @property
    def lost_share(self) -> float:
        """Share of prompt tokens that could have been hits but were not."""
        if not self.prompt_tokens:
            return 0.0
        return (self.reusable_tokens - self.reused_tokens) / self.prompt_tokens

    @property
    def reused_share(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def chunk_hashes(text: str, block_chars: int) -> list[int]:
    """Chained 64-bit hashes of the full ``block_chars``-character blocks of ``text``."""
    data = text.encode("utf-8")
    out: list[int] = []
    prev = 0
    for start in range(0, len(data) - block_chars + 1, block_chars):
        prev = xxhash.xxh64_intdigest(data[start : start + block_chars], seed=prev)
        out.append(prev)
    return out


def canonical_text(text: str) -> tuple[str, list[tuple[str, int, str]]]:
    """``text`` with every volatile value replaced by one placeholder character, and the
    values found: ``(pattern, offset in the original text, value)``, by offset."""
    spans: list[tuple[int, int, str]] = []
    taken = [False] * (len(text) + 1)
    for name, pattern in VOLATILE_PATTERNS:
        for match in pattern.finditer(text):
            start, end = match.span()
            if any(taken[start:end]):
                continue
            for i in range(start, end):
                taken[i] = True
            spans.append((start, end, name))
    spans.sort()
    out: list[str] = []
    pos = 0
    found: list[tuple[str, int, str]] = []
    for start, end, name in spans:
        out.append(text[pos:start])
        out.append(_PLACEHOLDER)
        found.append((name, start, text[start:end]))
        pos = end
    out.append(text[pos:])
    return "".join(out), found


def _leading(hashes: Sequence[int], seen: set[int]) -> int:
    n = 0
    for h in hashes:
        if h not in seen:
            break
        n += 1
    return n


def _excerpt(text: str, offset: int, width: int = 30) -> str:
    start = max(0, offset - width)
    return text[start : offset + width].replace("\n", " ")


def audit(requests: Iterable[AuditRequest], *, block_size: int = 16,
          chars_per_token: int = 4) -> AuditReport:
    """Audit ``requests`` in arrival order (module docstring).

    Raises:
        ValueError: ``block_size`` or ``chars_per_token`` below 1.
    """
    if block_size < 1 or chars_per_token < 1:
        raise ValueError(f"block_size ({block_size}) and chars_per_token ({chars_per_token}) "
                         "must be >= 1")
    block_chars = block_size * chars_per_token
    report = AuditReport(block_chars=block_chars)
    seen: set[int] = set()
    seen_canonical: set[int] = set()
    hit: Counter[str] = Counter()
    first: dict[str, int] = {}
    lost: Counter[str] = Counter()
    examples: dict[str, str] = {}
    systems: Counter[str] = Counter()
    systems_canonical: dict[str, set[str]] = defaultdict(set)
    last_turn: dict[tuple[str, str], AuditRequest] = {}

    def note(kind: str, block: int, loss: int, example: str) -> None:
        hit[kind] += 1
        first[kind] = min(first.get(kind, block), block)
        lost[kind] += loss
        examples.setdefault(kind, example)

    for req in requests:
        report.requests += 1
        tokens = len(req.text) // chars_per_token
        report.prompt_tokens += tokens
        hashes = chunk_hashes(req.text, block_chars)
        canonical, values = canonical_text(req.tools_sorted_text)
        canon_hashes = chunk_hashes(canonical, block_chars)
        reused = _leading(hashes, seen)
        reusable = max(reused, _leading(canon_hashes, seen_canonical))
        seen.update(hashes)
        seen_canonical.update(canon_hashes)
        report.reused_tokens += reused * block_size
        report.reusable_tokens += reusable * block_size
        if reused < len(hashes):
            report.divergence_blocks[reused] += 1
        loss = (reusable - reused) * block_size
        blamed = False
        if req.session is not None:
            key = (req.route, req.session)
            before = last_turn.get(key)
            if before is not None:
                if (before.tool_names != req.tool_names
                        and sorted(before.tool_names) == sorted(req.tool_names)):
                    note("tools_reordered", reused, 0 if blamed else loss,
                         f"{list(before.tool_names)} -> {list(req.tool_names)}")
                    blamed = True
                # Volatile values are their own finding: compare the history without them.
                old = tuple(canonical_text(m)[0] for m in before.messages)
                new = tuple(canonical_text(m)[0] for m in req.messages[: len(old)])
                if len(req.messages) >= len(old) and new != old:
                    changed = next(i for i, (a, b) in enumerate(zip(old, new, strict=True))
                                   if a != b)
                    note("history_rewritten", reused, 0 if blamed else loss,
                         f"message {changed} changed: {before.messages[changed][:50]!r}")
                    blamed = True
            last_turn[key] = req
        if reusable > reused and not blamed:
            # The earliest volatile value inside the blocks that canonicalisation saved.
            # (Offsets are in the tools-sorted text, the same length as the original up to
            # the tools, and block positions are what the report needs.)
            for name, offset, _ in values:
                block = offset // block_chars
                if reused <= block < reusable:
                    note(f"volatile:{name}", block, loss,
                         _excerpt(req.tools_sorted_text, offset))
                    blamed = True
                    break
        if req.system is not None:
            systems[req.system] += 1
            systems_canonical[canonical_text(req.system)[0]].add(req.system)
    many = [variants for variants in systems_canonical.values() if len(variants) > 1]
    once = sum(1 for count in systems.values() if count == 1)
    if len(systems) > 1 and (many or once > 1):
        if many:
            variants = max(many, key=len)
            detail = (f"{len(variants)} variants of one system prompt differ only in volatile "
                      f"values; e.g. {min(variants)[:70]!r}")
            count = sum(systems[s] for v in many for s in v)
        else:
            detail = (f"{len(systems)} distinct system prompts in {sum(systems.values())} "
                      f"requests, {once} seen once; e.g. {next(iter(systems))[:70]!r}")
            count = once
        report.findings.append(Finding("per_request_system_prompt", count, 0, 0, detail))
    for kind in sorted(hit, key=lambda k: (-lost[k], k)):
        report.findings.append(Finding(kind, hit[kind], first[kind], lost[kind],
                                       examples[kind]))
    return report

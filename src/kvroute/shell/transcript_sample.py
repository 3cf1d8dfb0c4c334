"""The router's opt-in sample of finished conversations, written for ``kvroute gate replay``.

Owns the files of ``core/transcript_sample.py``'s decisions: one ``<tenant>.jsonl`` per
opted-in tenant under ``gate.sample.directory`` (a tenant's conversations never share a
file with another's), in the transcript format ``parse_transcripts`` reads. At start it
reads each existing file's ids and size, so a restarted router keeps the bounds and never
writes an id twice. A background task (started with the first sampled answer) appends the
conversations that went idle, once a second; ``close`` writes the ones still open.

A write that fails is logged and turns the sample off, so a full disk never fails a request
(as ``shell/audit_sample.py`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvroute.config import TranscriptSampleConfig
from kvroute.core.transcript_sample import (
    SampleCounts,
    TranscriptSampler,
    conversation_of,
)

__all__ = ["TranscriptWriter", "tenant_file"]

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 1.0


def tenant_file(directory: Path, tenant: str) -> Path:
    """Where ``tenant``'s sampled transcripts go."""
    return directory / f"{tenant}.jsonl"


def _existing_ids(path: Path) -> list[str]:
    """The ids a transcript file already holds (bad lines are someone else's problem here:
    ``kvroute gate replay`` names them; the sample only must not repeat an id)."""
    ids: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            item = json.loads(stripped)
        except json.JSONDecodeError:
            continue
        if isinstance(item, dict) and isinstance(item.get("id"), str):
            ids.append(item["id"])
    return ids


class TranscriptWriter:
    """Offers successful chat answers to the sampler and appends what it returns."""

    def __init__(self, config: TranscriptSampleConfig,
                 clock: Callable[[], float] = time.monotonic,
                 on_counts: Callable[[dict[str, int]], None] | None = None) -> None:
        """``on_counts``: told the counts (and ``open``) after every flush: ``/metrics``."""
        self.directory = Path(config.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.sampler = TranscriptSampler(config)  # the config is the sample's settings
        for tenant in sorted(config.tenants):
            path = tenant_file(self.directory, tenant)
            if path.exists():
                self.sampler.existing(tenant, _existing_ids(path), path.stat().st_size)
        self._clock = clock
        self._on_counts = on_counts
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    @property
    def counts(self) -> SampleCounts:
        return self.sampler.counts

    def offer(self, tenant: str, route: str, messages: Sequence[Mapping[str, Any]] | None,
              session: str | None, max_tokens: int | None) -> None:
        """One successful chat answer (``messages``: the request's history)."""
        if self._stopped or messages is None or tenant not in self.sampler.settings.tenants:
            return
        conversation = conversation_of(messages, session, max_tokens)
        if conversation is None:
            return
        if self.sampler.offer(tenant, route, conversation, self._clock()) and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._flush_loop())

    async def _flush_loop(self) -> None:
        while not self._stopped:
            await asyncio.sleep(FLUSH_EVERY_S)
            self.flush()

    def flush(self, *, everything: bool = False) -> int:
        """Append the finished conversations (all of them with ``everything``); returns how
        many lines were written."""
        if self._stopped:
            return 0
        lines = self.sampler.due(self._clock(), everything=everything)
        try:
            return self._append(lines)
        finally:
            if self._on_counts is not None:
                self._on_counts({**dataclasses.asdict(self.sampler.counts),
                                 "open": self.sampler.open})

    def _append(self, lines: list[tuple[str, str]]) -> int:
        by_tenant: dict[str, list[str]] = {}
        for tenant, line in lines:
            by_tenant.setdefault(tenant, []).append(line)
        for tenant, chunk in by_tenant.items():
            path = tenant_file(self.directory, tenant)
            try:
                with path.open("a", encoding="utf-8") as out:
                    out.write("".join(line + "\n" for line in chunk))
            except OSError as exc:
                log.error("transcript sample %s: write failed (%s); sampling stopped", path, exc)
                self._stopped = True
                return 0
        return len(lines)

    async def close(self) -> None:
        """Write every conversation still open, stop the background task."""
        self.flush(everything=True)
        self._stopped = True
        log.info("transcript sample %s: %s", self.directory, self.sampler.counts)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

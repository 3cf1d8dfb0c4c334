"""``async with`` for the shell's long-lived services (the router runtime, the Endpoint Picker
runtime, the standalone KV-event relay): ``start`` on entry, ``stop`` on exit, and ``stop``
also when ``start`` fails half-way, so nothing it had opened (sockets, tasks, subscriptions)
outlives the failure."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Self


class Service(ABC):
    """A service with ``start`` and ``stop``; ``stop`` must be safe after a partial start."""

    @abstractmethod
    async def start(self) -> None:
        """Open what the service needs (sockets, tasks, subscriptions)."""

    @abstractmethod
    async def stop(self) -> None:
        """Close what ``start`` opened, whatever part of it ran."""

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

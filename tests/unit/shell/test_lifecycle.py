"""``shell/lifecycle.Service``: ``async with`` starts and stops, stops after a failed start,
and a service without ``start`` or ``stop`` cannot be built."""

from __future__ import annotations

import asyncio

import pytest

from kvroute.shell.lifecycle import Service


class _Recorder(Service):
    def __init__(self, fail_start: bool = False) -> None:
        self.calls: list[str] = []
        self.fail_start = fail_start

    async def start(self) -> None:
        self.calls.append("start")
        if self.fail_start:
            raise OSError("port taken")

    async def stop(self) -> None:
        self.calls.append("stop")


def test_a_service_is_stopped_on_exit_and_after_a_failed_start() -> None:
    async def main() -> tuple[list[str], list[str]]:
        ok = _Recorder()
        async with ok:
            assert ok.calls == ["start"]
        failing = _Recorder(fail_start=True)
        with pytest.raises(OSError, match="port taken"):
            async with failing:
                pass
        return ok.calls, failing.calls

    assert asyncio.run(main()) == (["start", "stop"], ["start", "stop"])


def test_a_service_without_stop_cannot_be_built() -> None:
    class NoStop(Service):
        async def start(self) -> None:
            pass

    with pytest.raises(TypeError, match="stop"):
        NoStop()  # type: ignore[abstract]

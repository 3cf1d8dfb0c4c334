"""Discovery's probe reads: one bounded GET, and the one error every failed probe raises.

Engines' ``/health``, ``/v1/models`` and ``/metrics`` and external providers' authenticated
``/v1/models`` (``shell/discovery.py``) are read the same way: the body of a 200 answer within
``discovery.timeout_s``, anything else a ``ProbeError``. Its ``outcome`` word is the probe's
``kvroute_discovery_total`` label; its message (outcome and detail) is what the log and
``/admin/state`` show as the replica's last error. A failed probe is a result, not a fault: the
callers count it and move on, so nothing else escapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp

from kvroute.wire.model_list import ModelListError, model_cards

__all__ = ["ProbeError", "probe_get", "probed_model_cards"]


class ProbeError(Exception):
    """One probe failed; the message is the outcome word and the detail."""

    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(f"{outcome}: {detail}")
        self.outcome = outcome
        self.detail = detail


async def probe_get(
    session: aiohttp.ClientSession,
    url: str,
    *,
    what: str,
    timeout: aiohttp.ClientTimeout,
    headers: Mapping[str, str] | None = None,
    auth_hint: bool = False,
) -> bytes:
    """The body of ``GET url`` when it answers 200.

    Args:
        what: the outcome words' prefix (``health``, ``models``, ``metrics``, ``catalog``).
        headers: extra request headers (a provider's ``Authorization``).
        auth_hint: say "check the provider's API key" when the answer is 401 or 403.

    Raises:
        ProbeError: ``{what}_error`` for another status or a failed request,
            ``{what}_timeout`` when the answer takes longer than ``timeout``.
    """
    try:
        async with session.get(url, headers=headers, timeout=timeout) as resp:
            body = await resp.read()
            if resp.status != 200:
                hint = (" (check the provider's API key)"
                        if auth_hint and resp.status in (401, 403) else "")
                raise ProbeError(f"{what}_error", f"GET {url} answered HTTP {resp.status}{hint}")
            return body
    except TimeoutError as exc:
        raise ProbeError(
            f"{what}_timeout", f"GET {url} took longer than {timeout.total}s"
        ) from exc
    except aiohttp.ClientError as exc:
        raise ProbeError(
            f"{what}_error", f"GET {url} failed: {type(exc).__name__}: {exc}"
        ) from exc


def probed_model_cards(body: bytes) -> dict[str, Mapping[str, Any]]:
    """A probed ``/v1/models`` body -> {model id: card} (``wire.model_list.model_cards``).

    Raises:
        ProbeError: ``models_malformed`` when the body is not an OpenAI model list.
    """
    try:
        return model_cards(body)
    except ModelListError as exc:
        raise ProbeError("models_malformed", str(exc)) from exc

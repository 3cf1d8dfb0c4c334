"""vLLM's two-step disaggregated prefill/decode protocol, as bodies and answers.

The router runs a split request (``core/disagg.py``) as vLLM's P/D proxies do (its
``disagg_proxy`` examples, llm-d's sidecar, Dynamo's disaggregated router):

1. the **prefill** request goes to the prefill replica with ``max_tokens: 1``, unstreamed,
   and ``kv_transfer_params: {"do_remote_decode": true, ...}``: compute the prompt and keep
   its blocks for a decode replica to pull;
2. its answer carries, at the top level, the ``kv_transfer_params`` that locate the blocks
   (``do_remote_prefill: true``, ``remote_engine_id``, ``remote_block_ids``, ``remote_host``,
   ``remote_port``, ...);
3. the **decode** request is the client's own body with those ``kv_transfer_params`` added,
   sent to the decode replica, which pulls the blocks it lacks and streams the answer.

The parameters are the KV connector's (NixlConnector's names above) and opaque to the
router: it passes on what the prefill replica returned.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

REMOTE_DECODE: Final[Mapping[str, Any]] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What the prefill request asks for: keep the KV for a remote decode."""

_OUTPUT_LIMITS: Final = ("max_tokens", "max_completion_tokens")
_DROPPED: Final = ("stream_options", "min_tokens", "n")


class TransferParamsError(ValueError):
    """A prefill answer without usable ``kv_transfer_params``."""


def prefill_body(body: Mapping[str, Any], *, model: str, cache_salt: str | None) -> bytes:
    """The prefill request for a client's ``body``: the same prompt, one output token,
    unstreamed, asking the engine to keep the KV for a remote decode."""
    out = {key: value for key, value in body.items() if key not in _DROPPED}
    for key in _OUTPUT_LIMITS:
        if key in out:
            out[key] = 1
    out["max_tokens"] = 1
    out["stream"] = False
    out["model"] = model
    if cache_salt is not None:
        out["cache_salt"] = cache_salt
    out["kv_transfer_params"] = dict(REMOTE_DECODE)
    return json.dumps(out, separators=(",", ":")).encode()


def transfer_params(answer: bytes) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill's answer, for the decode request.

    Raises:
        TransferParamsError: the answer is not JSON, or has no ``kv_transfer_params`` object
            asking for a remote prefill (an engine started without ``--kv-transfer-config``
            answers without them).
    """
    try:
        decoded = json.loads(answer)
    except ValueError as exc:
        raise TransferParamsError(f"the prefill answer is not JSON: {exc}") from exc
    params = decoded.get("kv_transfer_params") if isinstance(decoded, dict) else None
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        raise TransferParamsError(
            "the prefill answer has no kv_transfer_params with do_remote_prefill: true; is "
            "the prefill engine started with --kv-transfer-config (a KV connector)?")
    return params

"""The bytes routers exchange on the cluster bus: batches of ``core/peers`` announcements.

One message is one batch from one router, MessagePack-encoded (``msgspec``), each item a
tagged array so a placement with 100 block hashes costs about 1 KB::

    {"from": "router-a", "seq": 17, "bye": false,
     "items": [["p", id, replica, prefill, prompt, expected_out, predicted_out|nil,
                session|nil, tenant|nil, [hash, ...], approximate],
               ["f", id, replica, work_tokens|nil, ttft_s|nil],
               ["d", id, replica, output_tokens|nil, itl_sample|nil]]}

An empty ``items`` is a heartbeat; ``bye`` says the router is stopping (its peers drop its
load at once instead of at expiry). ``seq`` counts batches per sender, so a receiver can
count gaps. A first token's ``work_tokens`` and ``ttft_s`` are the origin's prefill rate
sample (``core/load.RateSample``), and an end's ``itl_sample`` its inter-token sample, nil
or absent when it learned none: a version that sends
``["f", id, replica]`` is read as sending none, and one that reads only those three ignores
the rest (msgspec skips trailing array items), so routers of both versions can share a bus
during an upgrade. Decoding rejects anything else with ``PeerMessageError`` naming what was wrong:
a bus is shared infrastructure and a foreign publisher on the subject must not crash a router.
"""

from __future__ import annotations

from typing import Final

import msgspec

from kvroute.core.load import RateSample
from kvroute.core.peers import Announcement, Done, FirstToken, Placed
from kvroute.core.types import ReplicaId, TenantName, WireHash

__all__ = ["PeerBatch", "PeerMessageError", "decode_batch", "encode_batch"]


class PeerMessageError(ValueError):
    """A message on the cluster subject is not a batch this version of kvroute wrote."""


class _Placed(msgspec.Struct, array_like=True, tag="p"):
    request_id: str
    replica: str
    prefill_tokens: int
    prompt_tokens: int
    expected_output_tokens: int
    predicted_output_tokens: int | None
    session: str | None
    tenant: str | None
    hashes: list[int]
    approximate: bool


class _FirstToken(msgspec.Struct, array_like=True, tag="f"):
    request_id: str
    replica: str
    work_tokens: int | None = None
    ttft_s: float | None = None


class _Done(msgspec.Struct, array_like=True, tag="d"):
    request_id: str
    replica: str
    output_tokens: int | None
    itl_sample: float | None = None


class PeerBatch(msgspec.Struct, rename={"sender": "from"}):
    """One router's batch: who sent it, its sequence number, its announcements."""

    sender: str
    seq: int
    items: list[_Placed | _FirstToken | _Done] = []
    bye: bool = False

    def announcements(self) -> list[Announcement]:
        out: list[Announcement] = []
        for item in self.items:
            if type(item) is _Placed:
                out.append(Placed(
                    item.request_id, ReplicaId(item.replica), item.prefill_tokens,
                    item.prompt_tokens, item.expected_output_tokens,
                    item.predicted_output_tokens, item.session,
                    None if item.tenant is None else TenantName(item.tenant),
                    tuple(WireHash(h) for h in item.hashes), item.approximate))
            elif type(item) is _FirstToken:
                sample = (None if item.work_tokens is None or item.ttft_s is None
                          else RateSample(item.work_tokens, item.ttft_s))
                out.append(FirstToken(item.request_id, ReplicaId(item.replica), sample))
            else:
                assert type(item) is _Done
                out.append(Done(item.request_id, ReplicaId(item.replica), item.output_tokens,
                                item.itl_sample))
        return out


_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(PeerBatch)


def _wire(item: Announcement) -> _Placed | _FirstToken | _Done:
    if type(item) is Placed:
        return _Placed(item.request_id, item.replica, item.prefill_tokens, item.prompt_tokens,
                       item.expected_output_tokens, item.predicted_output_tokens, item.session,
                       item.tenant, list(item.hashes), item.approximate)
    if type(item) is FirstToken:
        sample = item.rate_sample
        if sample is None:
            return _FirstToken(item.request_id, item.replica)
        return _FirstToken(item.request_id, item.replica, sample.work_tokens, sample.ttft_s)
    assert type(item) is Done
    return _Done(item.request_id, item.replica, item.output_tokens, item.itl_sample)


def encode_batch(sender: str, seq: int, items: list[Announcement], *, bye: bool = False) -> bytes:
    """One message carrying ``items`` (none: a heartbeat) from ``sender``."""
    return _ENCODER.encode(PeerBatch(sender, seq, [_wire(item) for item in items], bye))


def decode_batch(data: bytes) -> PeerBatch:
    """The batch in ``data``.

    Raises:
        PeerMessageError: ``data`` is not a batch ``encode_batch`` wrote (the reason in the
            message).
    """
    try:
        batch = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise PeerMessageError(f"not a kvroute peer batch: {exc}") from exc
    if not batch.sender or batch.seq < 0:
        raise PeerMessageError(f"peer batch with sender {batch.sender!r} and seq {batch.seq}")
    return batch

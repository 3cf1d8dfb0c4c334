"""``core/peer_names``: announcements name no request or tenant in clear on the bus, and a
receiver with the same secret and tenants gets the tenant back."""

from __future__ import annotations

from kvroute.core.load import RateSample
from kvroute.core.peer_names import conceal, reveal
from kvroute.core.peers import Done, FirstToken, Placed
from kvroute.core.pseudonyms import Pseudonyms
from kvroute.core.types import ReplicaId, TenantName, WireHash

SECRET = "a-cluster-secret-of-enough-bytes"
R0 = ReplicaId("r0")


def _placed(tenant: str | None) -> Placed:
    return Placed("req-1", R0, 100, 120, 30, None, "sess-alias",
                  None if tenant is None else TenantName(tenant), (WireHash(1), WireHash(2)))


def test_conceal_hides_the_request_and_tenant_and_reveal_brings_the_tenant_back() -> None:
    sender = Pseudonyms(SECRET, ["acme", "globex"])
    receiver = Pseudonyms(SECRET, ["globex", "acme"])
    sample = RateSample(320, 0.1)
    sent = [conceal(sender, _placed("acme")), conceal(sender, FirstToken("req-1", R0, sample)),
            conceal(sender, Done("req-1", R0, 7, 1.5))]
    assert all(item.request_id != "req-1" and item.request_id == sent[0].request_id
               for item in sent)
    assert isinstance(sent[0], Placed) and sent[0].tenant not in (None, "acme")
    assert sent[0].session == "sess-alias"  # already a pseudonym (RouterCore.session_names)
    got, unknown = reveal(receiver, sent)
    assert unknown == 0
    assert got[0] == Placed(sent[0].request_id, R0, 100, 120, 30, None, "sess-alias",
                            TenantName("acme"), (WireHash(1), WireHash(2)))
    assert got[1:] == sent[1:]
    assert got[1] == FirstToken(sent[0].request_id, R0, sample)  # the sample, as timed
    assert got[2] == Done(sent[0].request_id, R0, 7, 1.5)
    assert reveal(receiver, [conceal(sender, _placed(None))])[0][0].hashes == (WireHash(1),
                                                                                 WireHash(2))


def test_a_tenant_unknown_to_the_receiver_keeps_its_load_but_loses_its_blocks() -> None:
    sent = conceal(Pseudonyms(SECRET, ["acme"]), _placed("acme"))
    got, unknown = reveal(Pseudonyms(SECRET, ["globex"]), [sent])
    assert unknown == 1
    assert isinstance(got[0], Placed) and got[0].tenant is None and got[0].hashes == ()
    assert got[0].prefill_tokens == 100
    other_secret = Pseudonyms("another-secret-of-enough-bytes", ["acme"])
    assert reveal(other_secret, [sent])[1] == 1

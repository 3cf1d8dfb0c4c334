"""Announcements as they go on the cluster bus and come off it: names as pseudonyms.

A router's ``core/peers`` announcements name its request ids and tenants in clear; on the bus
(``shell/cluster.py``) each is a keyed pseudonym under the cluster secret
(``core/pseudonyms.py``). ``conceal`` is what a sender does before publishing; ``reveal`` is
what a receiver does before ``PeerView.apply``: it maps a tenant's pseudonym back to one of
the configured tenants, and strips the block hashes of a placement whose tenant it cannot
map (predicted entries need a tenant's scope; the load still counts). Session keys need
neither: the core already keys its sessions by their pseudonyms
(``RouterCore.session_names``).

Pure, so the live router and the simulator of several routers (``sim/routers.py``) transform
announcements the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from kvroute.core.peers import Announcement, Done, FirstToken, Placed
from kvroute.core.pseudonyms import Pseudonyms
from kvroute.core.types import TenantName

__all__ = ["conceal", "reveal"]


def conceal(names: Pseudonyms, item: Announcement) -> Announcement:
    """``item`` as it goes on the bus: its request id and tenant as pseudonyms."""
    rid = names.request(item.request_id)
    if type(item) is Placed:
        tenant = None if item.tenant is None else TenantName(names.tenant(item.tenant))
        return replace(item, request_id=rid, tenant=tenant)
    if type(item) is FirstToken:
        return replace(item, request_id=rid)  # its rate sample holds no id
    assert type(item) is Done
    return replace(item, request_id=rid)  # its inter-token sample holds no id


def reveal(names: Pseudonyms, items: Iterable[Announcement]) -> tuple[list[Announcement], int]:
    """A peer's announcements with tenant pseudonyms mapped back to tenant names, and how
    many placements named a tenant not configured here (kept without their hashes)."""
    out: list[Announcement] = []
    unknown = 0
    for item in items:
        if type(item) is Placed and item.tenant is not None:
            tenant = names.tenant_of(item.tenant)
            if tenant is None:
                unknown += 1
                item = replace(item, tenant=None, hashes=())
            else:
                item = replace(item, tenant=tenant)
        out.append(item)
    return out, unknown

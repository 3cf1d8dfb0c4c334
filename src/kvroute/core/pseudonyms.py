"""Keyed pseudonyms: tenant, session and request ids as several routers share them.

Routers that share state put it where other programs can read it: announcements on a NATS
subject (``shell/cluster.py``), session records and warm cooldowns in Redis
(``shell/state.py``). Tenants never see each other's cache, nor learn who else uses the fleet,
so what goes there names no tenant and no session in clear. Each name is replaced by a
keyed BLAKE2b of it (``hashlib.blake2b(key=...)``, 16 bytes in hex) under the fleet's
cluster secret (``cluster.secret`` / ``cluster.secret_env``):

* routers that share the secret derive the same pseudonym from the same name, so they still
  match each other's records (a session's key in one router's load tracker equals its key in
  the announcement another router receives);
* a reader without the secret learns neither the name nor whether two fleets share one, and
  cannot test guesses (the key, not the name's entropy, is what protects a short tenant name).

Each kind of name has its own BLAKE2b personalisation, so a session's pseudonym on the bus is
not its Redis key, and a tenant named like a session id gets a different pseudonym.
Tenants are few and known from the config: ``tenant_of`` maps a tenant's pseudonym back to
its name (a receiver needs the name to scope the index entries it writes); sessions and
requests are only ever compared, never mapped back.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Final

from kvroute.core.types import TenantName

__all__ = ["MIN_SECRET_BYTES", "Pseudonyms"]

MIN_SECRET_BYTES: Final = 16
"""A shorter cluster secret is refused: it could be guessed, and every pseudonym with it."""

_DIGEST_BYTES: Final = 16
_TENANT: Final = b"kvroute-tenant"
_SESSION: Final = b"kvroute-session"
_REQUEST: Final = b"kvroute-request"
_STATE: Final = b"kvroute-state"
_KEY_FOLD: Final = b"kvroute-keyfold"


class Pseudonyms:
    """The fleet's pseudonyms under one secret (module docstring).

    Args:
        secret: the cluster secret (at least ``MIN_SECRET_BYTES`` bytes as UTF-8); a longer
            one than BLAKE2b's 64-byte key is folded to 64 bytes by an unkeyed BLAKE2b.
        tenants: the tenants ``tenant_of`` can name (the config's).

    Raises:
        ValueError: the secret is shorter than ``MIN_SECRET_BYTES`` (the message never holds
            it).
    """

    __slots__ = ("_key", "_of_tenant", "_tenant_of")

    def __init__(self, secret: str | bytes, tenants: Iterable[str] = ()) -> None:
        key = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(f"the cluster secret has {len(key)} bytes; it needs at least "
                             f"{MIN_SECRET_BYTES} (a long random value)")
        if len(key) > hashlib.blake2b.MAX_KEY_SIZE:
            key = hashlib.blake2b(key, person=_KEY_FOLD).digest()
        self._key = key
        self._of_tenant: dict[str, str] = {}
        self._tenant_of: dict[str, TenantName] = {}
        for name in tenants:
            alias = self._hash(name, _TENANT)
            self._of_tenant[name] = alias
            self._tenant_of[alias] = TenantName(name)

    def __repr__(self) -> str:
        return f"Pseudonyms({len(self._tenant_of)} tenants)"  # never the key

    def _hash(self, text: str, person: bytes) -> str:
        return hashlib.blake2b(text.encode("utf-8"), digest_size=_DIGEST_BYTES, key=self._key,
                               person=person).hexdigest()

    def tenant(self, name: str) -> str:
        """A tenant's pseudonym."""
        alias = self._of_tenant.get(name)
        return alias if alias is not None else self._hash(name, _TENANT)

    def tenant_of(self, alias: str) -> TenantName | None:
        """The configured tenant whose pseudonym is ``alias`` (None: none of them)."""
        return self._tenant_of.get(alias)

    def session(self, key: str) -> str:
        """A session key's pseudonym (the load tracker's ``tenant\\x1fsession id``)."""
        return self._hash(key, _SESSION)

    def request(self, request_id: str) -> str:
        """A request id's pseudonym (a client may choose its id, ``X-Request-Id``)."""
        return self._hash(request_id, _REQUEST)

    def state_key(self, key: str) -> str:
        """A shared-state key's pseudonym (``core.session.session_key``: tenant, route and
        session id)."""
        return self._hash(key, _STATE)

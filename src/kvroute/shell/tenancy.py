"""Who is asking: API keys to tenants, the admin key, and each tenant's cache salt.

Tenants never share, see or steer each other's cache: a request's tenant scopes every index
lookup (``core/index.TenantScope``), and a salted tenant's ``cache_salt`` is the router's,
so its blocks hash apart from everyone else's on the engines themselves. Every tenant is
salted unless its config opts out (``cache_salt: false``, logged at start). The routing
headers, which say where a prefix is cached, go only to tenants allowed to see them. Keys are
compared in constant time, and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Mapping

from kvroute.config import DEFAULT_TENANT, RouterConfig, Secrets
from kvroute.core.index import AdminCapability
from kvroute.core.types import TenantName
from kvroute.http.server import Request
from kvroute.wire.openai import RequestError

__all__ = ["bearer", "cache_salt", "check_admin", "log_tenant_isolation", "routing_header_tenants",
           "tenant_of"]

log = logging.getLogger("kvroute.tenancy")


def log_tenant_isolation(config: RouterConfig) -> None:
    """Warn about every tenant whose config opts out of its cache salt (it shares prefix
    cache hits, and their timing, with the other unsalted tenants)."""
    shared = [tenant.name for tenant in config.tenants if not tenant.cache_salt]
    if shared:
        log.warning("tenants %s opt out of cache salting (cache_salt: false): their prompts "
                    "share prefix-cache blocks with each other, so one can time another's "
                    "prompts; remove cache_salt: false to isolate them", ", ".join(shared))


def routing_header_tenants(config: RouterConfig) -> frozenset[TenantName] | None:
    """The tenants shown the routing headers (``x-kvroute-*``); None: every client (no
    tenants are configured)."""
    if not config.tenants:
        return None
    return frozenset(t.name for t in config.tenants if t.routing_headers)


def bearer(request: Request) -> str | None:
    """The key of ``Authorization: Bearer <key>``, or None."""
    value = request.headers.get("authorization", "")
    scheme, _, key = value.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


def _lookup_key(keys: Mapping[str, TenantName], key: str) -> TenantName | None:
    """Constant-time over the key values (a timing side channel must not leak key prefixes)."""
    found: TenantName | None = None
    probe = key.encode()
    for known, tenant in keys.items():
        if hmac.compare_digest(known.encode(), probe):
            found = tenant
    return found


def tenant_of(request: Request, secrets: Secrets) -> TenantName:
    """The request's tenant (no tenants configured: one default tenant).

    Raises:
        RequestError: 401, the key is missing or unknown (the message says which).
    """
    if not secrets.api_keys:
        return DEFAULT_TENANT
    key = bearer(request)
    if key is None:
        raise RequestError(
            "Missing API key: send 'Authorization: Bearer <your key>'.", status=401,
            code="invalid_api_key",
        )
    tenant = _lookup_key(secrets.api_keys, key)
    if tenant is None:
        raise RequestError(
            "Invalid API key: the key in 'Authorization: Bearer ...' is not known to this "
            "router. Check the key your administrator gave you.", status=401,
            code="invalid_api_key",
        )
    return tenant


def cache_salt(secrets: Secrets, tenant: TenantName, client_salt: str | None) -> str | None:
    """The salt the engine must hash into block 0.

    A salted tenant's salt is the router's (derived from its name and the server secret);
    a client salt sent by such a tenant is folded into it, so the client can partition its
    own cache further but can never reach another tenant's blocks. Unsalted tenants' own
    salts pass through unchanged.
    """
    tenant_salt = secrets.cache_salts.get(tenant)
    if tenant_salt is None:
        return client_salt
    if client_salt is None:
        return tenant_salt
    return hmac.new(tenant_salt.encode(), client_salt.encode(), hashlib.sha256).hexdigest()[:32]


def check_admin(request: Request, secrets: Secrets,
                admin: AdminCapability | None) -> AdminCapability:
    """The admin capability for a request that carries the admin key.

    Raises:
        RequestError: 404 when admin endpoints are disabled, 401 without a key, 403 with
            another key.
    """
    if admin is None or secrets.admin_key is None:
        raise RequestError(
            "Admin endpoints are disabled: set admin_key_env in the router's config and "
            "export that variable.", status=404, type="NotFoundError",
        )
    key = bearer(request)
    if key is None:
        raise RequestError("Missing admin key: send 'Authorization: Bearer <admin key>'.",
                           status=401, code="invalid_api_key")
    if not hmac.compare_digest(key.encode(), secrets.admin_key.encode()):
        raise RequestError("This key is not the admin key; admin endpoints need it.",
                           status=403, code="forbidden")
    return admin

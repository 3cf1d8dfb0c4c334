"""``shell/tenancy.py``: keys compared in constant time, salts by default, opt-outs logged,
routing headers only for tenants allowed them."""

from __future__ import annotations

import hmac
import logging
from typing import Any

import pytest

from kvroute.config import parse_config, resolve_secrets
from kvroute.core.index import AdminCapability
from kvroute.core.types import TenantName
from kvroute.http.server import Request
from kvroute.shell import tenancy
from kvroute.wire.openai import RequestError

BASE: dict[str, Any] = {
    "pools": {"p": {"model": "m", "replicas": [{"name": "r0", "url": "http://127.0.0.1:9"}]}},
    "routes": {"a": {"pools": ["p"]}},
    "admin_key_env": "ADMIN_KEY",
}
ENV = {"ACME_KEY": "key-acme", "BETA_KEY": "key-beta", "ADMIN_KEY": "key-admin",
       "KVROUTE_SALT_SECRET": "salt-secret"}


def request_with(authorization: str | None) -> Request:
    headers = {} if authorization is None else {"authorization": authorization}
    return Request(None, "GET", "/admin/state", "", headers, "1.1", True)


def tenants(*items: dict[str, Any]) -> dict[str, Any]:
    return {**BASE, "tenants": list(items)}


def test_the_admin_key_is_compared_with_compare_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = resolve_secrets(parse_config(BASE, env={}), ENV)
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(tenancy.hmac, "compare_digest", recording)
    admin = AdminCapability()
    assert tenancy.check_admin(request_with("Bearer key-admin"), secrets, admin) is admin
    assert compared == [(b"key-admin", b"key-admin")]
    with pytest.raises(RequestError) as info:
        tenancy.check_admin(request_with("Bearer key-admin-not"), secrets, admin)
    assert info.value.status == 403 and len(compared) == 2


@pytest.mark.parametrize("authorization", [
    None, "", "Bearer", "Bearer ", "Basic key-admin", "key-admin", "Bearer key-admi",
    "Bearer key-admin2", "Bearer KEY-ADMIN", "Bearer key-acme", "Bearer key-admin\x00",
])
def test_admin_needs_exactly_the_admin_key(authorization: str | None) -> None:
    config = parse_config(tenants({"name": "acme", "api_key_env": "ACME_KEY"}), env={})
    secrets = resolve_secrets(config, ENV)
    with pytest.raises(RequestError) as info:
        tenancy.check_admin(request_with(authorization), secrets, AdminCapability())
    assert info.value.status in (401, 403)


def test_admin_is_disabled_without_an_admin_key_whatever_is_sent() -> None:
    config = parse_config({k: v for k, v in BASE.items() if k != "admin_key_env"}, env={})
    secrets = resolve_secrets(config, ENV)
    with pytest.raises(RequestError) as info:
        tenancy.check_admin(request_with("Bearer key-admin"), secrets, None)
    assert info.value.status == 404


def test_every_tenant_is_salted_unless_it_opts_out_and_the_opt_out_is_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    config = parse_config(tenants({"name": "acme", "api_key_env": "ACME_KEY"},
                                  {"name": "beta", "api_key_env": "BETA_KEY",
                                   "cache_salt": False}), env={})
    secrets = resolve_secrets(config, ENV)
    assert set(secrets.cache_salts) == {"acme"}
    assert tenancy.cache_salt(secrets, TenantName("acme"), None) == secrets.cache_salts["acme"]
    assert tenancy.cache_salt(secrets, TenantName("beta"), None) is None
    with caplog.at_level(logging.WARNING, logger="kvroute.tenancy"):
        tenancy.log_tenant_isolation(config)
    assert [r.getMessage() for r in caplog.records if "beta" in r.getMessage()
            and "cache_salt: false" in r.getMessage()]
    caplog.clear()
    salted = parse_config(tenants({"name": "acme", "api_key_env": "ACME_KEY"}), env={})
    with caplog.at_level(logging.WARNING, logger="kvroute.tenancy"):
        tenancy.log_tenant_isolation(salted)
    assert not caplog.records


def test_routing_headers_go_to_tenants_allowed_them_or_to_all_without_tenants() -> None:
    config = parse_config(tenants({"name": "acme", "api_key_env": "ACME_KEY",
                                   "routing_headers": True},
                                  {"name": "beta", "api_key_env": "BETA_KEY"}), env={})
    assert tenancy.routing_header_tenants(config) == frozenset({"acme"})
    assert tenancy.routing_header_tenants(parse_config(BASE, env={})) is None

"""Who sent a request: tenant and request id, from headers, API key or body.

Sources are tried in the configured order, first match wins:

* ``header`` -- a header naming the tenant (default ``X-Tenant-ID``);
* ``api_key`` -- ``Authorization: Bearer ...`` or ``x-api-key``, mapped through the
  config's table; an unmapped key becomes ``key:`` + 12 hex of a keyed hash, so the key
  itself never reaches a log;
* ``user`` -- the request body's ``user`` field (OpenAI).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

SOURCES = ("header", "api_key", "user")


class HeaderView(Protocol):
    def get(self, key: str, default: str | None = None, /) -> str | None: ...


@dataclass(frozen=True, slots=True)
class TenantRules:
    sources: tuple[str, ...] = SOURCES
    header: str = "X-Tenant-ID"
    api_keys: Mapping[str, str] = field(default_factory=dict)
    secret: bytes = b""  # keys the hash of unmapped API keys

    def __post_init__(self) -> None:
        unknown = set(self.sources) - set(SOURCES)
        if unknown:
            raise ValueError(f"unknown tenant source(s) {sorted(unknown)}; use {list(SOURCES)}")


def api_key_of(headers: HeaderView) -> str | None:
    auth = headers.get("authorization") or ""
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    key = headers.get("x-api-key")
    return key.strip() if key and key.strip() else None


def key_tenant(key: str, secret: bytes) -> str:
    """Stable pseudonymous tenant for an unmapped API key."""
    return "key:" + hmac.new(secret, key.encode(), hashlib.sha256).hexdigest()[:12]


def resolve_tenant(rules: TenantRules, headers: HeaderView, body_user: str | None) -> str | None:
    """The tenant of a request, or None when no source names one."""
    for source in rules.sources:
        if source == "header":
            value = (headers.get(rules.header) or "").strip()
            if value:
                return value
        elif source == "api_key":
            key = api_key_of(headers)
            if key:
                return rules.api_keys.get(key) or key_tenant(key, rules.secret)
        elif source == "user" and isinstance(body_user, str) and body_user.strip():
            return body_user.strip()
    return None


def request_id_of(headers: HeaderView) -> str:
    """The incoming ``X-Request-ID`` (trimmed to 128 characters), else a new one."""
    incoming = (headers.get("x-request-id") or "").strip()
    return incoming[:128] if incoming else "ct-" + secrets.token_hex(12)

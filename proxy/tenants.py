"""Who sent a request: tenant and request id, from headers, API key or body.

Sources are tried in the configured order, first match wins:

* ``header`` -- a header naming the tenant (default ``X-Tenant-ID``);
* ``api_key`` -- ``Authorization: Bearer ...`` or ``x-api-key``, mapped through the
  config's table (plain keys, or ``sha256:`` + the hex SHA-256 of a key, so the config
  holds no secret); an unmapped key becomes ``key:`` + 12 hex of a keyed hash, so the
  key itself never reaches a log;
* ``user`` -- the request body's ``user`` field (OpenAI).

A header or a ``user`` field is what a client *says* it is: anyone can send a victim's
name, and then a real leak to them is their "own" text, never a finding. So those two
are *claims*, taken only from a trusted peer (``trusted_peers``: loopback by default, a
gateway on the same host, the way uvicorn trusts ``X-Forwarded-*``) or from a request
that carries the operator's gateway secret (compared in constant time). From anyone
else a claim is ignored, reported in :class:`Identity`, and the credential decides.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

SOURCES = ("header", "api_key", "user")
CLAIMS = frozenset({"header", "user"})  # what a client says of itself
DEFAULT_TRUSTED_PEERS = ("127.0.0.0/8", "::1/128")
HASHED_KEY_PREFIX = "sha256:"


class HeaderView(Protocol):
    def get(self, key: str, default: str | None = None, /) -> str | None: ...


@dataclass(frozen=True, slots=True)
class TenantRules:
    sources: tuple[str, ...] = SOURCES
    header: str = "X-Tenant-ID"
    api_keys: Mapping[str, str] = field(default_factory=dict)
    secret: bytes = b""  # keys the hash of unmapped API keys
    trusted_peers: tuple[str, ...] = DEFAULT_TRUSTED_PEERS  # CIDRs whose claims count
    gateway_header: str = "X-Crosstalk-Gateway"
    gateway_secret: str = ""  # a request carrying it may claim a tenant, from anywhere
    _networks: tuple = field(init=False, repr=False, compare=False, default=())
    _hashed: Mapping[str, str] = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        unknown = set(self.sources) - set(SOURCES)
        if unknown:
            raise ValueError(f"unknown tenant source(s) {sorted(unknown)}; use {list(SOURCES)}")
        networks = tuple(ipaddress.ip_network(c, strict=False) for c in self.trusted_peers)
        object.__setattr__(self, "_networks", networks)
        hashed = {
            k[len(HASHED_KEY_PREFIX) :].lower(): t
            for k, t in self.api_keys.items()
            if k.startswith(HASHED_KEY_PREFIX)
        }
        object.__setattr__(self, "_hashed", hashed)

    def trusts(self, peer: str | None, headers: HeaderView) -> bool:
        """Whether claims (a tenant header, a ``user`` field) of this request count: it
        comes from a trusted peer address, or carries the gateway secret."""
        if self.gateway_secret:
            given = (headers.get(self.gateway_header) or "").encode()
            if hmac.compare_digest(given, self.gateway_secret.encode()):
                return True
        if not peer or not self._networks:
            return False
        try:
            address = ipaddress.ip_address(peer.partition("%")[0])
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
            address = address.ipv4_mapped
        return any(address in net for net in self._networks)

    def tenant_of_key(self, key: str) -> str:
        mapped = self.api_keys.get(key)
        if mapped is None and self._hashed:
            mapped = self._hashed.get(hash_key(key)[len(HASHED_KEY_PREFIX) :])
        return mapped or key_tenant(key, self.secret)


@dataclass(frozen=True, slots=True)
class Identity:
    """A request's tenant (None: no source named one) and the claims that were ignored
    because the request could not make them (``(source, claimed tenant)``)."""

    tenant: str | None
    ignored: tuple[tuple[str, str], ...] = ()


def hash_key(key: str) -> str:
    """How an API key is written in ``[tenants.api_keys]`` without the key itself. An API
    key carries 128 or more random bits: its SHA-256 cannot be reversed, and a hash keyed
    with the detection key would break every mapping when that key is rotated."""
    return HASHED_KEY_PREFIX + hashlib.sha256(key.encode()).hexdigest()


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


def identify(
    rules: TenantRules, headers: HeaderView, body_user: str | None, *, trusted: bool
) -> Identity:
    """The tenant of a request by the first source that names one. Claims count only when
    ``trusted`` (``TenantRules.trusts``); otherwise they are skipped and reported."""
    ignored: list[tuple[str, str]] = []
    for source in rules.sources:
        if source == "api_key":
            key = api_key_of(headers)
            if key:
                return Identity(rules.tenant_of_key(key), tuple(ignored))
            continue
        if source == "header":
            value = (headers.get(rules.header) or "").strip()
        else:
            value = body_user.strip() if isinstance(body_user, str) else ""
        if value:
            if trusted:
                return Identity(value, tuple(ignored))
            ignored.append((source, value))
    return Identity(None, tuple(ignored))


def resolve_tenant(rules: TenantRules, headers: HeaderView, body_user: str | None) -> str | None:
    """The tenant of a request whose claims are trusted (replay of the operator's own
    captures): ``identify(..., trusted=True).tenant``."""
    return identify(rules, headers, body_user, trusted=True).tenant


def request_id_of(headers: HeaderView) -> str:
    """The incoming ``X-Request-ID`` (trimmed to 128 characters), else a new one."""
    incoming = (headers.get("x-request-id") or "").strip()
    return incoming[:128] if incoming else "ct-" + secrets.token_hex(12)

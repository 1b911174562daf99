"""Who sent a request: tenant and request id, from headers, API key or body.

Sources are tried in the configured order, first match wins:

* ``header`` -- a header naming the tenant (default ``X-Tenant-ID``);
* ``api_key`` -- ``Authorization: Bearer ...`` or ``x-api-key``, mapped through the
  config's table (plain keys, or ``sha256:`` + the hex SHA-256 of a key, so the config
  holds no secret); an unmapped key becomes ``key:`` + 12 hex of a keyed hash, so the
  key itself never reaches a log;
* ``user`` -- the request body's ``user`` field (OpenAI);
* ``jwt`` -- a claim (``jwt_claim``) of a JSON Web Token in ``Authorization: Bearer``,
  verified with the operator's key (PyJWT): signature, ``exp`` (required), and the
  audience and issuer when configured -- the way API gateways pass identity on. A token
  that fails is ignored and reported like an untrusted claim; the next source decides.

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
from typing import Any, Protocol, overload

DEFAULT_SOURCES = ("header", "api_key", "user")
SOURCES = (*DEFAULT_SOURCES, "jwt")
CLAIMS = frozenset({"header", "user"})  # what a client says of itself
# Algorithm families: one key verifies one family, so an RSA public key can never be
# taken for an HMAC secret (the classic algorithm-confusion forgery). "none" is absent.
JWT_HMAC = frozenset({"HS256", "HS384", "HS512"})
JWT_PUBLIC_KEY = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
# RFC 7518 3.2: an HMAC key at least as long as the hash.
JWT_HMAC_MIN_BYTES = {"HS256": 32, "HS384": 48, "HS512": 64}
JWT_LEEWAY_SECONDS = 30  # clock skew tolerated between the token's issuer and this host
MAX_CLAIM_LOGGED = 128
DEFAULT_TRUSTED_PEERS = ("127.0.0.0/8", "::1/128")
HASHED_KEY_PREFIX = "sha256:"


class HeaderView(Protocol):
    # Two overloads, not one signature with a default: mitmproxy's ``Headers`` get is
    # Mapping's overloaded one, which a single signature would not match.
    @overload
    def get(self, key: str, /) -> str | None: ...
    @overload
    def get(self, key: str, default: str | None, /) -> str | None: ...


@dataclass(frozen=True, slots=True)
class TenantRules:
    sources: tuple[str, ...] = DEFAULT_SOURCES
    header: str = "X-Tenant-ID"
    api_keys: Mapping[str, str] = field(default_factory=dict)
    secret: bytes = b""  # keys the hash of unmapped API keys
    trusted_peers: tuple[str, ...] = DEFAULT_TRUSTED_PEERS  # CIDRs whose claims count
    gateway_header: str = "X-Crosstalk-Gateway"
    gateway_secret: str = ""  # a request carrying it may claim a tenant, from anywhere
    jwt_key: Any = None  # load_jwt_key(): an HMAC secret (bytes) or a public key object
    jwt_algorithms: tuple[str, ...] = ("RS256",)
    jwt_claim: str = "sub"
    jwt_audience: str = ""  # empty: the token's audience is not checked
    jwt_issuer: str = ""  # empty: the token's issuer is not checked
    _networks: tuple = field(init=False, repr=False, compare=False, default=())
    _hashed: Mapping[str, str] | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        unknown = set(self.sources) - set(SOURCES)
        if unknown:
            raise ValueError(f"unknown tenant source(s) {sorted(unknown)}; use {list(SOURCES)}")
        if "jwt" in self.sources and self.jwt_key is None:
            raise ValueError("tenant source 'jwt' needs a verification key (jwt_key)")
        check_jwt_algorithms(self.jwt_algorithms)
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

    def tenant_of_token(
        self, token: str, *, verify_expiry: bool = True
    ) -> tuple[str | None, str | None]:
        """``(tenant, None)`` from a verified token's claim; ``(None, claimed)`` when the
        token does not verify (bad signature, an algorithm not allowed, expired, an
        audience other than ``jwt_audience`` -- or any audience when none is set -- the
        wrong issuer, a malformed token), ``claimed`` being what its unverified claim said
        (for the log, never trusted); ``(None, None)`` for a valid token without the
        claim, and for a bearer credential not shaped as a JWT (a plain API key). Never
        raises: whatever PyJWT rejects, however, the token did not verify."""
        if token.count(".") != 2:
            return None, None
        try:
            claims = _pyjwt().decode(
                token,
                self.jwt_key,
                algorithms=list(self.jwt_algorithms),
                audience=self.jwt_audience or None,
                issuer=self.jwt_issuer or None,
                leeway=JWT_LEEWAY_SECONDS,
                options={"require": ["exp"], "verify_exp": verify_expiry},
            )
        except _jwt_rejections():
            return None, _unverified_claim(token, self.jwt_claim)
        value = claims.get(self.jwt_claim)
        return (value.strip() or None, None) if isinstance(value, str) else (None, None)


def check_jwt_algorithms(algorithms: tuple[str, ...]) -> None:
    """ValueError unless ``algorithms`` is a non-empty list of one family."""
    known = JWT_HMAC | JWT_PUBLIC_KEY
    if not algorithms or not all(isinstance(a, str) for a in algorithms):
        raise ValueError(f"jwt algorithms must be a list of names, not {list(algorithms)}")
    if set(algorithms) - known:
        raise ValueError(f"jwt algorithms must be some of {sorted(known)}, not {list(algorithms)}")
    if set(algorithms) & JWT_HMAC and set(algorithms) & JWT_PUBLIC_KEY:
        raise ValueError("jwt algorithms: HMAC (HS*) and public-key ones cannot share a key")


def load_jwt_key(data: bytes, algorithms: tuple[str, ...]) -> Any:
    """The verification key for ``algorithms`` from a key file's bytes: the shared secret
    for HS* (surrounding whitespace removed; at least as long as the hash, RFC 7518), else
    a PEM public key or certificate. ValueError when it is neither, or when it cannot
    verify every one of ``algorithms`` (an RSA key listed for ES256, a P-256 key for
    ES384): checked here, so that no token can reach a key PyJWT would refuse."""
    check_jwt_algorithms(algorithms)
    if set(algorithms) <= JWT_HMAC:
        key: Any = data.strip()
        shortest = max(JWT_HMAC_MIN_BYTES[a] for a in algorithms)
        if len(key) < shortest:
            raise ValueError(
                f"an HMAC JWT secret for {list(algorithms)} must be >= {shortest} bytes"
            )
        if b"-----BEGIN" in key:
            raise ValueError("an HMAC JWT secret cannot be a PEM key (algorithm confusion)")
        return key
    from cryptography import x509
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    try:
        if b"BEGIN CERTIFICATE" in data:
            key = x509.load_pem_x509_certificate(data).public_key()
        else:
            key = load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as e:
        raise ValueError(f"not a PEM public key or certificate: {e}") from None
    for name in algorithms:
        try:
            _pyjwt().get_algorithm_by_name(name).prepare_key(key)
        except _jwt_rejections() as e:
            raise ValueError(f"the key ({type(key).__name__}) cannot verify {name}: {e}") from None
    return key


def _unverified_claim(token: str, claim: str) -> str:
    try:
        value = _pyjwt().decode(token, options={"verify_signature": False}).get(claim)
    except _jwt_rejections():
        return ""
    return value[:MAX_CLAIM_LOGGED] if isinstance(value, str) else ""


def _pyjwt() -> Any:
    """PyJWT, imported when the first token or key needs it: it imports urllib and the
    email package, ~1.7 MB of RSS that a proxy without JWT tenants, and a replay, never
    use."""
    import jwt

    return jwt


def _jwt_rejections() -> tuple[type[Exception], ...]:
    """What PyJWT may raise on a token it rejects, or on a key it refuses (not only its
    InvalidTokenError): each means "did not verify", never a crash of the request hook."""
    return (_pyjwt().PyJWTError, TypeError, ValueError)


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
    rules: TenantRules,
    headers: HeaderView,
    body_user: str | None,
    *,
    trusted: bool,
    verify_expiry: bool = True,
) -> Identity:
    """The tenant of a request by the first source that names one. Claims count only when
    ``trusted`` (``TenantRules.trusts``); otherwise they are skipped and reported. A JWT's
    expiry is checked unless ``verify_expiry`` is false (a capture outlives its tokens)."""
    ignored: list[tuple[str, str]] = []
    for source in rules.sources:
        if source == "jwt":
            token = api_key_of(headers)
            if token:
                tenant, rejected = rules.tenant_of_token(token, verify_expiry=verify_expiry)
                if tenant:
                    return Identity(tenant, tuple(ignored))
                if rejected is not None:
                    ignored.append(("jwt", rejected))
            continue
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
    captures, whose tokens have expired since: their signatures still decide)."""
    return identify(rules, headers, body_user, trusted=True, verify_expiry=False).tenant


def request_id_of(headers: HeaderView) -> str:
    """The incoming ``X-Request-ID`` (trimmed to 128 characters), else a new one."""
    incoming = (headers.get("x-request-id") or "").strip()
    return incoming[:128] if incoming else "ct-" + secrets.token_hex(12)

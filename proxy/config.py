"""crosstalk configuration: a TOML file, overridden by command-line flags.

See ``config/crosstalk.example.toml`` for every key with its meaning. Unknown keys are
an error (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.engine import EngineConfig
from proxy.redaction import scheme_of
from proxy.store.domains import normal_url
from proxy.store.journal import JournalSettings
from proxy.tenants import (
    DEFAULT_SOURCES,
    DEFAULT_TRUSTED_PEERS,
    SOURCES,
    check_jwt_algorithms,
    load_jwt_key,
)

MODES = ("shadow", "enforce")
LOG_FORMATS = ("auto", "json", "console")
SHADOW_DETECTORS = ("auto", "inline", "process")
UNKNOWN_TENANT = ("anonymous", "reject")
_ENGINE = EngineConfig()


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which key and why."""


@dataclass(frozen=True, slots=True)
class ProxySection:
    upstream: str = ""  # empty: start the built-in simulator
    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    mode: str = "shadow"
    log_file: str = ""  # empty: stderr
    log_level: str = "info"
    log_format: str = "auto"  # auto (console on a terminal, else JSON lines) | json | console
    log_evidence_text: bool = False


@dataclass(frozen=True, slots=True)
class TenantSection:
    sources: tuple[str, ...] = DEFAULT_SOURCES
    header: str = "X-Tenant-ID"
    unknown: str = "anonymous"  # or "reject": 400 with an OpenAI-format error
    api_keys: dict[str, str] = field(default_factory=dict)
    # Peers (CIDRs) whose tenant header or body `user` counts; from anyone else such a
    # claim is ignored and logged (tenant.untrusted). Loopback: a gateway on this host.
    trusted_peers: tuple[str, ...] = DEFAULT_TRUSTED_PEERS
    # A request carrying this secret in gateway_header may claim a tenant from anywhere
    # (an auth gateway in front); the header is removed before the request goes upstream.
    gateway_header: str = "X-Crosstalk-Gateway"
    gateway_secret: str = ""
    # Source "jwt": the tenant is a claim of a JWT bearer token verified with this key
    # file (PEM public key or certificate; for HS* algorithms the shared secret).
    jwt_key_file: str = ""
    jwt_algorithms: tuple[str, ...] = ("RS256",)
    jwt_claim: str = "sub"
    jwt_audience: str = ""  # empty: not checked
    jwt_issuer: str = ""  # empty: not checked


@dataclass(frozen=True, slots=True)
class DetectionSection:
    key: str = ""  # hex; empty generates a key at start (fingerprints then die with it)
    baseline_dir: str = ""  # empty: the shipped baseline (proxy/defaults)
    vocabulary_dir: str = ""  # empty: the shipped vocabularies (proxy/defaults)
    # Baseline files of public corpora (crosstalk baseline build): keyed fingerprints of
    # text that is nobody's, made with this detection.key.
    baselines: tuple[str, ...] = ()
    state_file: str = ""  # learned commonness, loaded at start and saved at exit (.npz)
    # Engine parameters (EngineConfig; docs/detection.md and bench/quality.py for their effect).
    k: int = _ENGINE.k
    min_run_words: float = _ENGINE.min_run_words
    plain_run_factor: float = _ENGINE.plain_run_factor
    plain_user_factor: float = _ENGINE.plain_user_factor
    plain_output_factor: float = _ENGINE.plain_output_factor
    plain_share: float = _ENGINE.plain_share
    plain_cover_factor: float = _ENGINE.plain_cover_factor
    containment: float = _ENGINE.containment
    exclusive: float = _ENGINE.exclusive
    common_tenants: int = _ENGINE.common_tenants
    same_prompt_similarity: float = _ENGINE.same_prompt_similarity
    window_seconds: float = _ENGINE.window_seconds
    max_fingerprints: int = _ENGINE.max_fingerprints
    max_rare_words: int = _ENGINE.max_rare_words
    sketch_width_bits: int = _ENGINE.sketch_width_bits
    sketch_half_life: float = _ENGINE.sketch_half_life
    entities: bool = _ENGINE.entities
    case_identifiers: bool = _ENGINE.case_identifiers


POLICY_KEYS = {
    "mode": str,
    "min_foreign_words": float,
    "holdback_words": float,
    "inject_cache_salt": bool,  # [prevention]
    "inject_canary": bool,
}


@dataclass(frozen=True, slots=True)
class PolicySection:
    # Enforce mode holds back this many words of output until they are checked (16:
    # twice the 8-word detection threshold, so a leak is caught before its first word
    # is released; docs/modes.md, "Shadow and enforce").
    holdback_words: float = 16.0
    fail: str = "open"  # detector failure: "open" (pass, unscanned) or "closed" (cut)
    detector_budget_ms: float = 50.0  # a scan call slower than this is a failure
    # Optional learning period: enforce blocks fragment findings only once the engine has
    # learned from this many requests (a loaded state_file counts). 0: from the first
    # request; a fresh engine tells the model's habits from a leak by what is specific
    # to the source exchange (docs/detection.md). Entities and canaries always block.
    learn_requests: int = 0
    # Shadow mode feeds the detector this many characters of output at a time (0: every
    # SSE delta): findings come a few words later, for a fraction of the CPU.
    shadow_batch_chars: int = 64
    # Where shadow-mode detection runs: "process" (a child process at lower CPU priority
    # fed a copy of the traffic: the proxy's event loop only forwards), "inline" (on the
    # proxy's event loop, when it is idle), "auto" (process unless a policy enforces:
    # enforce mode needs the engine on the event loop, and one engine sees all traffic).
    shadow_detector: str = "auto"
    shadow_detector_nice: int = 10  # added niceness of the detector process (0-19)
    # Overrides by tenant ([policy.tenants.NAME]) and by path prefix
    # ([policy.routes."/v1/completions"]): mode, min_foreign_words, holdback_words.
    tenants: dict[str, dict] = field(default_factory=dict)
    routes: dict[str, dict] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class JournalSection:
    # Fingerprint journal (keyed records, no text) for `crosstalk replay`; empty: off.
    # Replaying needs the same detection.key: set one, or the journal dies with the key.
    directory: str = ""
    max_segment_mb: float = 64.0
    max_segment_minutes: float = 60.0
    retention_days: float = 30.0


@dataclass(frozen=True, slots=True)
class IndexSection:
    # Replicas share their keyed records (no text) through a Redis Stream
    # (proxy/store/redis_index.py, docs/operations.md, "Scale-out"); empty url: this process only.
    # Every replica needs the same detection.key.
    url: str = ""  # redis://HOST:PORT/DB or rediss:// (TLS)
    password: str = ""  # overrides a password in the url
    tls: bool = False  # TLS even for a redis:// url
    tls_ca_file: str = ""  # CA bundle that signed the server's certificate
    stream: str = "crosstalk:records"  # stream key; replicas of one deployment share it
    replica_name: str = ""  # label in the records' origin id; empty: the host name
    outbox_records: int = 20000  # records held while Redis is away; oldest dropped beyond
    timeout_seconds: float = 1.0  # one Redis call slower than this: degraded
    load_timeout_seconds: float = 30.0  # start: load the window for at most this long
    reconnect_max_seconds: float = 5.0  # backoff ceiling between reconnection attempts
    # At most one send and one read per batch_ms: under load each Redis call carries
    # what came in meanwhile (a call costs ~100 us of CPU whatever it carries); a record
    # then waits at most this long more to be sent, and as long to be read. 0: no wait.
    batch_ms: float = 5.0
    # Cache domains: which upstreams share a KV cache (one engine, or a pool behind a
    # shared cache), { "pool-a" = ["http://10.0.0.1:8000", ...] }. A replica publishes to
    # and reads only its upstream's domain (stream STREAM:DOMAIN); an upstream in no
    # domain, or no domains at all: the one default domain (stream STREAM), as before.
    domains: dict[str, list] = field(default_factory=dict)
    domain: str = ""  # this replica's domain by name, whatever its upstream


@dataclass(frozen=True, slots=True)
class PreventionSection:
    # docs/operations.md, "Prevention: cache_salt and canaries". Both also per tenant and per route
    # ([policy.tenants.NAME] / [policy.routes."/v1/chat/completions"] inject_... = true).
    inject_cache_salt: bool = False  # set cache_salt = HMAC(secret, tenant) on requests
    inject_canary: bool = False  # add the tenant's canary to the chat system prompt
    # Hex, at least 16 bytes; required when either is on anywhere. Keys the salts and
    # the canaries (domain-separated); changing it changes every salt and canary.
    cache_salt_secret: str = ""
    # Tenants that share one salt, so one prefix cache: { "group-a" = ["t1", "t2"] }.
    salt_groups: dict[str, list] = field(default_factory=dict)

    def secret(self) -> bytes:
        return bytes.fromhex(self.cache_salt_secret)

    def group_of(self) -> dict[str, str]:
        """tenant -> salt group."""
        return {t: group for group, tenants in self.salt_groups.items() for t in tenants}


@dataclass(frozen=True, slots=True)
class MetricsSection:
    # Prometheus endpoint (docs/operations.md, "Metrics"); port 0: off (crosstalk run --metrics-port).
    port: int = 0
    host: str = "127.0.0.1"
    # Distinct tenant label values; later tenants are counted as tenant="other".
    max_tenant_labels: int = 100


@dataclass(frozen=True, slots=True)
class OtelSection:
    # OpenTelemetry export (docs/operations.md, "OpenTelemetry"): a span per LLM exchange
    # and the counters, over OTLP/HTTP (protobuf) to this base URL, e.g. a Collector's
    # "http://127.0.0.1:4318" (/v1/traces and /v1/metrics are appended). Empty: off.
    endpoint: str = ""
    headers: dict[str, str] = field(default_factory=dict)  # e.g. an authorization header
    service_name: str = "crosstalk"
    metrics_interval_seconds: float = 60.0  # how often the counters are exported


@dataclass(frozen=True, slots=True)
class DegenerateSection:
    # Degenerate-output signal (docs/detection.md, "Degenerate output"): logged, never blocking.
    enabled: bool = True
    rate_window_seconds: float = 600.0  # the per-upstream rate covers this much time


@dataclass(frozen=True, slots=True)
class LimitsSection:
    # A request body over this many bytes is refused with 413 (0: no limit). 16 MiB holds
    # a full 128k-token context many times over.
    max_request_bytes: int = 16 * 1024 * 1024
    # LLM exchanges in flight at once; beyond, 429 with Retry-After (0: no limit).
    max_concurrent_exchanges: int = 0
    retry_after_seconds: int = 1
    # Output characters of one exchange the detector scans (0: all). Beyond, the rest
    # passes unscanned and the exchange line says so (scan_capped). 1,000,000 characters
    # is ~250k tokens, far beyond any model's output limit today.
    max_scanned_output_chars: int = 1_000_000
    # A connection with no byte either way for this long is closed: a client that went
    # quiet, an engine that hangs mid-generation (mitmproxy's tcp_timeout; its default).
    idle_timeout_seconds: int = 600
    # A request whose body took longer than this to arrive is refused with 408 and never
    # goes upstream (a client trickling its body; 0: no limit).
    max_request_seconds: float = 300.0


@dataclass(frozen=True, slots=True)
class TLSSection:
    # Clients -> crosstalk over HTTPS with the operator's certificate: a PEM file holding
    # the private key and the certificate chain (mitmproxy's --certs format). Empty:
    # mitmproxy answers TLS with a certificate of its own CA. HTTP/2 where offered.
    certificate: str = ""
    # crosstalk -> an https:// upstream: verified against the system's CAs, or this
    # bundle; upstream_insecure = true turns verification off (never in production).
    upstream_ca: str = ""
    upstream_insecure: bool = False
    # A client certificate for an upstream that asks for one (mutual TLS): PEM with key.
    client_certificate: str = ""


@dataclass(frozen=True, slots=True)
class Policy:
    """What applies to one exchange."""

    mode: str
    holdback_words: float
    min_foreign_words: float
    fail_closed: bool
    budget_ms: float
    learn_requests: int
    inject_cache_salt: bool = False
    inject_canary: bool = False


@dataclass(frozen=True, slots=True)
class Config:
    proxy: ProxySection = field(default_factory=ProxySection)
    tenants: TenantSection = field(default_factory=TenantSection)
    detection: DetectionSection = field(default_factory=DetectionSection)
    policy: PolicySection = field(default_factory=PolicySection)
    journal: JournalSection = field(default_factory=JournalSection)
    index: IndexSection = field(default_factory=IndexSection)
    prevention: PreventionSection = field(default_factory=PreventionSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    otel: OtelSection = field(default_factory=OtelSection)
    degenerate: DegenerateSection = field(default_factory=DegenerateSection)
    tls: TLSSection = field(default_factory=TLSSection)
    limits: LimitsSection = field(default_factory=LimitsSection)

    def policy_for(self, tenant: str, path: str) -> Policy:
        """The tenant's overrides win over the route's (longest matching prefix), which
        win over the global settings."""
        route_path = path.split("?", 1)[0]
        routes = sorted(
            (prefix for prefix in self.policy.routes if route_path.startswith(prefix)),
            key=len,
        )
        merged: dict = {}
        for prefix in routes:
            merged.update(self.policy.routes[prefix])
        merged.update(self.policy.tenants.get(tenant, {}))
        return Policy(
            mode=merged.get("mode", self.proxy.mode),
            holdback_words=float(merged.get("holdback_words", self.policy.holdback_words)),
            min_foreign_words=float(merged.get("min_foreign_words", 0.0)),
            fail_closed=self.policy.fail == "closed",
            budget_ms=self.policy.detector_budget_ms,
            learn_requests=self.policy.learn_requests,
            inject_cache_salt=merged.get("inject_cache_salt", self.prevention.inject_cache_salt),
            inject_canary=merged.get("inject_canary", self.prevention.inject_canary),
        )

    def enforces(self) -> bool:
        """Whether any exchange may be enforced (the global mode or any override)."""
        overrides = [*self.policy.tenants.values(), *self.policy.routes.values()]
        return self.proxy.mode == "enforce" or any(o.get("mode") == "enforce" for o in overrides)

    def detector_process(self) -> bool:
        """Whether detection runs in a separate process (``policy.shadow_detector``)."""
        choice = self.policy.shadow_detector
        return choice == "process" or (choice == "auto" and not self.enforces())

    def engine_config(self) -> EngineConfig:
        d = self.detection
        try:
            key = bytes.fromhex(d.key) if d.key else None
        except ValueError as e:
            raise ConfigError("detection.key must be hex") from e
        # Every engine field the section has, by name: a new engine parameter only
        # needs its line in DetectionSection.
        shared = {f.name for f in dataclasses.fields(EngineConfig)} & {
            f.name for f in dataclasses.fields(DetectionSection)
        } - {"key"}
        return EngineConfig(key=key, **{name: getattr(d, name) for name in shared})


#: Keys an older configuration may still hold, and why they went.
REMOVED_KEYS = {
    "winnow_window": "the engine keeps every k-gram of a text (docs/detection.md); delete the line",
}


def _section(cls: type, name: str, data: Any) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"[{name}] must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields)
    if gone := sorted(unknown & REMOVED_KEYS.keys()):
        raise ConfigError(f"{name}.{gone[0]} is gone: {REMOVED_KEYS[gone[0]]}")
    if unknown:
        raise ConfigError(f"unknown key(s) in [{name}]: {', '.join(sorted(unknown))}")
    values = {}
    for key, value in data.items():
        default = getattr(cls(), key)
        if isinstance(default, tuple) and isinstance(value, list):
            value = tuple(value)
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, type(default)) or (
            isinstance(value, bool) and not isinstance(default, bool)
        ):
            raise ConfigError(
                f"{name}.{key} must be {type(default).__name__}, not {type(value).__name__}"
            )
        values[key] = value
    return cls(**values)


def validate(config: Config) -> Config:
    p, t, d, j = config.proxy, config.tenants, config.detection, config.journal
    if p.mode not in MODES:
        raise ConfigError(f"proxy.mode must be one of {MODES}, not {p.mode!r}")
    if p.upstream and not p.upstream.startswith(("http://", "https://")):
        raise ConfigError(
            f"proxy.upstream must be an http:// or https:// URL; {scheme_of(p.upstream)}"
        )
    if not 0 <= p.listen_port <= 65535:
        raise ConfigError("proxy.listen_port must be 0..65535")
    if p.log_format not in LOG_FORMATS:
        raise ConfigError(f"proxy.log_format must be one of {LOG_FORMATS}, not {p.log_format!r}")
    if t.unknown not in UNKNOWN_TENANT:
        raise ConfigError(f"tenants.unknown must be one of {UNKNOWN_TENANT}")
    if not all(isinstance(s, str) for s in t.sources):
        raise ConfigError("tenants.sources must be a list of names")
    if bad := set(t.sources) - set(SOURCES):
        raise ConfigError(f"tenants.sources: unknown {sorted(bad)}; use {list(SOURCES)}")
    for cidr in t.trusted_peers:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError as e:
            raise ConfigError(f"tenants.trusted_peers: {e}") from None
    if t.gateway_secret and len(t.gateway_secret) < 16:
        raise ConfigError("tenants.gateway_secret must be at least 16 characters")
    if "jwt" in t.sources and not t.jwt_key_file:
        raise ConfigError("tenants.sources has 'jwt': set tenants.jwt_key_file")
    if "jwt" in t.sources and "api_key" in t.sources[: t.sources.index("jwt")]:
        raise ConfigError(
            "tenants.sources: put 'jwt' before 'api_key' (both read the bearer credential, "
            "and the first takes every one)"
        )
    try:
        check_jwt_algorithms(t.jwt_algorithms)
    except ValueError as e:
        raise ConfigError(f"tenants.{e}") from None
    if t.jwt_key_file:
        try:
            load_jwt_key(Path(t.jwt_key_file).read_bytes(), t.jwt_algorithms)
        except (OSError, ValueError) as e:
            raise ConfigError(f"tenants.jwt_key_file {t.jwt_key_file}: {e}") from None
    if not t.jwt_claim:
        raise ConfigError("tenants.jwt_claim must name a claim")
    if d.k < 2 or d.min_run_words <= 0 or d.common_tenants < 2:
        raise ConfigError("detection: need k >= 2, min_run_words > 0, common_tenants >= 2")
    if d.max_fingerprints < 1 or d.max_rare_words < 1:
        raise ConfigError("detection: max_fingerprints and max_rare_words must be >= 1")
    _validate_policy(config.policy)
    lim = config.limits
    counts = (lim.max_request_bytes, lim.max_concurrent_exchanges, lim.max_scanned_output_chars,
              lim.max_request_seconds)  # fmt: skip
    if min(counts) < 0 or lim.retry_after_seconds < 1 or lim.idle_timeout_seconds < 1:
        raise ConfigError(
            "limits: sizes, counts and max_request_seconds must be >= 0, "
            "retry_after_seconds and idle_timeout_seconds >= 1"
        )
    tls = config.tls
    for name in ("certificate", "upstream_ca", "client_certificate"):
        path = getattr(tls, name)
        if path and not Path(path).is_file():
            raise ConfigError(f"tls.{name}: no such file: {path}")
    config.engine_config()
    for name, value in (("detection.state_file", d.state_file), ("journal", j.directory)):
        if value and not d.key:
            raise ConfigError(
                f"{name} needs a fixed detection.key: hashes made under a key "
                "generated at start mean nothing after a restart"
            )
    if j.max_segment_mb <= 0 or j.max_segment_minutes <= 0 or j.retention_days <= 0:
        raise ConfigError("journal: max_segment_mb, max_segment_minutes, retention_days > 0")
    _validate_index(config.index, d.key)
    _validate_prevention(config)
    _validate_metrics(config.metrics, config.degenerate)
    _validate_otel(config.otel)
    if config.policy.shadow_detector == "process" and config.enforces():
        raise ConfigError(
            'policy.shadow_detector = "process" cannot serve enforce mode (its cut needs '
            'the engine on the event loop): use "auto" or "inline"'
        )
    return config


def _validate_prevention(config: Config) -> None:
    p = config.prevention
    overrides = [*config.policy.tenants.values(), *config.policy.routes.values()]
    used = p.inject_cache_salt or p.inject_canary
    used |= any(o.get("inject_cache_salt") or o.get("inject_canary") for o in overrides)
    try:
        secret = p.secret()
    except ValueError as e:
        raise ConfigError("prevention.cache_salt_secret must be hex") from e
    if used and len(secret) < 16:
        raise ConfigError(
            "inject_cache_salt/inject_canary need prevention.cache_salt_secret: hex, at least "
            "16 bytes (e.g. the output of `openssl rand -hex 32`), the same on every replica"
        )
    seen: dict[str, str] = {}
    for group, tenants in p.salt_groups.items():
        if not isinstance(tenants, list) or not all(isinstance(t, str) for t in tenants):
            raise ConfigError(f"prevention.salt_groups.{group} must be a list of tenant names")
        for tenant in tenants:
            if tenant in seen:
                raise ConfigError(
                    f"prevention.salt_groups: tenant {tenant!r} is in {seen[tenant]!r} and {group!r}"
                )
            seen[tenant] = group


def _validate_metrics(m: MetricsSection, d: DegenerateSection) -> None:
    if not 0 <= m.port <= 65535:
        raise ConfigError("metrics.port must be 0..65535")
    if m.max_tenant_labels < 0:
        raise ConfigError("metrics.max_tenant_labels must be >= 0")
    if d.rate_window_seconds <= 0:
        raise ConfigError("degenerate.rate_window_seconds must be > 0")


def _validate_otel(o: OtelSection) -> None:
    if o.endpoint and not o.endpoint.startswith(("http://", "https://")):
        raise ConfigError("otel.endpoint must be an http:// or https:// URL (OTLP/HTTP)")
    if not all(isinstance(v, str) for v in o.headers.values()):
        raise ConfigError("otel.headers: every value must be a string")
    if o.metrics_interval_seconds <= 0:
        raise ConfigError("otel.metrics_interval_seconds must be > 0")


def _validate_index(index: IndexSection, key: str) -> None:
    if index.url and not key:
        raise ConfigError(
            "index.url needs a fixed detection.key, the same on every replica: hashes made "
            "under a key generated at start mean nothing to the other replicas"
        )
    if index.url and not index.url.startswith(("redis://", "rediss://")):
        raise ConfigError(f"index.url must be a redis:// or rediss:// URL; {scheme_of(index.url)}")
    if not index.stream:
        raise ConfigError("index.stream must not be empty")
    if index.outbox_records < 1:
        raise ConfigError("index.outbox_records must be >= 1")
    if min(index.timeout_seconds, index.load_timeout_seconds, index.reconnect_max_seconds) <= 0:
        raise ConfigError("index: timeout_seconds, load_timeout_seconds, reconnect_max_seconds > 0")
    if not 0 <= index.batch_ms <= 1000:
        raise ConfigError("index.batch_ms must be between 0 and 1000 (milliseconds)")
    named = [index.domain, *index.domains] if index.domain else list(index.domains)
    for name in named:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ConfigError(
                f"index domain {name!r}: letters, digits, '_', '.', '-' (at most 64): it "
                "names a Redis stream"
            )
    seen: dict[str, str] = {}
    for name, upstreams in index.domains.items():
        if not isinstance(upstreams, list) or not all(isinstance(u, str) for u in upstreams):
            raise ConfigError(f"index.domains.{name} must be a list of upstream URLs")
        for url in upstreams:
            normal = normal_url(url)
            if normal in seen and seen[normal] != name:
                raise ConfigError(
                    f"index.domains: upstream {url!r} is in {seen[normal]!r} and {name!r}: a "
                    "cache is shared within one domain"
                )
            seen[normal] = name


def journal_settings(config: Config) -> JournalSettings | None:
    j = config.journal
    if not j.directory:
        return None
    return JournalSettings(
        j.directory,
        max_segment_bytes=int(j.max_segment_mb * (1 << 20)),
        max_segment_seconds=j.max_segment_minutes * 60,
        retention_days=j.retention_days,
    )


def _validate_policy(policy: PolicySection) -> None:
    if policy.shadow_batch_chars < 0:
        raise ConfigError("policy.shadow_batch_chars must be >= 0")
    if policy.shadow_detector not in SHADOW_DETECTORS:
        raise ConfigError(f"policy.shadow_detector must be one of {SHADOW_DETECTORS}")
    if not 0 <= policy.shadow_detector_nice <= 19:
        raise ConfigError("policy.shadow_detector_nice must be 0..19")
    if policy.fail not in ("open", "closed"):
        raise ConfigError(f"policy.fail must be open or closed, not {policy.fail!r}")
    if policy.holdback_words < 0 or policy.detector_budget_ms <= 0:
        raise ConfigError("policy: holdback_words >= 0 and detector_budget_ms > 0 needed")
    for kind, table in (("tenants", policy.tenants), ("routes", policy.routes)):
        for name, entry in table.items():
            where = f"policy.{kind}.{name!r}"
            if not isinstance(entry, dict):
                raise ConfigError(f"{where} must be a table")
            if unknown := set(entry) - set(POLICY_KEYS):
                raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}")
            if entry.get("mode", "shadow") not in MODES:
                raise ConfigError(f"{where}.mode must be one of {MODES}")
            for key in ("min_foreign_words", "holdback_words"):
                value = entry.get(key, 0)
                if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                    raise ConfigError(f"{where}.{key} must be a number >= 0")
            for key in ("inject_cache_salt", "inject_canary"):
                if not isinstance(entry.get(key, False), bool):
                    raise ConfigError(f"{where}.{key} must be true or false")


def load(path: str | Path | None = None, **overrides: Any) -> Config:
    """Read ``path`` (TOML) if given, apply ``overrides`` (``section__key=value``, None
    values ignored), validate. Raises ConfigError with a readable message."""
    data: dict[str, Any] = {}
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from e
    return _from_data(data, overrides)


def load_text(text: str) -> Config:
    """``load`` of a configuration given as TOML text. Raises ConfigError."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"cannot read config: {e}") from e
    return _from_data(data, {})


def _from_data(data: dict[str, Any], overrides: dict[str, Any]) -> Config:
    for name, value in overrides.items():
        if value is None:
            continue
        section, _, key = name.partition("__")
        data.setdefault(section, {})[key] = value
    sections = {
        "proxy": ProxySection,
        "tenants": TenantSection,
        "detection": DetectionSection,
        "policy": PolicySection,
        "journal": JournalSection,
        "index": IndexSection,
        "prevention": PreventionSection,
        "metrics": MetricsSection,
        "otel": OtelSection,
        "degenerate": DegenerateSection,
        "tls": TLSSection,
        "limits": LimitsSection,
    }
    if unknown := set(data) - set(sections):
        raise ConfigError(f"unknown section(s): {', '.join(sorted(unknown))}")
    config = Config(**{n: _section(cls, n, data.get(n, {})) for n, cls in sections.items()})
    return validate(config)

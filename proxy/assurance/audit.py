"""Engine audit: which serving engine answers at a URL, which version, which settings it
shows, and which public isolation advisories (``proxy/defaults/advisories.toml``) apply to it.

Operators must know whether the engine behind their gateway has known cross-tenant
isolation bugs. Engines say who they are on their info endpoints (vLLM ``/version`` and
``/metrics``, SGLang ``/get_server_info``, TGI ``/info``, llama.cpp ``/props``,
``/v1/models``, the ``Server`` header); this module reads them, then judges every
advisory of that engine, and of the add-ons it shows (LMCache), against the version and
the settings: ``applies`` (the audit fails), ``check`` (something the audit cannot see
decides it) or ``ok``.

Identification is a pure function of the fetched responses (``identify_from``), so it is
tested without a network; ``identify`` only does the fetching.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from proxy.defaults import ADVISORIES, shipped

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

ENGINES = ("vllm", "sglang", "tgi", "llamacpp", "tensorrt_llm", "vllm_mlx")
#: KV-cache add-ons that run inside an engine: their advisories are judged on any engine,
#: through the settings that show the add-on (``requires = { lmcache = true }``).
ADDONS = ("lmcache",)
KINDS = ("advisory", "setting")
APPLIES, CHECK, OK = "applies", "check", "ok"
#: Paths fetched to identify an engine. All are GETs without side effects.
INFO_PATHS = (
    "/version",
    "/get_server_info",
    "/get_model_info",
    "/info",
    "/props",
    "/v1/models",
    "/metrics",
)
_MAX_BODY = 2_000_000  # bytes kept of one info response (/metrics can be large)


class AdvisoryError(ValueError):
    """The advisories file cannot be used; the message names the entry and field."""


# --- versions ---------------------------------------------------------------------------

_VERSION_RE = re.compile(
    r"v?(\d+(?:\.\d+)*)(?:[-_.]?(dev|a|alpha|b|beta|rc|c|pre|post)[-_.]?(\d*))?", re.I
)
_STAGES = {
    "dev": 0, "a": 1, "alpha": 1, "b": 2, "beta": 2, "rc": 3, "c": 3, "pre": 3, "post": 5,
}  # fmt: skip
_FINAL = 4
_CONDITION_RE = re.compile(r"^\s*(<=|>=|==|!=|<|>)\s*(\S+)\s*$")


def parse_version(text: str) -> tuple:
    """A comparable key for a PEP 440-like version ("0.10.2", "v0.5.19", "0.11.0rc2",
    "0.10.2.dev12+gabc", "0.6.1.post1"). Pre-releases and dev builds sort before their
    release, so a nightly of the fixed release still counts as affected (conservative).
    Raises ValueError when ``text`` holds no version."""
    match = _VERSION_RE.search(text.strip())
    if not match:
        raise ValueError(f"not a version: {text!r}")
    release = [int(x) for x in match.group(1).split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    stage = _STAGES[match.group(2).lower()] if match.group(2) else _FINAL
    number = int(match.group(3)) if match.group(3) else 0
    return (tuple(release), stage, number)


def version_matches(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies ``spec``: "*" or comma-separated conditions
    ("<0.7.2", ">=0.7.0,<0.9.0"), all of which must hold."""
    if spec.strip() == "*":
        return True
    key = parse_version(version)
    for part in spec.split(","):
        match = _CONDITION_RE.match(part)
        if not match:
            raise ValueError(f"bad version condition {part!r} in {spec!r}")
        op, bound = match.group(1), parse_version(match.group(2))
        ok = {
            "<": key < bound,
            "<=": key <= bound,
            ">": key > bound,
            ">=": key >= bound,
            "==": key == bound,
            "!=": key != bound,
        }[op]
        if not ok:
            return False
    return True


# --- advisories -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Advisory:
    """One entry of the advisories file (see the file's header for the fields)."""

    id: str
    kind: str
    engine: str
    title: str
    affected: str
    fixed: str
    setting: str
    requires: Mapping[str, Any]
    action: str
    source: str
    aliases: tuple[str, ...] = ()
    references: tuple[str, ...] = ()
    notes: str = ""


@dataclass(frozen=True, slots=True)
class AdvisoryDB:
    """The advisories and the engine defaults used for settings an engine hides."""

    advisories: tuple[Advisory, ...]
    defaults: Mapping[str, Mapping[str, Any]]
    path: str
    sha256: str
    standards: tuple[Standard, ...] = ()


@dataclass(frozen=True, slots=True)
class Standard:
    """A requirement an operator is audited against (``[[standard]]``): listed, not judged."""

    id: str
    title: str
    source: str


_REQUIRED = ("id", "kind", "engine", "title", "affected", "fixed", "setting", "action", "source")


def load_advisories(path: str | Path | None = None) -> AdvisoryDB:
    """Read and validate the advisories file (default: the shipped one; its absence
    is an installation error, DefaultsMissing)."""
    # The file, or the shipped one (a Traversable: a Path unless installed zipped).
    file: Path | Traversable = Path(path) if path else shipped(ADVISORIES)
    try:
        raw = file.read_bytes()
        data = tomllib.loads(raw.decode())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise AdvisoryError(f"cannot read advisories {file}: {e}") from e
    advisories = []
    seen: set[str] = set()
    for i, entry in enumerate(data.get("advisory", [])):
        where = f"{file}: advisory #{i + 1} ({entry.get('id', '?')})"
        missing = [k for k in _REQUIRED if not isinstance(entry.get(k), str)]
        if missing:
            raise AdvisoryError(f"{where}: missing or non-text field(s) {missing}")
        if entry["engine"] not in ENGINES + ADDONS or entry["kind"] not in KINDS:
            raise AdvisoryError(
                f"{where}: engine must be one of {ENGINES + ADDONS}, kind one of {KINDS}"
            )
        if entry["id"] in seen:
            raise AdvisoryError(f"{where}: duplicate id")
        seen.add(entry["id"])
        try:
            version_matches("0", entry["affected"])
            if entry["fixed"]:
                parse_version(entry["fixed"])
        except ValueError as e:
            raise AdvisoryError(f"{where}: {e}") from e
        if not entry["source"].startswith("https://"):
            raise AdvisoryError(f"{where}: source must be an https URL")
        requires = entry.get("requires", {})
        if not isinstance(requires, dict):
            raise AdvisoryError(f"{where}: requires must be a table")
        advisories.append(
            Advisory(
                id=entry["id"],
                kind=entry["kind"],
                engine=entry["engine"],
                title=entry["title"],
                affected=entry["affected"],
                fixed=entry["fixed"],
                setting=entry["setting"],
                requires=requires,
                action=entry["action"],
                source=entry["source"],
                aliases=tuple(entry.get("aliases", ())),
                references=tuple(entry.get("references", ())),
                notes=entry.get("notes", ""),
            )
        )
    defaults = data.get("defaults", {})
    standards = []
    for i, entry in enumerate(data.get("standard", [])):
        if not all(isinstance(entry.get(k), str) for k in ("id", "title", "source")):
            raise AdvisoryError(f"{file}: standard #{i + 1}: id, title and source are required")
        standards.append(Standard(entry["id"], entry["title"], entry["source"]))
    return AdvisoryDB(
        tuple(advisories),
        defaults,
        str(file),
        hashlib.sha256(raw).hexdigest(),
        tuple(standards),
    )


# --- identification ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fetched:
    """One info endpoint's answer (status 0: no answer)."""

    status: int
    server: str = ""
    body: bytes = b""
    error: str = ""

    def json(self) -> Any:
        """The body as JSON, or None."""
        if self.status != 200:
            return None
        try:
            return json.loads(self.body)
        except (ValueError, UnicodeDecodeError):
            return None


@dataclass(slots=True)
class Identification:
    """What the target says about itself."""

    target: str
    engine: str | None = None
    version: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    evidence: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    reachable: bool = False

    def to_json(self) -> dict:
        return {
            "target": self.target,
            "engine": self.engine,
            "version": self.version,
            "settings": dict(sorted(self.settings.items())),
            "evidence": list(self.evidence),
            "models": list(self.models),
            "reachable": self.reachable,
        }


_METRIC_LABELS_RE = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.M)
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def _vllm_settings(metrics: str, version: str | None) -> dict[str, Any]:
    """Settings from vLLM's ``vllm:cache_config_info`` gauge: its labels are the cache
    config (enable_prefix_caching, prefix_caching_hash_algo, ...)."""
    match = _METRIC_LABELS_RE.search(metrics)
    if not match:
        return {}
    labels = dict(_LABEL_RE.findall(match.group("labels")))
    settings: dict[str, Any] = {}
    if "kv_offloading_backend" in labels:
        backend = labels["kv_offloading_backend"].lower()
        offloading = labels.get("kv_offloading_size", "None") not in ("None", "", "0")
        settings["lmcache"] = backend == "lmcache" and offloading
    if "enable_prefix_caching" in labels:
        settings["prefix_caching"] = _truthy(labels["enable_prefix_caching"])
    algo = labels.get("prefix_caching_hash_algo")
    if algo:
        settings["prefix_hash_algo"] = algo
        if version:
            try:
                default = "sha256" if version_matches(version, ">=0.10.2") else "builtin"
                settings["prefix_hash_default"] = algo == default
            except ValueError:
                pass
    return settings


def _sglang_settings(info: Mapping[str, Any]) -> dict[str, Any]:
    """Settings from SGLang's ``/get_server_info`` (its server arguments)."""
    settings: dict[str, Any] = {}
    if "disable_radix_cache" in info:
        settings["prefix_caching"] = not _truthy(info["disable_radix_cache"])
    if "disaggregation_mode" in info:
        mode = str(info["disaggregation_mode"] or "null").lower()
        settings["disaggregation"] = mode not in ("null", "none", "")
    if "enable_lmcache" in info:
        settings["lmcache"] = _truthy(info["enable_lmcache"])
    if "enable_hierarchical_cache" in info:
        settings["hierarchical_cache"] = _truthy(info["enable_hierarchical_cache"])
    return settings


_BUILD_INFO_RE = re.compile(r"^b(\d+)-(\w+)")


def _llamacpp_version(build_info: str) -> tuple[str | None, str]:
    """``(version, evidence)`` of llama.cpp's ``build_info`` (``b<build>-<commit>``).
    Build number 1 is what a source tree without git history reports (an sdist, a
    tarball): such a build cannot be placed among releases, so no version is claimed."""
    match = _BUILD_INFO_RE.match(build_info)
    if not match:
        return None, f"build_info {build_info!r} has no build number"
    build, commit = match.groups()
    if build == "1":
        return None, (
            f"build_info {build_info}: build number 1 (built from a source tree without git "
            f"history); the release is unknown, commit {commit}"
        )
    return f"b{build}", f"build_info {build_info}: build {build}, commit {commit}"


# A field an engine's info endpoint may fill with a credential (SGLang's server args
# carry ``api_key`` and ``admin_api_key``), in any case style: ``hfToken``, ``x-api-key``.
# ``max_prefill_tokens`` and the like are not; ``eos_token`` or a ``monkey`` go too,
# harmlessly (evidence loses a little, never a secret).
_CREDENTIAL_FIELD = re.compile(
    r"(?:keys?|token|secrets?|passwords?|passwd|passphrase|auth|authorization"
    r"|credentials?|cookies?)$",
    re.I,
)


def _without_credentials(body: Any) -> Any:
    """``body`` without the fields whose names say they hold a credential, at any depth."""
    if isinstance(body, dict):
        return {
            k: _without_credentials(v)
            for k, v in body.items()
            if not (isinstance(k, str) and _CREDENTIAL_FIELD.search(k))
        }
    if isinstance(body, list):
        return [_without_credentials(v) for v in body]
    return body


def _short(body: Any, limit: int = 80) -> str:
    """An endpoint's answer as evidence: its first ``limit`` characters, credentials out."""
    text = body if isinstance(body, str) else json.dumps(_without_credentials(body), sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def identify_from(target: str, fetched: Mapping[str, Fetched]) -> Identification:
    """Decide the engine, version and visible settings from the info endpoints' answers.

    Most specific first: SGLang's server info, TGI's ``/info``, llama.cpp's ``/props``;
    vLLM last, because its bare ``/version`` shape is easy to imitate.
    """
    ident = Identification(target)
    ident.reachable = any(f.status for f in fetched.values())
    servers = sorted({f.server for f in fetched.values() if f.server})
    if servers:
        ident.evidence.append("Server: " + ", ".join(servers))
    owners: set[str] = set()
    models = fetched.get("/v1/models", Fetched(0)).json()
    if isinstance(models, dict) and isinstance(models.get("data"), list):
        for m in models["data"]:
            if isinstance(m, dict) and isinstance(m.get("id"), str):
                ident.models.append(m["id"])
                if isinstance(m.get("owned_by"), str):
                    owners.add(m["owned_by"].lower())
        if owners:
            ident.evidence.append("/v1/models owned_by=" + ",".join(sorted(owners)))
    metrics_fetch = fetched.get("/metrics", Fetched(0))
    metrics = metrics_fetch.body.decode(errors="replace") if metrics_fetch.status == 200 else ""

    server_info = fetched.get("/get_server_info", Fetched(0)).json()
    model_info = fetched.get("/get_model_info", Fetched(0)).json()
    info = fetched.get("/info", Fetched(0)).json()
    props = fetched.get("/props", Fetched(0)).json()
    version_body = fetched.get("/version", Fetched(0)).json()

    sglang_keys = ("disable_radix_cache", "tp_size", "model_path", "chunked_prefill_size")
    if isinstance(server_info, dict) and (
        any(k in server_info for k in sglang_keys) or "sglang" in owners
    ):
        ident.engine = "sglang"
        ident.version = str(server_info["version"]) if server_info.get("version") else None
        ident.settings = _sglang_settings(server_info)
        ident.evidence.append("/get_server_info: " + _short(server_info))
        if isinstance(model_info, dict):
            ident.evidence.append("/get_model_info: " + _short(model_info))
    elif (
        isinstance(info, dict)
        and "model_id" in info
        and ("router" in info or "max_input_tokens" in info or "docker_label" in info)
    ):
        ident.engine = "tgi"
        ident.version = str(info["version"]) if info.get("version") else None
        ident.evidence.append("/info: " + _short(info))
    elif (
        (
            isinstance(props, dict)
            and ("default_generation_settings" in props or "build_info" in props)
        )
        or any("llama.cpp" in s.lower() for s in servers)
        or "llamacpp" in owners
    ):
        ident.engine = "llamacpp"
        if isinstance(props, dict) and props.get("build_info"):
            ident.version, note = _llamacpp_version(str(props["build_info"]))
            ident.evidence.append(note)
        if isinstance(props, dict):
            ident.evidence.append("/props: " + _short(props))
            if isinstance(props.get("total_slots"), int):
                ident.settings["slots"] = props["total_slots"]
    elif owners & {"tensorrt_llm", "vllm-mlx"}:
        # Both answer /version like vLLM does: told apart by who owns the models.
        ident.engine = "tensorrt_llm" if "tensorrt_llm" in owners else "vllm_mlx"
        if isinstance(version_body, dict) and version_body.get("version"):
            ident.version = str(version_body["version"])
            ident.evidence.append("/version: " + _short(version_body))
    elif (
        (isinstance(version_body, dict) and isinstance(version_body.get("version"), str))
        or "vllm" in owners
        or "vllm:" in metrics
    ):
        ident.engine = "vllm"
        if isinstance(version_body, dict) and version_body.get("version"):
            ident.version = str(version_body["version"])
            ident.evidence.append("/version: " + _short(version_body))
        if "vllm:" in metrics:
            ident.evidence.append("/metrics: vllm: metrics present")
        ident.settings = _vllm_settings(metrics, ident.version)
        if "lmcache:" in metrics:
            ident.settings["lmcache"] = True
            ident.evidence.append("/metrics: lmcache: metrics present")
    return ident


async def _fetch(session: aiohttp.ClientSession, url: str) -> Fetched:
    try:
        async with session.get(url, allow_redirects=False) as resp:
            body = await resp.content.read(_MAX_BODY)
            return Fetched(resp.status, resp.headers.get("Server", ""), body)
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return Fetched(0, error=f"{type(e).__name__}: {e}")


async def identify(
    target: str, *, api_key: str | None = None, timeout: float = 5.0
) -> Identification:
    """Fetch every info endpoint of ``target`` concurrently and identify the engine."""
    base = target.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=client_timeout, headers=headers) as session:
        answers = await asyncio.gather(*(_fetch(session, base + p) for p in INFO_PATHS))
    return identify_from(target, dict(zip(INFO_PATHS, answers, strict=True)))


# --- assessment -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Assessment:
    """The verdict of one advisory for the identified engine."""

    advisory: Advisory
    status: str  # applies | check | ok
    reason: str

    def to_json(self) -> dict:
        a = self.advisory
        return {
            "id": a.id,
            "kind": a.kind,
            "title": a.title,
            "aliases": list(a.aliases),
            "affected": a.affected,
            "fixed": a.fixed,
            "setting": a.setting,
            "status": self.status,
            "reason": self.reason,
            "action": a.action,
            "source": a.source,
        }


def parse_assumption(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of ``--assume``: true/false become booleans, anything else text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise ValueError(f"--assume wants KEY=VALUE, got {text!r}")
    value = value.strip()
    if value.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
        return key.strip(), _truthy(value)
    return key.strip(), value


def _format(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _wanted(required: Any, value: Any) -> bool:
    if isinstance(required, list):
        return str(value) in [str(r) for r in required]
    if isinstance(required, bool):
        return bool(value) == required
    return str(value) == str(required)


def assess(
    ident: Identification, db: AdvisoryDB, assumed: Mapping[str, Any] | None = None
) -> list[Assessment]:
    """Judge every advisory of the identified engine: version first, then each setting
    it requires, looked up as seen on the engine, else declared (``assumed``), else the
    engine's default from the advisories file."""
    assumed = dict(assumed or {})
    defaults = db.defaults.get(ident.engine or "", {})
    results = []
    for adv in db.advisories:
        if adv.engine == ident.engine or (ident.engine and adv.engine in ADDONS):
            results.append(_judge(adv, ident, assumed, defaults))
    order = {APPLIES: 0, CHECK: 1, OK: 2}
    return sorted(results, key=lambda a: order[a.status])


def _judge(
    adv: Advisory, ident: Identification, assumed: Mapping[str, Any], defaults: Mapping
) -> Assessment:
    why: list[str] = []
    if adv.affected.strip() != "*":
        if adv.engine in ADDONS:
            return Assessment(adv, CHECK, f"{adv.engine} version not exposed; {adv.affected}")
        if ident.version is None:
            return Assessment(adv, CHECK, f"version not exposed; affected {adv.affected}")
        try:
            hit = version_matches(ident.version, adv.affected)
        except ValueError:
            return Assessment(adv, CHECK, f"version {ident.version!r} not comparable")
        if not hit:
            fixed = f" (fixed in {adv.fixed})" if adv.fixed else ""
            return Assessment(adv, OK, f"{ident.version} not in {adv.affected}{fixed}")
        why.append(f"{ident.version} in {adv.affected}")
    unknown = []
    for key, required in adv.requires.items():
        if key in ident.settings:
            value, source = ident.settings[key], "seen"
        elif key in assumed:
            value, source = assumed[key], "declared"
        elif key in defaults:
            value, source = defaults[key], "engine default"
        else:
            unknown.append(key)
            continue
        if not _wanted(required, value):
            return Assessment(adv, OK, f"{key}={_format(value)} ({source})")
        why.append(f"{key}={_format(value)} ({source})")
    if unknown:
        hint = ", ".join(f"--assume {k}=..." for k in unknown)
        return Assessment(adv, CHECK, f"{', '.join(unknown)} not visible; declare: {hint}")
    return Assessment(adv, APPLIES, "; ".join(why) or "always")


# --- report -----------------------------------------------------------------------------


def render(
    ident: Identification, assessments: list[Assessment], standards: tuple[Standard, ...] = ()
) -> str:
    """The audit as text: what was found, a table of verdicts, what to do, and the
    standards that ask for tenant-split caches."""
    lines = [f"target:   {ident.target}"]
    if not ident.reachable:
        lines.append("engine:   target not reachable")
        return "\n".join(lines) + "\n"
    engine = ident.engine or "not identified"
    version = ident.version or "version not exposed"
    lines.append(f"engine:   {engine} {version if ident.engine else ''}".rstrip())
    for item in ident.evidence:
        lines.append(f"  seen:   {item}")
    if ident.models:
        lines.append(f"models:   {', '.join(ident.models)}")
    seen = ", ".join(f"{k}={_format(v)}" for k, v in sorted(ident.settings.items()))
    lines.append(f"settings: {seen or 'none exposed (engine defaults assumed where known)'}")
    if not ident.engine:
        return "\n".join(lines) + "\n"
    lines.append("")
    rows = [("STATUS", "ID", "FIXED IN", "WHY")]
    rows += [(a.status, a.advisory.id, a.advisory.fixed or "-", a.reason) for a in assessments]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        lines.append("  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3])
    todo = [a for a in assessments if a.status != OK]
    if todo:
        lines += ["", "What to do:"]
        for a in todo:
            lines.append(f"  [{a.status}] {a.advisory.id}: {a.advisory.title}")
            lines.append(f"      {a.advisory.action}")
            lines.append(f"      source: {a.advisory.source}")
    applies = sum(a.status == APPLIES for a in assessments)
    checks = sum(a.status == CHECK for a in assessments)
    lines += ["", f"{applies} apply, {checks} to check, {len(assessments) - applies - checks} ok"]
    if standards:
        lines += ["", "Standards to hold the deployment to:"]
        lines += [f"  {s.id}: {s.title}\n      source: {s.source}" for s in standards]
    return "\n".join(lines) + "\n"


def audit_record(
    ident: Identification,
    assessments: list[Assessment],
    db: AdvisoryDB,
    assumed: Mapping[str, Any],
) -> dict:
    """The audit part of an evidence record."""
    return {
        "identification": ident.to_json(),
        "advisories_file": {"path": db.path, "sha256": db.sha256, "entries": len(db.advisories)},
        "assumed": {k: assumed[k] for k in sorted(assumed)},
        "assessments": [a.to_json() for a in assessments],
        "counts": {
            status: sum(a.status == status for a in assessments) for status in (APPLIES, CHECK, OK)
        },
    }

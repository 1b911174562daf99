"""crosstalk audit: version logic, the advisories file, engine identification, and the
command against real servers on loopback (the simulator impersonating vLLM, and a small
aiohttp server answering like SGLang)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from aiohttp import web
from conftest import ROOT, free_port, run_sim

from proxy.assurance.audit import (
    APPLIES,
    CHECK,
    OK,
    AdvisoryError,
    Fetched,
    assess,
    identify_from,
    load_advisories,
    parse_assumption,
    parse_version,
    version_matches,
)
from proxy.defaults import ADVISORIES, shipped


def crosstalk(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --- versions and the data file -----------------------------------------------------


@pytest.mark.parametrize(
    ("version", "spec", "expected"),
    [
        ("0.7.1", "<0.7.2", True),
        ("0.7.2", "<0.7.2", False),
        ("v0.7.2", "<=0.7.2", True),
        ("0.8.5.post1", ">=0.7.0,<0.9.0", True),
        ("0.9", ">=0.7.0,<0.9.0", False),
        ("0.10.2.dev12+gabcdef", "<0.10.2", True),  # a nightly of the fix is not the fix
        ("0.11.0rc2", "<0.11.0", True),
        ("0.5.21", ">=0.5.13,<=0.5.21", True),
        ("0.5.22", ">=0.5.13,<=0.5.21", False),
        ("1.0.0", "*", True),
    ],
)
def test_version_matches(version: str, spec: str, expected: bool) -> None:
    assert version_matches(version, spec) is expected


def test_version_order_and_errors() -> None:
    assert parse_version("0.10.0") > parse_version("0.9.9")
    assert parse_version("0.9") == parse_version("0.9.0")
    with pytest.raises(ValueError):
        parse_version("unknown")
    with pytest.raises(ValueError):
        version_matches("0.1", "~0.1")


def test_shipped_advisories_are_complete_and_cited() -> None:
    db = load_advisories()
    raw = tomllib.loads(shipped(ADVISORIES).read_text())
    assert len(db.advisories) == len(raw["advisory"]) >= 10
    engines = {a.engine for a in db.advisories}
    assert {"vllm", "sglang"} <= engines
    for a in db.advisories:
        assert a.source.startswith("https://"), a.id
        assert all(r.startswith("https://") for r in a.references), a.id
        assert a.action and a.setting and a.title, a.id
        # Every setting an entry needs is one the audit can see, take from --assume, or
        # knows a default for: otherwise it could never be anything but "check".
        for key in a.requires:
            assert isinstance(key, str) and key, a.id
    ids = [a.id for a in db.advisories]
    assert "GHSA-rm76-4mrf-v9r8" in ids and "GHSA-4qjh-9fv9-r85r" in ids


def test_bad_advisories_file_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[advisory]]\nid = "X-1"\nkind = "advisory"\nengine = "vllm"\n')
    with pytest.raises(AdvisoryError, match="X-1"):
        load_advisories(bad)
    entry = dict(tomllib.loads(shipped(ADVISORIES).read_text())["advisory"][0])
    entry["affected"] = "~1.0"
    lines = [f"{k} = {json.dumps(v)}" for k, v in entry.items() if not isinstance(v, dict)]
    bad.write_text("[[advisory]]\n" + "\n".join(lines) + "\n")
    with pytest.raises(AdvisoryError, match="bad version condition"):
        load_advisories(bad)


def test_assumptions() -> None:
    assert parse_assumption("multimodal=false") == ("multimodal", False)
    assert parse_assumption("prefix_hash_algo=xxhash") == ("prefix_hash_algo", "xxhash")
    with pytest.raises(ValueError):
        parse_assumption("multimodal")


# --- identification (pure) ----------------------------------------------------------


def ok(body: object, server: str = "uvicorn") -> Fetched:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Fetched(200, server, data)


MISSING = Fetched(404, "uvicorn", b'{"detail":"Not Found"}')


def test_identify_vllm_with_metrics_settings() -> None:
    metrics = (
        b"# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        b'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",'
        b'prefix_caching_hash_algo="xxhash"} 1.0\n'
    )
    ident = identify_from(
        "http://x",
        {
            "/version": ok({"version": "0.12.0"}),
            "/v1/models": ok({"data": [{"id": "m", "owned_by": "vllm"}]}),
            "/metrics": ok(metrics),
            "/get_server_info": MISSING,
            "/info": MISSING,
            "/props": MISSING,
        },
    )
    assert (ident.engine, ident.version) == ("vllm", "0.12.0")
    assert ident.settings == {
        "prefix_caching": True,
        "prefix_hash_algo": "xxhash",
        "prefix_hash_default": False,
    }
    verdicts = {a.advisory.id: a for a in assess(ident, load_advisories())}
    assert verdicts["vllm-prefix-hash-xxhash"].status == APPLIES
    assert "(seen)" in verdicts["vllm-prefix-hash-xxhash"].reason
    assert verdicts["GHSA-rm76-4mrf-v9r8"].status == OK


def test_identify_sglang_tgi_llamacpp() -> None:
    sglang = identify_from(
        "http://x",
        {
            "/get_server_info": ok(
                {
                    "version": "0.5.19",
                    "tp_size": 1,
                    "disaggregation_mode": "prefill",
                    "disable_radix_cache": False,
                    "enable_lmcache": True,
                }
            ),  # fmt: skip
            "/version": ok({"version": "0.5.19"}),
        },
    )
    assert (sglang.engine, sglang.version) == ("sglang", "0.5.19")
    assert sglang.settings == {"prefix_caching": True, "disaggregation": True, "lmcache": True}
    tgi = identify_from(
        "http://x",
        {"/info": ok({"model_id": "m", "version": "2.4.1", "router": "text-generation-router"})},
    )
    assert (tgi.engine, tgi.version) == ("tgi", "2.4.1")
    llama = identify_from(
        "http://x",
        {"/props": ok({"default_generation_settings": {}, "build_info": "b4800-1a2b3c"})},
    )
    assert (llama.engine, llama.version) == ("llamacpp", "b4800")
    assert "build 4800, commit 1a2b3c" in " ".join(llama.evidence)
    nothing = identify_from("http://x", {"/version": Fetched(0, error="refused")})
    assert not nothing.reachable and nothing.engine is None


def test_llamacpp_built_without_git_history_claims_no_version() -> None:
    """An sdist or tarball build reports build number 1: no release can be inferred,
    so every versioned llama.cpp advisory is to check, never ok."""
    ident = identify_from(
        "http://x",
        {"/props": ok({"build_info": "b1-0c1e570", "total_slots": 4}, server="llama.cpp")},
    )
    assert (ident.engine, ident.version, ident.settings) == ("llamacpp", None, {"slots": 4})
    assert any("build number 1" in e and "0c1e570" in e for e in ident.evidence)
    verdicts = {a.advisory.id: a.status for a in assess(ident, load_advisories())}
    assert verdicts["llamacpp-system-prompt-leak"] == CHECK
    assert verdicts["llamacpp-cache-ram-stale-restore"] == APPLIES  # both on by default
    declared = assess(ident, load_advisories(), {"cache_ram": False})
    assert {a.advisory.id: a.status for a in declared}["llamacpp-cache-ram-stale-restore"] == OK


def test_engines_that_answer_version_like_vllm_are_told_apart_by_owner() -> None:
    for owner, engine in (("tensorrt_llm", "tensorrt_llm"), ("vllm-mlx", "vllm_mlx")):
        ident = identify_from(
            "http://x",
            {
                "/version": ok({"version": "1.2.0"}),
                "/v1/models": ok({"data": [{"id": "m", "owned_by": owner}]}),
            },
        )
        assert (ident.engine, ident.version) == (engine, "1.2.0")
        ids = {a.advisory.engine for a in assess(ident, load_advisories())}
        assert ids <= {engine, "lmcache"} and engine in ids


def test_lmcache_advisories_follow_the_engine_that_shows_lmcache() -> None:
    metrics = (
        'vllm:cache_config_info{enable_prefix_caching="True",kv_offloading_backend="lmcache",'
        'kv_offloading_size="64.0"} 1.0\n'
    )
    ident = identify_from(
        "http://x", {"/version": ok({"version": "0.26.0"}), "/metrics": ok(metrics.encode())}
    )
    assert ident.engine == "vllm" and ident.settings["lmcache"] is True
    verdicts = {a.advisory.id: a for a in assess(ident, load_advisories())}
    # In-process connector or MP mode is not visible: to check, never ok.
    assert verdicts["lmcache-connectorv1-cache-salt"].status == CHECK
    assert "lmcache_connector" in verdicts["lmcache-connectorv1-cache-salt"].reason
    plain = identify_from("http://x", {"/version": ok({"version": "0.26.0"})})
    plain_verdicts = {a.advisory.id: a.status for a in assess(plain, load_advisories())}
    assert plain_verdicts["lmcache-connectorv1-cache-salt"] == OK  # lmcache default: off


def test_unknown_version_is_check_not_ok() -> None:
    ident = identify_from(
        "http://x", {"/v1/models": ok({"data": [{"id": "m", "owned_by": "vllm"}]})}
    )
    assert ident.engine == "vllm" and ident.version is None
    statuses = {a.advisory.id: a.status for a in assess(ident, load_advisories())}
    assert statuses["GHSA-rm76-4mrf-v9r8"] == CHECK


# --- the command against real servers -----------------------------------------------


def test_audit_flags_affected_simulator_and_passes_fixed_one(tmp_path: Path) -> None:
    with run_sim(tmp_path, "--engine-version", "0.8.5") as affected:
        flagged = crosstalk("audit", "--target", affected.url)
        declared = crosstalk("audit", "--target", affected.url, "--assume", "prefix_caching=false")
    with run_sim(tmp_path, "--engine-version", "0.11.0") as fixed:
        passed = crosstalk("audit", "--target", fixed.url)
        salt = crosstalk(
            "audit", "--target", fixed.url, "--assume", "cache_salt_from_gateway=false"
        )
    assert flagged.returncode == 1, flagged.stdout + flagged.stderr
    assert "engine:   vllm 0.8.5" in flagged.stdout
    rows = {line.split()[1]: line.split()[0] for line in flagged.stdout.splitlines() if
            line.split() and line.split()[0] in (APPLIES, CHECK, OK)}  # fmt: skip
    assert rows["GHSA-4qjh-9fv9-r85r"] == APPLIES  # 0.8.5 < 0.9.0, prefix caching default on
    assert rows["vllm-prefix-hash-sha256"] == APPLIES
    assert rows["GHSA-rm76-4mrf-v9r8"] == OK  # fixed in 0.7.2
    assert "VERDICT:  ADVISORY APPLIES" in flagged.stdout.upper()
    assert "https://github.com/vllm-project/vllm/security/advisories/GHSA-4qjh-9fv9-r85r" in (
        flagged.stdout
    )
    # Prefix caching declared off: the prefix-cache advisories no longer apply.
    assert declared.returncode == 0, declared.stdout
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "engine:   vllm 0.11.0" in passed.stdout
    assert "0 apply" in passed.stdout
    # A setting the audit cannot see, declared by the operator, decides an entry.
    assert salt.returncode == 1 and "vllm-cache-salt" in salt.stdout


def fake_sglang(version: str, mode: str) -> web.Application:
    """Answers like an SGLang server: /get_server_info (server args), /get_model_info."""
    app = web.Application()
    info = {
        "version": version, "model_path": "Qwen/Qwen2.5-0.5B-Instruct", "tp_size": 1,
        "disable_radix_cache": False, "disaggregation_mode": mode, "enable_lmcache": False,
    }  # fmt: skip

    async def server_info(_request: web.Request) -> web.Response:
        return web.json_response(info)

    async def model_info(_request: web.Request) -> web.Response:
        return web.json_response({"model_path": info["model_path"], "is_generation": True})

    async def models(_request: web.Request) -> web.Response:
        entry = {"id": info["model_path"], "object": "model", "owned_by": "sglang"}
        return web.json_response({"object": "list", "data": [entry]})

    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/v1/models", models)
    return app


async def audit_fake(app: web.Application, *args: str) -> tuple[int, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "audit", "--target", f"http://127.0.0.1:{port}", *args,
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode or 0, out.decode()
    finally:
        await runner.cleanup()


def test_audit_sglang_disaggregation() -> None:
    code, out = asyncio.run(audit_fake(fake_sglang("0.5.19", "prefill")))
    assert code == 1, out
    assert "engine:   sglang 0.5.19" in out
    assert "disaggregation=true" in out
    assert any(
        line.startswith("applies") and "CVE-2026-92972" in line for line in out.splitlines()
    ), out
    code, out = asyncio.run(audit_fake(fake_sglang("0.5.20", "null")))
    assert code == 0, out
    assert "CVE-2026-92972" in out and "0 apply" in out


def test_audit_unreachable_target() -> None:
    result = crosstalk("audit", "--target", f"http://127.0.0.1:{free_port()}", "--timeout", "2")
    assert result.returncode == 2
    assert "not reachable" in result.stdout

"""TLS both ways, with certificates the test makes (the ``cryptography`` package):
clients reach ``crosstalk run`` over HTTPS with the operator's certificate (HTTP/2 where
offered), and crosstalk reaches an HTTPS upstream with verification on, a custom CA
bundle, and a client certificate when the upstream demands one. A wrong CA is a clear
error and nothing reaches the engine."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx2
import openai
import pytest
from conftest import ROOT, start_server, stop
from pki import LOOPBACK, issue, make_ca


@pytest.fixture(scope="module")
def pki(module_tmp: Path) -> dict[str, Path]:
    d = module_tmp / "pki"
    d.mkdir()
    ca, wrong = make_ca(d, "test-ca"), make_ca(d, "wrong-ca")
    issue(d, "crosstalk", ca)
    issue(d, "engine", ca)
    issue(d, "crosstalk-client", ca, client=True)
    return {"ca": ca[0], "wrong_ca": wrong[0], "dir": d}


# --- servers --------------------------------------------------------------------------------


@contextmanager
def https_sim(tmp: Path, pki: dict[str, Path], *, client_ca: bool = False) -> Iterator[str]:
    d = pki["dir"]
    extra = ["--tls-client-ca", str(pki["ca"])] if client_ca else []

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "proxy", "sim", "--port", str(port),
                "--tls-cert", str(d / "engine.crt"), "--tls-key", str(d / "engine.key"),
                *extra]  # fmt: skip

    with (tmp / "sim.stderr").open("wb") as err:
        proc, port = start_server(command, stderr=err)
    try:
        yield f"https://{LOOPBACK}:{port}"
    finally:
        stop(proc)


@contextmanager
def crosstalk(tmp: Path, upstream: str, tls: dict[str, object]) -> Iterator[tuple[str, Path]]:
    name = f"crosstalk-{len(list(tmp.glob('crosstalk-*.toml')))}"
    cfg = tmp / f"{name}.toml"
    lines = [f"{k} = {json.dumps(v)}" for k, v in tls.items()]
    cfg.write_text("[tls]\n" + "\n".join(lines) + "\n")
    log = tmp / f"{name}.jsonl"

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "proxy", "run", "--listen-port", str(port),
                "--upstream", upstream, "--config", str(cfg), "--log-file", str(log)]  # fmt: skip

    stderr = tmp / f"{name}.stderr"
    with stderr.open("wb") as err:
        proc, port = start_server(command, stderr=err)
    try:
        yield f"{LOOPBACK}:{port}", log
    finally:
        assert stop(proc) == 0, stderr.read_text(errors="replace")[-4000:]


def engine_saw(upstream: str, pki: dict[str, Path], request_id: str, cert: bool = False):
    """The request headers the HTTPS simulator received for ``request_id``, or None."""
    context = trusting(pki["ca"])
    if cert:
        d = pki["dir"]
        context.load_cert_chain(d / "crosstalk-client.crt", d / "crosstalk-client.key")
    try:
        url = f"{upstream}/_sim/headers/{request_id}"
        with urllib.request.urlopen(url, context=context, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def trusting(ca: Path) -> ssl.SSLContext:
    """What a client that trusts only ``ca`` verifies servers with."""
    return ssl.create_default_context(cafile=str(ca))


def sdk(base: str, *, verify, http2: bool = False, request_id: str = "tls-1") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{base}/v1", api_key="sk-tls", max_retries=0, timeout=30,
        default_headers={"X-Request-ID": request_id},
        http_client=httpx2.Client(verify=verify, http2=http2),
    )  # fmt: skip


def chat(client: openai.OpenAI) -> str:
    answer = client.chat.completions.create(
        model="sim-llm-1", messages=[{"role": "user", "content": "Hello over TLS"}]
    )
    return answer.choices[0].message.content or ""


# --- tests ----------------------------------------------------------------------------------


def test_clients_reach_crosstalk_over_https_with_the_operators_certificate(tmp_path, pki):
    """The operator's certificate (verified by the client against the test CA), HTTP/2
    when the client offers it, and a plain HTTP upstream behind."""
    d = pki["dir"]
    with crosstalk(tmp_path, "", {"certificate": str(d / "crosstalk-combined.pem")}) as (addr, _):
        assert chat(sdk(f"https://{addr}", verify=trusting(pki["ca"])))
        with httpx2.Client(verify=trusting(pki["ca"]), http2=True) as c:
            r = c.post(
                f"https://{addr}/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "h2?"}]},
                headers={"Authorization": "Bearer sk-tls"},
            )
        assert r.status_code == 200 and r.http_version == "HTTP/2"
        with pytest.raises(openai.APIConnectionError):  # a client that trusts another CA
            chat(sdk(f"https://{addr}", verify=trusting(pki["wrong_ca"])))


def test_upstream_https_is_verified_against_the_configured_ca(tmp_path, pki):
    with https_sim(tmp_path, pki) as upstream:
        with crosstalk(tmp_path, upstream, {"upstream_ca": str(pki["ca"])}) as (addr, _):
            assert chat(sdk(f"http://{addr}", verify=False, request_id="good-ca"))
        assert engine_saw(upstream, pki, "good-ca") is not None
        wrong = {"upstream_ca": str(pki["wrong_ca"])}
        with (
            crosstalk(tmp_path, upstream, wrong) as (addr, _),
            pytest.raises(openai.APIStatusError) as info,
        ):
            chat(sdk(f"http://{addr}", verify=False, request_id="wrong-ca"))
        assert info.value.status_code == 502
        assert "certificate" in info.value.response.text.lower()
        assert engine_saw(upstream, pki, "wrong-ca") is None  # nothing forwarded


def test_upstream_that_demands_a_client_certificate_gets_crosstalks(tmp_path, pki):
    d = pki["dir"]
    with https_sim(tmp_path, pki, client_ca=True) as upstream:
        tls = {"upstream_ca": str(pki["ca"])}
        with crosstalk(tmp_path, upstream, tls) as (addr, _):
            with pytest.raises(openai.APIStatusError) as info:
                chat(sdk(f"http://{addr}", verify=False, request_id="no-cert"))
            assert info.value.status_code == 502
        mtls = {**tls, "client_certificate": str(d / "crosstalk-client-combined.pem")}
        with crosstalk(tmp_path, upstream, mtls) as (addr, _):
            assert chat(sdk(f"http://{addr}", verify=False, request_id="with-cert"))
        assert engine_saw(upstream, pki, "with-cert", cert=True) is not None
        assert engine_saw(upstream, pki, "no-cert", cert=True) is None


def test_a_missing_certificate_file_is_a_clear_error(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[tls]\ncertificate = "/nonexistent/cert.pem"\n')
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "run", "--config", str(cfg)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "tls.certificate: no such file" in done.stderr

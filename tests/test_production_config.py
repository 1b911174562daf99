"""The production configuration of the README ("Running it"), started as written:
config/production.example.toml in a directory holding the certificates it names, in
front of an HTTPS engine (the simulator with a certificate of the test's own CA). Only
the addresses differ (loopback ports). Enforce mode blocks a leak from request one,
tenants come from the gateway that proves itself, and the admin port says ready."""

from __future__ import annotations

import json
import sys
import tomllib
import urllib.request

import httpx2
import openai
import pytest
from conftest import ROOT, free_port, read_events, start_server, stop, wait_for_events
from pki import issue, make_ca
from test_tls import https_sim, trusting

CONFIG = ROOT / "config" / "production.example.toml"


@pytest.fixture
def site(tmp_path):
    """The directory crosstalk runs in, with certs/ as the config names them."""
    certs = tmp_path / "certs"
    certs.mkdir()
    ca = make_ca(certs, "site-ca")
    issue(certs, "crosstalk", ca)
    issue(certs, "engine", ca)
    (certs / "crosstalk.pem").write_bytes((certs / "crosstalk-combined.pem").read_bytes())
    (certs / "engine-ca.pem").write_bytes(ca[0].read_bytes())
    return tmp_path, {"ca": ca[0], "dir": certs}


def test_the_production_config_runs_as_written(site):
    root, pki = site
    settings = tomllib.loads(CONFIG.read_text())
    secret = settings["tenants"]["gateway_secret"]
    admin = free_port()
    with https_sim(root, pki) as upstream:

        def command(port: int) -> list[str]:
            return [sys.executable, "-m", "proxy", "run", "--config", str(CONFIG),
                    "--upstream", upstream, "--listen-port", str(port),
                    "--metrics-port", str(admin)]  # fmt: skip

        with (root / "crosstalk.stderr").open("wb") as err:
            proc, port = start_server(command, stderr=err, cwd=root)
        try:
            base = f"https://127.0.0.1:{port}/v1"

            def client(tenant: str, rid: str, **headers: str) -> openai.OpenAI:
                return openai.OpenAI(
                    base_url=base, api_key="sk-gateway", max_retries=0, timeout=30,
                    http_client=httpx2.Client(verify=trusting(pki["ca"])),
                    default_headers={"X-Tenant-ID": tenant, "X-Crosstalk-Gateway": secret,
                                     "X-Request-ID": rid, **headers},
                )  # fmt: skip

            prompt = (
                "Contract draft: Halvorsen Quarry lease, 1,284,500 NOK, signed by Marit Aasland."
            )
            ask = {"model": "m", "messages": [{"role": "user", "content": prompt}]}
            assert client("acme", "source").chat.completions.create(**ask).choices
            fault = {"x-sim-fault": "prompt_page", "x-sim-fault-source": "source",
                     "x-sim-fault-words": "12"}  # fmt: skip
            with pytest.raises(openai.APIStatusError) as info:
                client("globex", "victim", **fault).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "Hi"}]
                )
            assert info.value.status_code == 451
            assert info.value.body["code"] == "cross_tenant_leak"
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz", timeout=10) as r:
                assert json.loads(r.read())["ready"] is True
            log = root / settings["proxy"]["log_file"]
            events = wait_for_events(
                log, lambda ev: sum(e["event"] == "exchange" for e in ev) >= 2, timeout=30
            )
        finally:
            assert stop(proc) == 0
    tenants = {e["request_id"]: e["tenant"] for e in events if e["event"] == "exchange"}
    assert tenants == {"source": "acme", "victim": "globex"}
    blocked = [e for e in events if e["event"] == "leak.detected"]
    assert blocked and blocked[0]["action"] == "blocked" and blocked[0]["source_tenant"] == "acme"
    assert (root / settings["detection"]["state_file"]).exists()  # saved at exit
    assert any(e["event"] == "journal.opened" for e in read_events(log))

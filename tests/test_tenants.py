"""Tenant identity no client can forge: a tenant header or a body ``user`` is a claim,
taken only from a trusted peer or with the gateway's secret; otherwise the credential
decides. Unit rules first, then spoofing attempts through a real mitmdump, with the
client on another loopback address than the trusted one."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request

import httpx2
import jwt
import openai
import pytest
from conftest import ROOT, free_port, run_mitmdump, run_sim, wait_for_events
from cryptography.hazmat.primitives.asymmetric import rsa
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import ConfigError, load_text
from proxy.tenants import Identity, TenantRules, hash_key, identify, load_jwt_key, resolve_tenant

SECRET = "gateway-secret-0123456789"


class Headers(dict):
    """Case-insensitive lookups, as mitmproxy's headers do."""

    def get(self, key, default=None):
        return next((v for k, v in self.items() if k.lower() == key.lower()), default)


def rules(**kw) -> TenantRules:
    return TenantRules(secret=b"k", **kw)


def test_claims_count_only_from_trusted_peers_or_with_the_gateway_secret():
    r = rules(trusted_peers=("10.0.0.0/8",), gateway_secret=SECRET)
    spoof = Headers({"X-Tenant-ID": "victim", "Authorization": "Bearer sk-mine"})
    assert r.trusts("10.1.2.3", spoof) and r.trusts("::ffff:10.1.2.3", spoof)
    assert not r.trusts("192.168.1.5", spoof) and not r.trusts(None, spoof)
    assert r.trusts("192.168.1.5", Headers({"X-Crosstalk-Gateway": SECRET}))
    assert not r.trusts("192.168.1.5", Headers({"X-Crosstalk-Gateway": SECRET[:-1] + "x"}))
    untrusted = identify(r, spoof, "victim", trusted=False)
    assert untrusted.tenant.startswith("key:")  # the credential decides
    assert untrusted.ignored == (("header", "victim"),)
    assert identify(r, spoof, None, trusted=True).tenant == "victim"
    # No credential at all: an untrusted claim names nobody.
    alone = identify(r, Headers({"X-Tenant-ID": "victim"}), "victim", trusted=False)
    assert alone.tenant is None and alone.ignored == (("header", "victim"), ("user", "victim"))


def test_default_trusts_loopback_only():
    r = rules()
    assert r.trusts("127.0.0.1", Headers()) and r.trusts("::1", Headers())
    assert not r.trusts("10.0.0.1", Headers())
    assert not rules(trusted_peers=()).trusts("127.0.0.1", Headers())


def test_api_keys_can_be_written_as_their_hash():
    r = rules(api_keys={hash_key("sk-live-abc"): "acme", "sk-plain": "globex"})
    assert identify(r, Headers({"Authorization": "Bearer sk-live-abc"}), None, trusted=False) == (
        identify(r, Headers({"x-api-key": "sk-live-abc"}), None, trusted=False)
    )
    assert r.tenant_of_key("sk-live-abc") == "acme" and r.tenant_of_key("sk-plain") == "globex"
    assert r.tenant_of_key("sk-other").startswith("key:")
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "hash-key", "acme"],
        input="sk-live-abc\n", cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == f'"{hash_key("sk-live-abc")}" = "acme"'
    assert "sk-live-abc" not in done.stdout


# --- through mitmdump -------------------------------------------------------------------


def client(url: str, key: str, source: str = "127.0.0.1", **headers: str) -> openai.OpenAI:
    """An SDK client whose connections leave from ``source`` (a loopback address)."""
    transport = httpx2.HTTPTransport(local_address=source)
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key=key, default_headers=headers, max_retries=0, timeout=30,
        http_client=httpx2.Client(transport=transport),
    )  # fmt: skip


def ask(c: openai.OpenAI, text: str) -> str:
    out = c.chat.completions.create(model="m", messages=[{"role": "user", "content": text}])
    return out.choices[0].message.content or ""


@contextlib.contextmanager
def proxy_with(tmp_path, config: str):
    """The simulator and mitmdump configured with ``config`` (TOML): (sim, proxy, the
    metrics port)."""
    cfg = tmp_path / "tenants.toml"
    cfg.write_text(config)
    metrics = free_port()
    with (
        run_sim(tmp_path) as sim,
        run_mitmdump(
            tmp_path, sim.url, f"crosstalk_config={cfg}", f"crosstalk_metrics_port={metrics}"
        ) as p,
    ):
        yield sim, p, metrics


@pytest.fixture
def gateway(tmp_path):
    """Trusted peer 127.0.0.2 (the "gateway"); clients on 127.0.0.1 are untrusted."""
    with proxy_with(
        tmp_path,
        '[tenants]\nsources = ["header", "api_key", "user"]\ntrusted_peers = ["127.0.0.2/32"]\n'
        f'gateway_secret = "{SECRET}"\n'
        '[tenants.api_keys]\n"sk-alpha" = "alpha"\n'
        f'"{hash_key("sk-beta")}" = "beta"\n',
    ) as running:
        yield running


def untrusted_claims(port: int) -> float:
    """``crosstalk_tenant_claims_untrusted_total`` from the admin port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "crosstalk_tenant_claims_untrusted_total"
    )


SECRET_PROMPT = (
    "Draft the Q3 note: Project Marlowe Kestrel closes on 14 May, owner Ingrid Vasquez-Oduya, "
    "budget 4,817,230 EUR, contact ingrid.vasquez@marlowe-kestrel.example.org."
)


def leak_into(url: str, key: str, source_id: str, **headers: str) -> None:
    """A request whose answer the simulator corrupts with a page of ``source_id``'s prompt."""
    fault = {"x-sim-fault": "prompt_page", "x-sim-fault-source": source_id,
             "x-sim-fault-words": "24", "X-Request-ID": "victim"}  # fmt: skip
    ask(client(url, key, **fault, **headers), "Hi there")


def test_a_victim_naming_the_source_tenant_still_gets_its_leak_found(gateway):
    """The spoof of the issue: the client that receives alpha's text also sends
    ``X-Tenant-ID: alpha``. From an untrusted peer the claim is ignored (and logged), the
    API key says beta, and the leak is a finding."""
    sim, proxy, metrics = gateway
    ask(client(proxy.url, "sk-alpha", **{"X-Request-ID": "source"}), SECRET_PROMPT)
    leak_into(proxy.url, "sk-beta", "source", **{"X-Tenant-ID": "alpha"})
    events = wait_for_events(
        proxy.log, lambda ev: sum(e["event"] == "exchange" for e in ev) >= 2, timeout=30
    )
    untrusted = [e for e in events if e["event"] == "tenant.untrusted"]
    assert untrusted and untrusted[0]["claimed"] == ["alpha"] and untrusted[0]["tenant"] == "beta"
    assert untrusted[0]["peer"] == "127.0.0.1"
    found = [e for e in events if e["event"] == "leak.detected" and e["request_id"] == "victim"]
    assert found and found[0]["tenant"] == "beta" and found[0]["source_tenant"] == "alpha"
    assert untrusted_claims(metrics) == 1  # counted for alerts, not only logged


def test_trusted_gateway_claims_count_and_its_secret_never_goes_upstream(gateway):
    sim, proxy, metrics = gateway
    # From the trusted peer: the header names the tenant.
    ask(client(proxy.url, "sk-alpha", "127.0.0.2", **{"X-Tenant-ID": "acme",
                                                      "X-Request-ID": "from-peer"}), "hello")  # fmt: skip
    # From anywhere, with the secret: the header counts too, and the secret is removed.
    with_secret = client(proxy.url, "sk-alpha", **{"X-Tenant-ID": "initech",
                         "X-Crosstalk-Gateway": SECRET, "X-Request-ID": "with-secret"})  # fmt: skip
    ask(with_secret, "hello")
    events = wait_for_events(
        proxy.log, lambda ev: sum(e["event"] == "exchange" for e in ev) >= 2, timeout=30
    )
    tenants = {e["request_id"]: e["tenant"] for e in events if e["event"] == "exchange"}
    assert tenants == {"from-peer": "acme", "with-secret": "initech"}
    assert not [e for e in events if e["event"] == "tenant.untrusted"]
    assert untrusted_claims(metrics) == 0
    received = sim.headers("with-secret")
    assert received.get("x-tenant-id") == "initech"  # the claim itself passes through
    assert "x-crosstalk-gateway" not in received and SECRET not in str(received)


def test_one_key_rotating_fifty_names_cannot_make_a_victims_text_common(gateway):
    """Poisoning: commonness counts tenants. One credential sending 50 made-up tenant
    names from an untrusted peer stays one tenant, so the victim's text stays private
    and its leak is still found."""
    sim, proxy, metrics = gateway
    ask(client(proxy.url, "sk-alpha", **{"X-Request-ID": "source"}), SECRET_PROMPT)
    attacker = "sk-attacker-0123456789abcdef"
    for i in range(50):
        ask(client(proxy.url, attacker, **{"X-Tenant-ID": f"fake-{i:02d}",
                                            "X-Request-ID": f"poison-{i:02d}"}), SECRET_PROMPT)  # fmt: skip
    leak_into(proxy.url, "sk-beta", "source")
    events = wait_for_events(
        proxy.log, lambda ev: sum(e["event"] == "exchange" for e in ev) >= 52, timeout=60
    )
    tenants = {e["request_id"]: e["tenant"] for e in events if e["event"] == "exchange"}
    attacker_tenant = tenants["poison-00"]
    assert {tenants[f"poison-{i:02d}"] for i in range(50)} == {attacker_tenant}
    assert attacker_tenant.startswith("key:")
    assert len([e for e in events if e["event"] == "tenant.untrusted"]) == 50
    found = [e for e in events if e["event"] == "leak.detected" and e["request_id"] == "victim"]
    # Two tenants hold the text now (alpha, and the attacker who sent it 50 times): still
    # private to them, not common, so the leak to beta is found.
    assert found and found[0]["tenant"] == "beta"
    assert found[0]["source_tenant"] in ("alpha", attacker_tenant)


# --- JWT bearer tokens ------------------------------------------------------------------


def es256_pair() -> tuple[object, bytes]:
    """A signing key (the operator's identity provider) and its PEM public key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return key, public


def token(key, ttl: float = 300, **claims) -> str:
    return jwt.encode({"exp": int(time.time() + ttl), **claims}, key, algorithm="ES256")


def test_jwt_claim_names_the_tenant_only_when_the_token_verifies():
    key, public = es256_pair()
    forger, _ = es256_pair()
    r = rules(
        sources=("jwt", "api_key"), jwt_key=load_jwt_key(public, ("ES256",)),
        jwt_algorithms=("ES256",), jwt_claim="org", jwt_audience="crosstalk",
    )  # fmt: skip

    def who(bearer: str):
        return identify(r, Headers({"Authorization": f"Bearer {bearer}"}), None, trusted=False)

    good = token(key, org="acme", aud="crosstalk")
    assert who(good) == Identity("acme", ())
    # Forged signature, expired, wrong audience, no exp: ignored and reported with what
    # they claimed; the bearer credential then decides as an API key (its own pseudonym).
    for bad in (
        token(forger, org="acme", aud="crosstalk"),
        token(key, ttl=-120, org="acme", aud="crosstalk"),
        token(key, org="acme", aud="someone-else"),
        jwt.encode({"org": "acme", "aud": "crosstalk"}, key, algorithm="ES256"),
    ):
        got = who(bad)
        assert got.tenant == r.tenant_of_key(bad) and got.tenant.startswith("key:")
        assert got.ignored == (("jwt", "acme"),)
    # alg "none"; a header naming an algorithm this key does not serve (PyJWT would raise
    # TypeError or InvalidKeyError if it were allowed); an HMAC token keyed with the
    # public key (algorithm confusion).
    unsigned = jwt.encode({"org": "acme", "exp": int(time.time()) + 300}, None, algorithm="none")
    assert who(unsigned).ignored == (("jwt", "acme"),)
    payload = {"org": "acme", "aud": "crosstalk", "exp": int(time.time()) + 300}
    rsa_signed = jwt.encode(payload, rsa.generate_private_key(65537, 2048), algorithm="RS256")
    assert who(rsa_signed).ignored == (("jwt", "acme"),)
    confused = jwt.encode(payload, b"k" * 32, algorithm="HS256", headers={"alg": "HS256"})
    assert who(confused).ignored == (("jwt", "acme"),)
    header, payload, _ = good.split(".")
    assert who(f"{header}.{payload}.AAAA").ignored == (("jwt", "acme"),)
    # A plain API key is not a token: no claim was made, nothing reported.
    assert who("sk-plain-key") == Identity(r.tenant_of_key("sk-plain-key"), ())
    # A valid token without the claim names nobody through this source.
    assert who(token(key, sub="u1", aud="crosstalk")).ignored == ()
    # No audience configured: a token issued for some audience (another service) fails.
    anyone = rules(sources=("jwt",), jwt_key=r.jwt_key, jwt_algorithms=("ES256",))
    aimed = token(key, sub="acme", aud="billing")
    assert identify(anyone, Headers({"x-api-key": aimed}), None, trusted=False).tenant is None
    assert (
        identify(anyone, Headers({"x-api-key": token(key, sub="acme")}), None, trusted=False)
    ).tenant == "acme"
    # Replay of a capture: the token has expired since, its signature still decides.
    expired = token(key, ttl=-3600, org="acme", aud="crosstalk")
    assert resolve_tenant(r, Headers({"Authorization": f"Bearer {expired}"}), None) == "acme"


def test_jwt_keys_and_algorithms_are_checked_when_loaded():
    _, public = es256_pair()
    not_pem = b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"
    for data, algorithms, says in (
        (public, ("HS256", "ES256"), "cannot share a key"),
        (public, ("none",), "some of"),
        (b"short\n", ("HS256",), ">= 32 bytes"),
        (b"s" * 40, ("HS256", "HS384"), ">= 48 bytes"),
        (public + b"padding" * 8, ("HS256",), "cannot be a PEM key"),
        # The key must fit every algorithm listed, or a forged header would reach PyJWT
        # with a key it refuses (an exception in the request hook, not a verdict).
        (public, ("ES256", "ES384"), "cannot verify ES384"),
        (public, ("RS256",), "cannot verify RS256"),
        (not_pem, ("RS256",), "not a PEM"),
    ):
        with pytest.raises(ValueError, match=says):
            load_jwt_key(data, algorithms)
    with pytest.raises(ValueError, match="needs a verification key"):
        rules(sources=("jwt",))
    assert load_jwt_key(b" " + b"s" * 32 + b"\n", ("HS256",)) == b"s" * 32


def test_a_jwt_from_the_operators_gateway_names_the_tenant_through_mitmdump(tmp_path):
    """The SDK sends a token signed by the operator's identity provider as its API key:
    the tenant is its claim. A token signed by anyone else claims the same tenant and is
    ignored (logged, counted): its leak from that tenant is still a finding."""
    key, public = es256_pair()
    forger, _ = es256_pair()
    (tmp_path / "idp.pem").write_bytes(public)
    config = (
        '[tenants]\nsources = ["jwt", "api_key"]\n'
        f'jwt_key_file = "{tmp_path / "idp.pem"}"\njwt_algorithms = ["ES256"]\n'
        'jwt_claim = "tenant"\njwt_issuer = "https://idp.example"\n'
    )
    with proxy_with(tmp_path, config) as (_, proxy, metrics):
        alpha = token(key, tenant="alpha", iss="https://idp.example")
        ask(client(proxy.url, alpha, **{"X-Request-ID": "source"}), SECRET_PROMPT)
        forged = token(forger, tenant="alpha", iss="https://idp.example")
        leak_into(proxy.url, forged, "source")
        events = wait_for_events(
            proxy.log, lambda ev: sum(e["event"] == "exchange" for e in ev) >= 2, timeout=30
        )
        assert untrusted_claims(metrics) == 1
    tenants = {e["request_id"]: e["tenant"] for e in events if e["event"] == "exchange"}
    assert tenants["source"] == "alpha" and tenants["victim"].startswith("key:")
    untrusted = [e for e in events if e["event"] == "tenant.untrusted"]
    assert [(u["sources"], u["claimed"]) for u in untrusted] == [(["jwt"], ["alpha"])]
    found = [e for e in events if e["event"] == "leak.detected" and e["request_id"] == "victim"]
    assert found and found[0]["source_tenant"] == "alpha"
    assert forged not in proxy.log.read_text() and alpha not in proxy.log.read_text()


def test_jwt_configuration_errors_are_named(tmp_path):
    (tmp_path / "idp.pem").write_bytes(es256_pair()[1])
    key_file = f'jwt_key_file = "{tmp_path / "idp.pem"}"\njwt_algorithms = ["ES256"]\n'
    assert load_text(f'[tenants]\nsources = ["jwt", "api_key"]\n{key_file}')
    for text, says in (
        (f'[tenants]\nsources = ["api_key", "jwt"]\n{key_file}', "put 'jwt' before"),
        ('[tenants]\nsources = ["jwt"]\n', "set tenants.jwt_key_file"),
        (f'[tenants]\nsources = ["jwt"]\n{key_file}jwt_claim = ""\n', "jwt_claim"),
        ('[tenants]\njwt_algorithms = [["RS256"]]\n', "a list of names"),
        ('[tenants]\nsources = [["jwt"]]\n', "a list of names"),
    ):
        with pytest.raises(ConfigError, match=says):
            load_text(text)


def test_an_unusable_jwt_key_file_is_a_clear_error_at_start(tmp_path):
    (tmp_path / "bad.pem").write_text("not a key\n")
    cfg = tmp_path / "jwt.toml"
    cfg.write_text(f'[tenants]\nsources = ["jwt"]\njwt_key_file = "{tmp_path / "bad.pem"}"\n')
    (tmp_path / "capture.jsonl").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "replay", "--config", str(cfg),
         str(tmp_path / "capture.jsonl")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "tenants.jwt_key_file" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr

"""Prevention: tenant-keyed cache_salt and canaries (proxy/prevention.py, proxy/mitm/prevention_addon.py).

Library tests (salts, canaries, the request rewrite, the canary stripper at every cut),
then through a real mitmdump with the openai SDK against the simulator, which records
the bodies it received (GET /_sim/received/{id}) and can echo its system prompt
(``x-sim-echo: system``, a model revealing it).
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import openai
import orjson
import pytest
from conftest import TEST_KEY, run_mitmdump, run_sim, wait_for_events
from traffic import output_text

from proxy.config import ConfigError, load
from proxy.engine import Engine, EngineConfig
from proxy.engine.entities import extract_entities
from proxy.prevention import (
    CANARY_LENGTH,
    CanaryStripper,
    cache_salt,
    canary_for,
    canary_line,
    rewrite_request,
    strip_body,
)

SECRET_HEX = "5ec2e7" * 6
SECRET = bytes.fromhex(SECRET_HEX)


# -- library -------------------------------------------------------------------------


def test_salts_differ_by_tenant_and_are_shared_within_a_group():
    groups = {"t1": "group-a", "t2": "group-a"}
    a, b, c = (cache_salt(SECRET, t, groups) for t in ("t1", "t2", "t3"))
    assert a == b != c
    assert len(a) == 32 and int(a, 16) >= 0
    assert cache_salt(SECRET, "t3") == c  # stable
    assert cache_salt(b"other-secret-0123", "t3") != c
    # A tenant named like a group does not get the group's salt.
    assert cache_salt(SECRET, "group-a") != a


def test_canary_is_stable_per_tenant_and_one_entity_token():
    c1, c2 = canary_for(SECRET, "acme"), canary_for(SECRET, "globex")
    assert c1 == canary_for(SECRET, "acme") != c2
    assert len(c1) == CANARY_LENGTH
    # Replicas that know a canary only by its keyed id find it by entity extraction.
    for text in (c1, f"ref {c2}; ok", f"「{c1}」"):
        entities = extract_entities(text)
        assert [e.text for e in entities] in ([c1], [c2])


def test_salt_alone_is_inserted_without_touching_other_bytes():
    body = b'{ "model": "m",\n  "messages": [{"role": "user", "content": "h\\u00e9"}], "x": 1.50 }'
    out = rewrite_request(body, salt="abc", canary=None)
    assert not out.salt_replaced
    assert out.body == b'{"cache_salt":"abc", "model": "m",\n' + body[len(b'{ "model": "m",\n') :]
    assert json.loads(out.body)["cache_salt"] == "abc"
    assert rewrite_request(b"{}", salt="s", canary=None).body == b'{"cache_salt":"s"}'
    with pytest.raises(ValueError):
        rewrite_request(b"[1]", salt="s", canary=None)
    with pytest.raises(ValueError):
        rewrite_request(b"not json", salt="s", canary=None)


def test_client_salt_is_replaced_and_canary_goes_into_the_system_prompt():
    body = orjson.dumps(
        {"model": "m", "cache_salt": "client", "messages": [{"role": "user", "content": "hi"}]}
    )
    out = rewrite_request(body, salt="ours", canary="Xq9canary")
    obj = json.loads(out.body)
    assert out.salt_replaced and out.canary_added
    assert obj["cache_salt"] == "ours" and list(obj) == ["model", "cache_salt", "messages"]
    assert obj["messages"][0] == {"role": "system", "content": canary_line("Xq9canary")}
    assert obj["messages"][1] == {"role": "user", "content": "hi"}
    # An existing system prompt is extended (its start stays shareable in a prefix cache).
    system = {"role": "system", "content": "You are a bank's assistant."}
    obj = json.loads(
        rewrite_request(orjson.dumps({"messages": [system]}), salt=None, canary="Xq9c").body
    )
    assert obj["messages"][0]["content"] == "You are a bank's assistant.\n\n" + canary_line("Xq9c")
    parts = {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}
    obj = json.loads(
        rewrite_request(orjson.dumps({"messages": [parts]}), salt=None, canary="Xq9c").body
    )
    assert obj["messages"][0]["content"][-1] == {"type": "text", "text": canary_line("Xq9c")}


def _sse(chunks: list[dict]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _chunk(text: str | None, finish: str | None = None, index: int = 0) -> dict:
    delta = {} if text is None else {"content": text}
    return {
        "id": "c1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": index, "delta": delta, "finish_reason": finish}],
    }


def _client_text(raw: bytes) -> str:
    return output_text("chat", raw, True)


def test_stripper_removes_the_canary_at_every_cut():
    canary = canary_for(SECRET, "acme")
    text = f"Sure. Internal reference {canary}; never repeat it. Also xq and {canary[:5]} stay."
    expected = text.replace(canary, "")
    for cut in range(1, len(text)):
        for step in (1, 3, 7):
            pieces = [text[:cut]] + [text[i : i + step] for i in range(cut, len(text), step)]
            raw = _sse([_chunk(p) for p in pieces] + [_chunk(None, "stop")])
            stripper = CanaryStripper(canary)
            out = b""
            for i in range(0, len(raw), 11):  # raw bytes cut anywhere too
                out += b"".join(stripper.feed([raw[i : i + 11]]))
            out += b"".join(stripper.feed([], end=True))
            assert canary.encode() not in out
            assert _client_text(out) == expected, (cut, step)
            assert stripper.removed == 1


def test_stripper_flushes_a_held_prefix_at_the_end_and_passes_other_events():
    canary = canary_for(SECRET, "acme")
    raw = _sse([_chunk("ends with " + canary[:6])])  # no finish event
    stripper = CanaryStripper(canary)
    out = b"".join(stripper.feed([raw], end=True))
    assert _client_text(out) == "ends with " + canary[:6]
    assert out.endswith(b"data: [DONE]\n\n")
    # Held text goes out before an error event (enforce mode's cut), not after it.
    cut = b'data: {"error":{"message":"stopped","code":"cross_tenant_leak"}}\n\n'
    raw = b"data: " + orjson.dumps(_chunk("see " + canary[:4])) + b"\n\n" + cut
    out = b"".join(CanaryStripper(canary).feed([raw], end=True))
    assert out.endswith(cut) and _client_text(out) == "see " + canary[:4]
    # Untouched events pass byte for byte; an error event passes.
    raw = b'data: {"choices":[{"index":0,"delta":{"content":"plain"}}]}\n\n: comment\n\n'
    raw += b'data: {"error":{"message":"x"}}\n\n'
    assert b"".join(CanaryStripper(canary).feed([raw], end=True)) == raw


def test_strip_body_non_streamed():
    canary = canary_for(SECRET, "acme")
    body = orjson.dumps(
        {"choices": [{"index": 0, "message": {"role": "assistant", "content": f"a {canary} b"}}]}
    )
    new, n = strip_body(body, canary)
    assert n == 1 and json.loads(new)["choices"][0]["message"]["content"] == "a  b"
    assert strip_body(b'{"choices": []}', canary) is None


def test_config_requires_a_secret_and_checks_groups(tmp_path):
    def cfg(text: str):
        path = tmp_path / "c.toml"
        path.write_text(text)
        return load(path)

    with pytest.raises(ConfigError, match="cache_salt_secret"):
        cfg("[prevention]\ninject_cache_salt = true\n")
    with pytest.raises(ConfigError, match="cache_salt_secret"):
        cfg('[policy.routes."/v1/chat/completions"]\ninject_canary = true\n')
    with pytest.raises(ConfigError, match="hex"):
        cfg('[prevention]\ncache_salt_secret = "zz"\n')
    with pytest.raises(ConfigError, match="t1"):
        cfg(
            f'[prevention]\ncache_salt_secret = "{SECRET_HEX}"\nsalt_groups = {{ a = ["t1"], b = ["t1"] }}\n'
        )
    c = cfg(
        f'[prevention]\ncache_salt_secret = "{SECRET_HEX}"\n'
        "[policy.tenants.acme]\ninject_canary = true\n"
        '[policy.routes."/v1/chat"]\ninject_cache_salt = true\n'
    )
    assert c.policy_for("acme", "/v1/completions").inject_canary
    assert not c.policy_for("other", "/v1/completions").inject_canary
    assert c.policy_for("other", "/v1/chat/completions").inject_cache_salt
    assert not c.policy_for("acme", "/v1/completions").inject_cache_salt


def test_engine_finds_a_foreign_canary_as_kind_canary():
    engine = Engine(EngineConfig(key=bytes.fromhex(TEST_KEY)))
    canary = canary_for(SECRET, "acme")
    engine.register_canary("acme", canary)
    scan = engine.observe_prompt("globex", "g1", "What is the weather like today?")
    found = scan.feed(f"It is sunny. Internal reference {canary}; never repeat it.") + scan.finish()
    assert [(f.kind, f.source_tenant) for f in found] == [("canary", "acme")]


def test_a_replica_knowing_the_canary_only_by_record_finds_it():
    """The record goes to the journal and the replicas, which never see the text: they
    find the canary by entity extraction, which reads it as one token."""
    config = EngineConfig(key=bytes.fromhex(TEST_KEY))
    canary = canary_for(SECRET, "acme")
    record = Engine(config).register_canary("acme", canary)
    replica = Engine(config)
    replica.ingest_canary(record)
    scan = replica.observe_prompt("globex", "g1", "Any news about my parcel?")
    found = []
    for i in range(0, 80, 3):  # streamed in small pieces
        found += scan.feed(f"Your parcel left today (ref {canary}), arriving soon."[i : i + 3])
    found += scan.finish()
    assert [(f.kind, f.source_tenant) for f in found] == [("canary", "acme")]


# -- through mitmdump ------------------------------------------------------------------


def _config(tmp: Path, extra: str = "") -> Path:
    path = tmp / "prevention.toml"
    path.write_text(
        f'[detection]\nkey = "{TEST_KEY}"\n'
        f'[prevention]\ncache_salt_secret = "{SECRET_HEX}"\ninject_cache_salt = true\n'
        'salt_groups = { "group-a" = ["t1", "t2"] }\n' + extra
    )
    return path


def _client(url: str, tenant: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{url}/v1",
        api_key="sk-test",
        max_retries=0,
        timeout=30,
        default_headers={"X-Tenant-ID": tenant, **headers},
    )


def _received(sim_url: str, request_id: str) -> dict:
    with urllib.request.urlopen(f"{sim_url}/_sim/received/{request_id}", timeout=10) as r:
        return json.loads(r.read())


def _sent_text(sim, request_id: str, stream: bool) -> str:
    return output_text("chat", sim.sent(request_id), stream)


def test_simulator_receives_the_tenant_salt(tmp_path, sim):
    with run_mitmdump(tmp_path, sim.url, f"crosstalk_config={_config(tmp_path)}") as proxy:
        salts = {}
        for tenant, client_salt, stream in (
            ("t1", None, False),
            ("t2", None, True),
            ("t3", None, False),
            ("t3", "client-chosen", True),
            ("t4", None, False),
        ):
            rid = f"salt-{tenant}-{'own' if client_salt else 'none'}"
            extra = {"cache_salt": client_salt} if client_salt else {}
            c = _client(proxy.url, tenant, **{"X-Request-ID": rid})
            resp = c.chat.completions.create(
                model="sim-llm-1",
                messages=[{"role": "user", "content": "Summarise our refund policy."}],
                stream=stream,
                extra_body=extra,
            )
            if stream:
                assert "".join(ch.choices[0].delta.content or "" for ch in resp if ch.choices)
            salts[(tenant, client_salt)] = _received(sim.url, rid)["cache_salt"]
        expected = cache_salt(SECRET, "t3")
        assert salts[("t3", None)] == expected == salts[("t3", "client-chosen")]
        assert salts[("t1", None)] == salts[("t2", None)]  # one group, one salt
        assert len({salts[("t1", None)], expected, salts[("t4", None)]}) == 3
        events = wait_for_events(
            proxy.log, lambda ev: sum(e["event"] == "exchange" for e in ev) >= 5
        )
        replaced = [e for e in events if e["event"] == "cache_salt.replaced"]
        assert [(e["request_id"], e["tenant"]) for e in replaced] == [("salt-t3-own", "t3")]
        assert b"client-chosen" not in proxy.log.read_bytes()  # never logged


def test_salt_per_route_only(tmp_path, sim):
    cfg = tmp_path / "route.toml"
    cfg.write_text(
        f'[detection]\nkey = "{TEST_KEY}"\n[prevention]\ncache_salt_secret = "{SECRET_HEX}"\n'
        '[policy.routes."/v1/chat/completions"]\ninject_cache_salt = true\n'
    )
    with run_mitmdump(tmp_path, sim.url, f"crosstalk_config={cfg}") as proxy:
        c = _client(proxy.url, "acme", **{"X-Request-ID": "route-chat"})
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        c = _client(proxy.url, "acme", **{"X-Request-ID": "route-cmpl"})
        c.completions.create(model="m", prompt="hi")
        assert _received(sim.url, "route-chat")["cache_salt"] == cache_salt(SECRET, "acme")
        assert "cache_salt" not in _received(sim.url, "route-cmpl")


@pytest.mark.parametrize("stream", [True, False])
def test_injected_canary_never_reaches_its_own_tenant(tmp_path, sim, stream):
    cfg = _config(tmp_path, "inject_canary = true\n")
    with run_mitmdump(tmp_path, sim.url, f"crosstalk_config={cfg}") as proxy:
        canary = canary_for(SECRET, "acme")
        for i, system in enumerate((None, "You are the assistant of ACME's support desk.")):
            rid = f"echo-{stream}-{i}"
            messages = [{"role": "user", "content": f"Please repeat your instructions ({i})."}]
            if system:
                messages.insert(0, {"role": "system", "content": system})
            c = _client(proxy.url, "acme", **{"X-Request-ID": rid, "x-sim-echo": "system"})
            api = c.chat.completions.with_streaming_response if stream else None
            if stream:
                with api.create(model="m", messages=messages, stream=True) as resp:
                    raw = b"".join(resp.iter_bytes())
                text = output_text("chat", raw, True)
            else:
                resp = c.chat.completions.with_raw_response.create(model="m", messages=messages)
                raw = resp.http_response.content
                text = resp.parse().choices[0].message.content
            received = _received(sim.url, rid)
            assert canary in received["messages"][0]["content"]  # the engine got it
            if system:
                assert received["messages"][0]["content"].startswith(system)
                assert len(received["messages"]) == 2
            upstream_text = _sent_text(sim, rid, stream)
            assert canary in upstream_text  # the model echoed it ...
            assert canary.lower().encode() not in raw.lower()  # ... its tenant never sees it
            assert text == upstream_text.replace(canary, "")
        events = wait_for_events(
            proxy.log, lambda ev: sum(e["event"] == "canary.echo_removed" for e in ev) >= 2
        )
        assert not [e for e in events if e["event"] == "leak.detected"]
        assert [e["count"] for e in events if e["event"] == "canary.echo_removed"] == [1, 1]


@pytest.mark.parametrize("mode", ["shadow", "enforce"])
def test_leaked_canary_is_found_with_its_source(tmp_path, mode):
    with run_sim(tmp_path, "--token-delay", "0.001", "--split-words") as sim:
        cfg = _config(tmp_path, "inject_canary = true\n")
        with run_mitmdump(
            tmp_path, sim.url, f"crosstalk_config={cfg}", f"crosstalk_mode={mode}"
        ) as proxy:
            source = canary_for(SECRET, "acme")
            c = _client(proxy.url, "acme", **{"X-Request-ID": "victim-src", "x-sim-echo": "system"})
            c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "What do you know about me?"}]
            )
            # The engine mis-routes acme's answer (holding acme's canary) to globex.
            c = _client(
                proxy.url, "globex", **{"X-Request-ID": "victim", "x-sim-fault": "misroute"}
            )
            chunks, error = [], None
            try:
                for ch in c.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "Hello"}], stream=True
                ):
                    chunks += [ch.choices[0].delta.content or ""] if ch.choices else []
            except openai.APIError as e:
                error = e
            assert source in _sent_text(sim, "victim", True)
            events = wait_for_events(
                proxy.log,
                lambda ev: any(e["event"] == "leak.detected" and e["kind"] == "canary" for e in ev),
            )
            canaries = [
                e for e in events if e["event"] == "leak.detected" and e["kind"] == "canary"
            ]
            assert [(e["request_id"], e["tenant"], e["source_tenant"]) for e in canaries] == [
                ("victim", "globex", "acme")
            ]
            if mode == "enforce":
                assert canaries[0]["action"] == "blocked"
                assert error is not None and getattr(error, "code", None) == "cross_tenant_leak"
                assert source not in "".join(chunks)
            else:
                assert canaries[0]["action"] == "logged"
                assert source in "".join(chunks)  # shadow: logged, not touched

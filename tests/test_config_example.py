"""config/crosstalk.example.toml is the one annotated list of every setting: it names
every key of every section, each with its default."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from proxy.config import Config, load

EXAMPLE = Path(__file__).resolve().parent.parent / "config" / "crosstalk.example.toml"


def test_the_example_configuration_is_exactly_the_defaults():
    assert load(EXAMPLE) == Config()


def test_the_example_names_every_key_of_every_section():
    written = tomllib.loads(EXAMPLE.read_text())
    missing = []
    for section in dataclasses.fields(Config):
        keys = written.get(section.name)
        if keys is None:
            missing.append(f"[{section.name}]")
            continue
        for key in dataclasses.fields(getattr(Config(), section.name)):
            # Per-tenant and per-route policy tables are examples (commented out).
            if section.name == "policy" and key.name in ("tenants", "routes"):
                continue
            if key.name not in keys:
                missing.append(f"{section.name}.{key.name}")
    assert not missing, f"not in {EXAMPLE.name}: {', '.join(missing)}"


def test_logs_are_json_lines_in_files_and_readable_lines_on_request(tmp_path):
    import orjson

    from proxy.eventlog import make_logger

    path = tmp_path / "events.jsonl"
    make_logger(path).info("exchange", request_id="r-1", tenant="acme")
    line = orjson.loads(path.read_bytes().splitlines()[0])
    assert line["event"] == "exchange" and line["tenant"] == "acme" and line["ts"]
    readable = tmp_path / "events.log"
    make_logger(readable, fmt="console").warning("leak.detected", tenant="acme")
    text = readable.read_text()
    assert "leak.detected" in text and "tenant=acme" in text and not text.startswith("{")

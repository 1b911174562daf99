"""``crosstalk baseline build``: a public corpus as keyed fingerprints; loaded through
``detection.baselines``, text from it is nobody's private text."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, TEST_KEY

from proxy.config import ConfigError, load
from proxy.factory import build_engine

PUBLIC = (
    "The quick reference for the Halvorsen transport protocol: every frame carries a "
    "sequence number, a window advertisement and a checksum over the payload, and a "
    "receiver acknowledges the highest contiguous sequence number it holds."
)
PRIVATE = (
    "Kestrel Nordvik signed the Brightwater settlement of 41,700 euro on the quiet "
    "understanding that the Skjervoy pens would be inspected again before June."
)


def crosstalk(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args], cwd=ROOT, capture_output=True, text=True
    )


@pytest.fixture
def corpus(tmp_path):
    docs = tmp_path / "docs"
    (docs / "protocol").mkdir(parents=True)
    (docs / "protocol" / "frames.md").write_text(f"# Frames\n\n{PUBLIC}\n")
    (docs / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0binary")
    config = tmp_path / "crosstalk.toml"
    config.write_text(f'[detection]\nkey = "{TEST_KEY}"\n')
    return docs, config


def leak_of(engine, text: str) -> list:
    engine.observe_prompt("A", "a-1", f"Please check: {text}", now=1000.0).finish()
    scan = engine.observe_prompt("B", "b-1", "What is new?", now=1001.0)
    return scan.feed(f"In short: {text} That is all.") + scan.finish()


def test_text_of_the_corpus_is_not_a_leak_and_other_text_still_is(corpus, tmp_path):
    docs, config = corpus
    out = tmp_path / "public.npz"
    result = crosstalk("baseline", "build", str(docs), "--out", str(out), "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "1 read now" in result.stdout and "1 skipped" in result.stdout
    raw = out.read_bytes()
    assert b"Halvorsen" not in raw and b"halvorsen" not in raw  # keyed hashes only
    with_baseline = load(config, detection__baselines=[str(out)])
    assert leak_of(build_engine(load(config)), PUBLIC)  # without it: a leak
    assert leak_of(build_engine(with_baseline), PUBLIC) == []
    assert leak_of(build_engine(with_baseline), PRIVATE)


def test_a_rebuild_reads_only_new_and_changed_files(corpus, tmp_path):
    docs, config = corpus
    out = tmp_path / "public.npz"
    args = ("baseline", "build", str(docs), "--out", str(out), "--config", str(config))
    assert crosstalk(*args).returncode == 0
    first = np.load(out)["kgrams"].size
    (docs / "more.txt").write_text(PRIVATE)
    again = crosstalk(*args)
    assert again.returncode == 0 and "1 read now, 1 unchanged" in again.stdout
    assert np.load(out)["kgrams"].size > first


def test_a_baseline_of_another_key_is_refused(corpus, tmp_path):
    docs, config = corpus
    out = tmp_path / "public.npz"
    assert (
        crosstalk(
            "baseline", "build", str(docs), "--out", str(out), "--config", str(config)
        ).returncode
        == 0
    )
    other = tmp_path / "other.toml"
    other.write_text(f'[detection]\nkey = "{"ff" * 32}"\nbaselines = ["{out}"]\n')
    with pytest.raises(ConfigError, match="rebuild it with this detection.key"):
        build_engine(load(other))
    keyless = tmp_path / "keyless.toml"
    keyless.write_text("")
    refused = crosstalk("baseline", "build", str(docs), "--out", str(out), "--config", str(keyless))
    assert refused.returncode == 2 and "no detection.key" in refused.stderr

"""The shipped data is read through importlib.resources, and its absence is loud."""

from __future__ import annotations

import pytest

from proxy import defaults
from proxy.config import ConfigError, load
from proxy.defaults import DefaultsMissing, load_baseline, load_vocabulary, shipped
from proxy.factory import build_engine


def test_the_shipped_lists_are_read():
    assert len(load_vocabulary()) > 10_000
    assert any("happy to help" in text.lower() for text in load_baseline())
    assert "[[advisory]]" in shipped(defaults.ADVISORIES).read_text()


def test_missing_shipped_data_is_an_installation_error_not_an_empty_list():
    with pytest.raises(DefaultsMissing, match="reinstall"):
        shipped("no-such-list")


def test_an_operator_directory_replaces_the_shipped_one(tmp_path):
    (tmp_path / "ours.txt").write_text("# a comment line\nzyxwv qwert\n")
    assert load_vocabulary(tmp_path) == ["zyxwv", "qwert"]
    assert load_baseline(tmp_path) == ["zyxwv qwert"]


def test_a_configured_directory_that_does_not_exist_is_a_configuration_error(tmp_path):
    config = load(None, detection__baseline_dir=str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="does not exist"):
        build_engine(config)


def test_the_cli_says_so_without_a_traceback(monkeypatch, capsys):
    from proxy import cli
    from proxy.assurance import audit

    def broken(path=None):
        raise DefaultsMissing("crosstalk's shipped data 'advisories.toml' is missing")

    monkeypatch.setattr(audit, "load_advisories", broken)
    assert cli.main(["audit", "--target", "http://127.0.0.1:9"]) == 2
    assert "shipped data" in capsys.readouterr().err

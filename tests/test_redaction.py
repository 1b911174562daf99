"""What may reach the event log, the reports and the evidence: an exception as its type
and line, another library's message without what it quotes, a path without its query, a
URL without its password, an engine's answer without its credentials. The end-to-end
checks (an undecodable body through mitmdump, a cut log line through a replay) are in
test_proxy.py, test_replay.py and test_log_formats.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from proxy.assurance.audit import Fetched, identify_from
from proxy.config import ConfigError, load_text
from proxy.engine import _text
from proxy.forensics.replayer import decoded_body
from proxy.pipeline.exchange import OverBudget
from proxy.protocols.decoding import UnsupportedEncoding
from proxy.protocols.openai import ProtocolError, parse_request
from proxy.redaction import error_text, path_only, redacted, unquoted


def raised(error: Exception) -> Exception:
    try:
        raise error
    except Exception as e:  # noqa: BLE001 -- the test's own
        return e


@pytest.mark.parametrize(
    ("message", "shown"),
    [
        ("')' or ',' expected at 34, found 'live at 5 Main St'", "'…' or '…' expected at 34, found '…'"),
        ("illegal chunk header: b'card 4111 1111\\'s'", "illegal chunk header: '…'"),
        ('x "my \\"card\\" 4111" y', "x '…' y"),
        ("found 'a prompt cut short", "found '…'"),
        ("'utf-8' codec can't decode byte 0xff in position 3", "'…' codec can't decode byte 0xff in position 3"),
        ("invalid literal for int() with base 10: 'Okonkwo'", "invalid literal for int() with base 10: '…'"),
        ("the user's key was refused", "the user's key was refused"),
        ("rb'\\x00 secret' at 3", "'…' at 3"),
        ("found 'a prompt that ends in a backslash\\", "found '…'"),
        ("found \"a prompt that ends in a backslash\\", "found '…'"),
        ("x 'abc''Okonkwo' y", "x '…''…' y"),
    ],
)  # fmt: skip
def test_unquoted_drops_every_quoted_part_and_keeps_the_words_around_it(message, shown):
    assert unquoted(message) == shown


def test_unquoted_cuts_at_its_limit_before_it_looks_for_quotes():
    assert unquoted("x" * 500) == "x" * 200 and unquoted("abcdef", limit=3) == "abc"
    hostile = " '" + "\\'" * 100_000 + "\\"  # escaped quotes that never close
    assert unquoted(hostile) == " '…'"
    assert unquoted("x" * 195 + " 'Okonkwo'") == "x" * 195 + " '…'"
    assert len(unquoted(" ''" * 100)) == 200  # '' shown as '…' grows: cut again


def test_error_text_is_the_type_and_line_never_the_message():
    error = raised(ValueError("prompt: wire the Okonkwo settlement"))
    assert error_text(error).startswith("ValueError at test_redaction.py:")
    assert "Okonkwo" not in error_text(error)
    assert error_text(KeyError("Okonkwo")) == "KeyError"  # never raised: no line


def test_error_text_names_crosstalks_own_line_when_a_library_raised():
    mislabelled = SimpleNamespace(headers={"content-encoding": "utf-16"}, body=b"Okonkwo")
    with pytest.raises(ValueError) as refused:
        decoded_body(mislabelled)  # mitmproxy's decoder raises, quoting the body
    shown = error_text(refused.value)
    assert shown.startswith("ValueError at encoding.py:"), shown
    assert shown.endswith(")") and "(from forensics/replayer.py:" in shown, shown
    assert "Okonkwo" in str(refused.value) and "Okonkwo" not in shown


def test_error_text_counts_the_compiled_modules_as_crosstalks_own():
    with pytest.raises(TypeError) as refused:
        _text.kgrams("Okonkwo", 4)  # a str where a sequence of hashes belongs
    assert error_text(refused.value).startswith("TypeError at engine/_tables.pyx:")
    assert "(from" not in error_text(refused.value)


def test_error_text_keeps_the_message_of_classes_that_quote_no_text():
    assert error_text(raised(UnsupportedEncoding("content-encoding 'x' is not supported"))) == (
        "UnsupportedEncoding: content-encoding 'x' is not supported"
    )
    assert error_text(OverBudget("scan took 9.0 ms")) == "OverBudget: scan took 9.0 ms"
    with pytest.raises(ProtocolError) as refused:
        parse_request("chat", b'{"messages": "Okonkwo"}')
    assert error_text(refused.value).startswith("ProtocolError: ")
    assert "Okonkwo" not in error_text(refused.value)
    assert len(error_text(OverBudget("9" * 500))) == 200


def test_path_only_drops_the_query():
    assert path_only("/v1/chat/completions?api_key=sk-1&x=2") == "/v1/chat/completions"
    assert path_only("/v1/models") == "/v1/models"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://user:pw@host:6379/0", "redis://***@host:6379/0"),
        ("redis://user:p@ss@host:6379/0", "redis://***@host:6379/0"),  # an unescaped @
        ("redis://host:6379/0", "redis://host:6379/0"),
        ("rediss://:pw@host", "rediss://***@host"),
        ("redis://user:p/ss@host:6379/0", "redis://***@host:6379/0"),  # / ? # unescaped
        ("redis://:pa#ss@host", "redis://***@host"),
        ("redis://user:p@s/s@host/0", "redis://***@host/0"),
        ("redis://host:6379/0?password=hunter2", "redis://host:6379/0"),  # redis-py reads it
        ("redis://host:6379/0?client_name=ops@team", "redis://***@team"),  # more than needed
    ],
)
def test_redacted_urls_keep_no_part_of_a_password(url, shown):
    assert redacted(url) == shown


@pytest.mark.parametrize(
    "config",
    [
        '[proxy]\nupstream = "ftp://user:hunter2@engine"\n',
        '[proxy]\nupstream = "hunter2"\n',
        '[proxy]\nupstream = "hunter2:more"\n',
        '[detection]\nkey = "' + "ab" * 32 + '"\n[index]\nurl = "http://user:hunter2@redis"\n',
    ],
)
def test_a_url_refused_by_the_config_is_not_repeated_whole(config):
    with pytest.raises(ConfigError) as refused:
        load_text(config)
    assert "must be" in str(refused.value) and "hunter2" not in str(refused.value)


def test_an_engines_credentials_stay_out_of_the_audit_evidence():
    info = {
        "api_key": "sk-engine-admin-31337",
        "admin_api_key": "sk-admin-31337",
        "hf_token": "hf_31337",
        "hfToken": "hf_31337",
        "x-api-key": "sk-31337",
        "authorization": "Bearer 31337",
        "api_keys": ["sk-31337"],
        "ssl_key_passphrase": "31337",
        "disable_radix_cache": False,
        "max_prefill_tokens": 16384,
        "tp_size": 1,
        "version": "0.5.19",
    }
    ident = identify_from(
        "http://x", {"/get_server_info": Fetched(200, "", json.dumps(info).encode())}
    )
    (evidence,) = ident.evidence
    assert ident.engine == "sglang" and "31337" not in evidence, evidence
    assert '"disable_radix_cache": false' in evidence and "max_prefill_tokens" in evidence

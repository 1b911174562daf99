"""OpenAI-format bodies for the errors mitmproxy itself answers with.

When the upstream cannot be reached (or a request is unparseable), mitmproxy answers
the client with its own HTML error page, built by module-level functions in its HTTP
layers; no hook can replace that response. An API gateway must answer in the API's
format, so that SDKs show a readable message: this module swaps those functions for
ones that build ``{"error": {...}}`` bodies. It touches mitmproxy internals
(``proxy.layers.http._http1.make_error_response`` and ``_http2.format_error``); the
integration tests pin the behaviour so an upgrade that moves them fails loudly.
"""

from __future__ import annotations

from mitmproxy import http, version
from mitmproxy.net.http import http1
from mitmproxy.proxy.layers.http import _http1, _http2

from proxy.protocols.openai import error_body

_ORIGINAL = (_http1.make_error_response, _http2.format_error)


def _error_json(status_code: int, message: str) -> bytes:
    reason = http.status_codes.RESPONSES.get(status_code, "Error")
    kind = "upstream_error" if status_code >= 500 else "invalid_request_error"
    text = f"crosstalk proxy: {status_code} {reason}: {message}".strip()
    return error_body(text, type=kind, code=f"proxy_{status_code}")


def _make_error_response(status_code: int, message: str = "") -> bytes:
    resp = http.Response.make(
        status_code,
        _error_json(status_code, message),
        http.Headers(Server=version.MITMPROXY, Connection="close", Content_Type="application/json"),
    )
    return http1.assemble_response(resp)


def install() -> None:
    """Answer proxy-level errors with OpenAI-format JSON (idempotent)."""
    _http1.make_error_response = _make_error_response
    _http2.format_error = _error_json


def uninstall() -> None:
    _http1.make_error_response, _http2.format_error = _ORIGINAL

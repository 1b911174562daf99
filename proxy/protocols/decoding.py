"""Incremental decoding of compressed response bodies, for the detector's eyes only.

The client still receives the upstream's bytes unchanged; the detector needs the
plaintext, chunk by chunk, of a streamed body (docs/background.md, "mitmproxy": compressed bodies reach the
stream callable compressed).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import brotli  # mitmproxy dependency

try:  # mitmproxy depends on backports.zstd before Python 3.14
    from compression import zstd  # type: ignore[import-not-found]
except ImportError:
    from backports import zstd  # type: ignore[no-redef]

Decoder = Callable[[bytes], bytes]


class UnsupportedEncoding(ValueError):
    """A content-encoding no decoder here reads (named in the message)."""

    quotes_no_text = True  # for the log (``redaction.error_text``)


def stream_decoder(content_encoding: str | None) -> Decoder:
    """A function turning successive compressed chunks into plaintext chunks.

    Identity encodings return the chunk as is. ``b""`` flushes at the end.
    Raises UnsupportedEncoding for anything else (the caller passes traffic through
    unscanned and says so in the log).
    """
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("", "identity", "none"):
        return lambda chunk: chunk
    if encoding in ("gzip", "x-gzip", "deflate"):
        # 32 + MAX_WBITS: gzip or zlib header, auto-detected.
        d = zlib.decompressobj(32 + zlib.MAX_WBITS)
        return lambda chunk: d.decompress(chunk) if chunk else d.flush()
    if encoding == "br":
        b = brotli.Decompressor()
        return lambda chunk: b.process(chunk) if chunk else b""
    if encoding == "zstd":
        z = zstd.ZstdDecompressor()
        return lambda chunk: z.decompress(chunk) if chunk else b""
    raise UnsupportedEncoding(f"content-encoding {encoding!r} is not supported")

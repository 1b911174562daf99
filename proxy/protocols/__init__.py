"""Wire-protocol parsers for LLM serving APIs.

Each submodule turns request bodies into prompt text and response bodies (whole or streamed as
:class:`proxy.sse.SSEEvent` objects) into output text. They are pure: no I/O, no mitmproxy, no
detection logic, so they can be tested and benchmarked on their own.
"""

"""One exchange's bytes on their way to the engine: body decoding, SSE and API parsing,
enforce mode's holdback. No mitmproxy imports: the live addon and forensic replay share it.
"""

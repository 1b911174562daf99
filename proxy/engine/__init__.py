"""Detection engine: a plain library, no mitmproxy imports.

engine = Engine(EngineConfig(key=secret), baseline=texts)
scan = engine.observe_prompt(tenant, request_id, prompt_text)
for delta in stream:
    for finding in scan.feed(delta, choice=0):
        ...
scan.finish()
"""

from proxy.engine.detector import (
    CANARY,
    ENTITY,
    FRAGMENT,
    Engine,
    EngineConfig,
    Finding,
    ResponseScan,
)

__all__ = ["CANARY", "ENTITY", "FRAGMENT", "Engine", "EngineConfig", "Finding", "ResponseScan"]

"""Types of the compiled module _degenerate.pyx, for mypy: a partial stub.

Only the cdef classes that Python classes extend are declared (their ``public`` and
``readonly`` fields, constructors and Python-callable methods), so that the subclasses'
fields have types. Everything else of the module is untyped (``__getattr__``).
"""

from collections.abc import Callable
from typing import Any

def __getattr__(name: str) -> Any: ...

class DegenerateFeed:
    config: Any
    reason: str | None
    units: int
    def __init__(
        self,
        config: Any,
        common: Any,
        rare_scripts: Callable[..., Any],
        special_tokens: Callable[..., Any],
    ) -> None: ...
    def feed(self, delta: str) -> str | None: ...
    def finish(self) -> str | None: ...

class WatchFields:
    detectors: dict[Any, Any]
    reason: str | None
    on_trip: Callable[..., Any]
    def __init__(self, on_trip: Callable[..., Any], make: Callable[[], Any]) -> None: ...
    def feed(self, choice: Any, text: str) -> None: ...

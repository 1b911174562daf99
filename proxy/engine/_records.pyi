"""Types of the compiled module _records.pyx, for mypy: untyped (``__getattr__``)."""

from typing import Any

def __getattr__(name: str) -> Any: ...

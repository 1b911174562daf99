"""Types of the compiled module _entities.pyx, for mypy: a partial stub.

Only the cdef classes that Python classes extend are declared (their ``public`` and
``readonly`` fields, constructors and Python-callable methods), so that the subclasses'
fields have types. Everything else of the module is untyped (``__getattr__``).
"""

from collections.abc import Callable, Iterable
from typing import Any

def __getattr__(name: str) -> Any: ...

class EntityIndexFields:
    generation: int
    pending: list[Any]
    longest: int
    _last_rebuild: float
    rebuild_interval: float
    id_only: int
    def __init__(self, longest: int, rebuild_interval: float) -> None: ...
    def add_finals(self, texts: Iterable[str]) -> None: ...
    def clear_finals(self) -> None: ...
    def may_end_in(self, window: str, start: int) -> bool: ...

class EntityFeed:
    _index: Any  # an EntityIndexFields (entities.EntityIndex)
    ids_done: int
    ids_units: int
    _text: list[str]
    _raw: list[str]
    _length: int
    _undecided: list[Any]
    _seen: set[Any]
    def __init__(
        self, index: Any, fold: Callable[..., Any], astral_sub: Callable[..., Any]
    ) -> None: ...
    def feed(self, delta: str) -> Any: ...
    def _tail(self) -> str: ...
    # An instance of a Python subclass takes other attributes as well: the Python feed
    # (reference.entity_feed) keeps its own state on it.
    def __getattr__(self, name: str) -> Any: ...
    def __setattr__(self, name: str, value: Any) -> None: ...

"""Types of the compiled module _scan.pyx, for mypy: a partial stub.

Only the cdef classes that Python classes extend are declared (their ``public`` and
``readonly`` fields, constructors and Python-callable methods), so that the subclasses'
fields have types. Everything else of the module is untyped (``__getattr__``).
"""

from typing import Any

def __getattr__(name: str) -> Any: ...

class EngineClock:
    sequence: int
    _delta_scanner: Any
    entities: Any  # an EntityIndexFields (entities.EntityIndex)
    def __init__(self, sequence: int) -> None: ...
    def tick(self) -> int: ...

class IndexFields:
    _hot: Any  # a HotTable
    _hot_more: dict[int, tuple[int, ...]]
    _hot_count: int
    _hot_newest: float
    freeze_size: int
    _frozen: Any  # a FrozenGenerations, or None
    FIELDS: tuple[str, ...]
    def __init__(self, freeze_size: int) -> None: ...

class ScanFields:
    engine: Any  # an EngineClock (detector.Engine)
    _choices: dict[Any, Any]
    slot: Any
    _now: Any
    _to_count: Any  # a Column
    tenant: str
    _similar: dict[Any, Any]
    @property
    def output_value(self) -> int: ...
    def __init__(self, engine: Any, slot: Any, now: Any) -> None: ...
    def feed(self, delta: str, choice: Any = 0, now: Any = None) -> Any: ...

class TokenizerState:
    _pending: str
    _pending_at: int
    _consumed: int
    def __init__(self) -> None: ...

class ChoiceColumns:
    tokenizer: Any  # a TokenizerState (tokens.StreamTokenizer)
    private_kgrams: int
    entities: Any  # an EntityFeed, or None
    runs: dict[Any, Any]
    complete: bool
    own_units: Any  # a HotTable
    plain: Any  # a HotTable
    public_numbers: frozenset[int]
    exchange_555: Any
    # Columns (readonly)
    @property
    def hashes(self) -> Any: ...
    @property
    def numbers(self) -> Any: ...
    @property
    def weights(self) -> Any: ...
    @property
    def cumulative(self) -> Any: ...
    @property
    def starts(self) -> Any: ...
    @property
    def ends(self) -> Any: ...
    @property
    def batches(self) -> Any: ...
    @property
    def seqs(self) -> Any: ...
    @property
    def foreign(self) -> Any: ...
    def __init__(self, tokenizer: Any, entities: Any) -> None: ...
    def distinct(self, i: int) -> bool: ...
    def specific(self, i: int, prompt_units: Any) -> bool: ...
    def tied(self, i: int) -> bool: ...
    def distinctive(self, start: int, stop: int) -> bool: ...
    def extend_units(
        self, hashes: Any, numbers: Any, starts: Any, ends: Any, weights: Any
    ) -> None: ...
    def cover(self, source: Any, index: int, k: int, fp: Any, specific_to: Any = None) -> None: ...

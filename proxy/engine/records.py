"""What the engine learns from an exchange, in keyed form: no text, only keyed hashes,
offsets and counts.

A live engine makes these records as it observes traffic (``Engine.observe_prompt``,
``ResponseScan.record``); another engine replays them (``Engine.ingest_prompt``,
``ResponseScan.replay``) and reaches the same findings as if it had seen the text. So a
fingerprint journal, or replicas that share what they observe, never hold anyone's
words: only hashes under the engine's key (records of another key mean nothing and are
refused, see ``key_id``).

Unit hashes are kept per word, because the engine learns which *words* most tenants
use. That is more than k-gram fingerprints reveal: someone with the records but without
the key could still count how often each hashed word occurs. Store records as
pseudonymised personal data, away from the key.

Order matters: concurrent responses stream into the index side by side. Every prompt
and every feed of a live scan takes the engine's next *sequence number*; a replay runs
them in that order (``RecordReplayer``). Records are made when a prompt is observed and
when a response finishes, so they come out of order; each carries a *low water mark*,
below which every sequence number is already in an earlier record.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class PromptRecord:
    """A request's prompt: the units of its text, which of them a model wrote, and the
    entities it holds."""

    tenant: str
    request_id: str
    time: float
    units: np.ndarray  # uint64 keyed unit hashes, in order
    model_units: np.ndarray  # uint64 keyed unit hashes of the model-written part
    entities: tuple[tuple[str, str], ...] = ()  # (kind, entity id)
    seq: int = 0
    low_water: int = 0
    turns_known: bool = False  # its turns were read: its text is its users' words


@dataclass(frozen=True, slots=True)
class ChoiceRecord:
    """One choice of a response's output, in the batches the live scan saw it."""

    choice: int
    units: np.ndarray  # uint64 keyed unit hashes
    weights: np.ndarray  # uint8: 2 a word, 1 a character of a script without spaces
    numbers: np.ndarray  # bool: the unit is a specific number (an amount, an id)
    starts: np.ndarray  # uint32 character offsets of each unit in the output
    ends: np.ndarray  # uint32
    batches: np.ndarray  # uint32: units scanned after each live feed, cumulative
    seqs: np.ndarray  # uint64: the sequence number of each feed (the last: finish)
    # Entities of other requests met in the output: (start, end, entity id, the feed
    # they came in); and every entity the finished output holds (kind, id, start, end).
    matches: tuple[tuple[int, int, str, int], ...] = ()
    extracted: tuple[tuple[str, str, int, int], ...] = ()
    chars: int = 0  # characters of output
    # uint32: the first units of the k-grams the scan found another tenant's text, sorted;
    # None when it found a leak of text in the output (its findings set what no record
    # carries) and in the records of versions before it: a receiver scans it again.
    foreign: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class OutputRecord:
    """A finished response: every choice."""

    tenant: str
    request_id: str
    time: float
    choices: tuple[ChoiceRecord, ...]
    low_water: int = 0
    prompt_seq: int = 0  # the sequence number of its prompt's record
    # Tenants whose answer the output was found to hold (``ResponseScan._carries``): a
    # receiver knows it even where the finding cannot be made again (its source left
    # the window before the output ended).
    carries: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class CanaryRecord:
    """A canary registered for a tenant, by id (its keyed hash)."""

    tenant: str
    entity_id: str
    time: float = 0.0
    seq: int = 0


Record = PromptRecord | OutputRecord | CanaryRecord


def collapsed_choice(choice: ChoiceRecord) -> ChoiceRecord:
    """``choice`` as if its whole output had come in one feed (its last sequence
    number). The engine indexes the same fingerprints with the same owners as when the
    feeds are replayed one by one (checked: identical findings for the leaks of 100
    victims against both), at a fifth of the cost: one scan instead of one per delta."""
    if len(choice.batches) <= 1:
        return choice
    return dataclasses.replace(
        choice,
        batches=choice.batches[-1:],
        seqs=choice.seqs[-1:],
        matches=tuple((start, end, entity, 0) for start, end, entity, _ in choice.matches),
    )


def unjudged(record: Record) -> Record:
    """``record`` as versions before ``foreign`` made it: an output without its scan's
    judgment of the text it met (an ingesting engine scans it again). For the
    benchmarks and tests of that path."""
    if not isinstance(record, OutputRecord):
        return record
    choices = tuple(dataclasses.replace(c, foreign=None) for c in record.choices)
    return dataclasses.replace(record, choices=choices)

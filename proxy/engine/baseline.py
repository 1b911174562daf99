"""Baseline files: an operator's public corpus as keyed fingerprints, without its text.

Tenants paste public text (documentation, standards, contract templates, library code)
and models recite public text to other tenants. Neither is a leak, even when only one
other tenant has pasted it; a baseline says so. ``crosstalk baseline build DIR...``
turns a corpus (a RAG document store, product docs, templates) into a ``.npz`` file:

* ``kgrams`` -- sorted unique k-gram fingerprints of every text (never private);
* ``units`` -- sorted unique unit hashes (plain words: they make nothing distinctive);
* ``entities`` -- entity ids found in the corpus (published addresses, example keys);
* ``key_id``, ``k`` -- the key and shingle size it was made with: another key's hashes
  would silently mean nothing, so loading them is refused;
* ``manifest_*`` -- per file read, a keyed hash of its path, its size and mtime, so that
  a rebuild reads only new and changed files. A changed file's old fingerprints stay
  (the file only grows; ``--rebuild`` starts over).

Everything stored is a keyed hash or a count. No mitmproxy imports.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from proxy.engine.entities import iter_entity_keys
from proxy.engine.fingerprint import Hasher
from proxy.engine.tokens import unit_texts

#: Files larger than this are skipped (and counted): a corpus is documents, not dumps.
MAX_FILE_BYTES = 64 * 1024 * 1024
#: Fingerprints gathered in memory before they are merged into the sorted arrays.
MERGE_EVERY = 2_000_000
_EMPTY = np.zeros(0, dtype=np.uint64)


class BaselineError(ValueError):
    """The baseline file cannot be used (unreadable, or made with another key)."""


@dataclass(slots=True)
class Baseline:
    """Keyed fingerprints of a public corpus (see the module docstring)."""

    key_id: str
    k: int
    kgrams: np.ndarray = field(default_factory=lambda: _EMPTY)
    units: np.ndarray = field(default_factory=lambda: _EMPTY)
    entities: set[str] = field(default_factory=set)
    manifest: dict[int, tuple[int, int]] = field(default_factory=dict)  # path -> size, mtime

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (a temporary file in the same folder, then a rename)."""
        target = Path(path)
        paths = np.fromiter(self.manifest, dtype=np.uint64, count=len(self.manifest))
        stats = np.array(list(self.manifest.values()), dtype=np.int64).reshape(-1, 2)
        with tempfile.NamedTemporaryFile(
            dir=target.parent or ".", suffix=".npz", delete=False
        ) as f:
            np.savez_compressed(
                f,
                key_id=np.array(self.key_id),
                k=np.array(self.k),
                kgrams=self.kgrams,
                units=self.units,
                entities=np.array(sorted(self.entities), dtype=str),
                manifest_paths=paths,
                manifest_stats=stats,
            )
        os.replace(f.name, target)

    def check(self, hasher: Hasher) -> Baseline:
        """This baseline, if it was made with ``hasher``'s key and shingle size; else
        BaselineError (another key's hashes would silently mean nothing)."""
        if (self.key_id, self.k) != (hasher.key_id, hasher.k):
            raise BaselineError(
                f"baseline made with key {self.key_id} k={self.k}, not key "
                f"{hasher.key_id} k={hasher.k}: rebuild it with this detection.key"
            )
        return self

    @classmethod
    def load(cls, path: str | os.PathLike) -> Baseline:
        """Read a file written by ``save`` (BaselineError when it cannot be read)."""
        try:
            with np.load(path) as data:
                baseline = cls(
                    str(data["key_id"]),
                    int(data["k"]),
                    data["kgrams"].astype(np.uint64),
                    data["units"].astype(np.uint64),
                    set(data["entities"].tolist()),
                    {
                        int(p): (int(s), int(m))
                        for p, (s, m) in zip(
                            data["manifest_paths"].tolist(),
                            data["manifest_stats"].tolist(),
                            strict=True,
                        )
                    },
                )
        except (OSError, KeyError, ValueError) as e:
            raise BaselineError(f"cannot read baseline {path}: {e}") from e
        return baseline


@dataclass(slots=True)
class BuildStats:
    files_read: int = 0
    files_unchanged: int = 0
    files_skipped: int = 0  # binary, unreadable or too large
    bytes_read: int = 0


def corpus_files(roots: Iterable[str | os.PathLike]) -> Iterator[Path]:
    """Every regular file under ``roots`` (a root may be a file), in path order."""
    for root in map(Path, roots):
        if root.is_file():
            yield root
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                yield Path(dirpath) / name


def _text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte) or undecodable bytes."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1") if data.isascii() else None


def build(
    roots: Iterable[str | os.PathLike],
    hasher: Hasher,
    *,
    previous: Baseline | None = None,
    progress: Callable[[BuildStats, int], None] | None = None,
) -> tuple[Baseline, BuildStats]:
    """Fingerprint every file under ``roots`` into a baseline (extending ``previous``,
    whose unchanged files are not read again). ``progress(stats, files_seen)`` is called
    after each file."""
    baseline = previous or Baseline(hasher.key_id, hasher.k)
    stats = BuildStats()
    kgram_parts: list[np.ndarray] = [baseline.kgrams]
    unit_parts: list[np.ndarray] = [baseline.units]
    pending = 0
    seen = 0
    for path in corpus_files(roots):
        seen += 1
        try:
            info = path.stat()
        except OSError:
            stats.files_skipped += 1
            continue
        path_key = int.from_bytes(
            hashlib.blake2b(str(path.resolve()).encode(), key=hasher.key, digest_size=8).digest(),
            "little",
        )
        if baseline.manifest.get(path_key) == (info.st_size, info.st_mtime_ns):
            stats.files_unchanged += 1
        elif info.st_size > MAX_FILE_BYTES:
            stats.files_skipped += 1
        else:
            try:
                text = _text_of(path)
            except OSError:
                text = None
            if text is None:
                stats.files_skipped += 1
            else:
                hashes = hasher.units(unit_texts(text))
                kgram_parts.append(np.array(hasher.kgrams_of_hashes(hashes), dtype=np.uint64))
                unit_parts.append(np.array(hashes, dtype=np.uint64))
                baseline.entities.update(
                    hasher.digest(key.encode()) for _, key in iter_entity_keys(text)
                )
                baseline.manifest[path_key] = (info.st_size, info.st_mtime_ns)
                stats.files_read += 1
                stats.bytes_read += info.st_size
                pending += len(hashes)
                if pending >= MERGE_EVERY:
                    kgram_parts = [np.unique(np.concatenate(kgram_parts))]
                    unit_parts = [np.unique(np.concatenate(unit_parts))]
                    pending = 0
        if progress is not None:
            progress(stats, seen)
    baseline.kgrams = np.unique(np.concatenate(kgram_parts))
    baseline.units = np.unique(np.concatenate(unit_parts))
    return baseline, stats

"""The data crosstalk ships: plain-word vocabularies, the boilerplate baseline and the
public isolation advisories. Package data, read with :mod:`importlib.resources`, so an
installed wheel reads exactly what a source checkout reads.

A missing shipped file is an installation error (:class:`DefaultsMissing`), never an
empty list: without its vocabulary and baseline the engine would still run but detect
differently. An operator's own directory (``detection.baseline_dir`` and
``vocabulary_dir``) replaces the shipped one; a missing one is a :class:`ValueError`.
"""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Protocol, cast

VOCABULARY = "vocabulary"
BASELINE = "baseline"
ADVISORIES = "advisories.toml"
NAMES = "names"
FIRST_NAMES = "first_names"


class _TextFile(Protocol):
    """What ``read_texts`` reads a file as: the Traversables importlib.resources gives
    (``pathlib.Path``, ``zipfile.Path``) take ``errors``; the Traversable ABC omits it."""

    def read_text(self, encoding: str | None = None, errors: str | None = None) -> str: ...


class DefaultsMissing(RuntimeError):
    """A file this package ships is not installed: the installation is broken."""


def shipped(name: str) -> Traversable:
    """The shipped file or directory ``name`` (``VOCABULARY``, ``BASELINE``, ``ADVISORIES``,
    ``NAMES``, ``FIRST_NAMES``).
    Raises DefaultsMissing when it is not installed."""
    item = resources.files(__package__) / name
    if not (item.is_dir() or item.is_file()):
        raise DefaultsMissing(
            f"crosstalk's shipped data {name!r} is missing from {resources.files(__package__)}:"
            " the package was installed without its data files; reinstall it"
        )
    return item


def _txt_files(root: Traversable) -> list[Traversable]:
    found = []
    for item in root.iterdir():
        if item.is_dir():
            found.extend(_txt_files(item))
        elif item.name.endswith(".txt"):
            found.append(item)
    return found


def read_texts(root: Traversable | Path) -> list[str]:
    """The ``*.txt`` files under ``root`` (recursively, in path order), ``#`` comment lines
    removed."""
    texts = []
    for item in sorted(_txt_files(root), key=lambda t: str(t)):
        lines = cast(_TextFile, item).read_text(encoding="utf-8", errors="replace").splitlines()
        texts.append("\n".join(line for line in lines if not line.lstrip().startswith("#")))
    return texts


def _texts_of(directory: str | Path | None, name: str) -> list[str]:
    if not directory:
        return read_texts(shipped(name))
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"{name} directory {str(root)!r} does not exist")
    return read_texts(root)


def load_baseline(directory: str | Path | None = None) -> list[str]:
    """Baseline texts (shared system prompts, templates, public documents, boilerplate):
    the operator's ``directory`` if given, else the shipped baseline."""
    return _texts_of(directory, BASELINE)


def load_vocabulary(directory: str | Path | None = None) -> list[str]:
    """Plain words of common languages, one a line: ``directory`` if given, else the
    shipped vocabularies of the ten languages and of code."""
    return [w for text in _texts_of(directory, VOCABULARY) for w in text.split()]


def load_surnames() -> frozenset[str]:
    """Frequent surnames, lowercased (``names/*.txt``): what makes a run of plain words
    ("Hill-Thompson") a name. Shipped only; not a vocabulary (its words stay plain)."""
    return frozenset(w for text in read_texts(shipped(NAMES)) for w in text.split())


def load_first_names() -> frozenset[str]:
    """Frequent first names, lowercased (``first_names/*.txt``): what makes a pair of
    plain words before a frequent surname ("Richard Williams") a person's full name."""
    return frozenset(w for text in read_texts(shipped(FIRST_NAMES)) for w in text.split())

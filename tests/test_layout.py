"""The package keeps the layering docs/architecture.md describes: each folder imports
only what its row allows, and mitmproxy only where the proxy runs."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "proxy"
TOP = {"config", "tenants", "prevention", "eventlog", "factory"}
# modules at the package root that are a layer of their own (the rest are "top")
OWN_LAYER = {"redaction"}

# folder (or top-level module group) -> (crosstalk groups it may import, mitmproxy allowed)
ALLOWED: dict[str, tuple[set[str], bool]] = {
    "redaction": (set(), False),
    "engine": (set(), False),
    "protocols": (set(), False),
    "defaults": (set(), False),
    "store": ({"engine", "redaction"}, False),
    "top": ({"engine", "protocols", "defaults", "store", "redaction"}, False),
    "pipeline": ({"engine", "protocols", "redaction"}, False),
    "assurance": ({"engine", "defaults", "top", "redaction"}, False),
    "sim": ({"engine"}, False),
    "mitm": (
        {"engine", "protocols", "defaults", "store", "top", "pipeline", "sim", "redaction"},
        True,
    ),
    "forensics": (
        {"engine", "protocols", "defaults", "store", "top", "pipeline", "mitm", "redaction"},
        True,
    ),
}


def group_of(name: str) -> str | None:
    """The layout group of a ``proxy.*`` module name (None: the package root itself)."""
    parts = name.split(".")
    if parts[0] != "proxy" or len(parts) < 2 or parts[1] == "__version__":
        return None
    return "top" if parts[1] in TOP else parts[1]


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "proxy":
                names.update(f"proxy.{a.name}" for a in node.names)
            else:
                names.add(node.module)
    return names


def test_every_folder_imports_only_what_its_layer_allows():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        own = group_of("proxy." + ".".join(rel.with_suffix("").parts))
        if own not in ALLOWED:
            continue  # commands, cli, __main__: may import everything
        allowed, mitm_ok = ALLOWED[own]
        for name in imports_of(path):
            if name.split(".")[0] == "mitmproxy" and not mitm_ok:
                violations.append(f"{rel} imports {name}")
            group = group_of(name)
            if group is not None and group != own and group not in allowed:
                violations.append(f"{rel} imports {name} ({own} may not use {group})")
    assert not violations, "\n".join(violations)


def test_no_module_is_left_at_the_package_root_unassigned():
    """A new top-level module must be given a place in the table (and the docs)."""
    roots = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__", "cli"}
    assert roots <= TOP | OWN_LAYER, f"unassigned: {sorted(roots - TOP - OWN_LAYER)}"


def test_the_relative_import_check_sees_every_import():
    """The rules read absolute imports: a relative one would slip past them."""
    relative = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if any(
            isinstance(n, ast.ImportFrom) and n.level > 0
            for n in ast.walk(ast.parse(p.read_text()))
        )
    ]
    assert not relative

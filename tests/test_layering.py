"""The floors of the package import only downward:

    kv <- connector <- sched <- worker <- models <- engine <- server <- bench / cli

A module may import its own floor and any floor below it; an import pointing up (the worker
reaching for a model class, the scheduler for the engine) fails here with the line that does
it. Imports inside functions count too: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "hybridkv"

# Lowest first. A module outside these packages (cli.py, config.py, ...) gets the floor named
# in TOP_LEVEL.
FLOORS = ["kv", "connector", "sched", "worker", "models", "engine", "server", "bench"]
TOP_LEVEL = {"__init__": "engine", "config": "engine", "cli": "bench"}


def floor_of(module: str) -> str:
    parts = module.split(".")
    assert parts[0] == "hybridkv", module
    if len(parts) == 1:
        return TOP_LEVEL["__init__"]
    if parts[1] in FLOORS:
        return parts[1]
    if parts[1] in TOP_LEVEL:
        return TOP_LEVEL[parts[1]]
    if parts[1] == "data":
        return FLOORS[0]
    raise AssertionError(f"module {module} has no floor: add it to FLOORS or TOP_LEVEL")


def module_name(path: Path, root: Path = SRC) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path = SRC) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return [(line, name) for line, name in found if name.split(".")[0] == "hybridkv"]


def upward_imports(root: Path = SRC) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        mine = FLOORS.index(floor_of(module_name(path, root)))
        for line, name in imported_modules(path, root):
            theirs = FLOORS.index(floor_of(name))
            if theirs > mine:
                bad.append(f"{path.relative_to(root.parent)}:{line} imports {name} "
                           f"({FLOORS[theirs]} is above {FLOORS[mine]})")
    return bad


def test_no_upward_import() -> None:
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    # The walk itself must notice one, or the test above could never fail.
    root = tmp_path / "hybridkv"
    (root / "kv").mkdir(parents=True)
    (root / "kv" / "probe.py").write_text("def f():\n    from ..engine.llm import LLM\n")
    (root / "worker.py").write_text("import hybridkv.sched.request\n")
    assert upward_imports(root) == [
        "hybridkv/kv/probe.py:2 imports hybridkv.engine.llm (engine is above kv)"]

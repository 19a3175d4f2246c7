"""Every import inside properties/ and zoo/ runs down a floor, and no modules import each other in a circle
(docs/ARCHITECTURE.md, "Layers: every import runs down"). Read from the source with ast, nothing imported; the
clause modules (test_*.py) are leaves and checked apart."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Floors, lowest first; a package's modules may import their own floor's and those below. Floors that share a
# number are siblings: neither imports the other.
FLOORS = {
    "properties": {"core": 0, "kernel": 1, "module": 2, "model": 2, "distributed": 2, "adapters": 3, "repro": 3,
                   "plugin": 4, "catalog": 5},
    "zoo": {"runtime": 0, "nn": 1, "config": 2, "io": 3, "interop": 4, "tasks": 5, "cli": 6, "__main__": 7},
}
# properties/__init__.py (clause, Subject) reads core/ only; zoo/__init__.py names zoo.config lazily, by string.
FRONT = {"properties": 0, "zoo": 7}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import, function-level ones included (a lazy import is still an arrow)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def _floor(module: str) -> tuple[str, int] | None:
    """(room, floor) of a module of properties/ or zoo/, or None for anything else."""
    package, _, rest = module.partition(".")
    if package not in FLOORS:
        return None
    room = rest.partition(".")[0]
    if room in FLOORS[package]:
        return room, FLOORS[package][room]
    return "", FRONT[package]   # the package itself, or a name it exports


def _sources(package: str, tests: bool) -> list[Path]:
    return [p for p in sorted((ROOT / package).rglob("*.py")) if p.name.startswith("test_") == tests]


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_every_import_runs_down_a_floor(package):
    upward = []
    for path in _sources(package, tests=False):
        here = _floor(_module(path))
        for line, target in _imports(path):
            if package == "zoo" and target.partition(".")[0] == "properties":
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {target}: the zoo never imports the suite")
            there = _floor(target)
            if here is None or there is None or there[0] == here[0] or not target.startswith(package + "."):
                continue   # within a room, or another package (the suite imports the zoo, never the reverse)
            if there[1] > here[1] or (there[1] == here[1] and here[0] and there[0]):
                upward.append(f"{path.relative_to(ROOT)}:{line} ({here[0] or package}, floor {here[1]}) imports "
                              f"{target} ({there[0] or package}, floor {there[1]})")
    assert not upward, "imports that run up a floor:\n" + "\n".join(upward)


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_no_modules_import_each_other_in_a_circle(package):
    modules = {_module(p): p for p in _sources(package, tests=False)}

    def arrows(module: str) -> set[str]:
        out = set()
        for _, target in _imports(modules[module]):
            while target and target not in modules:   # a name imported from a module: that module
                target = target.rpartition(".")[0]
            if target and target != module and not module.startswith(target + "."):
                out.add(target)
        return out
    graph = {m: arrows(m) for m in modules}
    state: dict[str, int] = {}   # 1: on the current path, 2: done

    def circle_from(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n] if n in path else [m, n]
            if n not in state:
                found = circle_from(n, path + [n])
                if found:
                    return found
        state[m] = 2
        return None
    for m in sorted(graph):
        if m not in state:
            found = circle_from(m, [m])
            assert found is None, "modules importing each other in a circle: " + " -> ".join(found)


def test_clause_modules_import_their_level_and_below():
    """A clause module (properties/<level>/test_*.py) reads its level, the floors below and the package front; the
    module clauses also model/checks.py's comparison, the model clauses the module oracles that judge a model's own
    parts (docs/ARCHITECTURE.md)."""
    allowed_across = {("module", "properties.model.checks"), ("model", "properties.module.")}
    upward = []
    for path in _sources("properties", tests=True):
        level, floor = _floor(_module(path))
        for line, target in _imports(path):
            there = _floor(target)
            if there is None or not there[0] or there[0] == level or not target.startswith("properties."):
                continue
            if (there[1] > floor or (there[1] == floor and there[0] != level)) and not any(
                    level == lv and target.startswith(prefix) for lv, prefix in allowed_across):
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not upward, "clause modules importing above their level:\n" + "\n".join(upward)

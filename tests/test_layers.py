"""The import graph of src/evenzero: layers import one way, and nothing imports in a circle.

Every import of an evenzero module counts: at the top of a file, inside a function (a
lazy import is still a dependency), under `TYPE_CHECKING`. `LAYERS` below is the rule
(docs/architecture.md explains it); a module the table does not place fails
`test_every_module_has_a_layer`, whose message says where to add it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "evenzero"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("spec/plan", ("evenzero.spec", "evenzero.spec_json", "evenzero.userjson", "evenzero.wire",
                   "evenzero.model_presets", "evenzero.plan")),
    ("cost", ("evenzero.cost.*",)),
    ("strategies", ("evenzero.strategies.*",)),
    ("calibration", ("evenzero.calibration",)),
    ("runtime", ("evenzero", "evenzero.runtime.*", "evenzero.rendezvous", "evenzero.moe")),
    ("checkpoint/deepspeed/lightning", ("evenzero.checkpoint.*", "evenzero.deepspeed.*",
                                        "evenzero.lightning.*")),
    ("commands/repro/cli", ("evenzero.commands.*", "evenzero.repro.*", "evenzero.cli",
                            "evenzero.plan_report", "evenzero.planview",
                            "evenzero.timelineview")),
)
"""Lowest first. A module may import its own layer and the layers below it, never one
above. "pkg.*" is the package and everything in it; other entries are one module
("evenzero" alone is the package's `__init__`, which re-exports the planner and
`ZeroOptimizer`)."""


@dataclass(frozen=True)
class Import:
    source: str
    """The importing module."""
    target: str
    """The evenzero module imported."""
    where: str
    """path:line of the import statement."""


def module_names() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = ("evenzero",) + path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts).removesuffix(".__init__")] = path
    return out


def imports() -> list[Import]:
    """Every import of an evenzero module, resolved to the module it loads."""
    modules = module_names()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    out: dict[Import, None] = {}  # one per statement and target, in file order
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        where = path.relative_to(SRC.parent.parent)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                # `from pkg import name`: a submodule if there is one, else pkg itself
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name.startswith("evenzero") else None
                if target is not None and target != module:
                    out[Import(module, target, f"{where}:{node.lineno}")] = None
    return list(out)


def layer_of(module: str) -> int | None:
    """Index in LAYERS of the most specific entry that places `module`."""
    best: tuple[int, int] | None = None
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            package = entry.removesuffix(".*")
            placed = (module == entry or (entry.endswith(".*") and
                                          (module == package or module.startswith(package + "."))))
            if placed and (best is None or len(package) > best[1]):
                best = (index, len(package))
    return None if best is None else best[0]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def file_edges(found: list[Import]) -> dict[str, set[str]]:
    """Module -> modules it imports. A package's `__init__` importing its own submodules
    is how a package presents its parts, not a dependency of theirs on it: left out."""
    edges: dict[str, set[str]] = {m: set() for m in module_names()}
    for i in found:
        if not i.target.startswith(i.source + "."):
            edges[i.source].add(i.target)
    return edges


def describe(component: list[str], found: list[Import]) -> str:
    members = set(component)
    lines = [f"  {i.where}: {i.source} imports {i.target}" for i in found
             if i.source in members and i.target in members
             and not i.target.startswith(i.source + ".")]
    return " <-> ".join(m.removeprefix("evenzero.") for m in component) + "\n" + "\n".join(lines)


# ----------------------------------------------------------------------------- tests


def test_every_module_has_a_layer():
    missing = [m for m in module_names() if layer_of(m) is None]
    assert not missing, (
        f"{', '.join(missing)}: not in the layer table. Add each to LAYERS in "
        f"tests/test_layers.py (and the table in docs/architecture.md), in the lowest "
        f"layer whose modules are all it imports, so that nothing below imports it")


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for i in imports():
        src, dst = layer_of(i.source), layer_of(i.target)
        if src is not None and dst is not None and dst > src:
            upward.append(f"  {i.where}: {i.source} ({LAYERS[src][0]}) imports {i.target} "
                          f"({LAYERS[dst][0]})")
    assert not upward, ("upward imports (layers, lowest first: "
                        + " <- ".join(name for name, _ in LAYERS) + "):\n" + "\n".join(upward))


def test_no_import_cycle_between_files():
    found = imports()
    bad = cycles(file_edges(found))
    assert not bad, "import cycles:\n" + "\n".join(describe(c, found) for c in bad)


def test_no_import_cycle_between_parts():
    """Parts of one layer (checkpoint and deepspeed, commands and repro) may import each
    other one way only, so the layer keeps an order inside."""
    def part(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    edges: dict[str, set[str]] = {}
    lines: dict[tuple[str, str], str] = {}
    for i in imports():
        a, b = part(i.source), part(i.target)
        if a != b and "evenzero" not in (a, b):
            edges.setdefault(a, set()).add(b)
            edges.setdefault(b, set())
            lines.setdefault((a, b), i.where)
    bad = cycles(edges)
    assert not bad, "import cycles between parts:\n" + "\n".join(
        " <-> ".join(c) + ": " + ", ".join(f"{a}->{b} at {w}" for (a, b), w in lines.items()
                                           if a in c and b in c) for c in bad)


# ------------------------------------------------------------------- the test's own logic


def test_the_checks_catch_what_they_are_for():
    """An upward import, a cycle and an unplaced module on a made-up graph."""
    assert layer_of("evenzero.cost.timeline") == 1 and layer_of("evenzero.plan") == 0
    assert layer_of("evenzero.plan_report") == len(LAYERS) - 1  # not evenzero.plan's
    assert layer_of("evenzero") == 4 and layer_of("evenzero.newthing") is None
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # The package presenting its submodules is no cycle; a submodule importing the
    # package back is an edge like any other.
    edges = file_edges([Import("evenzero.cost", "evenzero.cost.model", "x:1"),
                        Import("evenzero.cost.model", "evenzero.cost", "x:2")])
    assert edges["evenzero.cost"] == set() and edges["evenzero.cost.model"] == {"evenzero.cost"}
    found = imports()
    lazy = [i for i in found if i.source == "evenzero" and i.target == "evenzero.runtime.optimizer"]
    assert lazy, "an import inside a function must count"

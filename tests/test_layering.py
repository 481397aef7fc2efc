"""The modules of megatron/ import each other without cycles (issue 44).

Why: a cycle makes the import order decide which names exist (a module run half-way through its
imports), forces imports into functions or under ``TYPE_CHECKING`` to break at run time, and
means neither module can be read, tested or replaced alone. The graph here is built from the
source with :mod:`ast`, so it counts every import: module level, inside functions and under
``if TYPE_CHECKING:`` alike (a type-only import is still a dependency of the reader's model of
the code). An edge goes to the module that is named: ``from pkg import sub`` to ``pkg.sub`` when
that is a module, else to ``pkg`` (its ``__init__``); the packages a submodule import runs
implicitly are not edges (a package re-exporting its children is not a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

REPO = Path(__file__).resolve().parent.parent
ROOT = "megatron"
"""The tree whose import graph is checked (megatron-core's modules, also under ``megatron``,
are not in it: they are not ours)."""

Edge = Tuple[str, str]


def module_files(repo: Path = REPO, root: str = ROOT) -> Dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``repo / root`` (a package by its
    ``__init__.py``)."""
    out: Dict[str, Path] = {}
    for path in sorted((repo / root).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(repo).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> Optional[str]:
    """Absolute name of the module an ``ImportFrom`` reads from (relative levels resolved)."""
    if node.level == 0:
        return node.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level - 1 > len(base):
        return None
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_edges(modules: Dict[str, Path]) -> Dict[Edge, int]:
    """(importer, imported) -> line of the first such import, both modules of ``modules``."""
    edges: Dict[Edge, int] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name in modules]
            elif isinstance(node, ast.ImportFrom):
                source = _resolve_from(name, is_package, node)
                if source is None:
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in modules:
                        targets.append(sub)
                    elif source in modules:
                        targets.append(source)
            for target in targets:
                if target != name:
                    edges.setdefault((name, target), node.lineno)
    return edges


def strongly_connected(nodes: Set[str], edges: Dict[Edge, int]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    succ: Dict[str, List[str]] = {n: [] for n in nodes}
    for a, b in sorted(edges):
        succ[a].append(b)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    components: List[List[str]] = []
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(succ[node]):
                work.append((node, i + 1))
                nxt = succ[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return components


def shortest_cycle(component: List[str], edges: Dict[Edge, int]) -> List[str]:
    """A shortest cycle through the component's first module, as [m0, m1, ..., m0]."""
    members = set(component)
    start = component[0]
    prev: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for a in frontier:
            for (x, b) in edges:
                if x != a or b not in members:
                    continue
                if b == start:
                    path = [a]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if b not in prev:
                    prev[b] = a
                    nxt_frontier.append(b)
        frontier = nxt_frontier
    return [start]


def describe_cycles(modules: Dict[str, Path], edges: Dict[Edge, int],
                    repo: Path = REPO) -> List[str]:
    """One paragraph per strongly connected set of modules: a shortest cycle through it and every
    import between its members, each with its file and line."""
    out = []
    for comp in strongly_connected(set(modules), edges):
        cycle = shortest_cycle(comp, edges)
        members = set(comp)
        inside = sorted(e for e in edges if e[0] in members and e[1] in members)

        def line(a: str, b: str) -> str:
            return f"    {a} -> {b}  ({modules[a].relative_to(repo)}:{edges[(a, b)]})"

        out.append(f"cycle among {len(comp)} modules: {', '.join(comp)}\n  shortest:\n"
                   + "\n".join(line(a, b) for a, b in zip(cycle, cycle[1:]))
                   + "\n  every import inside it:\n" + "\n".join(line(a, b) for a, b in inside))
    return out


def test_resolves_relative_type_checking_and_function_level_imports(tmp_path: Path) -> None:
    """The graph builder sees the imports the check is about (a guard on the guard)."""
    pkg = tmp_path / "megatron" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("import megatron.pkg.a\nfrom megatron.pkg import thing\n")
    files = module_files(tmp_path)
    edges = import_edges(files)
    assert set(edges) == {("megatron.pkg.a", "megatron.pkg.b"),
                          ("megatron.pkg.b", "megatron.pkg.c"),
                          ("megatron.pkg.c", "megatron.pkg.a"),
                          ("megatron.pkg.c", "megatron.pkg")}
    (cycle,) = describe_cycles(files, edges, tmp_path)
    assert "megatron.pkg.a -> megatron.pkg.b" in cycle and "megatron/pkg/a.py:3" in cycle


def test_megatron_imports_have_no_cycles() -> None:
    """No module of megatron/ imports, by any path, a module that imports it back."""
    modules = module_files()
    cycles = describe_cycles(modules, import_edges(modules))
    assert not cycles, "import cycles in megatron/:\n" + "\n".join(cycles)


QUANT = "megatron.distributed.quant"
TRAINER = "megatron.training"
TRAINER_MAY_IMPORT = (f"{QUANT}.integration",)
"""The quantized layer's one module the trainer may name: its entry points (``integration``).
The failure beacon and the megatron-core seam sit beside the layer (``megatron.distributed.failures``,
``megatron.distributed.mcore_compat``), where both layers import them."""


def trainer_reaches_into_quant(edges: Dict[Edge, int]) -> List[str]:
    """``importer -> imported (line)`` for each import of a quant module outside
    :data:`TRAINER_MAY_IMPORT` by a module of ``megatron/training``."""
    def allowed(target: str) -> bool:
        return any(target == ok or target.startswith(ok + ".") for ok in TRAINER_MAY_IMPORT)

    return sorted(f"{a} -> {b} (line {line})" for (a, b), line in edges.items()
                  if (a == TRAINER or a.startswith(TRAINER + "."))
                  and (b == QUANT or b.startswith(QUANT + ".")) and not allowed(b))


def test_trainer_to_quant_check_sees_every_import(tmp_path: Path) -> None:
    """Function-level and plain ``import`` statements count; the allowed modules do not (a guard
    on the guard)."""
    pkg = tmp_path / "megatron"
    for sub in ("training", "distributed/mcore_compat", "distributed/quant/paro"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
    for init in ("", "training", "distributed", "distributed/quant",
                 "distributed/mcore_compat", "distributed/quant/paro"):
        (pkg / init / "__init__.py").write_text("")
    for mod in ("integration", "config", "paro/strategy"):
        (pkg / "distributed/quant" / f"{mod}.py").write_text("")
    for mod in ("failures", "mcore_compat/ops"):
        (pkg / "distributed" / f"{mod}.py").write_text("")
    (pkg / "training/ok.py").write_text(
        "from megatron.distributed.quant import integration\n"
        "from megatron.distributed import failures\n"
        "from megatron.distributed.mcore_compat.ops import x\n")
    (pkg / "training/bad.py").write_text(
        "def f():\n    from megatron.distributed.quant.paro.strategy import AUTO\n"
        "import megatron.distributed.quant.config\n")
    found = trainer_reaches_into_quant(import_edges(module_files(tmp_path)))
    assert found == ["megatron.training.bad -> megatron.distributed.quant.config (line 3)",
                     "megatron.training.bad -> megatron.distributed.quant.paro.strategy (line 2)"]


def test_trainer_enters_the_quant_layer_only_through_integration() -> None:
    """megatron/training names no module of megatron/distributed/quant but ``integration``: the
    config is built, and the layer driven, through one entry point, so the layer's inside can
    change without the trainer."""
    bad = trainer_reaches_into_quant(import_edges(module_files()))
    assert not bad, ("megatron/training imports the quantized layer's inside; go through "
                     "megatron.distributed.quant.integration:\n" + "\n".join(bad))

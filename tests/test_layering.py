"""The layers, read from the code's own imports: ``kvtypes < configs < cache < scheduler < engine
< server < kvserve``, ``bench`` on top. A module may import its own layer and the ones below,
never one above, and no set of the project's modules imports itself round a cycle (imports
inside functions count: a lazy import that closes a cycle is still a cycle, only deferred).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["kvtypes", "configs", "cache", "scheduler", "engine", "server", "kvserve", "bench"]


def module_files() -> dict[str, Path]:
    mods = {}
    for top in LAYERS:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


MODULES = module_files()


def imports_of(name: str, path: Path) -> set[str]:
    """The project modules ``name`` imports: ``from a.b import c`` is ``a.b.c`` when that is a
    module, else ``a.b``; relative imports are resolved against the module's package."""
    found: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def test_the_graph_sees_the_imports_it_should():
    # guards the parser itself: a graph with no edges would pass every check below
    assert "engine.core.protocol" in GRAPH["engine.core.loop"]
    assert "kvtypes.sampling_params" in GRAPH["engine.sampling.sampler"]
    assert sum(map(len, GRAPH.values())) > 200


def test_no_module_imports_a_layer_above_its_own():
    rank = {top: i for i, top in enumerate(LAYERS)}
    upward = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets
                    if rank[t.split(".")[0]] > rank[m.split(".")[0]])
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_no_import_cycle_among_the_project_modules():
    cycles = strongly_connected(GRAPH)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
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
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(component)
    return out

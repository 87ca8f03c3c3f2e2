"""The library's layers, as imports (every import of a spekit module, lazy ones inside functions included):
- no module outside spekit/commands imports a command module (the library never imports its commands);
- no circle of imports spans more than two files;
- no import points from a lower layer to a higher one (core < pacing < backends < drafters < engine, methods <
  API < applications < commands)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "spekit"
CORE = ("config", "sampling", "tree", "acceptance", "stats", "grammar", "logprobs", "cache", "detokenize")
LAYERS = [
    ("core", [f"spekit.{m}" for m in CORE]),
    ("pacing", ["spekit.pacing"]),
    ("backends", ["spekit.backends"]),
    ("drafters", ["spekit.proposers", "spekit.heads", "spekit.retrieval"]),
    ("engine", ["spekit.engine", "spekit.batching", "spekit.methods"]),
    ("api", ["spekit.api", "spekit.hf_generate", "spekit"]),
    ("applications", ["spekit.bench", "spekit.train", "spekit.server"]),
    ("commands", ["spekit.commands", "spekit.__main__"]),
]


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("spekit",) + path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports() -> dict[str, set[str]]:
    """module -> the spekit modules it imports (a name imported from a package counts as its submodule when
    there is one)."""
    mods, graph = modules(), {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                full = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
                if full.startswith("spekit"):
                    found |= {f"{full}.{a.name}" if f"{full}.{a.name}" in mods else full for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("spekit")}
        graph[name] = {m for m in found if m in mods and m != name}
    return graph


def layer(module: str) -> int:
    best = max(((i, len(p)) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
                if module == p or module.startswith(p + ".")), key=lambda x: x[1])
    return best[0]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, count = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = count[0]
        count[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_library_never_imports_its_commands():
    graph = imports()
    bad = [(a, b) for a, bs in graph.items() for b in bs
           if b.startswith("spekit.commands") and not a.startswith(("spekit.commands", "spekit.__main__"))]
    assert not bad, bad


def test_no_circle_of_imports_spans_more_than_two_files():
    big = [c for c in circles(imports()) if len(c) > 2]
    assert not big, big


def test_no_import_points_from_a_lower_layer_to_a_higher_one():
    graph = imports()
    upward = [(a, b) for a, bs in graph.items() for b in bs if layer(b) > layer(a)]
    assert not upward, upward

"""Layers point one way: verifier <- engine <- gateway; training and loadtest on top.

The import graph is read from the source (every `import`, including the lazy ones inside
functions, which hide cycles from the interpreter but not from readers). A new edge that breaks a
layer, or any cycle between modules, fails here with the offending edge named.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "verifier", "training", "loadtest")

# layer -> the layers it may import (besides itself). `server.cli` is the application entry point:
# it names subcommand modules as strings, so it imports nothing here and nothing imports it.
ALLOWED = {
    "verifier": set(),
    "server.cli_errors": set(),
    "server.engine": {"verifier", "server.cli_errors"},
    "server.sglang_plugin": {"verifier", "server.engine"},
    "server.gateway": {"verifier", "server.engine", "server.cli_errors"},
    "server.runtime_cli": {"verifier", "server.sglang_plugin", "server.cli_errors"},
    "server.cli": {"server.cli_errors"},
    "training": {"verifier", "server.engine", "server.cli_errors"},
    "loadtest": set(),  # HTTP only: it must work against any OpenAI-compatible server
}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    """Project modules imported anywhere in `path` (a `from pkg import mod` counts as `pkg.mod`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in mods}
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "server" and len(parts) > 1 else parts[0]


def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(path, mods) - {name} for name, path in mods.items()}


def test_every_module_is_in_a_known_layer():
    unknown = {_layer(m) for m in graph()} - set(ALLOWED) - {"server"}
    assert not unknown, f"add these layers to ALLOWED with their rules: {sorted(unknown)}"


def test_layers_point_one_way():
    bad = [
        f"{src} -> {dst}"
        for src, dsts in graph().items()
        for dst in dsts
        if _layer(src) != _layer(dst)
        and _layer(dst) not in ALLOWED.get(_layer(src), {_layer(dst)})
        and _layer(dst) != "server"  # the bare `server` package (its __init__ docstring)
    ]
    assert not bad, "layer violations:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(g):
        if node not in state and (cycle := visit(node)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_the_checker_sees_lazy_imports():
    """Power: a lazy import inside a function is an edge (the old engine <-> training cycle hid so)."""
    g = graph()
    assert "server.engine.model_pair" in g["server.engine.bench.workload"]  # imported in a function

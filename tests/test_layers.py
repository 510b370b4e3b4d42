"""Layers point one way: verifier <- engine <- gateway; training and loadtest on top; the engine's
SGLang client and embedded engine never import each other.

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

# The engine's two rooms never import each other: the SGLang client is HTTP only (no torch) and
# the embedded engine needs nothing of it. Both may use what `server.engine` itself shares
# (protocol, model_pair, head_store).
ROOMS = ("server.engine.sglang", "server.engine.embedded")
# Inside the embedded engine, the model and the planner sit below the round, the row and the
# scheduler: they may import each other's room (planner -> model) but nothing above them.
EMBEDDED_BELOW = {
    "server.engine.embedded.model": set(),
    "server.engine.embedded.planner": {"server.engine.embedded.model"},
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


def _room(module: str, rooms) -> str | None:
    return next((r for r in rooms if module == r or module.startswith(r + ".")), None)


def test_engine_rooms_do_not_import_each_other():
    bad = [
        f"{src} -> {dst}"
        for src, dsts in graph().items()
        for dst in dsts
        if (a := _room(src, ROOMS)) and (b := _room(dst, ROOMS)) and a != b
    ]
    assert not bad, "sglang <-> embedded imports:\n" + "\n".join(sorted(bad))


def test_embedded_model_and_planner_import_nothing_above_them():
    inside = "server.engine.embedded"
    bad = [
        f"{src} -> {dst}"
        for src, dsts in graph().items()
        if (room := _room(src, EMBEDDED_BELOW))
        for dst in dsts
        if dst.startswith(inside + ".") and _room(dst, EMBEDDED_BELOW) not in {room, *EMBEDDED_BELOW[room]}
    ]
    assert not bad, "upward imports in the embedded engine:\n" + "\n".join(sorted(bad))


def test_the_room_rules_have_power():
    """Power: the checks name the edges they exist for (a rule that matches no module is void)."""
    g = graph()
    assert _room("server.engine.sglang.client", ROOMS) == "server.engine.sglang"
    assert _room("server.engine.embedded.round", ROOMS) == "server.engine.embedded"
    assert _room("server.engine.protocol", ROOMS) is None  # shared: both rooms may import it
    assert "server.engine.protocol" in g["server.engine.sglang.client"]
    assert "server.engine.protocol" in g["server.engine.embedded.engine"]
    assert "server.engine.embedded.model.llama" in g["server.engine.embedded.planner.cost_profile"]


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
    assert "server.engine.model_pair" in g["server.engine.embedded.bench.workload"]  # imported in a function

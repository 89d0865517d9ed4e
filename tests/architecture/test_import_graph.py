"""The folders are the layers: imports run downwards only, and no module imports itself
back through others (docs/design.md, "Layout of the code"). Read from the source with
``ast``, so a new import that breaks the layering fails here, naming it."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "src" / "shardmuon"

# Each room (a folder, or a top-level module) and its layer: a module may import from its
# own room or a lower layer. The package's ``__init__`` is the public face of layer 4.
LAYERS = {
    "ops": 0,
    "planning": 1,
    "validation": 1,
    "settings": 1,
    "routing": 1,
    "runtime": 2,
    "state_dict_checks": 2,
    "optimizer": 3,
    "functional": 3,
    "qk_clip": 3,
    "": 4,
    "config": 4,
    "integrations": 4,
    "harness": 5,
    "train": 6,
    "bench": 7,
    "cli": 8,
    "__main__": 9,
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in SOURCE.rglob("*.py"):
        parts = ("shardmuon", *path.relative_to(SOURCE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every ``shardmuon`` module ``path`` imports, at any depth of the file; ``from
    package import submodule`` counts as the submodule."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("shardmuon"):
                submodules = {f"{node.module}.{alias.name}" for alias in node.names}
                names.update(submodules & modules)
                if submodules - modules:
                    names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("shardmuon"))
    return names & modules


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, set(modules)) - {name} for name, path in modules.items()}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_room_has_a_layer() -> None:
    rooms = {_room(m) for m in _modules()}
    assert rooms <= set(LAYERS), f"rooms without a layer: {sorted(rooms - set(LAYERS))}"


def test_imports_run_downwards_only() -> None:
    upward = [
        f"{a} imports {b} ({_room(a) or 'shardmuon'} is layer {LAYERS[_room(a)]}, "
        f"{_room(b) or 'shardmuon'} layer {LAYERS[_room(b)]})"
        for a, targets in _graph().items()
        for b in targets
        if LAYERS[_room(b)] > LAYERS[_room(a)]
    ]
    assert not upward, "\n".join(sorted(upward))


def test_no_module_imports_itself_back() -> None:
    graph = _graph()
    # A package's __init__ importing its own submodules is how a package exposes them; a
    # submodule importing its package's __init__ back is then the circle.
    cycles, state = [], {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join([*trail[trail.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)

"""The package's imports point down: no module imports one above it, and no two import each other.

Read from the source with ``ast`` (imports inside functions included: a lazy import is still an
arrow), so the test sees every ``infmem_verl`` module, not only what one process happens to load.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "infmem_verl"

# Layers, bottom first: a module may import its own layer and the ones below (within a layer the
# cycle check keeps the arrows one-way). The top-level name of a module or sub-package decides.
LAYERS = [
    {"agent"},  # the framework-free core and its records (facts, errors, config)
    {"assets", "settings", "warmup_report"},  # readers of files and of the infmem.* config
    {"data", "cli", "actor_faults", "ray_start"},  # cli, actor_faults, ray_start: the entry points' one-line reports, Ray's start
    {"small_vocab"},  # the stand-in students' tokenizer, trained on the assets' and the data's text
    {"policy"},
    {"reward", "metrics"},
    {"cost", "footprint", "run_record", "evaluation"},
    {"preflight", "viewer", "verl_plugin"},
    {"cpu", "sft"},
    {"console", "eval", "export"},
    {"distill", "inspect", "plugin", "main", "config_reference"},
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def import_graph() -> dict[str, set[str]]:
    """Each ``infmem_verl`` module -> the ``infmem_verl`` modules it imports (the package itself
    counts only where its ``__init__`` is what is imported)."""
    sources = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in sources.items():
        graph[name] = {m for m in _imports(path, name) if m in sources and m != name}
    assert len(graph) > 50 and graph["infmem_verl.main"], "the package's sources were not found"
    return graph


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return -1  # infmem_verl/__init__.py: conf_dir(), below everything
    top = parts[1]
    for rank, layer in enumerate(LAYERS):
        if top in layer:
            return rank
    raise AssertionError(f"{module}: infmem_verl.{top} has no layer in LAYERS; add it where it belongs")


def test_no_module_imports_a_layer_above_it():
    upward = [
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if _layer(target) > _layer(module)
    ]
    assert not upward, "\n".join(upward)


def test_the_agent_core_imports_only_itself_and_no_framework():
    graph = import_graph()
    for module in (m for m in graph if m.startswith("infmem_verl.agent")):
        assert all(t.startswith("infmem_verl.agent") for t in graph[module]), (module, graph[module])
        path = PACKAGE.parent / (module.replace(".", "/") + ".py")
        if not path.is_file():
            path = path.with_suffix("") / "__init__.py"
        third_party = {m.split(".")[0] for m in _imports(path, module)}
        # (torch is allowed: the optional dense re-ranker runs a small encoder in process)
        assert not third_party & {"verl", "ray", "hydra", "omegaconf"}, module


def test_no_two_modules_import_each_other_even_through_others():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)

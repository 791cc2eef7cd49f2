"""The package's shape (ARCHITECTURE.md): a call flows api -> options -> dispatch -> runtime, no module
imports one upstream of it, there is no import cycle, and the launch path never imports the NumPy
reference."""
import ast
from pathlib import Path

import cuflash

PACKAGE = Path(cuflash.__file__).resolve().parent

# Layers, upstream first: a module may import its own layer or any layer after it.
LAYERS = [
    {"cuflash.__main__", "cuflash.torch"},
    {"cuflash.api", "cuflash.estimate", "cuflash.merge", "cuflash.kvcache", "cuflash.distributed", "cuflash.varlen"},
    {"cuflash._dispatch.plan", "cuflash._dispatch.masking", "cuflash._dispatch.select",
     "cuflash._dispatch.tables", "cuflash._dispatch.model", "cuflash._dispatch.packed", "cuflash._dispatch.documents",
     "cuflash._dispatch"},
    {"cuflash.options", "cuflash.block_sparse"},
    {"cuflash._runtime.launch", "cuflash._runtime.tma", "cuflash._runtime.build", "cuflash._runtime.params",
     "cuflash._runtime.device", "cuflash._runtime"},
    {"cuflash.reference", "cuflash.mods"},
    {"cuflash.semantics"},
]
LAUNCH_PATH = {"cuflash.options"} | LAYERS[2] | LAYERS[4]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict:
    """Module -> the cuflash modules it imports (at any depth of its code)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = node.module if node.level == 0 else ".".join(x for x in (base, node.module) if x)
                if target and target.startswith("cuflash"):
                    if node.module is not None:   # "from . import x" imports x, not the package
                        found.add(target)
                    found.update(f"{target}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("cuflash"))
        graph[name] = found
    known = set(graph)
    return {name: {t for t in targets if t in known and t != name} for name, targets in graph.items()}


def _layer(name: str) -> int:
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    return -1


def test_every_module_has_a_layer():
    assert {name for name in _imports() if _layer(name) < 0} <= {"cuflash"}


def test_imports_flow_downstream():
    wrong = [(name, t) for name, targets in _imports().items() for t in targets
             if name != "cuflash" and _layer(t) < _layer(name)]
    assert not wrong, f"upstream imports: {wrong}"


def test_no_import_cycle():
    graph = _imports()
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in graph.get(node, ()):
            if state.get(nxt) == "open":
                raise AssertionError(f"import cycle: {' -> '.join(stack + [node, nxt])}")
            if nxt not in state:
                visit(nxt, stack + [node])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [])


def test_launch_path_does_not_import_the_reference():
    graph = _imports()
    offenders = [name for name in LAUNCH_PATH if "cuflash.reference" in graph.get(name, ())]
    assert not offenders

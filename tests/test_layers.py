"""The package's layers as the tree shows them: no import cycle, and the arrows the
design allows (docs/design.md, "Layers")."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "attnnb"
BACKENDS = ("cpu", "cuda", "reference")
VALIDATION = ("_front.validate", "_front.checks", "_front.device", "_front.device_kernels",
              "_front.function_args")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, deferred imports included."""
    modules = _modules()
    edges = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets |= {f"{module}.{a.name}" for a in node.names} | {module}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        edges[name] = set()
        for target in targets:
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target in modules and target != name and target != "attnnb":
                edges[name].add(target)
    return edges


def _cycle(edges) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_graph_sees_deferred_and_relative_imports():
    edges = _graph()
    assert "attnnb._mods.reads" in edges["attnnb._mods.core"]  # deferred, in resolved()
    assert "attnnb.cpu._tiles" in edges["attnnb.cpu.attention"]


def test_no_import_cycle():
    assert _cycle(_graph()) is None


def test_a_cycle_would_be_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_backends_import_no_public_module_no_other_backend_and_not_the_oracle():
    wrong = []
    for module, targets in _graph().items():
        layer = _layer(module)
        if layer not in BACKENDS:
            continue
        for target in targets:
            other = _layer(target)
            public = not other.startswith("_") and other not in BACKENDS
            if public or (other in BACKENDS and other != layer):
                wrong.append(f"{module} -> {target}")
    assert not wrong, wrong


def test_validation_reaches_into_no_backend():
    edges = _graph()
    wrong = [f"{m} -> {t}" for m in (f"attnnb.{v}" for v in VALIDATION) for t in edges[m]
             if _layer(t) in BACKENDS + ("_dask",)]
    assert not wrong, wrong


def test_the_top_level_holds_public_modules_and_folders():
    flat_private = [p.name for p in PACKAGE.glob("_*.py")
                    if p.name not in ("__init__.py", "__main__.py")]
    assert not flat_private, flat_private

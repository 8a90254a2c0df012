"""The engine's shape, checked from its source: packages import only their own layer and those below it (so no import
cycle), kernels and formats know no model, a weight format's name is spelled in one table, and the top level stays
small."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "a3b_core"
# top to bottom: a module may import from its own group and any group below it
LAYERS = (("a3b_core", "a3b_core.__main__", "a3b_core.services"), ("a3b_core.runtime",), ("a3b_core.prompting",),
          ("a3b_core.media",), ("a3b_core.models",), ("a3b_core.formats",), ("a3b_core.kernels",),
          ("a3b_core.release",), ("a3b_core.errors",))
FORMAT_NAMES = ("fp32", "bf16", "fp16", "fp8", "int8", "int4", "gguf")
FORMAT_TABLE = PACKAGE / "formats" / "table.py"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    for index, group in enumerate(LAYERS):
        if any(module == name or (name != "a3b_core" and module.startswith(name + ".")) for name in group):
            return index
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of each a3b_core import outside `if TYPE_CHECKING:` blocks, names resolved to their module."""
    module = module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            test = getattr(child, "test", None)
            if isinstance(child, ast.If) and getattr(test, "id", getattr(test, "attr", "")) == "TYPE_CHECKING":
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = ".".join(package[:len(package) - child.level + 1] + [child.module or ""]).strip(".") \
                    if child.level else child.module
                for alias in child.names:
                    submodule = f"{base}.{alias.name}"
                    is_module = (ROOT / submodule.replace(".", "/")).with_suffix(".py").exists() or \
                        (ROOT / submodule.replace(".", "/") / "__init__.py").exists()
                    found.append((child.lineno, submodule if is_module else base))
            visit(child)
    visit(ast.parse(path.read_text()))
    return [(line, name) for line, name in found if name == "a3b_core" or name.startswith("a3b_core.")]


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_down_the_layers(path):
    """Layered imports leave no cycle between packages; kernels/ and formats/ import no model definition."""
    module = module_name(path)
    upward = sorted({f"line {line}: {name}" for line, name in imported_modules(path)
                     if layer(name) < layer(module) and not module.startswith(name + ".")})
    assert not upward, f"{module} imports from a layer above its own: {upward}"


def test_no_import_cycle_between_modules():
    graph = {module_name(path): {name for _, name in imported_modules(path)} for path in SOURCES}
    done: set[str] = set()

    def visit(module: str, stack: list[str]) -> None:
        if module in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(module):] + [module]))
        if module in done or module not in graph:
            return
        for target in graph[module]:
            if not module.startswith(target + "."):  # a module's own package runs first; that is no cycle
                visit(target, stack + [module])
        done.add(module)
    for module in graph:
        visit(module, [])


def test_format_names_are_spelled_only_in_the_format_table():
    spelled = []
    for path in SOURCES + sorted((ROOT / "nodes").rglob("*.py")):
        if path == FORMAT_TABLE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in FORMAT_NAMES:
                spelled.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not spelled, spelled


def test_top_level_stays_small():
    entries = [p.name for p in PACKAGE.iterdir()
               if (p.suffix == ".py") or (p.is_dir() and (p / "__init__.py").exists())]
    assert len(entries) <= 12, sorted(entries)
    assert not (PACKAGE / "demo" / "__init__.py").exists()  # the demo folder holds weights, not code

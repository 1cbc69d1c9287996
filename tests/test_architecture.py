"""The shape of the package, checked: no import cycle, op types compared only in ops.py, and the
testing helpers kept out of the tool."""
import ast
from pathlib import Path

import onnx
import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "qdqgraph"
ONNX_OPS = {s.name for s in onnx.defs.get_all_schemas_with_history()}


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = list(p.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The qdqgraph modules `name` imports, at module level or inside functions alike (an import
    moved into a function to dodge a cycle is still an edge). Importing a.b.c also runs the
    package a.b, unless the importer lives inside it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        for t in targets:
            if not t.startswith("qdqgraph"):
                continue
            parts = t.split(".")
            for k in range(2, len(parts) + 1):      # the module and the packages on the way
                m = ".".join(parts[:k])
                if m in known and not name.startswith(m + ".") and m != name:
                    found.add(m)
    return found


def test_no_import_cycle():
    mods = modules()
    graph = {name: imports(name, path, set(mods)) for name, path in mods.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_cycle_check_sees_function_level_imports(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from qdqgraph.b import x\n")
    assert imports("qdqgraph.a", a, {"qdqgraph.a", "qdqgraph.b"}) == {"qdqgraph.b"}


def _op_type_comparisons(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, op type) of every quoted ONNX op type in a comparison (==, !=, in, not in),
    directly or in a tuple/list/set operand."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for operand in [node.left, *node.comparators]:
            values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            for v in values:
                if isinstance(v, ast.Constant) and isinstance(v.value, str) and v.value in ONNX_OPS:
                    found.append((node.lineno, v.value))
    return found


def test_op_types_are_compared_only_in_the_vocabulary():
    """ops.py is the one place op-type strings are compared; elsewhere code asks the op classes of
    rules/op_classes.toml (vocab.is_(node, "conv")) or uses the constants of ops.py."""
    bad = []
    for name, path in modules().items():
        if name == "qdqgraph.ops":
            continue
        bad += [f"{path.relative_to(PACKAGE.parent)}:{line} compares {op!r}"
                for line, op in _op_type_comparisons(ast.parse(path.read_text()))]
    assert bad == [], "\n".join(bad)


def test_the_op_type_check_finds_a_comparison():
    tree = ast.parse('if node.op == "Conv" or n.op in ("Relu", "Sigmoid") or x == "not an op":\n    pass\n')
    assert [op for _, op in _op_type_comparisons(tree)] == ["Conv", "Relu", "Sigmoid"]


def test_the_tool_does_not_import_its_testing_helpers():
    mods = modules()
    for name, path in mods.items():
        if name.startswith("qdqgraph.testing"):
            continue
        assert not any(m.startswith("qdqgraph.testing") for m in imports(name, path, set(mods))), name


def test_every_package_ships_in_the_wheel():
    """A package folder missing from pyproject's `packages` is left out of the wheel (qdqgraph.fix
    once was): every folder with an __init__.py is listed."""
    try:
        import tomllib
    except ImportError:                      # Python 3.10: the tomli dependency
        import tomli as tomllib
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "qdqgraph").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)


ONNX_MODULES = {"qdqgraph.graph.io", "qdqgraph.graph.proto", "qdqgraph.graph.example", "qdqgraph.graph.export"}
MAX_TOP_LEVEL_MODULES = 12


def _imports_onnx(path: Path) -> bool:
    """Whether the module imports the onnx library (onnx or onnx.*, not onnx_graphsurgeon), at any level."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name == "onnx" or a.name.startswith("onnx.") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and node.module and (
                node.module == "onnx" or node.module.startswith("onnx.")):
            return True
    return False


def test_only_the_graph_io_modules_import_onnx():
    """The onnx library is reached through graph/io.py (files), graph/proto.py (types, schemas, the
    checker's errors) and graph/example.py (the built-in model); the testing helpers build models
    with it too. Everything else works on graphsurgeon graphs."""
    found = {name for name, path in modules().items()
             if not name.startswith("qdqgraph.testing") and _imports_onnx(path)}
    assert found <= ONNX_MODULES, sorted(found - ONNX_MODULES)
    assert len(ONNX_MODULES) <= 4


def test_the_onnx_import_check_sees_one(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from onnx import helper\n")
    assert _imports_onnx(p)
    p.write_text("import onnx_graphsurgeon as gs\n")
    assert not _imports_onnx(p)


def test_few_top_level_modules():
    """Code lives in the package of its job (graph/, samples/, calib/, placement/, recipes/, passes/,
    precisions/, trtsim/, backends/, execution/, fix/, cli/); the top level keeps the API, the
    configuration, the errors, the op vocabulary and the stages that tie the packages together."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


MAX_FUNCTION_LEVEL_IMPORTS = 30


def _function_level_imports(path: Path) -> list[int]:
    tree = ast.parse(path.read_text())
    parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            a = parents.get(node)
            while a is not None and not isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = parents.get(a)
            if a is not None:
                lines.append(node.lineno)
    return lines


def test_imports_at_module_level():
    """Imports sit at the top of a module, where the architecture check and a reader see them; a
    function imports an optional dependency (Ray, Pillow, tqdm, a TensorRT, PyTorch) or one it alone
    needs. At most MAX_FUNCTION_LEVEL_IMPORTS in the tool."""
    found = {f"{name}:{line}" for name, path in modules().items() if not name.startswith("qdqgraph.testing")
             for line in _function_level_imports(path)}
    assert len(found) <= MAX_FUNCTION_LEVEL_IMPORTS, sorted(found)


def test_the_function_level_import_count_sees_one(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import os\n\ndef f():\n    import json\n    return json\n")
    assert _function_level_imports(p) == [4]


MAX_COMPLEXITY = 25


def test_no_function_above_the_complexity_limit():
    """No function of the tool above cyclomatic complexity MAX_COMPLEXITY (radon's measure): a
    function that branches that much is split into the steps it takes."""
    radon = pytest.importorskip("radon.complexity")
    over = []
    for name, path in modules().items():
        if name.startswith("qdqgraph.testing"):
            continue
        for block in radon.cc_visit(path.read_text()):
            for b in [block, *getattr(block, "closures", []), *getattr(block, "methods", [])]:
                if b.complexity > MAX_COMPLEXITY:
                    over.append(f"{name}.{getattr(b, 'classname', None) or ''}{'.' if getattr(b, 'classname', None) else ''}{b.name} ({b.complexity})")
    assert over == [], over


def test_no_file_holds_merge_conflict_markers():
    """A merge left '<<<<<<< HEAD' ... '>>>>>>> branch' in docs/ACCURACY.md once, unnoticed."""
    root, found = PACKAGE.parent, []
    paths = [p for d in ("qdqgraph", "tests", "docs", "benchmarks", "rules", ".ci") for p in (root / d).rglob("*")]
    for path in sorted(paths + [root / "README.md"]):
        if path.suffix not in {".py", ".md", ".toml", ".sh", ".txt"} or not path.is_file():
            continue
        for k, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if line.startswith(("<<<<<<< ", ">>>>>>> ")):
                found.append(f"{path.relative_to(root)}:{k}")
    assert not found, found

"""The import graph of cli/, core/ and loaders/, read from their source with `ast` (nothing is imported):
it has no cycles, and no package imports a layer above it (core never imports cli; the engine, core
outside core/llm, never imports core.llm; loaders import neither cli nor core.llm).

Every import statement is an edge, those inside functions included: a cycle hidden by moving one of its
imports into a function is still two modules that need each other (the cycles this test was written
against were all of that kind), and an upward import is upward wherever it runs. The one exception is an
import under `if TYPE_CHECKING:`, which never runs: it names a type for annotations only.

The scripts under scripts/ use ggrun as an installed package: none imports from tests/ (what they share with
the tests lives in the package) or puts the repository root on sys.path."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("cli", "core", "loaders")

Graph = dict[str, dict[str, int]]  # module -> {imported module: line}


def modules(root: Path) -> dict[str, Path]:
    """Each module under root's cli/, core/ and loaders/ by its installed name (ggrun.core.ops)."""
    found = {}
    for top in TOP:
        for path in (root / top).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(("ggrun",) + (parts[:-1] if parts[-1] == "__init__" else parts))] = path
    return found


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST):
    """The import statements of tree, those under `if TYPE_CHECKING:` left out."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if not _type_checking(node):
            yield from _imports(node)


def _targets(node: ast.Import | ast.ImportFrom, name: str, package: bool, known: set[str]) -> list[str]:
    """The modules an import statement in module `name` (a package's __init__ when `package`) names:
    `from a.b import c` names a.b.c where that is a module, else a.b."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        here = name.split(".") if package else name.split(".")[:-1]
        base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]


def import_graph(root: Path) -> Graph:
    """Which of root's modules each module imports, with the line of the first such import."""
    found = modules(root)
    graph: Graph = {}
    for name, path in found.items():
        edges = graph.setdefault(name, {})
        for node in _imports(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, name, path.name == "__init__.py", set(found)):
                if target in found and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next((e for e in edges if e not in index or e in on_stack), None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif nxt in index:
                low[node] = min(low[node], index[nxt])
            else:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(graph[nxt])))
    return found


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def upward(graph: Graph) -> list[str]:
    """Imports of a layer above the importer's: core -> cli, the engine -> core.llm, loaders -> cli or
    core.llm; each as 'importer:line -> imported'."""
    above = {"ggrun.loaders": ("ggrun.cli", "ggrun.core.llm"), "ggrun.core": ("ggrun.cli",)}
    bad = []
    for name, edges in graph.items():
        forbidden = [up for pkg, ups in above.items() if _inside(name, pkg) for up in ups]
        if _inside(name, "ggrun.core") and not _inside(name, "ggrun.core.llm"):
            forbidden.append("ggrun.core.llm")
        bad += [f"{name}:{line} -> {target}" for target, line in edges.items()
                if any(_inside(target, up) for up in forbidden)]
    return bad


def test_no_import_cycles():
    graph = import_graph(ROOT)
    assert len(graph) > 100  # the source was found
    found = cycles(graph)
    assert not found, "\n".join(
        " <-> ".join(c) + "\n" + "\n".join(f"  {a} imports {b} (line {graph[a][b]})" for a in c for b in graph[a]
                                          if b in c) for c in found)


def test_no_upward_imports():
    assert upward(import_graph(ROOT)) == []


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for top in TOP:
        (root / top).mkdir(exist_ok=True)
    return root


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    root = _tree(tmp_path, {"core/__init__.py": "", "core/a.py": "from ggrun.core import b\n",
                            "core/b.py": "def f():\n    from ggrun.core.a import x\n",
                            "core/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ggrun.core import d\n",
                            "core/d.py": "from . import c\n"})
    assert cycles(import_graph(root)) == [["ggrun.core.a", "ggrun.core.b"]]


def test_upward_imports_are_found(tmp_path):
    root = _tree(tmp_path, {"cli/app.py": "", "core/llm/session.py": "from ggrun.cli import app\n",
                            "core/ops.py": "def f():\n    import ggrun.core.llm.session\n",
                            "loaders/gguf.py": "from ggrun.core.llm import session\n",
                            "core/llm/model.py": "from ggrun.core import ops\n"})
    assert sorted(upward(import_graph(root))) == ["ggrun.core.llm.session:1 -> ggrun.cli.app",
                                                  "ggrun.core.ops:2 -> ggrun.core.llm.session",
                                                  "ggrun.loaders.gguf:1 -> ggrun.core.llm.session"]


def _path_of(node: ast.expr, names: dict[str, Path], script: Path) -> Path | None:
    """The folder a sys.path expression of `script` names, read from the few forms scripts use
    (Path(__file__), .resolve(), .parent, .parents[n], / "name", str(...), a module-level name); None if
    it is something else."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 1:
        if node.func.id == "str":
            return _path_of(node.args[0], names, script)
        if node.func.id == "Path" and isinstance(node.args[0], ast.Name) and node.args[0].id == "__file__":
            return script
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "resolve":
        return _path_of(node.func.value, names, script)
    if isinstance(node, ast.Attribute) and node.attr == "parent":
        base = _path_of(node.value, names, script)
        return base.parent if base else None
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents" \
            and isinstance(node.slice, ast.Constant):
        base = _path_of(node.value.value, names, script)
        return base.parents[node.slice.value] if base else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant):
        base = _path_of(node.left, names, script)
        return base / node.right.value if base else None
    return None


def script_faults(root: Path) -> list[str]:
    """Each import from tests/ and each sys.path entry that is the repository root (or that this check
    cannot read) in the scripts under root/scripts, as 'script:line what'."""
    faults = []
    for script in sorted((root / "scripts").rglob("*.py")):
        tree = ast.parse(script.read_text(), str(script))
        rel = script.relative_to(root)
        found: list[tuple[int, str]] = []
        names: dict[str, Path] = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                value = _path_of(node.value, names, script)
                if value is not None:
                    names[node.targets[0].id] = value
        for node in ast.walk(tree):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [(node.lineno, f"imports {m}") for m in modules if m == "tests" or m.startswith("tests.")]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("insert", "append") and ast.unparse(node.func.value) == "sys.path":
                entry = _path_of(node.args[-1], names, script)
                if entry is None:
                    found.append((node.lineno, f"adds {ast.unparse(node.args[-1])} to sys.path (not readable here)"))
                elif entry.resolve() == root.resolve():
                    found.append((node.lineno, "puts the repository root on sys.path"))
        faults += [f"{rel}:{line} {what}" for line, what in sorted(found)]
    return faults


def test_scripts_use_the_installed_package():
    assert list((ROOT / "scripts").rglob("*.py"))  # the scripts were found
    assert script_faults(ROOT) == []


def test_script_faults_are_found(tmp_path):
    bench = tmp_path / "scripts" / "bench"
    bench.mkdir(parents=True)
    (bench / "a.py").write_text("import sys\nfrom pathlib import Path\nROOT = Path(__file__).resolve().parents[2]\n"
                                "sys.path.insert(0, str(ROOT))\nsys.path.insert(0, str(ROOT / 'scripts' / 'bench'))\n"
                                "from tests.synth import write_tiny_llama\n")
    (bench / "b.py").write_text("import sys, os\nsys.path.append(os.getcwd())\n"
                                "def f():\n    import tests.core.op_cases\n")
    (bench / "c.py").write_text("import sys\nfrom pathlib import Path\n"
                                "sys.path.insert(0, str(Path(__file__).parent))\n")
    assert script_faults(tmp_path) == ["scripts/bench/a.py:4 puts the repository root on sys.path",
                                       "scripts/bench/a.py:6 imports tests.synth",
                                       "scripts/bench/b.py:2 adds os.getcwd() to sys.path (not readable here)",
                                       "scripts/bench/b.py:4 imports tests.core.op_cases"]

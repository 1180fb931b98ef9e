"""numba's disk cache stays keyed correctly (core/backends/cpu/jit.py): numba revalidates a cached kernel
against its own file only, so every file whose kernels, intrinsics or constants the compiled code of
another file takes in must be one of jit.SHARED_SOURCES (they name the cache directory). Read from the
sources: a new module of kernels that borrows from a file not listed fails here, before a stale kernel
is ever loaded."""
from __future__ import annotations

import ast
from pathlib import Path

from ggrun.core.backends.cpu import jit

CPU = Path(jit.__file__).parent
PACKAGE = "ggrun.core.backends.cpu"
COMPILED = {"kernel", "intrinsic"}  # the decorators whose functions numba compiles


def _source_of(module: str) -> str | None:
    """The path (relative to cpu/) of a ggrun CPU module, or None for another module."""
    if not module.startswith(PACKAGE + "."):
        return None
    rel = Path(*module[len(PACKAGE) + 1:].split("."))
    for candidate in (rel.with_suffix(".py"), rel / "__init__.py"):
        if (CPU / candidate).is_file():
            return candidate.as_posix()
    return None


def _imported(tree: ast.Module) -> dict[str, str]:
    """Names a module imports from other CPU modules (or imports them as), to the file they come from."""
    names = {}
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom) or node.module is None:
            continue
        for alias in node.names:
            source = _source_of(f"{node.module}.{alias.name}") or _source_of(node.module)
            if source is not None:
                names[alias.asname or alias.name] = source
    return names


def _decorator_name(node: ast.expr) -> str:
    node = node.func if isinstance(node, ast.Call) else node
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _compiled_code(tree: ast.Module) -> list[ast.AST]:
    """The parts of a module that end up compiled: kernel and intrinsic functions, and the module-level
    assignments they read (vector ops, constants), but not plain Python functions or statements."""
    parts = [node for node in tree.body if isinstance(node, ast.FunctionDef)
             and any(_decorator_name(d) in COMPILED for d in node.decorator_list)]
    assignments = [node for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))]
    used = set().union(set(), *map(_free_names, parts))
    while True:
        read = [a for a in assignments if a not in parts and _targets(a) & used]
        if not read:
            return parts
        parts += read
        used |= set().union(set(), *map(_free_names, read))


def _free_names(node: ast.AST) -> set[str]:
    """The names code reads that it does not bind itself (its arguments and locals are not borrowed)."""
    bound = {a.arg for a in ast.walk(node) if isinstance(a, ast.arg)}
    bound |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    if not isinstance(node, ast.FunctionDef):
        bound = set()
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def _targets(node: ast.Assign | ast.AnnAssign) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def borrowed_sources() -> dict[str, set[str]]:
    """For each CPU module with compiled code: the other CPU files that code takes names from."""
    found = {}
    for path in sorted(CPU.rglob("*.py")):
        tree = ast.parse(path.read_text())
        imported = _imported(tree)
        used = set().union(set(), *map(_free_names, _compiled_code(tree)))
        own = path.relative_to(CPU).as_posix()
        sources = {imported[name] for name in used & imported.keys()} - {own, "jit.py"}
        if sources:
            found[own] = sources
    return found


def test_compiled_code_borrows_only_from_shared_sources():
    missing = {own: sorted(s for s in sources if s not in jit.SHARED_SOURCES)
               for own, sources in borrowed_sources().items()}
    assert not {own: s for own, s in missing.items() if s}, \
        "add these files to jit.SHARED_SOURCES (or move what is borrowed into one that is)"


def test_the_check_sees_the_kernel_files_borrowing():
    """The quant kernels do borrow (from the block codes and the vector language): the walk finds it."""
    borrowed = borrowed_sources()
    assert "quant/codes.py" in borrowed["quant/avx2.py"]
    assert "quant/vec.py" in borrowed["quant/avx512.py"]


def test_shared_sources_exist():
    assert all((CPU / name).is_file() for name in jit.SHARED_SOURCES)

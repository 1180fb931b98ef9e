"""Loading ggrun's kernels from numba's on-disk cache without the work only compiling needs (a library
patch: applied by cli/library_patches' `apply`).

Before the first kernel a process calls, even one found in the cache, numba installs every typing and
lowering registry it has (importing much of numba: about 0.2 s, a tenth of ggrun's time to its first
token). Those registries serve compiling, and a cached kernel is machine code that is only loaded and
linked; what it does need at run time is numba's runtime (NRT, for arrays it allocates), which is set
up here.

A cached kernel also carries its LLVM bitcode, which numba parses on every load (about 10 ms a kernel,
half the load) to list the symbols it defines and to keep it for inlining into kernels compiled later.
For ggrun's kernels the symbols are read from the machine code's own symbol table instead, and the
bitcode is parsed only if a later compilation links the kernel in.

Two more costs of a process's first load go the same way. numba's runtime compiles a small LLVM module
of its own at set-up (28 ms); its machine code is kept beside the kernels after the first time. And a
kernel that allocates arrays carries environments naming numba's array module, which numba imports to
rebuild them (30 ms; nothing of it runs in ggrun's kernels): it is imported lazily instead, so it runs
only if something in the process uses it. Before numba's compiler installs its registries (a kernel not in
the cache), those lazy modules are run: the compiler imports numba's modules by name for the lowerings they
register as they run, and a lazy module imported by name alone never would (`x ** y` then had no lowering).

A kernel that is not in the cache is compiled as always, and numba's compiler installs the registries
itself then. Kernels of other packages load as numba loads them.
"""
from __future__ import annotations

import hashlib
import importlib.util
import struct
import sys
from pathlib import Path

import llvmlite
import numba
from llvmlite import binding as ll
from numba.core import base, caching, codegen, config, environment
from numba.core.runtime import _nrt_python, nrt

_numba_load = caching.Cache.load_overload
_numba_unserialize = codegen.JITCodeLibrary._unserialize.__func__
_numba_rebuild_env = environment._rebuild_env
_numba_refresh = base.BaseContext.refresh
_loading_ours = False  # set while one of ggrun's kernels loads
_lazy_namespaces: dict[str, dict] = {}  # modules imported lazily by _rebuild_env: their namespaces


def skip_compiler_set_up() -> None:
    """Make numba load ggrun's cached kernels without its compiler set-up (for this process; repeatable).
    Where numba's cache lacks the internals this relies on, nothing changes."""
    if caching.Cache.load_overload is not _numba_load or not hasattr(caching.Cache, "_load_overload"):
        return
    caching.Cache.load_overload = _load_overload
    codegen.JITCodeLibrary._unserialize = classmethod(_unserialize)
    environment._rebuild_env = _rebuild_env
    base.BaseContext.refresh = _refresh


def _refresh(self):
    """numba's BaseContext.refresh (the compiler's registries) after running the modules made lazy here."""
    for name in list(_lazy_namespaces):
        module = sys.modules.get(name)
        if module is not None:
            getattr(module, "__name__", None)  # any attribute runs a lazy module (importlib's _LazyModule)
    return _numba_refresh(self)


def _load_overload(self, sig, target_context):
    """numba's Cache.load_overload less its target_context.refresh(), for functions of ggrun's modules."""
    global _loading_ours
    if not self._py_func.__module__.startswith("ggrun."):
        return _numba_load(self, sig, target_context)
    _loading_ours = True
    try:
        if not nrt.rtsys._init:
            _initialize_nrt(target_context)
        with self._guard_against_spurious_io_errors():
            return self._load_overload(sig, target_context)
    finally:
        _loading_ours = False


def _unserialize(cls, codegen_, state):
    """numba's JITCodeLibrary._unserialize for a library cached as machine code, less the bitcode parse:
    the engine learns the defined symbols from the machine code, and the bitcode is parsed when the
    library is linked into another (`_module_for_linking`)."""
    name, kind, data = state
    symbols = _elf_defined_symbols(data[0]) if kind == "object" and _loading_ours else None
    if symbols is None:
        return _numba_unserialize(cls, codegen_, state)
    object_code, bitcode = data
    library = codegen_.create_library(name)
    library.enable_object_caching()
    library._set_compiled_object(object_code)
    library._get_module_for_linking = lambda: _module_for_linking(library, bitcode)
    library._finalize_final_module()
    codegen_._engine._defined_symbols |= symbols
    return library


def _rebuild_env(modname, consts, env_name):
    """numba's environment._rebuild_env, importing a module not yet imported lazily while ggrun's kernels
    load: the environment keeps the module's namespace, which fills when the module is first used."""
    namespace = _lazy_namespaces.get(modname) if _loading_ours else None
    if namespace is None and _loading_ours and modname not in sys.modules:
        namespace = _lazy_namespaces[modname] = _lazy_namespace(modname)
    if namespace is None or environment.lookup_environment(env_name) is not None:
        return _numba_rebuild_env(modname, consts, env_name)
    env = environment.Environment(namespace)  # as numba's, less the import
    env.consts[:] = consts
    env.env_name = env_name
    environment.Environment._memo[env_name] = env
    return env


# A kernel compiled while this stands in for numba's pickles its environments as a call of it, by name:
# under numba's name, so that the cache never names this module (a kernel compiled with the patch
# loads without it, and a rename here cannot make cached kernels fail to load).
_rebuild_env.__module__, _rebuild_env.__qualname__ = environment.__name__, "_rebuild_env"


def _lazy_namespace(name: str) -> dict | None:
    """Module `name` registered to run when first used (importlib's LazyLoader); its namespace, or None."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        return None
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    namespace = module.__dict__  # read before the module turns lazy: reading it after would run it
    sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return namespace


def _initialize_nrt(target_context) -> None:
    """numba's rtsys.initialize, its LLVM module loaded as machine code kept in numba's cache directory
    (made there by the first process that compiles it)."""
    path = Path(config.CACHE_DIR) / f"nrt-{_nrt_key(target_context)}.bin"
    try:
        machine_code, bitcode = _split(path.read_bytes())
    except (OSError, ValueError):
        nrt.rtsys.initialize(target_context)
        _save_nrt(path, target_context)
        return
    if config.NRT_STATS:
        _nrt_python.memsys_enable_stats()
    for py_name, address in _nrt_python.c_helpers.items():  # as rtsys.initialize registers them
        ll.add_symbol(py_name if py_name.startswith("_") else "NRT_" + py_name, address)
    nrt.rtsys._library = _unserialize(codegen.JITCodeLibrary, target_context.codegen(),
                                      ("nrt", "object", (machine_code, bitcode)))
    nrt.rtsys._init = True


def _nrt_key(target_context) -> str:
    """What the runtime's machine code depends on: numba, llvmlite and the host CPU numba compiles for."""
    what = (numba.__version__, llvmlite.__version__, target_context.codegen().magic_tuple())
    return hashlib.sha256(repr(what).encode()).hexdigest()[:16]


def _save_nrt(path: Path, target_context) -> None:
    library = nrt.rtsys.library
    machine_code = target_context.codegen()._tm.emit_object(library._final_module)
    bitcode = library._get_module_for_linking().as_bitcode()
    tmp = path.with_suffix(f".{id(library)}.tmp")
    try:
        tmp.write_bytes(struct.pack("<Q", len(machine_code)) + machine_code + bitcode)
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)


def _split(data: bytes) -> tuple[bytes, bytes]:
    (n,) = struct.unpack_from("<Q", data)
    if len(data) < 8 + n or _elf_defined_symbols(data[8:8 + n]) is None:
        raise ValueError("not a runtime cache file")
    return data[8:8 + n], data[8 + n:]


def _module_for_linking(library, bitcode: bytes):
    if library._shared_module is None:
        library._shared_module = ll.parse_bitcode(bitcode)
    return library._shared_module


_SECTION = struct.Struct("<IIQQQQIIQQ")  # Elf64_Shdr
_SYMBOL = struct.Struct("<IBBHQQ")  # Elf64_Sym
_SHT_SYMTAB = 2


def _elf_defined_symbols(obj: bytes) -> set[str] | None:
    """Names of the functions and data an ELF64 little-endian object defines; None for another format."""
    if obj[:4] != b"\x7fELF" or obj[4] != 2 or obj[5] != 1:
        return None
    (shoff,) = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    sections = [_SECTION.unpack_from(obj, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for _, sh_type, _, _, offset, size, link, _, _, _ in sections:
        if sh_type != _SHT_SYMTAB:
            continue
        strings = sections[link][4]
        for name_at, info, _, shndx, _, _ in _SYMBOL.iter_unpack(obj[offset:offset + size]):
            if name_at and shndx and (info & 0xF) <= 2:  # defined; no type, data or function
                names.add(obj[strings + name_at:obj.index(b"\0", strings + name_at)].decode())
    return names

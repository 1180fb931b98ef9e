"""Loading ggrun's kernels from numba's on-disk cache without the work only compiling needs.

Before the first kernel a process calls, even one found in the cache, numba installs every typing and
lowering registry it has (importing much of numba: about 0.2 s, a tenth of ggrun's time to its first
token). Those registries serve compiling, and a cached kernel is machine code that is only loaded and
linked; what it does need at run time is numba's runtime (NRT, for arrays it allocates), which is set
up here.

A cached kernel also carries its LLVM bitcode, which numba parses on every load (about 10 ms a kernel,
half the load) to list the symbols it defines and to keep it for inlining into kernels compiled later.
For ggrun's kernels the symbols are read from the machine code's own symbol table instead, and the
bitcode is parsed only if a later compilation links the kernel in.

A kernel that is not in the cache is compiled as always, and numba's compiler installs the registries
itself then. Kernels of other packages load as numba loads them.
"""
from __future__ import annotations

import struct

from llvmlite import binding as ll
from numba.core import caching, codegen
from numba.core.runtime import nrt

_numba_load = caching.Cache.load_overload
_numba_unserialize = codegen.JITCodeLibrary._unserialize.__func__
_loading_ours = False  # set while one of ggrun's kernels loads


def skip_compiler_set_up() -> None:
    """Make numba load ggrun's cached kernels without its compiler set-up (for this process; repeatable).
    Where numba's cache lacks the internals this relies on, nothing changes."""
    if caching.Cache.load_overload is not _numba_load or not hasattr(caching.Cache, "_load_overload"):
        return
    caching.Cache.load_overload = _load_overload
    codegen.JITCodeLibrary._unserialize = classmethod(_unserialize)


def _load_overload(self, sig, target_context):
    """numba's Cache.load_overload less its target_context.refresh(), for functions of ggrun's modules."""
    global _loading_ours
    if not self._py_func.__module__.startswith("ggrun."):
        return _numba_load(self, sig, target_context)
    if not nrt.rtsys._init:
        nrt.rtsys.initialize(target_context)
    _loading_ours = True
    try:
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

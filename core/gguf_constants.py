"""gguf-py's constants (ggml's type ids and block sizes, GGUF's value types, magic and alignment) without
the rest of its package: importing `gguf` runs its reader, writer, vocabulary and metadata modules (and
PyYAML), about 30 ms of every start, none of which ggrun's runtime uses.

The module is loaded from gguf-py's own file and registered as `gguf.constants`, so that anything that
imports gguf later gets this same module (and the same enum classes).
"""
from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def _constants() -> ModuleType:
    name = "gguf.constants"
    if name in sys.modules:
        return sys.modules[name]
    package = importlib.util.find_spec("gguf")
    locations = package.submodule_search_locations if package is not None else None
    spec = importlib.util.spec_from_file_location(name, f"{locations[0]}/constants.py") if locations else None
    if spec is None or spec.loader is None:  # not a plain package on disk: import it as usual
        import gguf.constants

        return gguf.constants
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_c = _constants()
GGML_QUANT_SIZES = _c.GGML_QUANT_SIZES
GGMLQuantizationType = _c.GGMLQuantizationType
GGUFValueType = _c.GGUFValueType
GGUF_MAGIC = _c.GGUF_MAGIC
GGUF_DEFAULT_ALIGNMENT = _c.GGUF_DEFAULT_ALIGNMENT

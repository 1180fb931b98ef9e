"""gguf-py's constants (ggml's type ids and block sizes, GGUF's value types, magic and alignment) without
the rest of its package: importing `gguf` runs its reader, writer, vocabulary and metadata modules (and
PyYAML), about 30 ms of every start, none of which ggrun's runtime uses.

`register` loads the module from gguf-py's own file and registers it as `gguf.constants`, so that
ggrun's `from gguf.constants import ...` finds it without importing the package, and anything that
imports gguf later gets this same module (and the same enum classes).
"""
from __future__ import annotations

import importlib.util
import sys


def register() -> None:
    """gguf.constants in sys.modules, loaded from its file alone (where gguf is a plain package on disk)."""
    name = "gguf.constants"
    if name in sys.modules:
        return
    package = importlib.util.find_spec("gguf")
    locations = package.submodule_search_locations if package is not None else None
    spec = importlib.util.spec_from_file_location(name, f"{locations[0]}/constants.py") if locations else None
    if spec is None or spec.loader is None:  # not a plain package on disk: imported as usual when used
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)

"""Every patch ggrun makes to a third-party library's internals, in this one package, applied by `apply`:
once, from the CLI's entry point (cli/app.py's main), and by the test suite (tests/conftest.py), never by
importing an engine module. Each one shortens ggrun's start-up and changes nothing else; with
GGRUN_LIBRARY_PATCHES=0 `apply` does nothing and ggrun runs on the libraries as they are, only slower
to start.

- gguf_constants.py: gguf-py's constants loaded from their file alone, registered as `gguf.constants`
  (importing the `gguf` package runs its reader, writer and PyYAML: 30 ms)
- numba_start.py: numba imported without PyYAML, each cache directory checked once, arrays typed
  without importing numpy.ma, numba's extensions initialized only when something compiles
- numba_loads.py: ggrun's cached kernels loaded without numba's compiler set-up (0.2 s); installed by
  `after_compiling`, once the model's kernels are compiled (cli/common.py's load_model): a kernel compiled
  while it stands can miss lowerings that the skipped set-up registers (seen: range() in a kernel first
  compiled after a cached one had loaded)
- typer_options.py: options of plain types parsed without typer's pydantic adapters (0.1 s)

Each is guarded (where an internal is missing it does nothing); pyproject.toml caps the libraries at the
versions tested, and tests/test_library_internals.py fails when an internal these use is gone.
"""
from __future__ import annotations

import os

SWITCH = "GGRUN_LIBRARY_PATCHES"  # "0": apply nothing


def enabled() -> bool:
    """Whether the patches apply in this process (the environment does not switch them off)."""
    return os.environ.get(SWITCH, "1") != "0"


def apply() -> None:
    """Install every patch (repeatable: a second call changes nothing), unless switched off. Call it
    before ggrun's engine is imported: numba's first import and the kernels' declarations are two of
    the things they shorten (imported later, everything still works, only those savings are lost)."""
    if not enabled():
        return
    from ggrun.cli.library_patches import gguf_constants, numba_start, typer_options

    gguf_constants.register()
    with numba_start.numba_without_yaml():
        from ggrun.core.backends.cpu import jit  # noqa: F401  (ggrun's numba settings, then numba)
    numba_start.install()
    typer_options.install()


def after_compiling() -> None:
    """The patch for loading cached kernels (numba_loads.py), unless switched off: call it once the kernels
    a run needs are compiled; later loads from numba's cache then skip numba's compiler set-up."""
    if not enabled():
        return
    from ggrun.cli.library_patches import numba_loads  # reads numba's originals: after numba's import

    numba_loads.skip_compiler_set_up()

"""Every internal of a third-party library that ggrun replaces or reads is still there.

ggrun's start-up shortcuts, all in cli/library_patches/, patch numba (numba_start.py, numba_loads.py) and
typer (typer_options.py), and load gguf-py's constants file by its path (gguf_constants.py). Each is
guarded: where an internal is missing it quietly does nothing, and ggrun still works, only slower. This
test is what fails instead, so that an upgrade past pyproject.toml's ceilings is noticed; the names
below are those the patching modules use."""
from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

NUMBA = {
    # numba_start.py
    "numba.core.caching": ["_CacheLocator.ensure_cache_path", "_CacheLocator.get_cache_path"],
    "numba.core.typing.typeof": ["typeof_impl.dispatch", "typeof_impl.register"],
    "numba.core.dispatcher": ["_DispatcherBase._compilation_chain_init_hook"],
    "numba.np.numpy_support": ["from_dtype", "map_layout"],
    "numba.core.errors": ["NumbaNotImplementedError", "NumbaValueError"],
    # numba_loads.py
    "numba.core.codegen": ["JITCodeLibrary._unserialize", "JITCodeLibrary._set_compiled_object",
                           "JITCodeLibrary._finalize_final_module", "JITCodeLibrary._get_module_for_linking",
                           "JITCodeLibrary.enable_object_caching", "JITCPUCodegen.magic_tuple"],
    "numba.core.environment": ["_rebuild_env", "lookup_environment", "Environment._memo"],
    "numba.core.base": ["BaseContext.refresh"],
    "numba.core.runtime.nrt": ["rtsys._init", "rtsys.initialize", "rtsys.__class__.library"],
    "numba.core.runtime._nrt_python": ["c_helpers", "memsys_enable_stats"],
    "llvmlite.binding": ["parse_bitcode", "add_symbol"],
}
NUMBA_CACHE = ["load_overload", "_load_overload", "_guard_against_spurious_io_errors"]  # caching.Cache's
TYPER = {"typer.core": ["build_runtime_param"], "typer._coercion": ["RuntimeParam._coerce_value"]}
TYPER_PARAM_FIELDS = ["parameter_info", "annotation"]  # what PlainRuntimeParam passes to RuntimeParam
GGUF_CONSTANTS = ["GGML_QUANT_SIZES", "GGMLQuantizationType", "GGUFValueType", "GGUF_MAGIC", "GGUF_DEFAULT_ALIGNMENT"]


def _resolve(module: str, dotted: str):
    value = importlib.import_module(module)
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize("module, dotted", [(m, d) for group in (NUMBA, TYPER) for m, ds in group.items() for d in ds])
def test_patched_attribute_exists(module, dotted):
    assert _resolve(module, dotted) is not None, f"{module}.{dotted} is gone"


def test_numba_cache_loads_as_patched():
    from numba.core import caching

    missing = [name for name in NUMBA_CACHE if not hasattr(caching.Cache, name)]
    assert not missing, f"numba.core.caching.Cache lacks {missing}"


def test_typer_runtime_param_takes_the_fields_plain_options_passes():
    import dataclasses

    from typer import _coercion

    fields = {f.name for f in dataclasses.fields(_coercion.RuntimeParam)}
    assert set(TYPER_PARAM_FIELDS) <= fields


def test_typer_descriptor_has_what_plain_options_reads():
    import dataclasses

    from typer import _coercion

    fields = {f.name for f in dataclasses.fields(_coercion.TypeDescriptor)}
    assert {"parameter_info", "annotation", "file_annotation"} <= fields


def test_gguf_constants_file_is_where_it_is_loaded_from():
    spec = importlib.util.find_spec("gguf")
    assert spec is not None and spec.submodule_search_locations
    path = Path(spec.submodule_search_locations[0]) / "constants.py"
    assert path.is_file()
    text = path.read_text()
    missing = [name for name in GGUF_CONSTANTS if not re.search(rf"^(class )?{name}\b", text, re.M)]
    assert not missing, f"gguf/constants.py lacks {missing}"

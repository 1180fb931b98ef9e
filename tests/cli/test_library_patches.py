"""The library patches (cli/library_patches/): applied by `apply` (the CLI's entry point and the suite's
conftest) and `after_compiling` (the CLI, once a model's kernels are compiled), never by importing ggrun's modules, and switched off with GGRUN_LIBRARY_PATCHES=0. Each process
here starts fresh, so what it finds patched is what that process did."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PATCHED = """
import json, sys
from numba.core import caching, dispatcher
import typer.core
print(json.dumps({
    "numba_start": getattr(caching._CacheLocator.ensure_cache_path, "checked_once", False),
    "numba_extensions": getattr(dispatcher._DispatcherBase._compilation_chain_init_hook, "not_for_ggrun", False),
    "numba_loads": caching.Cache.load_overload.__module__.startswith("ggrun."),
    "typer_options": getattr(typer.core.build_runtime_param, "plain_options", False),
    "gguf_alone": "gguf.constants" in sys.modules and "gguf" not in sys.modules,
}))
"""
ENGINE = ("from ggrun.core.backends.cpu import CPUBackend; import ggrun.core.quants, ggrun.loaders.gguf_file; "
          "import ggrun.cli.cmdline, ggrun.cli.common; ")
APPLY = "from ggrun.cli import library_patches; library_patches.apply(); library_patches.after_compiling(); "


def patched(code: str, **env: str) -> dict[str, bool]:
    out = subprocess.run([sys.executable, "-c", code + PATCHED], capture_output=True, text=True, check=True,
                         env={**{k: v for k, v in os.environ.items() if k != "GGRUN_LIBRARY_PATCHES"}, **env})
    return json.loads(out.stdout.splitlines()[-1])


def test_apply_installs_every_patch():
    assert all(patched(APPLY + ENGINE).values())


def test_importing_ggrun_patches_nothing():
    found = patched(ENGINE)
    assert not any(v for k, v in found.items() if k != "gguf_alone")
    assert not found["gguf_alone"]  # the engine's `from gguf.constants import` imported gguf as usual


@pytest.mark.parametrize("order", ["before", "after"])
def test_switched_off_nothing_is_patched(order):
    code = APPLY + ENGINE if order == "before" else ENGINE + APPLY
    assert not any(patched(code, GGRUN_LIBRARY_PATCHES="0").values())


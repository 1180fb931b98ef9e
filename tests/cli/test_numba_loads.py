"""Loading the CPU kernels from numba's cache without numba's compiler set-up (cli/library_patches/numba_loads.py):
the same logits, and no registry set-up, in a process of its own (also with numba's runtime loaded from the
machine code kept by an earlier process); the symbols read from a kernel's machine code instead of its
bitcode."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from gguf.constants import GGMLQuantizationType as QT

DECODE = """
import json, sys
from numba.core import base
calls = []
refresh = base.BaseContext.refresh
base.BaseContext.refresh = lambda self: (calls.append(1), refresh(self))[1]
from ggrun.cli.library_patches import numba_loads
from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams
if sys.argv[2] == "skip":
    numba_loads.skip_compiler_set_up()
session = Session(Model.load(sys.argv[1], [CPUBackend()]), SessionParams(n_ctx=64, n_ubatch=8))
logits = session.decode(Batch.of_sequence([1, 2, 3], 0))
import numba.np.arrayobj  # a module whose import the loads deferred runs when used
assert callable(numba.np.arrayobj.make_array)
import pathlib, numba
nrt_files = sorted(p.name for p in pathlib.Path(numba.config.CACHE_DIR).glob("nrt-*.bin"))
print(json.dumps({"refreshes": len(calls), "logits": logits[-1, :8].tolist(), "nrt_files": nrt_files}))
"""


def decode(path, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", DECODE, str(path), mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_cached_kernels_load_without_the_compiler_set_up(tiny_llama_factory):
    path = tiny_llama_factory(weight_type=QT.Q8_0)
    numba_way = decode(path, "numba")  # compiles what the cache lacks, so the next process finds everything
    skipped = decode(path, "skip")
    again = decode(path, "skip")  # numba's runtime from the machine code the first skipping process kept
    assert numba_way["refreshes"] > 0 and skipped["refreshes"] == 0
    assert skipped["logits"] == numba_way["logits"] == again["logits"]
    assert skipped["nrt_files"] and again["nrt_files"] == skipped["nrt_files"]


def test_symbols_read_from_machine_code_are_those_the_bitcode_defines():
    """The names a cached kernel's machine code defines, read from its symbol table, are the ones numba
    would list from its bitcode (what it tells the execution engine is defined)."""
    import numba
    from llvmlite import binding as ll

    from ggrun.cli.library_patches.numba_loads import _elf_defined_symbols

    @numba.njit
    def scaled_sum(x, k):
        return (x * k).sum()

    scaled_sum(np.ones(3), 2.0)
    (result,) = scaled_sum.overloads.values()
    _, kind, (machine_code, bitcode) = result.library.serialize_using_object_code()
    module = ll.parse_bitcode(bitcode)
    defined = {g.name for g in [*module.functions, *module.global_variables] if not g.is_declaration}
    assert kind == "object" and defined
    assert _elf_defined_symbols(machine_code) == defined
    assert _elf_defined_symbols(b"\xcf\xfa\xed\xfe" + machine_code[4:]) is None  # another format: numba's way


def test_cached_environments_name_numbas_function_not_this_module(monkeypatch):
    """A kernel compiled while the patch stands in pickles its environment as a call by name: numba's
    name, so that the cache never depends on where the patch lives (or on its being applied)."""
    import pickle

    from numba.core import environment

    from ggrun.cli.library_patches import numba_loads

    monkeypatch.setattr(environment, "_rebuild_env", numba_loads._rebuild_env)  # the patch's part that pickles
    env = environment.Environment({"__name__": "math"})
    env.env_name = "ggrun_test_env"
    data = pickle.dumps(env)
    assert b"ggrun.cli" not in data and b"numba.core.environment" in data
    assert pickle.loads(data).globals["__name__"] == "math"


LAZY_THEN_COMPILE = """
import sys
from ggrun.cli.library_patches import numba_loads
numba_loads.skip_compiler_set_up()
import numba
if "numba.cpython.numbers" in sys.modules:
    print("imported already")
    raise SystemExit
numba_loads._loading_ours = True  # as a cached kernel whose environment names the module loads
numba_loads._rebuild_env("numba.cpython.numbers", [], "_ggrun_test_env")
numba_loads._loading_ours = False

@numba.njit(cache=False)
def f(x, y):
    return x ** y + x * y

print(f(2.0, 3.0))
"""


def test_a_module_made_lazy_by_a_load_still_gives_the_compiler_its_lowerings():
    """numba's compiler set-up imports numba.cpython.numbers by name for the lowerings it registers as it runs;
    made lazy by a cached kernel's environment, it must run before that (else `x ** y` has no lowering)."""
    out = subprocess.run([sys.executable, "-c", LAZY_THEN_COMPILE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.strip() == "imported already":
        import pytest

        pytest.skip("numba imported numba.cpython.numbers itself: nothing to make lazy")
    assert out.stdout.split() == ["14.0"]

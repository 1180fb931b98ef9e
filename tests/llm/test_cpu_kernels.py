"""The CPU warm-up set of a loaded model (core/llm/cpu_kernels.py with core/backends/cpu/warmup.py): it holds
every kernel signature the model's graphs meet (the families' too), and no product builder of a weight type the
model lacks."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from gguf.constants import GGMLQuantizationType as QT

from ggrun.core.backends.cpu import CPUBackend, precompile, warmup
from ggrun.core.dtypes import DType
from ggrun.core.llm.cpu_kernels import warm_tags
from ggrun.core.llm.model import Model
from ggrun.loaders.synthetic import FAMILY_PRESETS, family_options, write_tiny_family

# In a process of its own (its kernels start unloaded): the model's warm-up graphs run, then a prompt and
# decode steps; the kernel signatures the model's graphs added after the warm-up are printed (none, if the
# warm-up set holds them all). Kernels come from the suite's numba cache, compiled there when missing.
COVERAGE = """
import importlib, json, pkgutil, sys
from numba.core.registry import CPUDispatcher
import ggrun.core.backends.cpu as cpu_pkg
from ggrun.core.backends.cpu import CPUBackend, precompile, set_threads, warmup
from ggrun.core.dtypes import DType
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.cpu_kernels import warm_tags
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams

set_threads(2)
cpu = CPUBackend()
model = Model.load(sys.argv[1], [cpu], numerics=sys.argv[2])
kv = DType[sys.argv[3]]
tags = warm_tags(model, cpu, (kv,))
for warm in precompile.selected(tags):
    precompile.run(cpu, warm)
kernels = {}
for info in pkgutil.iter_modules(cpu_pkg.__path__):
    module = importlib.import_module(f"{cpu_pkg.__name__}.{info.name}")
    for name, value in vars(module).items():
        if isinstance(value, CPUDispatcher) and value.py_func.__module__ == module.__name__:
            kernels[f"{info.name}.{name}"] = value
before = {name: set(map(str, k.signatures)) for name, k in kernels.items()}
session = Session(model, SessionParams(n_ctx=256, n_batch=64, n_ubatch=64, type_k=kv, type_v=kv))
tokens = [1 + i % 30 for i in range(40)]
session.decode(Batch.of_sequence(tokens, 0))
for pos in range(40, 43):
    session.decode(Batch.of_sequence([3], pos))
new = {name: sorted(set(map(str, k.signatures)) - before[name]) for name, k in kernels.items()}
print(json.dumps({"tags": sorted(tags), "new": {n: s for n, s in new.items() if s}}))
"""


def coverage(path, numerics: str = "llama", kv: str = "F16") -> dict:
    out = subprocess.run([sys.executable, "-c", COVERAGE, str(path), numerics, kv], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_a_models_warm_up_set_holds_every_kernel_its_graphs_meet(tiny_llama_factory):
    """A tiny llama with Q4_0 matrices and a tied head: after its warm-up graphs ran, a prompt and decode
    steps load no kernel signature more."""
    found = coverage(tiny_llama_factory(weight_type=QT.Q4_0, tied_output=True))
    assert warmup.product(DType.Q4_0, True, True) in found["tags"]
    assert found["new"] == {}


def test_the_set_follows_numerics_and_cache_types(tiny_gemma3_factory):
    """gemma3's graphs with f32 numerics and an F32 KV cache meet other kernels (f32 products, f32 cache
    writes): those are in the set too."""
    found = coverage(tiny_gemma3_factory(weight_type=QT.Q8_0), numerics="f32", kv="F32")
    assert warmup.product(DType.Q8_0, True, False) in found["tags"] and warmup.kv(DType.F32) in found["tags"]
    assert found["new"] == {}


def test_the_set_has_no_products_of_other_weight_types(tiny_llama_factory):
    """The builders chosen for a Q4_0 model read Q4_0 weights (or any type: the fused feed-forward), never
    another type's."""
    cpu = CPUBackend()
    model = Model.load(tiny_llama_factory(weight_type=QT.Q4_0, tied_output=True), [cpu])
    tags = warm_tags(model, cpu)
    products = {tag for w in precompile.selected(tags) for tag in w.needs if tag.startswith("mul_mat")}
    assert products == {warmup.product(DType.Q4_0, True, True), warmup.product(None, True, True)}
    assert {tag for tag in tags if tag.startswith("get_rows")} == {warmup.rows(DType.Q4_0)}
    every = {tag for w in warmup.WARMS for tag in w.needs if tag.startswith("mul_mat")}
    assert warmup.product(DType.Q6_K, True, True) in every  # the others exist; the model just does not need them


def test_a_model_with_rope_factors_warms_their_rope(tmp_path):
    """Llama 3's rope_freqs (read-only, from the file) reach rope_rows as read-only factors: the warm-up set holds
    that signature, and a model without factors does not ask for it."""
    arch, options = family_options("llama+rope_freqs")
    found = coverage(write_tiny_family(tmp_path / "rope_freqs.gguf", arch, weight_type=QT.Q8_0, **options))
    assert warmup.ROPE_FACTORS in found["tags"]
    assert found["new"] == {}
    cpu = CPUBackend()
    plain = Model.load(write_tiny_family(tmp_path / "plain.gguf", "llama", **FAMILY_PRESETS["llama"]), [cpu])
    assert warmup.ROPE_FACTORS not in warm_tags(plain, cpu)



@pytest.mark.parametrize("name,qtype", [("qwen2", QT.Q4_K), ("gemma2", QT.Q4_K), ("qwen3moe", QT.Q4_K),
                                        ("gpt-oss", QT.MXFP4)])
def test_the_families_warm_up_sets_hold_their_kernels(tmp_path, name, qtype):
    """The families' own kernels are in their warm-up sets: qwen2's bias adds (a read-only bias), gemma2's
    soft-caps, the experts' products of qwen3moe (Q4_K) and gpt-oss (MXFP4: the lookup-table types' driver) with
    gpt-oss's expert biases and the routers' softmax; their graphs meet no kernel signature beyond them."""
    arch, options = family_options(name, qtype)
    found = coverage(write_tiny_family(tmp_path / f"{arch}.gguf", arch, weight_type=qtype, **options))
    assert found["new"] == {}
    assert (warmup.experts(DType[qtype.name]) in found["tags"]) == (arch in ("qwen3moe", "gpt-oss"))

"""The CUDA backend against the CPU: the same graphs give the same results, and the scheduler
splits a model between GPU and CPU with -ngl. Skipped where cupy or a GPU is missing."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
try:
    if cupy.cuda.runtime.getDeviceCount() < 1:
        pytest.skip("no GPU", allow_module_level=True)
except Exception as err:  # cupy without a driver
    pytest.skip(f"no usable GPU ({err})", allow_module_level=True)

from ggrun.core.backends.cpu import CPUBackend  # noqa: E402
from ggrun.core.backends.cuda import CUDABackend  # noqa: E402
from ggrun.core.llm.batch import Batch  # noqa: E402
from ggrun.core.llm.model import Model  # noqa: E402
from ggrun.core.llm.session import Session, SessionParams  # noqa: E402
from ggrun.core.validate import validate_plan  # noqa: E402


@pytest.fixture(scope="module")
def gpu():
    return CUDABackend(0)


def _logits(path, backends, ngl, tokens):
    # f32 numerics: the CPU's compiled kernels and the GPU's array kernels then differ by float
    # rounding only (llama.cpp's f16 and 8-bit roundings would magnify that into ~1e-3)
    m = Model.load(path, backends, ngl, numerics="f32")
    s = Session(m, SessionParams(n_ctx=256, n_ubatch=32))
    first = s.decode(Batch.of_sequence(tokens))
    nxt = s.decode(Batch.of_sequence([int(first[-1].argmax())], len(tokens)))
    return first, nxt, s


@pytest.mark.parametrize("ngl", [1, 3])
def test_offloaded_model_matches_cpu(tiny_llama_factory, gpu, ngl):
    path = tiny_llama_factory(n_layer=2)
    tokens = list(range(3, 40))
    ref_first, ref_next, _ = _logits(path, [CPUBackend()], 0, tokens)
    first, nxt, s = _logits(path, [gpu, CPUBackend()], ngl, tokens)
    np.testing.assert_allclose(first, ref_first, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(nxt, ref_next, atol=1e-4, rtol=1e-4)
    assert int(first[-1].argmax()) == int(ref_first[-1].argmax())
    sg = s.result.sg
    assert any(sp.backend is gpu for sp in sg.splits)
    for name, plan in sg.plans.items():
        validate_plan(sg.order, plan.offsets, plan.sizes, plan.scratch)


def test_cpu_cannot_read_gpu_memory(tiny_llama_factory, gpu):
    from ggrun.core.errors import RuntimeFailure

    path = tiny_llama_factory(n_layer=2)
    m = Model.load(path, [gpu, CPUBackend()], 3)
    with pytest.raises(RuntimeFailure):
        CPUBackend().array(m.weights["blk.0.attn_q.weight"])

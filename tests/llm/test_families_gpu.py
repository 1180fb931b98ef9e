"""Every family's tiny model offloaded whole to each GPU (-ngl 99) against the CPU alone: the same greedy token at
>= 98% of the positions of llama.cpp's saved chunks (tests/data/families_llama_cpp.json), for F32 weights and
the block types the families ship in (Q4_K; IQ4_NL, IQ4_XS and MXFP4 through the CUDA products of
core/backends/cuda/matmul.cu). Skipped where cupy or a GPU is missing."""
from __future__ import annotations

import json

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT

from tests.core.gpu import device_indices, require_gpu

require_gpu()

from ggrun.core.backends.cpu import CPUBackend  # noqa: E402
from ggrun.core.backends.cuda import CUDABackend  # noqa: E402
from ggrun.core.llm.model import Model  # noqa: E402
from ggrun.core.llm.perplexity import ChunkPlan, evaluate_chunks  # noqa: E402
from ggrun.core.llm.session import Session, SessionParams  # noqa: E402
from tests.llm.test_families import DATA, family_factory, reference_cases  # noqa: E402,F401  (the fixture)


def greedy(path, backends, n_gpu_layers: int, tokens: list[int], n_ctx: int) -> np.ndarray:
    """The top token at every scored position of the chunks (as test_families scores them)."""
    model = Model.load(path, backends, n_gpu_layers=n_gpu_layers)
    plan = ChunkPlan(n_ctx, len(tokens) // n_ctx)
    session = Session(model, SessionParams(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx))
    return np.concatenate([c.logits.argmax(axis=1) for c in evaluate_chunks(session, tokens, plan, n_ctx, None)])


@pytest.mark.parametrize("device", device_indices())
@pytest.mark.parametrize("case", reference_cases())
def test_gpu_agrees_with_cpu(family_factory, case, device):
    ref = json.loads(DATA.read_text())[case]
    arch, type_name = case.split("/")
    path = family_factory(arch=arch) if type_name == "F32" else family_factory(arch=arch, weight_type=QT[type_name])
    cpu = greedy(path, [CPUBackend()], 0, ref["tokens"], ref["n_ctx"])
    gpu = greedy(path, [CUDABackend(device), CPUBackend()], 99, ref["tokens"], ref["n_ctx"])
    same = np.mean(cpu == gpu)
    print(f"\n{case}: same greedy token on CUDA{device} at {same:.1%}")
    assert same >= 0.98

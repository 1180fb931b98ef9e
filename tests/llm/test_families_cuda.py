"""Every family of the registry on each GPU (-ngl 99: every layer and the head on the device) against the
CPU, on its tiny synthetic model (tests.synth.FAMILY_PRESETS): the token ranked first at each position of a
200-token text agrees at >= 98% of the positions, in F32 and F16 weights, with the default numerics
(issue 32's bar for the GPU). Quantized weights are left out: there the CPU's 8-bit activation blocks
(Q8_K) and the GPU's (Q8_1, as llama.cpp's CUDA backend) round differently, and the tiny models' mixture of
experts then picks other experts at near ties (measured on the stand-in: 87% for qwen3moe in Q4_K). Ops the CUDA backend lacks fall back to the CPU through the scheduler, as
they would for a user. Skipped where cupy or a GPU is missing."""
from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT

from tests.core.gpu import device_indices, require_gpu

require_gpu()

from ggrun.core.backends.cpu import CPUBackend  # noqa: E402
from ggrun.core.backends.cuda import CUDABackend  # noqa: E402
from ggrun.core.llm.batch import Batch  # noqa: E402
from ggrun.core.llm.model import Model  # noqa: E402
from ggrun.core.llm.session import Session, SessionParams  # noqa: E402
from tests.synth import FAMILY_PRESETS, write_tiny_family, written_once  # noqa: E402

N_TOKENS = 200
AGREE = 0.98


@pytest.fixture(scope="module")
def family_factory(tmp_path_factory):
    def write(path, arch, **options):
        return write_tiny_family(path, arch, **FAMILY_PRESETS[arch], **options)
    return written_once(write, tmp_path_factory.mktemp, "family")


def text(n_vocab: int) -> list[int]:
    """A fixed 200-token text over the tiny vocabulary."""
    return np.random.default_rng(7).integers(0, n_vocab, N_TOKENS).tolist()


def top_tokens(model: Model, tokens: list[int]) -> np.ndarray:
    """The token ranked first after each position (one sequence, prompt micro-batches of 64)."""
    s = Session(model, SessionParams(n_ctx=256, n_batch=256, n_ubatch=64))
    b = Batch()
    for i, t in enumerate(tokens):
        b.add(t, i, 0, True)
    return np.argmax(s.decode(b), axis=-1)


@pytest.mark.parametrize("device", device_indices())
@pytest.mark.parametrize("weight_type", [QT.F32, QT.F16], ids=["f32", "f16"])
@pytest.mark.parametrize("arch", sorted(FAMILY_PRESETS))
def test_a_family_on_the_gpu_ranks_as_on_the_cpu(family_factory, arch, weight_type, device):
    path = family_factory(arch=arch, weight_type=weight_type)
    on_cpu = Model.load(path, [CPUBackend()])
    tokens = text(on_cpu.hp.n_vocab)
    want = top_tokens(on_cpu, tokens)
    gpu = Model.load(path, [CUDABackend(device), CPUBackend()], 99)
    assert gpu.placement.output is not gpu.placement.input
    got = top_tokens(gpu, tokens)
    agree = float(np.mean(got == want))
    assert agree >= AGREE, f"{arch} {weight_type.name} on CUDA{device}: {agree:.1%} of positions agree"

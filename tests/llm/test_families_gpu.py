"""Every family's tiny model offloaded whole to each GPU (-ngl 99) against the CPU alone: the same greedy token at
the positions of llama.cpp's saved chunks (tests/data/families_llama_cpp.json), >= 98%, for F32 weights and the
block types the families ship in (Q4_K; IQ4_NL, IQ4_XS and MXFP4 through the CUDA products of
core/backends/cuda/matmul.cu) (test_gpu_agrees_with_cpu); qwen3moe's and gpt-oss's decode steps with their fused
experts. Skipped where cupy or a GPU is missing."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT

from tests.core.gpu import device_indices, require_gpu

require_gpu()

from ggrun.core.backends.cpu import CPUBackend  # noqa: E402
from ggrun.core.backends.cuda import CUDABackend, backend as cuda_backend, experts, matmul, ops  # noqa: E402
from ggrun.core.llm.batch import Batch  # noqa: E402
from ggrun.core.llm.model import Model  # noqa: E402
from ggrun.core.llm.perplexity import ChunkPlan, evaluate_chunks  # noqa: E402
from ggrun.core.llm.session import Session, SessionParams  # noqa: E402
from tests.llm.test_families import BOUNDS, DATA, family_factory, reference_cases  # noqa: E402,F401  (the fixture)


def greedy(path, backends, n_gpu_layers: int, tokens: list[int], n_ctx: int) -> np.ndarray:
    """The top token at every scored position of the chunks (as test_families scores them)."""
    model = Model.load(path, backends, n_gpu_layers=n_gpu_layers)
    plan = ChunkPlan(n_ctx, len(tokens) // n_ctx)
    session = Session(model, SessionParams(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx))
    return np.concatenate([c.logits.argmax(axis=1) for c in evaluate_chunks(session, tokens, plan, n_ctx, None)])


@pytest.mark.parametrize("device", device_indices())
@pytest.mark.parametrize("case", reference_cases())
def test_gpu_agrees_with_cpu(family_factory, case, device):
    """The same greedy token at >= 98% of the positions (test_families.BOUNDS). Block-quantized weights meet
    activations rounded to 8 bits, per 32 values on the GPU (or not at all: f16 tiles) and per 256 for the
    k-quants on the CPU; their models' bigram echo (loaders/synthetic.py QUANTIZED_OPTIONS) keeps that rounding
    from deciding near ties, which on the plain models it did at 1-20% of positions, in llama.cpp's own CUDA
    build too (scripts/bench/gpu_agreement.py, stop 47, H100). The float types' models carry it too (robust): the
    GPU's f16 tiles round where the CPU's f32 products do not, and on the plain gpt-oss model that moved the top
    token at 2.8% of positions (H100, stop 48)."""
    ref = json.loads(DATA.read_text())[case]
    arch, type_name = case.split("/")
    path = family_factory(arch=arch, weight_type=QT[type_name], robust=True)
    cpu = greedy(path, [CPUBackend()], 0, ref["tokens"], ref["n_ctx"])
    gpu = greedy(path, [CUDABackend(device), CPUBackend()], 99, ref["tokens"], ref["n_ctx"])
    same = np.mean(cpu == gpu)
    print(f"\n{case}: same greedy token on CUDA{device} at {same:.1%}")
    assert same >= BOUNDS[type_name][0]


BIAS_FUSIONS = (matmul._product_bias, experts._gated_experts_bias, experts._experts_bias, ops._bias_rope,
                ops._bias_rope_set_rows, ops._bias_set_rows)


def decode_steps(path, device: int) -> tuple[list[np.ndarray], Counter, Counter]:
    """A prompt, then four decode steps of one token on the GPU: every step's logits, and how many steps of each
    name the prompt's graph and the last decode graph bound (a node a fused kernel takes binds an empty step of its
    op's name)."""
    gpu = CUDABackend(device)
    s = Session(Model.load(path, [gpu, CPUBackend()], 99), SessionParams(n_ctx=64))
    prompt = list(range(3, 20))
    out = [s.decode(Batch.of_sequence(prompt, 0)).copy()]
    names = [Counter(step.name for sp in s.result.sg.splits if sp.backend is gpu for step in sp.calls.steps)]
    for i in range(4):
        out.append(s.decode(Batch.of_sequence([20 + i], len(prompt) + i)).copy())
    names.append(Counter(step.name for sp in s.result.sg.splits if sp.backend is gpu for step in sp.calls.steps))
    return out, *names


@pytest.mark.parametrize("device", device_indices())
def test_qwen3moe_decode_binds_its_fused_experts(family_factory, device):
    """qwen3moe's decode steps (Q4_K) run a layer's gate and up experts with their SwiGLU as one mmvq_id_glu launch
    and the weighting and sum of the experts' outputs as one moe_sum launch: the gated launch once kept its q8_1
    activations in the gate's scratch, which the planner may give to the up product's result, and then fell back to
    three kernels (as in every layer of a 48-layer Qwen3-30B-A3B-shaped model). Its prompt's gate and up experts
    share one quantization and grouping (mmq_idt_pair) in every layer too, but the last, which computes only the
    row the logits need (a decode step's mmvq_id_glu)."""
    path = family_factory(arch="qwen3moe", weight_type=QT.Q4_K)
    _, prompt, names = decode_steps(path, device)
    assert names["mmvq_id_glu"] == names["swiglu"] == names["moe_sum"] > 0, names  # a fused node keeps its name
    assert prompt["mmq_idt_pair"] > 0 and prompt["mmq_idt_pair"] + prompt["mmvq_id_glu"] == prompt["swiglu"], prompt


@pytest.mark.parametrize("device", device_indices())
def test_gpt_oss_decode_with_its_bias_adds_fused_as_without(family_factory, device, monkeypatch):
    """gpt-oss's decode steps (MXFP4): with its bias adds done inside the kernels beside them (the q/k/v, output
    and router products', the experts', RoPE's) the logits are the unfused kernels', up to float rounding."""
    path = family_factory(arch="gpt-oss", weight_type=QT.MXFP4)
    fused, _, names = decode_steps(path, device)
    assert {"mul_mat_multi+bias", "mul_mat+bias", "rope+bias", "mmvq_id_glu+bias", "mmvq_id+bias"} <= set(names), names
    monkeypatch.setattr(cuda_backend, "FUSIONS", [f for f in cuda_backend.FUSIONS if f[1] not in BIAS_FUSIONS])
    plain, _, names = decode_steps(path, device)
    assert not any("+bias" in n for n in names), names
    for f, p in zip(fused, plain):
        np.testing.assert_allclose(f, p, rtol=1e-5, atol=1e-5)

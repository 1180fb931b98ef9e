"""mul_mat_glu (a gated feed-forward's gate and up products and their swiglu/geglu, one node): the
op, its reference kernel bit for bit against mul_mat_multi followed by swiglu/geglu, the CPU's
compiled ways (r8, BLAS tiles, whole products) against that same unfused pair on the CPU bit for
bit and against the reference by NMSE, for every weight type, decode and prompt sizes, odd row
counts, threads and every instruction-set level; its planned scratch; and where the feed-forward builder
takes the fused node.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from ggrun.core import ops
from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.cpu import backend as cpu_backend
from ggrun.core.backends.cpu import matmul
from ggrun.core.backends.cpu.quant import avx2_r8, avx512, codes
from ggrun.core.backends.op_harness import TYPES, Leafs, ReferenceBackend, nmse, planned, run_on, weight_data
from ggrun.core.backends.sim import SimBackend
from ggrun.core.dtypes import DType
from ggrun.core.errors import GraphError
from ggrun.core.llm import blocks
from tests.core.test_cpu_matmul import (MAX_NMSE, act_quant_of, computed_in_place, k_for, simd,  # noqa: F401
                                        two_threads)

# random k-quant blocks give products of hundreds: the reference's silu takes exp(-g) to inf there
# (and so its result to 0, as the compiled kernels give it)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

GLUS = [("swiglu", False), ("geglu", True), ("geglu", False)]  # geglu with and without ggml's f16 table


@pytest.fixture(autouse=True)
def compiled_only(monkeypatch):
    """The CPU backend may not fall back to the reference kernels for these nodes."""
    kernels = dict(cpu_backend.KERNELS)

    def refuse(*args):
        raise AssertionError("the reference kernel ran on the CPU backend")
    for op in ("mul_mat", "mul_mat_multi", "mul_mat_glu", "swiglu", "geglu"):
        kernels[op] = refuse
    monkeypatch.setattr(cpu_backend, "KERNELS", kernels)


@dataclass(frozen=True)
class Ffn:
    """glu(x @ gate^T, x @ up^T) of random data: gate and up of `types`, [m, k]; x [n, k]."""

    types: tuple[DType, DType]
    m: int
    k: int
    n: int
    glu: str = "swiglu"
    f16_table: bool = False
    numerics: str = "llama"
    seed: int = 0

    def build(self, fused: bool = True):
        """build(leafs) -> the mul_mat_glu node, or (fused False) mul_mat_multi and swiglu/geglu."""
        data = [weight_data(t, self.m, self.k, self.seed + i) for i, t in enumerate(self.types)]
        x = np.random.default_rng(self.seed + 9).standard_normal((self.n, self.k)).astype(np.float32)

        def build(lf: Leafs):
            gate, up = (self._weight(lf, name, t, raw) for name, t, raw in zip(("gate", "up"), self.types, data))
            xt = lf.input("x", DType.F32, x)
            if fused:
                return ops.mul_mat_glu(gate, up, xt, self.glu, self.f16_table)
            g, u = ops.mul_mat_multi((gate, up), xt, ("g", "u"))
            return ops.swiglu(g, u) if self.glu == "swiglu" else ops.geglu(g, u, f16_table=self.f16_table)
        return build

    def _weight(self, lf: Leafs, name: str, dtype: DType, raw: np.ndarray):
        w = lf.weight(name, dtype, (self.m, self.k), raw)
        if self.numerics == "llama" and act_quant_of(dtype):
            w.params["act_quant"] = act_quant_of(dtype)
        if lf.ctx.backend.name == "CPU":
            lf.ctx.prepare_weight(w)  # the layout the engine makes at load
        return w

    def check(self) -> None:
        """The CPU's node equals the CPU's unfused pair bit for bit, and the reference by NMSE."""
        got = run_on(CPUBackend(), self.build())
        np.testing.assert_array_equal(got, run_on(CPUBackend(), self.build(fused=False)), err_msg=str(self))
        err = nmse(got, run_on(ReferenceBackend(), self.build()))
        assert err <= MAX_NMSE[self.numerics], (self, err)

    def way(self) -> str:
        node = self.build()(Leafs(CPUBackend()))
        return matmul._glu_way(node, matmul._glu_plans(node))[0]


def test_the_node_and_its_sources():
    lf = Leafs(CPUBackend())
    gate = lf.weight("gate", DType.F32, (6, 32), np.zeros((6, 32), np.float32))
    up = lf.weight("up", DType.F32, (6, 32), np.zeros((6, 32), np.float32))
    x = lf.input("x", DType.F32, np.zeros((3, 32), np.float32))
    node = ops.mul_mat_glu(gate, up, x, "geglu", f16_table=True, name="ffn")
    assert (node.op, node.name, node.shape, node.dtype) == ("mul_mat_glu", "ffn", (3, 6), DType.F32)
    assert node.srcs == (gate, up, x)
    assert node.params == {"glu": "geglu", "f16_table": True}


def test_bad_operands_are_refused():
    lf = Leafs(CPUBackend())
    w6, w4 = (lf.weight(f"w{m}", DType.F32, (m, 32), np.zeros((m, 32), np.float32)) for m in (6, 4))
    x = lf.input("x", DType.F32, np.zeros((2, 32), np.float32))
    with pytest.raises(GraphError):
        ops.mul_mat_glu(w6, w6, x, "relu")  # no such GLU
    with pytest.raises(GraphError):
        ops.mul_mat_glu(w6, w4, x, "swiglu")  # gate and up differ
    with pytest.raises(GraphError):
        ops.mul_mat_glu(w6, w6, lf.input("y", DType.F32, np.zeros((2, 16), np.float32)), "swiglu")  # K differs
    with pytest.raises(GraphError):
        ops.mul_mat_glu(w6, w6, lf.input("z", DType.F32, np.zeros((1, 2, 32), np.float32)), "swiglu")  # b not 2-d


@pytest.mark.parametrize("numerics", ["llama", "f32"])
@pytest.mark.parametrize("glu,f16_table", GLUS)
def test_reference_kernel_is_the_unfused_pair(glu, f16_table, numerics):
    for types in ((DType.Q4_1, DType.Q8_0), (DType.F16, DType.F32)):
        case = Ffn(types, 24, 64, 5, glu, f16_table, numerics)
        for backend in (ReferenceBackend, SimBackend):
            np.testing.assert_array_equal(run_on(backend(), case.build()), run_on(backend(), case.build(fused=False)))


@pytest.mark.parametrize("numerics", ["llama", "f32"])
@pytest.mark.parametrize("n", [1, 2, 7, 33, 512])
@pytest.mark.parametrize("dtype", TYPES, ids=str)
def test_every_weight_type(dtype, n, numerics):
    """37 rows: r8's last group of eight is partial."""
    for glu, f16_table in GLUS:
        Ffn((dtype, dtype), 37, k_for(dtype, small=n == 512), n, glu, f16_table, numerics).check()


# weights of two types: one activation format (one r8 call with two codes), two formats or
# layouts (each product its own call), a float and a quantized weight
PAIRS = [(DType.Q4_K, DType.Q6_K), (DType.Q5_0, DType.Q8_0), (DType.Q4_1, DType.Q4_K), (DType.Q4_0, DType.Q4_1),
         (DType.Q2_K, DType.Q3_K), (DType.F16, DType.BF16), (DType.Q4_0, DType.F32)]


@pytest.mark.parametrize("numerics", ["llama", "f32"])
@pytest.mark.parametrize("n", [1, 7, 33, 512])
@pytest.mark.parametrize("types", PAIRS, ids=lambda p: "+".join(map(str, p)))
def test_weights_of_two_types(types, n, numerics):
    Ffn(types, 21, 256, n, "geglu", True, numerics).check()


@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize("dtype", [DType.Q4_1, DType.Q5_0, DType.Q4_K, DType.Q6_K, DType.Q2_K, DType.F16], ids=str)
def test_threads_and_simd_levels(dtype, n, simd, two_threads):  # noqa: F811
    """61 rows split over two threads: eight r8 groups (the last partial), one 64-row ri64 group."""
    for numerics in ("llama", "f32"):
        Ffn((dtype, dtype), 61, k_for(dtype), n, "swiglu", False, numerics, seed=n).check()


def test_r8_way_in_several_steps_per_thread(monkeypatch, two_threads):  # noqa: F811
    """One group of rows (r8: eight, r16: sixteen) per step: each step's GLU reads only the rows that
    step computed."""
    if codes.SIMD == "generic":
        pytest.skip("the r8 and r16 layouts are AVX2's and AVX-512's")
    monkeypatch.setattr(matmul, "GLU_TILE_BYTES", 1)
    module, name = (avx512, "mul_mat_glu_r16_par") if codes.SIMD == "avx512" else (avx2_r8, "mul_mat_glu_r8_avx2_par")
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: calls.append(args[13]) or real(*args))
    for types in ((DType.Q4_1, DType.Q4_1), (DType.Q4_K, DType.Q6_K)):
        Ffn(types, 61, 256, 33, "geglu", True).check()
    assert calls == [1, 1]  # one call a pair (the unfused pair runs mul_mat_multi's kernel), step 1


def test_blas_way_over_several_tiles(monkeypatch):
    """Seven weight rows a tile, the last tile partial; Q4_1's rounding carries its min columns."""
    monkeypatch.setattr(matmul, "Q8_MAX_N", 0)
    monkeypatch.setattr(matmul, "R8_MAX_N", {})
    monkeypatch.setattr(matmul, "TILE_BYTES", 7 * (256 + 8) * 4)
    for dtype in (DType.Q4_1, DType.Q6_K, DType.F16):
        case = Ffn((dtype, dtype), 45, 256, 20, "swiglu")
        assert case.way() == "blas"
        case.check()


def test_each_case_takes_its_way():
    r8 = "whole" if codes.SIMD == "generic" else "r8"
    cases = {
        Ffn((DType.Q4_1, DType.Q4_1), 16, 64, 1): r8,                     # decode, repacked
        Ffn((DType.Q5_0, DType.Q5_0), 16, 64, 512): r8,                   # a prompt, repacked
        Ffn((DType.Q4_1, DType.Q4_K), 16, 256, 1): "whole",               # two activation formats
        Ffn((DType.Q2_K, DType.Q2_K), 16, 256, 2): "whole",               # not repacked, decode
        Ffn((DType.Q2_K, DType.Q2_K), 16, 256, 33): "blas",               # not repacked, a prompt
        Ffn((DType.Q4_1, DType.Q4_1), 16, 64, 1, numerics="f32"): "whole",
        Ffn((DType.Q4_1, DType.Q4_1), 16, 64, 33, numerics="f32"): "blas",
        Ffn((DType.F32, DType.F32), 16, 64, 33, numerics="f32"): "whole",  # an f32 weight has no tiles
    }
    assert {case: case.way() for case in cases} == cases


@pytest.mark.parametrize("n", [1, 64])
@pytest.mark.parametrize("numerics", ["llama", "f32"])
def test_scratch_is_planned_and_the_result_written_in_place(n, numerics):
    """The allocator gives the node the scratch its call needs; the call fills the node's planned
    array and allocates nothing of its size."""
    case = Ffn((DType.Q4_K, DType.Q4_K), 2048, 256, n, "swiglu", numerics=numerics)
    _, _, _, node = planned(CPUBackend(), case.build())
    assert node.scratch is not None and node.scratch.nbytes >= matmul._glu_scratch(node) > 0
    result, peak = computed_in_place(case.build())
    assert peak < result.nbytes // 4, peak
    assert nmse(result, run_on(ReferenceBackend(), case.build())) <= MAX_NMSE[numerics]


@pytest.mark.parametrize("backend,want", [
    (CPUBackend, ["mul_mat_glu"]),
    (SimBackend, ["mul_mat_glu"]),
    (lambda: SimBackend(refuse=frozenset({"mul_mat_glu"})), ["mul_mat_multi", "swiglu"]),
    (lambda: SimBackend(refuse=frozenset({"mul_mat_glu", "mul_mat_multi"})), ["mul_mat", "mul_mat", "swiglu"]),
])
def test_the_feed_forward_fuses_where_the_weights_backend_runs_the_node(backend, want):
    lf = Leafs(backend())
    gate, up = (lf.weight(n, DType.F32, (4, 32), np.zeros((4, 32), np.float32)) for n in ("gate", "up"))
    h = blocks.gated(lf.input("x", DType.F32, np.zeros((2, 32), np.float32)), gate, up, 3, "swiglu")
    assert (h.name, h.shape) == ("ffn_swiglu-3", (2, 4))
    nodes = [h] if h.op == "mul_mat_glu" else [s.view_src or s for s in h.srcs] + [h]
    assert [n.op for n in dict.fromkeys(nodes)] == want

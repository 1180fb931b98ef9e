"""The CPU's compiled products with stored weights (core/backends/cpu/matmul.py, quant/) against
the reference kernels, op by op: every weight type, decode steps and batches (each of the three
paths), llama numerics (8-bit activation blocks) and f32 numerics, each instruction-set level the
process may run (`simd`), one and two threads, odd row counts; get_rows of every stored type; and
results written into planned memory.
"""
from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest

from ggrun.core import ops
from ggrun.core.backends.cpu import CPUBackend, isa, jit
from ggrun.core.backends.cpu import backend as cpu_backend
from ggrun.core.backends.cpu import matmul
from ggrun.core.backends.cpu.quant import activations, avx2_r8, avx512, codes, decode, layouts, portable
from ggrun.core.backends.op_harness import (K_QUANTS, LEGACY, LUT4, TYPES, Leafs, ReferenceBackend, compare, planned,
                                            run_on, weight_data)
from ggrun.core.dtypes import DType
from ggrun.core.quants import vec_dot_blocks

# ggml's test-backend-ops allows 5e-4 for mul_mat; the only differences here are the order of
# float sums, Q8_1's f16 s = d * sum(q) (ggml's own rounding) and, for a few activations, rounding
# with 127/amax (ggml) instead of the reference's 1/f16(d).
MAX_NMSE = {"llama": 5e-5, "f32": 1e-9}


def act_quant_of(dtype: DType) -> str | None:
    """What core/llm/model.py sets on a weight with llama numerics."""
    if not dtype.is_quantized:
        return None
    return vec_dot_blocks(dtype.name)


def product(dtype: DType, m: int, k: int, x_shape: tuple[int, ...], numerics: str, seed: int = 0,
            repacked: bool = False):
    """build(leafs) of out = mul_mat(w, x), with the same random data on every backend; with
    `repacked`, the weight also carries the layout the engine makes at load (where there is one)."""
    data = weight_data(dtype, m, k, seed)
    x = np.random.default_rng(seed + 1).standard_normal(x_shape + (k,)).astype(np.float32)
    packed = matmul.repack(dtype, data) if repacked and dtype.is_quantized else None

    def build(lf: Leafs):
        w = lf.weight("w", dtype, (m, k), data)
        if numerics == "llama" and act_quant_of(dtype):
            w.params["act_quant"] = act_quant_of(dtype)
        if packed is not None and lf.ctx.backend.name == "CPU":
            w.params[matmul.REPACKED] = packed
        return ops.mul_mat(w, lf.input("x", DType.F32, x))
    return build


def k_for(dtype: DType, small: bool = False) -> int:
    if dtype.block_size == 256:
        return 256 if small else 512
    return 64 if small else 96 if dtype.is_quantized else 72  # 72: not a multiple of 16 (f32 tails)


@pytest.fixture(autouse=True)
def compiled_only(monkeypatch):
    """The CPU backend may not fall back to the reference for these ops: a binder must accept."""
    kernels = dict(cpu_backend.KERNELS)

    def refuse(*args):
        raise AssertionError("the reference kernel ran on the CPU backend")
    kernels["mul_mat"] = kernels["get_rows"] = refuse
    monkeypatch.setattr(cpu_backend, "KERNELS", kernels)


def levels_to_test() -> tuple[str, ...]:
    """The instruction-set levels this process tests: its own, and those below it unless GGRUN_CPU_ISA
    named the level (scripts/test.sh runs the kernel tests again under each lower level, compiled
    for it, so each level is tested once)."""
    if os.environ.get(isa.ENV):
        return (isa.LEVEL,)
    return isa.LEVELS[:isa.LEVELS.index(isa.LEVEL) + 1]


@pytest.fixture(params=isa.LEVELS)
def simd(request, monkeypatch):
    """The kernels of one level (quant.codes.SIMD set to it: the Python side picks kernels and layouts by it)."""
    if request.param not in levels_to_test():
        pytest.skip(f"level {request.param}: above this CPU's or this run's ({isa.LEVEL})")
    monkeypatch.setattr(codes, "SIMD", request.param)
    return request.param


@pytest.fixture
def two_threads(monkeypatch):
    """Two numba threads, and threads even for tiny weights, so the parallel kernels run."""
    before = jit.threads()
    jit.set_threads(2)
    monkeypatch.setattr(matmul, "split_min_bytes", lambda: 0)
    yield
    jit.set_threads(before)


@pytest.mark.parametrize("numerics", ["llama", "f32"])
@pytest.mark.parametrize("n_tokens", [1, 2, 7, 33])
@pytest.mark.parametrize("dtype", TYPES, ids=str)
def test_mul_mat(dtype, n_tokens, numerics):
    err = compare(CPUBackend(), product(dtype, 37, k_for(dtype), (n_tokens,), numerics))
    assert err <= MAX_NMSE[numerics], err


REPACKED_TYPES = LEGACY + [DType.Q4_K, DType.Q5_K, DType.Q6_K]


@pytest.mark.parametrize("n_tokens", [1, 2, 7])
@pytest.mark.parametrize("dtype", REPACKED_TYPES, ids=str)
def test_mul_mat_repacked(dtype, n_tokens, simd, monkeypatch):
    """The r16 layout (AVX-512: rows in groups of 16), the r8 layout (AVX2: groups of 8) and the
    ri64 layout (portable: groups of 64); 37 rows leave a partial group."""
    packed = matmul.repack(dtype, weight_data(dtype, 37, k_for(dtype), 0))
    if simd == "generic" and dtype in K_QUANTS:
        assert packed is None
        return
    assert packed is not None
    module, kernel = {"avx512": (avx512, "mul_mat_r16"), "avx2": (avx2_r8, "mul_mat_r8_avx2"),
                      "generic": (portable, "mul_mat_ri_portable")}[simd]
    used, real = [], getattr(module, kernel)

    def spy(*args):
        used.append(1)
        real(*args)
    monkeypatch.setattr(module, kernel, spy)
    err = compare(CPUBackend(), product(dtype, 37, k_for(dtype), (n_tokens,), "llama", repacked=True))
    assert err <= MAX_NMSE["llama"], err
    assert used, "the repacked kernel did not run"


@pytest.mark.parametrize("numerics", ["llama", "f32"])
@pytest.mark.parametrize("dtype", TYPES, ids=str)
def test_mul_mat_prompt_batch(dtype, numerics):
    err = compare(CPUBackend(), product(dtype, 19, k_for(dtype, small=True), (512,), numerics))
    assert err <= MAX_NMSE[numerics], err


@pytest.mark.parametrize("numerics", ["llama", "f32"])
@pytest.mark.parametrize("dtype", TYPES, ids=str)
def test_mul_mat_both_simd_levels_and_threads(dtype, numerics, simd, two_threads):
    for n_tokens in (1, 3):
        build = product(dtype, 29, k_for(dtype), (n_tokens,), numerics, seed=n_tokens, repacked=True)
        err = compare(CPUBackend(), build)
        assert err <= MAX_NMSE[numerics], (n_tokens, err)
    err = compare(CPUBackend(), product(dtype, 300, k_for(dtype, small=True), (40,), numerics))  # several tiles
    assert err <= MAX_NMSE[numerics], err


def test_repack_is_for_the_types_it_speeds_up(simd):
    raw = weight_data(DType.Q2_K, 8, 256, 0)
    assert matmul.repack(DType.Q2_K, raw) is None
    assert matmul.repack(DType.F16, weight_data(DType.F16, 8, 64, 0).view(np.uint8)) is None
    with pytest.raises(ValueError):
        matmul.repack(DType.Q4_1, raw.reshape(-1))


def test_prompt_batch_tiles(monkeypatch):
    """The BLAS path over several weight tiles, the last one partial."""
    monkeypatch.setattr(matmul, "TILE_BYTES", 7 * 96 * 4)
    for dtype in (DType.Q4_1, DType.Q6_K, DType.F16):
        err = compare(CPUBackend(), product(dtype, 45, k_for(dtype), (20,), "llama"))
        assert err <= MAX_NMSE["llama"], (dtype, err)


def test_activation_batch_dims_are_rows():
    """x [2, 3, K] against a 2-d weight: six rows, out [2, 3, M]."""
    err = compare(CPUBackend(), product(DType.Q8_0, 33, 64, (2, 3), "llama"))
    assert err <= MAX_NMSE["llama"]


@pytest.mark.parametrize("dtype", REPACKED_TYPES, ids=str)
def test_repacked_rows_do_not_depend_on_the_batch(dtype):
    """A batch's rows go through the r8/r16 kernels four at a time (the weights unpacked once for
    four rows) and the last few one at a time; each row's result is the same, bit for bit, as
    that row alone gives (what makes prompt splits and batch sizes invisible in the logits)."""
    n, k = 23, k_for(dtype)
    data = weight_data(dtype, 37, k, 0)
    if matmul.repack(dtype, data) is None:
        pytest.skip(f"level {codes.SIMD} reads {dtype} as stored: a batch takes the BLAS path")
    x = np.random.default_rng(5).standard_normal((n, k)).astype(np.float32)

    def build(rows):
        def one(lf: Leafs):
            w = lf.weight("w", dtype, (37, k), data)
            w.params["act_quant"] = act_quant_of(dtype)
            lf.ctx.prepare_weight(w)
            return ops.mul_mat(w, lf.input("x", DType.F32, rows))
        return one
    batch = run_on(CPUBackend(), build(x))
    for i in (0, 5, 19, 20, n - 1):
        np.testing.assert_array_equal(batch[i:i + 1], run_on(CPUBackend(), build(x[i:i + 1])), err_msg=f"row {i}")


@pytest.mark.parametrize("dtype", [DType.Q4_0, DType.Q4_1, DType.Q6_K], ids=str)
def test_both_paths_compute_alike(dtype, monkeypatch):
    """Below and above the crossover the same integer values meet the weight, and Q4_1's min
    meets ggml's f16 s = d * sum(q) on both: the q8 path and the BLAS path differ only by the
    order of float sums."""
    build = product(dtype, 40, k_for(dtype), (6,), "llama")
    q8 = run_on(CPUBackend(), build)
    monkeypatch.setattr(matmul, "Q8_MAX_N", 0)
    monkeypatch.setattr(matmul, "R8_MAX_N", {})
    blas = run_on(CPUBackend(), build)
    assert np.abs(q8 - blas).max() <= 2e-6 * np.abs(blas).max()


@pytest.mark.parametrize("dtype", LEGACY + K_QUANTS + LUT4 + [DType.F16, DType.BF16], ids=str)
def test_get_rows(dtype, simd):
    data = weight_data(dtype, 23, k_for(dtype), seed=3)
    ids = np.array([4, 0, 22, 4, 9], dtype=np.int32)

    def build(lf: Leafs):
        return ops.get_rows(lf.weight("w", dtype, (23, k_for(dtype)), data), lf.input("ids", DType.I32, ids))
    assert compare(CPUBackend(), build) == 0.0  # decoded bit for bit as core.quants does


@pytest.mark.parametrize("dtype", [DType.F16, DType.BF16], ids=str)
def test_every_half_decodes_exactly(dtype, simd):
    """All 65536 bit patterns (subnormals, infinities, NaNs, -0) decode as numpy decodes them
    (F16C quiets signalling NaNs, as on ggml's x86 path: NaNs need only stay NaNs)."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = bits.view(np.float16).astype(np.float32) if dtype is DType.F16 else (bits.astype(np.uint32) << 16).view(np.float32)
    out = np.empty((1, 1 << 16), np.float32)
    rows = decode.dequantize_rows if simd == "generic" else decode.dequantize_rows_avx2
    rows(codes.CODES[dtype], bits.view(np.uint8).reshape(1, -1), 0, 1, out)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(out[0]), nan)
    assert np.array_equal(out[0][~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("act", [codes.ACT_Q8_0, codes.ACT_Q8_1, codes.ACT_Q8_K], ids=["q8_0", "q8_1", "q8_k"])
@pytest.mark.parametrize("level", ["avx2", "avx512"])
def test_vector_activation_blocks_equal_the_portable_ones(act, level):
    """The AVX2 and AVX-512 quantizers give the portable one's blocks (ggml's rounding), here for
    rows of a wider array, all-zero and tiny blocks (f16-subnormal scales), and a block whose largest
    magnitude comes twice with both signs (Q8_K takes the first) included."""
    if level not in levels_to_test():
        pytest.skip(f"level {level}: above this CPU's or this run's ({isa.LEVEL})")
    rng = np.random.default_rng(5)
    wide = (rng.standard_normal((4, 800)) * np.exp(rng.uniform(-14, 3, (4, 1)))).astype(np.float32)
    wide[0, :32] = 0
    wide[0, 256:512] = 0
    wide[1, 32:64] *= 1e-6
    wide[3, 10], wide[3, 20] = -9.0, 9.0
    x = wide[:, :768]
    got, want = (codes.act_arrays(np.zeros(codes.act_arrays_bytes(4, 768), np.uint8), 4, 768) for _ in range(2))
    (activations.quantize_rows_avx2 if level == "avx2" else avx512.quantize_rows_avx512)(act, x, *got)
    activations.quantize_rows(act, np.ascontiguousarray(x), *want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_avx512_activation_blocks_keep_a_nan():
    """A NaN in a Q8_0/Q8_1 block makes its scale NaN (a block of NaNs does so on AVX2 too), so that a
    non-finite activation reaches the logits, where it is caught, rather than becoming zeros."""
    if "avx512" not in levels_to_test():
        pytest.skip(f"level avx512: above this CPU's or this run's ({isa.LEVEL})")
    x = np.ones((1, 96), np.float32)
    x[0, :32] = np.nan
    x[0, 40] = np.nan
    for act in (codes.ACT_Q8_0, codes.ACT_Q8_1):
        qs, d, s, sums = codes.act_arrays(np.zeros(codes.act_arrays_bytes(1, 96), np.uint8), 1, 96)
        avx512.quantize_rows_avx512(act, x, qs, d, s, sums)
        assert np.isnan(d[0, :2]).all() and d[0, 2] == np.float32(np.float16(1 / 127))


@pytest.mark.parametrize("dtype", REPACKED_TYPES, ids=str)
def test_avx512_products_equal_avx2_bit_for_bit(dtype):
    """The r16 kernels (AVX-512) compute every row's float steps as the r8 kernels (AVX2) do, in
    their order, on the same exact integer sums: the results are equal bit for bit, for decode
    steps, a 4-row tile and the rows left over, and a partial last group."""
    if "avx512" not in levels_to_test():
        pytest.skip(f"level avx512: above this CPU's or this run's ({isa.LEVEL})")
    code, act, k, m = codes.CODES[dtype], codes.ACT_OF[dtype], k_for(dtype), 37
    raw = weight_data(dtype, m, k, 0)
    packs = {"r8": layouts.repack_r8(code, raw), "r16": layouts.repack_r16(code, raw)}
    for n in (1, 6):
        x = np.random.default_rng(n).standard_normal((n, k)).astype(np.float32)
        outs = {}
        for name, fn in (("r8", avx2_r8.mul_mat_r8_avx2), ("r16", avx512.mul_mat_r16)):
            act_rows = codes.act_arrays(np.zeros(codes.act_arrays_bytes(n, k), np.uint8), n, k)
            outs[name] = np.full((n, m), np.nan, np.float32)
            fn((code,) * 3, act, (packs[name],) * 3, 1, x, *act_rows, (outs[name],) * 3)
        np.testing.assert_array_equal(outs["r16"].view(np.uint32), outs["r8"].view(np.uint32), err_msg=f"n={n}")


def test_float_weights_with_8_bit_activation_blocks_are_left_to_the_reference():
    """A float weight marked act_quant is no ggml pairing (their vec_dot types are float)."""
    lf = Leafs(CPUBackend())
    w = lf.weight("w", DType.F32, (4, 64), np.zeros((4, 64), np.float32))
    w.params["act_quant"] = "q8_0"
    assert matmul._plan(w, lf.input("x", DType.F32, np.zeros((2, 64), np.float32))) is None


def test_attention_products_are_left_to_others():
    """A batched f16 product (attention over the KV cache) is not this module's."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 8, 32)).astype(np.float16)
    q = rng.standard_normal((4, 3, 32)).astype(np.float32)
    lf = Leafs(CPUBackend())
    node = ops.mul_mat(lf.weight("k", DType.F16, k.shape, k), lf.input("q", DType.F32, q))
    assert matmul._plan(*node.srcs) is None


def computed_in_place(build):
    """Plan and compute the graph on the CPU, then compute it again (replaying the bound calls):
    the output node's planned array (a view of the arena, NaN before each run) and the bytes the
    replay allocated at its peak."""
    backend = CPUBackend()
    sched, sg, lf, out = planned(backend, build)
    for t, data in lf.feeds.items():
        sched.set_tensor(t, data)
    result = backend.array(out)
    assert result.base is not None  # a view of the arena
    result[...] = np.nan
    sched.compute(sg)  # compiles; the measured run below replays the bound calls
    result[...] = np.nan
    tracemalloc.start()
    sched.compute(sg)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return result, peak


@pytest.mark.parametrize("n_tokens", [1, 64])
def test_result_is_written_into_planned_memory(n_tokens):
    """The compiled call fills the node's planned array in place and allocates nothing of its size."""
    build = product(DType.Q4_K, 4096, 256, (n_tokens,), "llama")
    result, peak = computed_in_place(build)
    assert peak < result.nbytes // 4, peak
    assert np.all(np.isfinite(result))
    want = run_on(ReferenceBackend(), build)
    assert np.abs(result - want).max() <= 1e-4 * np.abs(want).max()

"""What only the CUDA backend promises beyond the shared op cases (tests/core/op_cases.py, run on every
backend, each GPU included, by test_backend_ops.py): the fusions that launch fewer kernels (RoPE of q
and k with the cache writes in one launch, and with the q/k/v products for one token; 8-bit activations
handed from one product's producer to the next), and a decode attention kernel that leaves its
counters ready for the next run. Every test runs on each GPU of the machine (CUDA0, CUDA1, ...).
Skipped where cupy or a GPU is missing."""
from __future__ import annotations

import numpy as np
import pytest

from tests.core.gpu import device_indices, require_gpu

cupy = require_gpu()

from ggrun.core import ops  # noqa: E402
from ggrun.core.backends.cuda import CUDABackend  # noqa: E402
from ggrun.core.backends.cuda.binding import Launch  # noqa: E402
from ggrun.core.backends.op_harness import ReferenceBackend, compare, nmse, planned, run_on, weight_data  # noqa: E402
from ggrun.core.dtypes import DType  # noqa: E402
from ggrun.core.ops import ROPE_NEOX, ROPE_NORMAL  # noqa: E402
from tests.core.op_cases import attention_case  # noqa: E402

F32, F16, I32 = DType.F32, DType.F16, DType.I32
NMSE_MUL_MAT = 5e-4
NMSE_GLU = 1e-3  # two products' 8-bit activation error, multiplied through the gate's activation
NMSE_LAYER = 2e-3  # a decode layer's chain: four products' 8-bit activations, through attention and the gate
NMSE_ELEMENTWISE = 1e-6
NMSE_ATTENTION = 5e-4
SEED = 7
rng = np.random.default_rng(SEED)


@pytest.fixture(scope="module", params=device_indices(), ids=lambda i: f"CUDA{i}")
def gpu(request):
    """Every GPU of the machine in turn: each runs the whole suite with its own device current, drawing the
    same inputs as the first (the shared generator starts again), so that a case's error is the same on each."""
    global rng
    rng = np.random.default_rng(SEED)
    return CUDABackend(request.param)


def values(*shape: int, scale: float = 1.0, gen: np.random.Generator | None = None) -> np.ndarray:
    """Random f32 values from the module's shared generator, or from `gen`."""
    return ((gen or rng).standard_normal(shape) * scale).astype(np.float32)


def check(gpu, build, threshold: float) -> float:
    """NMSE of the GPU against the reference below threshold, and every node ran a CUDA kernel."""
    err = compare(gpu, build)
    assert err < threshold, err
    _, sg, _, _ = planned(gpu, build)
    prepared = gpu.prepare(sg.splits[0].nodes)
    fallbacks = [s.name for s in prepared.steps if not s.capturable and "cuBLAS" not in s.name]
    assert not fallbacks, f"fell back to cupy array kernels: {fallbacks}"
    return err


# ---- weight products -------------------------------------------------------------------------


def rope_block(n_tokens: int, cache: DType, gemma: bool, n_dims: int = 64, products: bool = False):
    """An attention block's queries' RoPE, keys' RoPE into the cache and values' cache write (gemma3's:
    per-head norms, NeoX pairs, scaled queries), then attention over both caches; q, k and v are inputs, or
    with `products` one token row's three Q4_0 products. Returns (graph builder, the caches it fills)."""
    hq, hk, d, n_kv, n_embd = 4, 2, 64, 16, 128
    own = np.random.default_rng(n_tokens + 40 * products)  # its own numbers, whatever ran before it
    if products:
        x = values(n_tokens, n_embd, gen=own)
        w = {name: weight_data(DType.Q4_0, m, n_embd, seed=i)
             for i, (name, m) in enumerate([("wq", hq * d), ("wk", hk * d), ("wv", hk * d)])}
    else:
        qkv = values(n_tokens, hq, d, gen=own), values(n_tokens, hk, d, gen=own), values(n_tokens, hk * d, gen=own)
    qn, kn = values(d, gen=own), values(d, gen=own)
    idx = own.permutation(n_kv)[:n_tokens].astype(np.int32)
    pos = (np.arange(n_tokens) + 30).astype(np.int32)
    kc0, vc0 = (values(n_kv, hk * d, gen=own).astype(cache.np_dtype) for _ in range(2))
    mode = ROPE_NEOX if gemma else ROPE_NORMAL
    caches = {}

    def build(lf):
        p, ix = lf.input("pos", I32, pos), lf.input("idx", I32, idx)
        if products:
            ws = tuple(lf.weight(name, DType.Q4_0, (data.shape[0], n_embd), data) for name, data in w.items())
            q, k, v = ops.mul_mat_multi(ws, lf.input("x", F32, x), ("q", "k", "v"))
            q, k = ops.reshape(q, (n_tokens, hq, d)), ops.reshape(k, (n_tokens, hk, d))
        else:
            q, k, v = (lf.input(name, F32, data) for name, data in zip("qkv", qkv))
        norm = {n: lf.weight(n, F32, (d,), nw) if gemma else None for n, nw in (("qn", qn), ("kn", kn))}
        q = ops.rope(q, p, n_dims, mode, 10000.0, 1.0, out_scale=0.125 if gemma else 1.0, norm=norm["qn"], eps=1e-6)
        caches["k"], caches["v"] = lf.weight("kc", cache, (n_kv, hk * d), kc0), lf.weight("vc", cache, (n_kv, hk * d), vc0)
        k_all = ops.rope_set_rows(caches["k"], k, ix, p, n_dims, mode, 10000.0, 1.0, norm=norm["kn"], eps=1e-6)
        v_all = ops.set_rows(caches["v"], v, ix)
        keys, vals = (ops.permute(ops.view(c, (n_kv, hk, d)), (1, 0, 2)) for c in (k_all, v_all))
        mask = np.zeros((n_tokens, n_kv), dtype=np.float16)
        return ops.flash_attn(ops.permute(q, (1, 0, 2)), keys, vals, lf.input("mask", F16, mask), scale=d ** -0.5)
    return build, caches


def check_block(gpu, build, caches: dict, threshold: float) -> None:
    """The block's attention and both caches on the GPU against the reference."""
    def results(backend):
        sched, sg, leafs, out = planned(backend, build)
        for t, data in leafs.feeds.items():
            sched.set_tensor(t, data)
        sched.compute(sg)
        return [sched.get_tensor(x).astype(np.float64) for x in (out, caches["k"], caches["v"])]
    for got, want in zip(results(gpu), results(ReferenceBackend())):
        assert nmse(got, want) < threshold


@pytest.mark.parametrize("n_tokens", [1, 5])
@pytest.mark.parametrize("cache", [F16, F32])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma3"])
def test_rope_qkv_fused(gpu, gemma, cache, n_tokens):
    """The queries' RoPE, the keys' RoPE into the cache and the values' cache write run as one launch."""
    build, caches = rope_block(n_tokens, cache, gemma)
    check_block(gpu, build, caches, NMSE_ATTENTION)
    _, sg, _, _ = planned(gpu, build)
    steps = gpu.prepare(sg.splits[0].nodes).steps
    assert [s.name for s in steps] == ["rope_qkv", "rope_set_rows", "set_rows", "flash_attn"]
    assert len(_kernel_names(gpu, build)) == 2  # the fused kernel and the attention: the two stores launch nothing


@pytest.mark.parametrize("n_tokens", [1, 2])
@pytest.mark.parametrize("cache", [F16, F32])
@pytest.mark.parametrize("gemma,n_dims", [(False, 64), (False, 32), (True, 64)], ids=["llama", "llama-half", "gemma3"])
def test_qkv_products_rope_fused(gpu, gemma, n_dims, cache, n_tokens):
    """q, k and v products, then RoPE and the cache writes: for one token and llama's rotation (also of part
    of each head) one launch does all (mmvq_rope_qkv); gemma3's and two tokens keep the product and rope_qkv."""
    build, caches = rope_block(n_tokens, cache, gemma, n_dims, products=True)
    check_block(gpu, build, caches, NMSE_LAYER)
    names = _kernel_names(gpu, build)
    fused = not gemma and n_tokens == 1
    assert any("mmvq_rope_qkv" in n for n in names) == fused, names
    assert any("rope_qkv" in n and "mmvq" not in n for n in names) == (not fused), names


def test_attn_decode_runs_again(gpu):
    """The decode kernel elects its merging block with counters it must leave at zero: the same plan
    run again, eagerly, captured and replayed, gives the same result each time."""
    build = attention_case(F16, 1, 2048, 32, 8, 64, 300)(rng)
    want = run_on(ReferenceBackend(), build)
    sched, sg, leafs, out = planned(gpu, build)
    for t, data in leafs.feeds.items():
        sched.set_tensor(t, data)
    for _ in range(4):
        sched.compute(sg)
        assert nmse(sched.get_tensor(out), want) < NMSE_ATTENTION


def _kernel_names(gpu, build) -> list[str]:
    """The kernels the bound steps of build's graph launch, in order."""
    _, sg, _, _ = planned(gpu, build)
    names = []
    for step in gpu.prepare(sg.splits[0].nodes).steps:
        for launch in getattr(step.run, "items", [step.run]):
            if isinstance(launch, Launch):
                names.append(launch.kernel.name)
    return names


@pytest.mark.parametrize("n_tokens", [1, 3, 8, 9])
def test_q8_handoffs(gpu, n_tokens):
    """A decode layer's chain: residual add + norm -> q/k/v; attention -> output projection; norm ->
    gated product -> down. Where the producer writes the next product's 8-bit activations into its
    scratch, that product skips its own quantization launch, and the results do not change."""
    n_embd, hq, hk, d, n_kv, n_ff = 256, 4, 2, 64, 300, 512
    q4 = DType.Q4_0
    w = {name: weight_data(q4, m, k, seed=i) for i, (name, m, k) in enumerate(
        [("wq", hq * d, n_embd), ("wk", hk * d, n_embd), ("wo", n_embd, hq * d), ("gate", n_ff, n_embd),
         ("up", n_ff, n_embd), ("down", n_embd, n_ff)])}
    shapes = {"wq": (hq * d, n_embd), "wk": (hk * d, n_embd), "wo": (n_embd, hq * d), "gate": (n_ff, n_embd),
              "up": (n_ff, n_embd), "down": (n_embd, n_ff)}
    own = np.random.default_rng(100 + n_tokens)  # its own numbers, whatever ran before it
    xd, hd, nw = values(n_tokens, n_embd, gen=own), values(n_tokens, n_embd, gen=own), values(n_embd, gen=own)
    kd, vd = (values(n_kv, hk * d, gen=own).astype(np.float16) for _ in range(2))
    md = np.where(np.arange(n_kv)[None, :] > 200 + np.arange(n_tokens)[:, None], -np.inf, 0).astype(np.float16)

    def build(lf):
        ws = {name: lf.weight(name, q4, shapes[name], data) for name, data in w.items()}
        norm_w = lf.weight("norm", F32, (n_embd,), nw)
        both = ops.add_rms_norm(lf.input("x", F32, xd), lf.input("h", F32, hd), norm_w, 1e-5)
        normed = ops.view(both, (n_tokens, n_embd), offset=n_tokens * n_embd * 4)
        q, _ = ops.mul_mat_multi((ws["wq"], ws["wk"]), normed, ("q", "k"))
        qh = ops.permute(ops.reshape(q, (n_tokens, hq, d)), (1, 0, 2))
        k = ops.permute(ops.view(lf.weight("kc", F16, (n_kv, hk * d), kd), (n_kv, hk, d)), (1, 0, 2))
        v = ops.permute(ops.view(lf.weight("vc", F16, (n_kv, hk * d), vd), (n_kv, hk, d)), (1, 0, 2))
        att = ops.flash_attn(ops.cont(qh), k, v, lf.input("mask", F16, md), scale=d ** -0.5)
        o = ops.mul_mat(ws["wo"], ops.reshape(att, (n_tokens, hq * d)))
        ffn = ops.mul_mat(ws["down"], ops.mul_mat_glu(ws["gate"], ws["up"], normed, "swiglu"))
        return ops.add(o, ffn)
    check(gpu, build, NMSE_LAYER)
    if n_tokens <= 8:  # only the gated product, normed's second reader, quantizes for itself
        assert _kernel_names(gpu, build).count("quantize_q8_1") == 1, _kernel_names(gpu, build)

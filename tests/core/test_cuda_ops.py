"""The CUDA backend's kernels against the reference array kernels, op by op (the harness in
backend_ops.py, NMSE thresholds as llama.cpp's test-backend-ops): every weight type at decode and
prompt batch sizes, odd shapes and a matrix of more than 65,535 rows, every fused op, attention
with grouped heads, f16 and f32 caches and masked tails. Each case also checks that a CUDA kernel
ran rather than the cupy fallback. Every case runs on each GPU of the machine (CUDA0, CUDA1, ...).
Skipped where cupy or a GPU is missing."""
from __future__ import annotations

import numpy as np
import pytest

from tests.core.gpu import device_indices, require_gpu

cupy = require_gpu()

from ggrun.core import ops  # noqa: E402
from ggrun.core.backends.cuda import CUDABackend  # noqa: E402
from ggrun.core.backends.cuda.binding import Launch  # noqa: E402
from ggrun.core.dtypes import DType  # noqa: E402
from ggrun.core.ops import ROPE_NEOX, ROPE_NORMAL  # noqa: E402
from tests.core.backend_ops import ReferenceBackend, compare, nmse, planned, run_on  # noqa: E402
from tests.core.test_cpu_matmul import TYPES, weight_data  # noqa: E402

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


@pytest.mark.parametrize("n_tokens", [1, 2, 3, 7, 8, 9, 64])
@pytest.mark.parametrize("dtype", TYPES, ids=str)
def test_mul_mat(gpu, dtype, n_tokens):
    k = 512 if dtype.block_size == 256 else 96
    m = 67
    data = weight_data(dtype, m, k, seed=n_tokens)
    x = values(n_tokens, k)
    check(gpu, lambda lf: ops.mul_mat(lf.weight("w", dtype, (m, k), data), lf.input("x", F32, x)), NMSE_MUL_MAT)


@pytest.mark.parametrize("n_tokens", [1, 512])
def test_mul_mat_beyond_65535_rows(gpu, n_tokens):
    m, k = 70_001, 64
    data = weight_data(DType.Q4_0, m, k, seed=3)
    x = values(n_tokens, k)
    check(gpu, lambda lf: ops.mul_mat(lf.weight("w", DType.Q4_0, (m, k), data), lf.input("x", F32, x)),
          NMSE_MUL_MAT)


@pytest.mark.parametrize("dtype", TYPES, ids=str)
def test_get_rows(gpu, dtype):
    k = 512 if dtype.block_size == 256 else 96
    data = weight_data(dtype, 40, k, seed=1)
    ids = np.array([3, 0, 39, 3, 17], dtype=np.int32)
    check(gpu, lambda lf: ops.get_rows(lf.weight("e", dtype, (40, k), data), lf.input("ids", I32, ids)),
          NMSE_ELEMENTWISE)


@pytest.mark.parametrize("kv_dtype", [F16, F32])
def test_attention_products(gpu, kv_dtype):
    """Without the fused op: scores from a grouped-query cache view, then values."""
    kd = values(100, 2 * 16).astype(kv_dtype.np_dtype)
    qd = values(3, 4, 16)

    def build(lf):
        cache = lf.weight("k", kv_dtype, (100, 32), kd)
        k = ops.permute(ops.view(cache, (100, 2, 16)), (1, 0, 2))
        q = ops.permute(lf.input("q", F32, qd), (1, 0, 2))
        return ops.mul_mat(k, ops.cont(q))
    check(gpu, build, NMSE_MUL_MAT)


# ---- norms, elementwise ------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (33, 13), (512, 2048)])
def test_rms_norm_mul(gpu, shape):
    xd, wd = values(*shape), values(shape[-1])
    check(gpu, lambda lf: ops.rms_norm_mul(lf.input("x", F32, xd), lf.weight("w", F32, wd.shape, wd), 1e-6),
          NMSE_ELEMENTWISE)


def test_rms_norm_and_norm(gpu):
    xd = values(33, 577, scale=3.0)
    check(gpu, lambda lf: ops.rms_norm(lf.input("x", F32, xd), 1e-5), NMSE_ELEMENTWISE)
    check(gpu, lambda lf: ops.norm(lf.input("x", F32, xd), 1e-5), NMSE_ELEMENTWISE)


@pytest.mark.parametrize("post", [False, True])
def test_add_rms_norm(gpu, post):
    xd, hd, wd, pd = values(7, 640), values(7, 640), values(640), values(640)

    def build(lf):
        p = lf.weight("p", F32, (640,), pd) if post else None
        return ops.add_rms_norm(lf.input("x", F32, xd), lf.input("h", F32, hd), lf.weight("w", F32, (640,), wd),
                                1e-6, post=p)
    check(gpu, build, NMSE_ELEMENTWISE)


@pytest.mark.parametrize("op", ["add", "mul"])
@pytest.mark.parametrize("bshape", [(7, 64), (64,), (1, 64)])
def test_binary_broadcast(gpu, op, bshape):
    ad, bd = values(7, 64), values(*bshape)
    check(gpu, lambda lf: getattr(ops, op)(lf.input("a", F32, ad), lf.input("b", F32, bd)), NMSE_ELEMENTWISE)


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_gated(gpu, op):
    gd, ud = values(9, 130), values(9, 130)
    check(gpu, lambda lf: getattr(ops, op)(lf.input("g", F32, gd), lf.input("u", F32, ud)), 1e-5)


def test_unary_and_copies(gpu):
    ad = values(5, 3, 8)
    check(gpu, lambda lf: ops.scale(lf.input("a", F32, ad), 0.5), NMSE_ELEMENTWISE)
    check(gpu, lambda lf: ops.silu(lf.input("a", F32, ad)), NMSE_ELEMENTWISE)
    check(gpu, lambda lf: ops.cont(ops.permute(lf.input("a", F32, ad), (1, 0, 2))), 0.0 + 1e-12)
    check(gpu, lambda lf: ops.cast(ops.cast(lf.input("a", F32, ad), F16), F32), 1e-12)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_concat(gpu, axis):
    """The gather of a product split by rows, and concat along other axes: our copy kernels, no fallback."""
    shape = [5, 3, 8]
    ad = values(*shape)
    shape[axis] += 2
    bd = values(*shape)
    check(gpu, lambda lf: ops.concat(lf.input("a", F32, ad), lf.input("b", F32, bd), axis), 1e-12)


def test_soft_max_with_mask(gpu):
    ad = values(4, 7, 40)
    md = np.where(np.arange(40)[None, :] > np.arange(7)[:, None] + 30, -np.inf, 0).astype(np.float16)
    check(gpu, lambda lf: ops.soft_max(lf.input("a", F32, ad), lf.input("m", F16, md), scale=0.3), NMSE_ELEMENTWISE)


# ---- RoPE and the cache -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [ROPE_NORMAL, ROPE_NEOX])
@pytest.mark.parametrize("fused_norm", [False, True])
def test_rope(gpu, mode, fused_norm):
    ad, wd = values(7, 3, 64, scale=2.0), values(64)
    pos = np.array([0, 1, 5, 9, 100, 4000, 7], dtype=np.int32)

    def build(lf):
        norm = lf.weight("w", F32, (64,), wd) if fused_norm else None
        return ops.rope(lf.input("a", F32, ad), lf.input("pos", I32, pos), 64, mode, 10000.0, 1.0,
                        out_scale=0.125 if fused_norm else 1.0, norm=norm, eps=1e-6)
    check(gpu, build, 1e-6)


@pytest.mark.parametrize("cache", [F16, F32])
def test_rope_set_rows_and_set_rows(gpu, cache):
    ad, vd = values(3, 2, 32), values(3, 64)
    idx = np.array([5, 0, 9], dtype=np.int32)
    pos = np.array([11, 12, 13], dtype=np.int32)
    base = values(10, 64).astype(cache.np_dtype)

    def build_k(lf):
        dst = lf.weight("cache", cache, (10, 64), base)
        return ops.rope_set_rows(dst, lf.input("a", F32, ad), lf.input("idx", I32, idx), lf.input("pos", I32, pos),
                                 32, ROPE_NEOX, 10000.0)

    def build_v(lf):
        dst = lf.weight("cache", cache, (10, 64), base)
        return ops.set_rows(dst, lf.input("v", F32, vd), lf.input("idx", I32, idx))
    check(gpu, build_k, 1e-6)
    check(gpu, build_v, 1e-6)


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


def attention_case(kv_dtype, t: int, n_kv: int, hq: int, hk: int, d: int, seen: int | None = None):
    """A fused-attention graph builder: t query rows per head over n_kv cached keys, causal, and only
    the first `seen` cells visible (the rest of a padded cache) when given."""
    qd = values(hq, t, d)
    kd, vd = values(n_kv, hk * d).astype(kv_dtype.np_dtype), values(n_kv, hk * d).astype(kv_dtype.np_dtype)
    top = n_kv if seen is None else seen
    cells = np.arange(n_kv)[None, :]
    hidden = (cells > (top - t + np.arange(t))[:, None]) | (cells >= top)
    md = np.where(hidden, -np.inf, 0).astype(np.float16)

    def build(lf):
        k = ops.permute(ops.view(lf.weight("k", kv_dtype, (n_kv, hk * d), kd), (n_kv, hk, d)), (1, 0, 2))
        v = ops.permute(ops.view(lf.weight("v", kv_dtype, (n_kv, hk * d), vd), (n_kv, hk, d)), (1, 0, 2))
        return ops.flash_attn(lf.input("q", F32, qd), k, v, lf.input("mask", F16, md), scale=d ** -0.5)
    return build


@pytest.mark.parametrize("kv_dtype", [F16, F32])
@pytest.mark.parametrize("t,n_kv,hq,hk,d,seen", [(1, 33, 4, 2, 64, None), (1, 1000, 9, 3, 64, None),
                                                  (7, 256, 4, 1, 256, None), (64, 300, 8, 2, 128, None),
                                                  (3, 40, 2, 2, 16, None), (1, 4096, 32, 8, 64, 37),
                                                  (2, 8192, 8, 8, 128, 3000), (8, 512, 16, 4, 64, 200),
                                                  (130, 160, 16, 4, 64, None), (129, 200, 8, 2, 128, None),
                                                  (1, 300, 4, 1, 256, None), (2, 700, 4, 2, 128, 650)])
def test_flash_attn(gpu, kv_dtype, t, n_kv, hq, hk, d, seen):
    """Prompt rows (a warp per row; up to 520 rows a KV head) and decode rows (attn_decode, and
    attn_decode_rows for up to four rows a KV head: key chunks merged by the last block), with key
    chunks that no row sees."""
    check(gpu, attention_case(kv_dtype, t, n_kv, hq, hk, d, seen), NMSE_ATTENTION)


def test_attn_decode_runs_again(gpu):
    """The decode kernel elects its merging block with counters it must leave at zero: the same plan
    run again, eagerly, captured and replayed, gives the same result each time."""
    build = attention_case(F16, 1, 2048, 32, 8, 64, 300)
    want = run_on(ReferenceBackend(), build)
    sched, sg, leafs, out = planned(gpu, build)
    for t, data in leafs.feeds.items():
        sched.set_tensor(t, data)
    for _ in range(4):
        sched.compute(sg)
        assert nmse(sched.get_tensor(out), want) < NMSE_ATTENTION


@pytest.mark.parametrize("kinds", [((DType.Q4_0, 96), (DType.Q6_K, 32), (DType.F16, 40)),
                                   ((DType.Q4_0, 96), (DType.Q4_0, 32), (DType.Q4_0, 40)),
                                   ((DType.Q8_0, 64), (DType.Q8_0, 32), (DType.Q4_1, 32), (DType.Q4_1, 8))],
                         ids=["mixed", "one-type", "two-pairs"])
@pytest.mark.parametrize("n_tokens", [1, 7, 64])
def test_mul_mat_multi(gpu, n_tokens, kinds):
    """q, k and v (or gate and up) from one activation: weights of different types and heights, and
    runs of one type that a single product launch serves."""
    k = 256
    data = [weight_data(dt, m, k, seed=i) for i, (dt, m) in enumerate(kinds)]
    x = values(n_tokens, k)

    def build(lf):
        ws = tuple(lf.weight(f"w{i}", dt, (m, k), d) for i, ((dt, m), d) in enumerate(zip(kinds, data)))
        views = ops.mul_mat_multi(ws, lf.input("x", F32, x), tuple(f"p{i}" for i in range(len(ws))))
        flat = views[0].view_src  # every product, one after another
        return ops.add(flat, flat)
    check(gpu, build, NMSE_MUL_MAT)


@pytest.mark.parametrize("glu", ["swiglu", "geglu"])
@pytest.mark.parametrize("types", [(DType.Q4_0, DType.Q4_0), (DType.Q8_0, DType.Q8_0), (DType.Q6_K, DType.Q6_K),
                                   (DType.Q4_0, DType.Q8_0), (DType.MXFP4, DType.MXFP4), (DType.IQ4_XS, DType.IQ4_XS)],
                         ids=str)
@pytest.mark.parametrize("n_tokens", [1, 3, 8, 9, 64])
def test_mul_mat_glu(gpu, n_tokens, types, glu):
    """A gated feed-forward's first half: one fused product kernel for decode rows of one __dp4a type,
    else both products and the gated kernel."""
    m, k = 96, 256
    gd, ud = (weight_data(dt, m, k, seed=i) for i, dt in enumerate(types))
    x = values(n_tokens, k)

    def build(lf):
        gate, up = lf.weight("gate", types[0], (m, k), gd), lf.weight("up", types[1], (m, k), ud)
        return ops.mul_mat_glu(gate, up, lf.input("x", F32, x), glu)
    check(gpu, build, NMSE_GLU)


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

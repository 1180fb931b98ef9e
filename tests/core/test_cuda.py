"""The CUDA backend against the CPU: the same graphs give the same results, and the scheduler
splits a model between GPU and CPU with -ngl. Skipped where cupy or a GPU is missing."""
from __future__ import annotations

import numpy as np
import pytest

from tests.core.gpu import device_indices, require_gpu

cupy = require_gpu()

from ggrun.core.backends.cpu import CPUBackend  # noqa: E402
from ggrun.core.backends.cuda import CUDABackend  # noqa: E402
from ggrun.core.llm.batch import Batch  # noqa: E402
from ggrun.core.llm.model import Model  # noqa: E402
from ggrun.core.llm.session import Session, SessionParams  # noqa: E402
from ggrun.core.validate import validate_plan  # noqa: E402


@pytest.fixture(scope="module", params=device_indices(), ids=lambda i: f"CUDA{i}")
def gpu(request):
    """Every GPU of the machine in turn (its KV cache, uploads, graphs and fetches with its device current)."""
    return CUDABackend(request.param)


def _logits(path, backends, ngl, tokens):
    # f32 numerics on the CPU: its products then round nothing (llama.cpp's CPU roundings would add ~1e-3)
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
    # the prompt's products run as f16 GEMMs on the GPU (as ggml's CUDA backend): ~1e-3 of the logits
    np.testing.assert_allclose(first, ref_first, atol=3e-3, rtol=0)
    np.testing.assert_allclose(nxt, ref_next, atol=3e-3, rtol=0)
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


CONFIDENT = 0.1  # logit gap: a few times the rounding difference between the CPU's and GPU's products


def _greedy_agreement(path, gpu, n_tokens: int = 160) -> tuple[float, float]:
    """Shares of positions where the GPU's top token equals the CPU's (llama numerics): over all
    positions, and over those whose top two CPU logits differ by more than CONFIDENT (a random tiny
    model's logits lie close together, so rounding alone flips some of its near-ties)."""
    tokens = [int(t) for t in np.random.default_rng(5).integers(3, 250, n_tokens)]
    tops = []
    for backends, ngl in (([CPUBackend()], 0), ([gpu, CPUBackend()], 99)):
        m = Model.load(path, backends, ngl)
        s = Session(m, SessionParams(n_ctx=256, n_ubatch=16))
        prompt = Batch()
        for i, t in enumerate(tokens[:40]):  # a prompt batch with every position's logits
            prompt.add(t, i, 0, True)
        rows = [s.decode(prompt)]
        for i in range(40, n_tokens):  # decode steps: one token each, as generation runs
            rows.append(s.decode(Batch.of_sequence([tokens[i]], i)))
        tops.append(np.concatenate([r.reshape(-1, r.shape[-1]) for r in rows]))
    cpu, gpu_logits = tops
    same = cpu.argmax(axis=-1) == gpu_logits.argmax(axis=-1)
    top2 = np.sort(cpu, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > CONFIDENT
    return float(same.mean()), float(same[clear].mean())


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_quantized_model_agrees_with_cpu(tiny_llama_factory, tmp_path, gpu, arch):
    from gguf.constants import GGMLQuantizationType as QT

    from ggrun.loaders.synthetic import write_tiny_gemma3, write_tiny_llama

    write = write_tiny_llama if arch == "llama" else write_tiny_gemma3
    path = write(tmp_path / f"{arch}.gguf", weight_type=QT.Q4_0, n_embd=128, n_ff=256)
    everywhere, confident = _greedy_agreement(path, gpu)
    assert confident >= 0.98 and everywhere >= 0.9, (everywhere, confident)


def _steps(s: Session, script) -> list[np.ndarray]:
    out = []
    for kind, arg in script:
        if kind == "decode":
            out.append(s.decode(arg))
        elif kind == "seq_rm":
            s.seq_rm(*arg)
        elif kind == "seq_add":
            s.seq_add(*arg)
    return out


def _offloaded(path, graphs: bool, index: int = 0) -> tuple[CUDABackend, Session]:
    """A session of the model at path wholly on a fresh backend of GPU `index`, replaying CUDA graphs or not."""
    backend = CUDABackend(index)
    backend.use_graphs = graphs
    m = Model.load(path, [backend, CPUBackend()], 99, numerics="f32")
    return backend, Session(m, SessionParams(n_ctx=128, n_ubatch=32))


def test_cuda_graph_replay_and_invalidation(tiny_llama_factory, gpu, monkeypatch):
    """Decode steps replay a captured CUDA graph; a new batch shape, a removed sequence range and a
    K-shift invalidate it; every result equals the eager run's."""
    path = tiny_llama_factory(n_layer=2)
    script = [("decode", Batch.of_sequence(list(range(3, 20)), 0))]
    script += [("decode", Batch.of_sequence([20 + i], 17 + i)) for i in range(4)]
    script += [("decode", Batch.of_sequence([40, 41, 42], 21)), ("seq_rm", (0, 22, -1))]
    script += [("decode", Batch.of_sequence([50 + i], 22 + i)) for i in range(3)]
    script += [("seq_add", (0, 5, 25, -2)), ("decode", Batch.of_sequence([60], 23))]
    script += [("decode", Batch.of_sequence([61 + i], 24 + i)) for i in range(3)]
    results = {}
    for graphs in (False, True):
        backend, s = _offloaded(path, graphs, gpu.index)
        results[graphs] = _steps(s, script)
        if graphs:
            captured = [sp.calls for sp in s.result.sg.splits if sp.backend is backend]
            assert captured and all(p.graph is not None for p in captured), \
                [(p.runs, p.blocker) for p in captured]
    for eager, replayed in zip(results[False], results[True]):
        np.testing.assert_allclose(replayed, eager, rtol=0, atol=1e-5)


def test_prompt_graphs_with_cublas_products_are_captured_and_replayed(tiny_llama_factory, gpu):
    """A prompt micro-batch's products are cuBLAS GEMMs (blas.py): the same prompt decoded again reuses its graph,
    which is captured on its second run and replayed on the third, each time with the eager run's logits."""
    from ggrun.core.backends.cuda import blas
    assert blas.available()
    path = tiny_llama_factory(n_layer=2)
    prompt = Batch.of_sequence(list(range(3, 20)))
    results = {}
    for graphs in (False, True):
        backend, s = _offloaded(path, graphs, gpu.index)
        results[graphs] = []
        for _ in range(3):
            s.clear()
            results[graphs].append(s.decode(prompt).copy())
        calls = [sp.calls for sp in s.result.sg.splits if sp.backend is backend]
        assert any("cuBLAS" in step.name for c in calls for step in c.steps)
        assert all((c.graph is not None) == graphs and c.runs == 3 for c in calls), [(c.runs, c.blocker) for c in calls]
    for eager, replayed in zip(results[False], results[True]):
        np.testing.assert_array_equal(replayed, eager)


def test_split_inputs_are_copied_by_the_split_run(gpu):
    """A split's host inputs go up from its pinned region as part of its run (small ones by one kernel,
    large ones by copies): eagerly, then captured into the CUDA graph, then replayed, each run with new
    values; other destinations get a new region, and the graph that copied into the old ones is dropped
    and captured again."""
    import cupy

    from ggrun.core.backends.cuda.binding import Step
    from ggrun.core.backends.cuda.graphs import Prepared
    from ggrun.core.backends.cuda.uploads import GATHER_BYTES

    with gpu._dev, gpu.stream:
        dst, other, out = (cupy.zeros(64, dtype=cupy.float32) for _ in range(3))
        big = cupy.zeros(GATHER_BYTES // 4 + 1000, dtype=cupy.float32)
        prepared = Prepared([Step(lambda: cupy.multiply(dst, 2.0, out=out), True, "double")])
        graphs = []
        for i, where in enumerate([dst, dst, dst, dst, other, dst, dst]):
            host = np.full(64, i, dtype=np.float32)
            big_host = np.arange(big.size, dtype=np.float32) + i
            prepared.run(gpu.stream, True, [(host, where.data.ptr), (big_host, big.data.ptr)])
            gpu.stream.synchronize()
            assert float(where[0]) == i
            np.testing.assert_array_equal(cupy.asnumpy(big), big_host)
            if where is dst:
                np.testing.assert_array_equal(cupy.asnumpy(out), 2.0 * i)
            graphs.append(prepared.graph)
    assert graphs[0] is None and graphs[1] is graphs[2] is graphs[3] is not None  # eager, captured, replayed
    assert graphs[4] is not graphs[3] and graphs[5] is not graphs[4] and graphs[6] is graphs[5]


def test_a_region_waits_for_its_last_launch_unless_the_host_has_waited_for_the_stream_since(gpu):
    """fill waits on the event of the last launch reading the region, except when the count of the host's
    waits for the whole stream has moved past the one that launch was issued at; unknown counts wait."""
    from ggrun.core.backends.cuda.uploads import UploadRegion

    class Event:
        waited = 0

        def record(self, stream):
            pass

        def synchronize(self):
            self.waited += 1

    with gpu._dev:
        dst = cupy.zeros(4, dtype=cupy.float32)
    ups = [(np.arange(4, dtype=np.float32), dst.data.ptr)]
    region = UploadRegion(ups)
    region._read = event = Event()
    waited = []
    for issued_at, filled_at in [(3, 3), (3, 4), (3, None), (None, 9), (5, 5), (5, 6)]:
        region.issued(gpu.stream, issued_at)
        before = event.waited
        region.fill(ups, filled_at)
        waited.append(event.waited - before)
    assert waited == [1, 0, 1, 1, 1, 0]
    # the backend counts each of its waits for the stream
    n = gpu.waits
    with gpu._dev:
        t = cupy.ones(3, dtype=cupy.float32)
    gpu._wait()
    assert gpu.waits == n + 1
    with gpu._dev:  # t lives on gpu's device: its sum must run there
        assert float(t.sum()) == 3.0


@pytest.mark.parametrize("shape", [(1, 128256), (3, 1000), (7,)])
def test_checked_fetch_gives_the_values_and_finds_every_non_finite_one(gpu, shape):
    """get_checked (one kernel writing pinned memory and flags) returns exactly get_tensor's values,
    and says not finite for one NaN, +inf or -inf anywhere, the first and last element included; f16
    and views take the base class's way and answer the same."""
    from ggrun.core.context import ImmediateContext
    from ggrun.core.dtypes import DType

    t = ImmediateContext(gpu).new_tensor("logits", DType.F32, shape)
    x = gpu.array(t)
    n = int(np.prod(shape))
    values = np.random.default_rng(0).standard_normal(n).astype(np.float32).reshape(shape) * 30
    for at, bad in [(None, None), (0, np.nan), (n - 1, np.inf), (n // 2, -np.inf), (n // 3, np.nan)]:
        host = values.copy()
        if at is not None:
            host.reshape(-1)[at] = bad
        with gpu._dev:
            x.set(host)
            cupy.cuda.Device().synchronize()
        got, finite = gpu.get_checked(t)
        np.testing.assert_array_equal(got, host)
        assert got.shape == shape and finite is (at is None)
    h = ImmediateContext(gpu).new_tensor("half", DType.F16, (4,))
    with gpu._dev:
        gpu.array(h).set(np.array([1, 2, np.inf, 3], dtype=np.float16))
        cupy.cuda.Device().synchronize()
    got, finite = gpu.get_checked(h)
    assert got.dtype == np.float16 and not finite


def test_early_launches_give_the_plain_launches_results(tiny_llama_factory, gpu, monkeypatch):
    """Kernels started early (PDL: each waits for the one before, after prefetching what depends on no
    other kernel) give the same bits as kernels launched one after the other, eagerly and replayed."""
    from gguf.constants import GGMLQuantizationType as QT

    from ggrun.core.backends.cuda.binding import launches_of

    # Q4_0 products and a head dimension of 64: the decode products and attention prefetch
    path = tiny_llama_factory(n_layer=2, weight_type=QT.Q4_0, n_embd=128, n_head=2, n_head_kv=1, n_ff=256)
    script = [("decode", Batch.of_sequence(list(range(3, 20)), 0))]
    script += [("decode", Batch.of_sequence([20 + i], 17 + i)) for i in range(4)]
    results = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("GGRUN_CUDA_PDL", pdl)
        backend = CUDABackend(gpu.index)
        s = Session(Model.load(path, [backend, CPUBackend()], 99, numerics="f32"), SessionParams(n_ctx=128))
        results[pdl] = _steps(s, script)
        launches = [x for sp in s.result.sg.splits if sp.backend is backend for x in launches_of(sp.calls.steps)]
        early = [x for x in launches if x is not None and x.early]
        if pdl == "0" or int(cupy.cuda.Device(gpu.index).compute_capability) < 90:
            assert not early
        else:
            prologues = " ".join(x.kernel.name for x in early if x.prologue)
            assert "mmvq" in prologues and "attn_decode" in prologues, prologues
            assert all(int(x.args[-1]) == int(x.early) for x in launches if x is not None and x.prologue)
    for plain, early in zip(results["0"], results["1"]):
        np.testing.assert_array_equal(early, plain)


def test_plan_starts_a_prefetching_product_plainly_after_a_kernel_filling_the_gpu(monkeypatch):
    """launch.plan: every launch starts early, except one with a prologue after a launch whose blocks
    cover every multiprocessor (or after work that is not a launch) unless its prologue is light; a
    prologue's last argument says whether it runs."""
    from ggrun.core.backends.cuda import launch
    from ggrun.core.backends.cuda.binding import Launch, i32

    monkeypatch.setattr(launch, "_device", lambda device: (True, 132))
    monkeypatch.delenv("GGRUN_CUDA_PDL", raising=False)

    def mk(blocks: int, prologue: bool) -> Launch:
        return Launch(None, (blocks,), (128,), (i32(7), i32(0)) if prologue else (i32(7),), prologue=prologue)

    norm, qkv, glu, down, after_host, tail = mk(1, False), mk(768, True), mk(256, True), mk(512, True), \
        mk(4, True), mk(1, False)
    attn = mk(8, True)
    attn.light = True
    launch.plan([norm, qkv, attn, glu, down, None, after_host, tail])
    assert [x.early for x in (norm, qkv, attn, glu, down, after_host, tail)] == [True, True, True, True, False,
                                                                                False, True]
    assert [int(x.args[-1]) for x in (qkv, attn, glu, down, after_host)] == [1, 1, 1, 0, 0]
    assert norm.args == (7,) and tail.args == (7,)

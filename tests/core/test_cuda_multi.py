"""Two CUDA backends: on GPUs 0 and 1 where the machine has them, else both on GPU 0, each with its own
stream and staging memory (what a copy between GPUs must order is the same: another stream's kernels).
Copies between them, peer to peer and through pinned host memory, wait for the kernels that wrote the
source and hold back the source's later kernels; a model split over them (-sm layer, pipelined, and
-sm row) gives one GPU's logits, and so does one split over every GPU of a machine with more than two.
The staging ring reuses a region after its copy's event, never after a wait for the whole stream. A
failing call names its GPU. Skipped where cupy or a GPU is missing."""
from __future__ import annotations

import numpy as np
import pytest

from tests.core.gpu import require_gpu

cupy = require_gpu()

from ggrun.core.backends.cpu import CPUBackend  # noqa: E402
from ggrun.core.backends.cuda import CUDABackend  # noqa: E402
from ggrun.core.context import ImmediateContext  # noqa: E402
from ggrun.core.backends.cuda.backend import STAGING_BYTES  # noqa: E402
from ggrun.core.dtypes import DType  # noqa: E402
from ggrun.core.errors import DeviceFailure  # noqa: E402
from ggrun.core.llm.batch import Batch  # noqa: E402
from ggrun.core.llm.model import Model  # noqa: E402
from ggrun.core.llm.placement import DeviceSplit  # noqa: E402
from ggrun.core.llm.session import Session, SessionParams  # noqa: E402

N = 1 << 24  # floats: 64 MiB, so the kernels below take long enough for a missing wait to show


@pytest.fixture(scope="module")
def pair():
    a = CUDABackend(0)
    b = CUDABackend(1 if cupy.cuda.runtime.getDeviceCount() > 1 else 0)
    if b.index == a.index:
        b.name = "CUDA0b"  # a second backend on the one GPU, named apart for the scheduler
    return a, b


@pytest.mark.parametrize("peer", [True, False], ids=["peer", "staged"])
def test_a_copy_between_gpus_is_ordered_both_ways(pair, peer):
    """src is written by 20 kernels on a's stream, copied into dst on b's, then overwritten on a's stream
    at once: dst must hold the 20 additions, not an earlier or a later value."""
    a, b = pair
    if peer and b.index != a.index and not b.peer_access(a):
        pytest.skip("these GPUs have no peer access")
    b._peer[a.index] = peer  # on one GPU, memcpyPeerAsync between its two streams stands in for peer access
    src = ImmediateContext(a).new_tensor("src", DType.F32, (N,))
    dst = ImmediateContext(b).new_tensor("dst", DType.F32, (N,))
    x = a.array(src)
    with a._dev:
        x.fill(0)
        cupy.cuda.Device().synchronize()
        with a.stream:
            for _ in range(20):
                x += 1.0
    b.copy_tensor(src, dst)
    with a._dev, a.stream:
        x.fill(-1.0)
    a.stream.synchronize()
    b.stream.synchronize()
    got = b.get_tensor(dst)
    assert got.min() == got.max() == 20.0


def _logits(model, n_copies=None, steps=6):
    """Prompt logits in micro-batches of 8, then greedy steps; the session for its scheduler."""
    s = Session(model, SessionParams(n_ctx=256, n_batch=32, n_ubatch=8, n_copies=n_copies))
    out = [s.decode(Batch.of_sequence(list(range(3, 35))))[-1]]
    for i in range(steps):
        out.append(s.decode(Batch.of_sequence([int(out[-1].argmax())], 32 + i))[-1])
    return np.stack(out), s


@pytest.fixture(scope="module")
def one_gpu(tiny_llama_factory, pair):
    path = tiny_llama_factory(n_layer=4)
    return path, _logits(Model.load(path, [pair[0], CPUBackend()], 99, numerics="f32"))[0]


def test_layers_over_two_gpus_give_one_gpus_logits_with_pipelining(one_gpu, pair):
    path, ref = one_gpu
    model = Model.load(path, [*pair, CPUBackend()], 99, numerics="f32", split=DeviceSplit(tensor_split=(1, 1)))
    assert {b.name for b in model.placement.layers} == {pair[0].name, pair[1].name}
    got, s = _logits(model)
    assert s.sched.n_copies == 4 and len(set(s.sched.slots_used)) == 4
    assert s.sched.copy_counts["device->device"].n > 0
    np.testing.assert_allclose(got, ref, atol=1e-3, rtol=0)
    np.testing.assert_allclose(_logits(model, n_copies=1)[0], got, atol=1e-5, rtol=0)


def test_rows_over_two_gpus_give_one_gpus_logits(one_gpu, pair):
    path, ref = one_gpu
    model = Model.load(path, [*pair, CPUBackend()], 99, numerics="f32",
                       split=DeviceSplit(mode="row", tensor_split=(1, 1), main_gpu=1))
    got, s = _logits(model)
    assert s.sched.copy_counts["device->device"].n > 0
    np.testing.assert_allclose(got, ref, atol=1e-3, rtol=0)


def test_rows_over_two_gpus_with_the_gather_captured(one_gpu, pair):
    """-sm row's gathers (concat) are CUDA kernels: every split on a GPU is captured into a CUDA graph."""
    path, ref = one_gpu
    model = Model.load(path, [*pair, CPUBackend()], 99, numerics="f32",
                       split=DeviceSplit(mode="row", tensor_split=(1, 1)))
    got, s = _logits(model)
    np.testing.assert_allclose(got, ref, atol=1e-3, rtol=0)
    on_gpus = [sp for sp in s.result.sg.splits if sp.backend in pair]
    assert on_gpus and all(sp.calls.blocker is None and sp.calls.graph is not None for sp in on_gpus)


def test_layers_over_every_gpu_give_one_gpus_logits(one_gpu):
    """Three or more GPUs (0-3 on a machine of four): layers split evenly over all of them, pipelined."""
    n = cupy.cuda.runtime.getDeviceCount()
    if n < 3:
        pytest.skip(f"{n} GPU(s): the two-GPU tests cover this")
    path, ref = one_gpu
    gpus = [CUDABackend(i) for i in range(min(n, 4))]
    model = Model.load(path, [*gpus, CPUBackend()], 99, numerics="f32",
                       split=DeviceSplit(tensor_split=(1,) * len(gpus)))
    assert [b.name for b in model.placement.devices] == [g.name for g in gpus]
    got, _ = _logits(model)
    np.testing.assert_allclose(got, ref, atol=1e-3, rtol=0)


def test_the_staging_ring_reuses_a_region_after_its_copy_without_waiting_for_the_stream(pair):
    """Uploads through staging, three times the ring's size, each into memory of its own: every one lands
    whole, and the host never waited for the whole stream (each region waits for its own copy's event)."""
    _, b = pair
    n = STAGING_BYTES // 3 // 4
    ctx = ImmediateContext(b)
    dsts = [ctx.new_tensor(f"d{i}", DType.F32, (n,)) for i in range(9)]
    b.stream.synchronize()
    waits = b.waits
    for i, t in enumerate(dsts):
        b.set_tensor(t, np.full(n, i, np.float32))
    assert b.waits == waits
    for i, t in enumerate(dsts):
        got = b.get_tensor(t)
        assert got.min() == got.max() == i


def test_a_failing_call_names_its_gpu(pair):
    _, b = pair
    with pytest.raises(DeviceFailure, match=f"^{b.name} \\(.*\\) failed: OutOfMemoryError"):
        b.alloc_buffer(1 << 60, "compute")

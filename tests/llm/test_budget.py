"""Memory checked before it is taken (core.llm.budget through Session): a KV cache or compute buffers
larger than what the memory pool has free is one BadInput line, raised before the allocation."""
from __future__ import annotations

import pytest

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.host import HostArrayBackend, host_available_bytes
from ggrun.core.errors import BadInput
from ggrun.core.llm import session as session_module, session_caches
from ggrun.core.llm.budget import GiB, Budget
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams

MiB = 2**20


@pytest.fixture(scope="module")
def model(tiny_llama_path) -> Model:
    return Model.load(tiny_llama_path, [CPUBackend()])


def kv_row_bytes(model: Model) -> int:
    """K and V bytes of one cell over all layers (f16 cache)."""
    return 2 * model.hp.n_layer * model.hp.n_embd_kv * 2


def test_host_memory_is_known_here():
    free = host_available_bytes()
    assert free is not None and 0 < free < 1 << 50


def test_an_absurd_context_is_refused_before_the_cache_exists(model, monkeypatch):
    def no_cache(*args, **kwargs):
        raise AssertionError("the KV cache was allocated before the check")

    monkeypatch.setattr(session_caches, "KVCache", no_cache)
    n_ctx = 2**31
    with pytest.raises(BadInput) as info:
        Session(model, SessionParams(n_ctx=n_ctx))
    kv = n_ctx * kv_row_bytes(model) / GiB
    assert str(info.value).startswith(f"this session needs {kv + n_ctx * 9 / GiB:.2f} GiB on CPU "
                                      f"(KV cache {kv + n_ctx * 9 / GiB:.2f} GiB), ")
    assert str(info.value).endswith(" GiB free; lower -c or -ub")


def test_compute_buffers_are_checked_before_they_are_reserved(model, monkeypatch):
    """Free memory that holds the cache but not the compute buffers: refused before reserving them."""
    n_ctx = 4096
    cache = n_ctx * (kv_row_bytes(model) + 9)
    monkeypatch.setattr(HostArrayBackend, "free_memory", lambda self: cache + MiB)
    reserved = []
    monkeypatch.setattr(session_module.Scheduler, "reserve", lambda self, sg: reserved.append(sg))
    with pytest.raises(BadInput, match=r"^this session needs \d+\.\d\d GiB on CPU \(KV cache 0\.00 GiB, "
                                       r"compute buffers \d+\.\d\d GiB\), 0\.00 GiB free; lower -c or -ub$"):
        Session(model, SessionParams(n_ctx=n_ctx, n_batch=4096, n_ubatch=4096))
    assert reserved == []


def test_a_session_that_fits_is_made(model, monkeypatch):
    monkeypatch.setattr(HostArrayBackend, "free_memory", lambda self: 64 * MiB)
    s = Session(model, SessionParams(n_ctx=256, n_ubatch=64))
    assert s.kv_need == {"CPU": 256 * (kv_row_bytes(model) + 9)}
    assert sum(s.kv_bytes_by_backend().values()) == 256 * kv_row_bytes(model)


class _Device:
    """A backend stand-in with a memory pool of its own."""

    def __init__(self, name: str, pool: str, free: int | None) -> None:
        self.name, self.memory_pool, self._free = name, pool, free

    def free_memory(self) -> int | None:
        return self._free


def test_needs_are_summed_per_pool():
    cpu, sim, gpu = _Device("CPU", "CPU", 10 * GiB), _Device("SIM", "CPU", 10 * GiB), _Device("CUDA", "CUDA0", GiB)
    budget = Budget.now([gpu, sim, cpu])
    assert budget.free == {"CUDA0": GiB, "CPU": 10 * GiB}
    budget.check({"KV cache": {"CPU": 5 * GiB, "SIM": 4 * GiB, "CUDA": GiB // 2}})
    with pytest.raises(BadInput, match=r"^this session needs 11\.00 GiB on CPU \(KV cache 9\.00 GiB, compute "
                                       r"buffers 2\.00 GiB\), 10\.00 GiB free; lower -c or -ub$"):
        budget.check({"KV cache": {"CPU": 5 * GiB, "SIM": 4 * GiB}, "compute buffers": {"SIM": 2 * GiB}})
    with pytest.raises(BadInput, match=r"needs 1\.50 GiB on CUDA0 \(compute buffers 1\.50 GiB\), 1\.00 GiB free"):
        budget.check({"compute buffers": {"CUDA": 3 * GiB // 2}})
    Budget.now([_Device("X", "X", None)]).check({"KV cache": {"X": 1 << 60}})  # unknown free memory: no check


class _SmallDevice(HostArrayBackend):
    """A stand-in GPU with its own memory pool and little of it free."""

    name = "SMALLGPU"
    memory_pool = "SMALLGPU0"
    wrap = None

    def __init__(self, free: int) -> None:
        self.device = "stand-in device"
        self.free = free
        self.allocated = 0

    def free_memory(self) -> int:
        return self.free

    def alloc_buffer(self, size: int, usage: str):
        self.allocated += size
        return super().alloc_buffer(size, usage)


def test_device_weights_are_checked_before_they_are_copied(tiny_llama_path):
    small = _SmallDevice(free=1000)
    with pytest.raises(BadInput, match=r"needs .* GiB on SMALLGPU0 \(weights .*free; lower -ngl"):
        Model.load(tiny_llama_path, [small, CPUBackend()], n_gpu_layers=99)
    assert small.allocated == 0
    roomy = _SmallDevice(free=1 << 40)
    Model.load(tiny_llama_path, [roomy, CPUBackend()], n_gpu_layers=99)
    assert roomy.allocated > 0

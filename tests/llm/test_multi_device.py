"""Models over two stand-in devices (SIM0, SIM1: what two GPUs are to the engine): the same greedy tokens
and logits as CPU-only for the tiny llama and gemma3 with -sm layer and -sm row, weights and KV cache
where the placement puts them, copies between the devices counted, and pipeline slots taken in turn
by successive micro-batches with graph reuse on.

Models load with f32 numerics, so that llama.cpp's roundings, which only the CPU applies, stay out of the
comparison; SIM's reference kernels and the CPU's compiled ones still sum in other orders and the f16 KV
cache can round a value either way, so logits agree to test_offload's LOGITS_ATOL (measured: 3e-4).
"""
from __future__ import annotations

import numpy as np
import pytest

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.sim import SimBackend
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.model import Model
from ggrun.core.llm.placement import DeviceSplit
from ggrun.core.llm.session import Session, SessionParams
from ggrun.core.rowsplit import ROW_PARTS
from ggrun.core.validate import validate_plan
from tests.llm.test_offload import PROMPT, assert_same_run, greedy_run

ALL = 99
F32 = "f32"


def machine() -> list:
    return [SimBackend(name="SIM0"), SimBackend(name="SIM1"), CPUBackend()]


@pytest.fixture(scope="module")
def models(tiny_llama_factory, tiny_gemma3_factory) -> dict:
    """Each tiny model's path and its CPU-only greedy run."""
    out = {}
    for arch, path in (("llama", tiny_llama_factory(n_layer=4)), ("gemma3", tiny_gemma3_factory())):
        out[arch] = (path, greedy_run(Model.load(path, [CPUBackend()], numerics=F32), PROMPT, 4))
    return out


def where(t) -> str:
    return t.buffer.backend.name


# ---- -sm layer ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("ts", [(1, 1), (3, 1), (1, 3)])
def test_layer_split_gives_the_cpus_tokens(models, arch, ts):
    path, ref = models[arch]
    model = Model.load(path, machine(), ALL, numerics=F32, split=DeviceSplit(tensor_split=ts))
    p = model.placement
    assert (p.layers[0].name, p.output.name) == ("SIM0", "SIM1")  # the rules themselves: test_placement
    for name, t in model.weights.tensors.items():
        if name.startswith("blk."):
            assert where(t) == p.layers[int(name.split(".")[1])].name, name
    assert where(model.weights["output.weight"]) == "SIM1"
    run = greedy_run(model, PROMPT, 4)
    assert_same_run(run, ref)


def test_a_pipelined_prompt_looks_its_tokens_up_on_the_cpu(models):
    """With layers split (micro-batches pipelined) and the head tied to the embedding, a prompt's rows come
    from the CPU's table, not from the head's device, where the lookup would wait for the micro-batch
    before it; a one-token decode step still takes them from the head's device."""
    path, _ = models["gemma3"]  # a tied head
    model = Model.load(path, machine(), ALL, split=DeviceSplit(tensor_split=(1, 1)))
    s = Session(model, SessionParams(n_ctx=256, n_batch=16, n_ubatch=16))

    def lookup_backend() -> str:
        sg = s.result.sg
        return next(sg.backend_of[id(n)].name for n in sg.graph.nodes if n.name == "inp_embd")
    s.decode(Batch.of_sequence(PROMPT[:-1], 0))
    assert lookup_backend() == "CPU"
    s.decode(Batch.of_sequence(PROMPT[-1:], len(PROMPT) - 1))
    assert lookup_backend() == "SIM1"


def test_each_layers_kv_cache_lives_with_the_layer(models):
    path, _ = models["gemma3"]  # two caches: the sliding-window layers' and the global one's
    model = Model.load(path, machine(), ALL, split=DeviceSplit(tensor_split=(1, 1)))
    s = Session(model, SessionParams(n_ctx=256, n_batch=16, n_ubatch=16))
    seen = 0
    for cache in s.caches:
        for il, rows in cache.layers.items():
            assert where(rows.k) == where(rows.v) == model.placement.layers[il].name
            seen += 1
    assert seen == model.hp.n_layer
    assert set(s.kv_bytes_by_backend()) == {"SIM0", "SIM1"}


# ---- -sm row --------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("ts, main", [((1, 1), 0), ((3, 1), 1)])
def test_row_split_gives_the_cpus_tokens(models, arch, ts, main):
    path, ref = models[arch]
    model = Model.load(path, machine(), ALL, numerics=F32, split=DeviceSplit(mode="row", tensor_split=ts, main_gpu=main))
    main_name = f"SIM{main}"
    assert {b.name for b in model.placement.layers} == {main_name}
    for name, t in model.weights.tensors.items():
        parts = t.params.get(ROW_PARTS)
        if name.startswith("blk.") and len(t.shape) == 2 or name == "output.weight":
            ranges = model.placement.row_ranges(name, t.shape)
            assert parts is not None and t.buffer is None, name  # a handle: its rows live in the parts
            assert [(where(x), x.shape[0]) for x in parts] == [(d.name, hi - lo) for d, lo, hi in ranges]
        elif name != "token_embd.weight":
            assert parts is None and where(t) == main_name, name
    run = greedy_run(model, PROMPT, 4)
    assert_same_run(run, ref)
    s = Session(model, SessionParams(n_ctx=256, n_batch=16, n_ubatch=16))
    assert set(s.kv_bytes_by_backend()) == {main_name}
    s.decode(Batch.of_sequence(PROMPT, 0))
    sg = s.result.sg
    gather = next(n for n in sg.graph.nodes if n.name == "result_output")
    assert gather.op == "concat" and sg.backend_name(gather) == main_name


def test_row_split_parts_hold_the_matrix_rows(models):
    path, _ = models["llama"]
    whole = Model.load(path, [CPUBackend()])
    model = Model.load(path, machine(), ALL, split=DeviceSplit(mode="row", tensor_split=(1, 1)))
    handle = model.weights["blk.1.ffn_up.weight"]
    parts = [p.buffer.backend.get_tensor(p) for p in handle.params[ROW_PARTS]]
    np.testing.assert_array_equal(np.concatenate(parts), whole.backends[-1].get_tensor(whole.weights["blk.1.ffn_up.weight"]))


# ---- copies ---------------------------------------------------------------------------------------


def _one_step(model) -> Session:
    s = Session(model, SessionParams(n_ctx=256, n_batch=16, n_ubatch=16))
    s.decode(Batch.of_sequence(PROMPT, 0))
    for c in s.sched.copy_counts.values():
        c.n = c.nbytes = 0
    for b in model.backends[:-1]:
        b.reset_counters()
    s.decode(Batch.of_sequence([7], len(PROMPT)))
    return s


def test_layer_split_copies_the_stream_device_to_device(models):
    """One decode step, layers 0-2 on SIM0, layer 3 and the head on SIM1: SIM1 gets layer 2's stream and
    feed-forward output from SIM0 (two device-to-device copies of n_embd floats); SIM0 gets the embedding,
    positions, KV rows and mask from the host, SIM1 the same but the embedding; nothing goes back to the
    host as a copy (the session reads the logits)."""
    path, _ = models["llama"]
    model = Model.load(path, machine(), ALL, split=DeviceSplit(tensor_split=(1, 1)))
    s = _one_step(model)
    counts = {k: (c.n, c.nbytes) for k, c in s.sched.copy_counts.items()}
    n_embd = model.hp.n_embd
    assert counts["device->device"] == (2, 2 * n_embd * 4)
    assert counts["host->device"][0] == 7 and counts["device->host"] == (0, 0)
    sim0, sim1 = model.backends[:2]
    assert sim0.bytes_out == 2 * n_embd * 4  # what SIM1 took straight from SIM0's arena
    assert sim1.bytes_in == 2 * n_embd * 4 + counts["host->device"][1] - sim0.bytes_in


def test_row_split_copies_activations_out_and_partial_products_back(models):
    """Per layer, SIM1 reads four activations (attention's and the feed-forward's normed input, the merged
    heads, the gated product) and sends back its rows of six results: q, k and v (one product there), the
    attention output, the gated product (gate and up together there) and the down projection; the head adds
    one of each."""
    path, _ = models["llama"]
    model = Model.load(path, machine(), ALL, split=DeviceSplit(mode="row", tensor_split=(1, 1)))
    s = _one_step(model)
    assert s.sched.copy_counts["device->device"].n == 10 * model.hp.n_layer + 2


# ---- pipeline slots -------------------------------------------------------------------------------


def _pipelined(models, n_copies=None, ngl=ALL):
    path, _ = models["llama"]
    model = Model.load(path, machine(), ngl, split=DeviceSplit(tensor_split=(1, 1)))
    return Session(model, SessionParams(n_ctx=256, n_batch=2, n_ubatch=2, n_copies=n_copies))


def _pos_copy(s: Session, slot: int):
    """SIM0's copy of the positions input in pipeline slot `slot` of the kept graph."""
    sg = s.result.sg
    first = next(sp for sp in sg.splits if sp.backend.name == "SIM0")
    c = next(c for c in first.copies if c.srcs[0].name == "inp_pos")
    return first.backend.array(sg.slots[slot][id(c)])


def test_micro_batches_take_the_pipeline_slots_in_turn(models):
    s = _pipelined(models)
    assert s.sched.n_copies == 4  # llama.cpp's GGML_SCHED_MAX_COPIES
    logits = []
    for k in range(6):
        logits.append(s.decode(Batch.of_sequence(PROMPT[:2], 2 * k))[-1])
        slot = k % 4
        assert s.sched.slots_used[-1] == slot
        np.testing.assert_array_equal(_pos_copy(s, slot), [2 * k, 2 * k + 1])  # this micro-batch's copy
        if k >= 1:  # the previous micro-batch's slot still holds its own positions
            np.testing.assert_array_equal(_pos_copy(s, (k - 1) % 4), [2 * k - 2, 2 * k - 1])
    assert list(s.sched.slots_used) == [0, 1, 2, 3, 0, 1]
    assert s.stats.graphs_built == 1 and s.stats.graphs_reused == 5
    sg = s.result.sg
    for sp in sg.splits:  # each slot's calls were prepared once and kept
        if sp.copies:
            assert sp.calls is not None and sorted(sp.slot_calls) == [1, 2, 3]
    for plan in sg.plans.values():  # slots share no byte with each other or with anything else
        validate_plan(sg.order, plan.offsets, plan.sizes, plan.scratch)
    assert all(c.is_input and c.is_output for c in sg.persistent) and len(sg.persistent) == 4 * sg.n_copies
    one = _pipelined(models, n_copies=1)
    assert one.sched.n_copies == 1 and not one.result
    for k, want in enumerate(logits):
        got = one.decode(Batch.of_sequence(PROMPT[:2], 2 * k))[-1]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_slot_count_comes_from_the_environment_and_needs_everything_offloaded(models, monkeypatch):
    monkeypatch.setenv("GGRUN_SCHED_MAX_COPIES", "2")
    s = _pipelined(models)
    for k in range(3):
        s.decode(Batch.of_sequence(PROMPT[:2], 2 * k))
    assert list(s.sched.slots_used) == [0, 1, 0]
    assert _pipelined(models, ngl=4).sched.n_copies == 1  # the head on the CPU: no pipelining

"""-ngl offload onto the stand-in device `sim`: where weights and KV cache rows live, logits and
greedy tokens equal to a CPU-only run, and the splits and copied bytes the scheduler's rules
predict from the model's structure.

The prediction (`predict`) is derived here from the llama graph, not read from the scheduler:
- graph inputs (tokens, positions, KV row indices, KQ mask, output ids) live on the CPU; the
  token embedding stays on the CPU, so the embedding lookup is always the CPU's first node;
- the offloaded layers are the last N; the first of them begins with the node that adds the
  previous layer's feed-forward output to the residual stream and normalises the sum by its
  attn_norm weight (one node, on the device with its weight), so the stream and that output enter
  the device; the first layer's norm reads only the embedding. A micro-batch of more than
  FUSED_ADD_MAX_TOKENS tokens adds on the CPU (the add has no weight) and copies the sum;
- every device layer reads positions (rope), KV row indices (set_rows) and the mask (soft_max),
  copied once and shared; the last layer reads the output ids when fewer rows than tokens need
  logits;
- the head on the CPU (-ngl <= n_layer) gets the last layer's stream and feed-forward output back
  ([outputs, n_embd] each: output_norm's node, on the CPU with its weight, adds them);
  the head on the device (-ngl > n_layer) returns logits [outputs, n_vocab] through get_tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.sim import SimBackend
from ggrun.core.errors import GraphError
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.blocks import FUSED_ADD_MAX_TOKENS
from ggrun.core.llm.kv_cache import KV_PAD
from ggrun.core.llm.model import Model, Placement
from ggrun.core.llm.session import Session, SessionParams
from ggrun.core.sched import ScheduledGraph
from ggrun.core.validate import validate_plan

F32, I32, F16 = 4, 4, 2
PROMPT = [5, 17, 2, 44, 9, 120, 33]
N_CTX = 256


# ---- the prediction --------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What the prediction needs to know about a model and a micro-batch."""

    n_layer: int
    n_embd: int
    n_vocab: int
    n_tokens: int
    n_outputs: int
    n_kv: int


def n_kv_for(n_ctx: int, n_cells_used: int) -> int:
    """Cells attention reads: the used ones padded to KV_PAD, at most the context."""
    return min(n_ctx, max(KV_PAD, -(-n_cells_used // KV_PAD) * KV_PAD))


def predict(s: Shape, ngl: int, tied: bool = False) -> dict:
    """Splits as (backend, [copied sources]) with the bytes of each copy, and sim's byte counters
    over one compute (copies in and out, plus the logits read back when the head is on SIM). A tied
    head on SIM serves the embedding lookup: the token ids travel, and the CPU computes nothing."""
    off = min(ngl, s.n_layer)
    if off == 0:
        return dict(splits=[("CPU", [])], sim_in=0, sim_out=0)
    first = s.n_layer - off
    lookup_on_sim = tied and ngl > s.n_layer
    into_sim = ([("inp_tokens", s.n_tokens * I32)] if lookup_on_sim else _stream_into(s.n_tokens, first - 1, s.n_embd))
    into_sim += [("inp_pos", s.n_tokens * I32), ("inp_kv_idx", s.n_tokens * I32),
                 ("inp_kq_mask", s.n_tokens * s.n_kv * F16)]
    if s.n_outputs < s.n_tokens:
        into_sim.append(("inp_out_ids", s.n_outputs * I32))
    splits = [("SIM", into_sim)] if lookup_on_sim else [("CPU", []), ("SIM", into_sim)]
    if ngl > s.n_layer:
        out = s.n_outputs * s.n_vocab * F32  # logits, read back by the session
    else:
        back = _stream_into(s.n_outputs, s.n_layer - 1, s.n_embd)
        splits.append(("CPU", back))
        out = sum(b for _, b in back)
    return dict(splits=splits, sim_in=sum(b for _, b in into_sim), sim_out=out)


def _stream_into(rows: int, il: int, n_embd: int) -> list[tuple[str, int]]:
    """What the node after layer il reads from the other side: the embedding (before layer 0), else
    layer il's stream after attention and its feed-forward output, or their sum when a micro-batch
    this large adds them in a node of its own."""
    row_bytes = rows * n_embd * F32
    if il < 0:
        return [("inp_embd", row_bytes)]
    if rows > FUSED_ADD_MAX_TOKENS:
        return [(f"l_out-{il}", row_bytes)]
    return [(f"attn_residual-{il}", row_bytes), (f"ffn_out-{il}", row_bytes)]


def copied(sg: ScheduledGraph) -> list[tuple[str, list[tuple[str, int]]]]:
    """The scheduler's splits in the prediction's terms: the sources copied into each, by name."""
    return [(s.backend.name, sorted((c.srcs[0].name, c.nbytes) for c in s.copies)) for s in sg.splits]


def sorted_prediction(p: dict) -> list:
    return [(b, sorted(c)) for b, c in p["splits"]]


def check_plans(sg: ScheduledGraph) -> None:
    for plan in sg.plans.values():
        validate_plan(sg.order, plan.offsets, plan.sizes, plan.scratch)


# ---- running ------------------------------------------------------------------------------------


@dataclass
class Run:
    logits: list[np.ndarray]  # prompt's last-token logits, then one per decoded token
    tokens: list[int]
    prompt_splits: list
    step_splits: list
    step_sim: tuple[int, int]  # sim (bytes_in, bytes_out) over the first one-token decode
    step_sched_bytes: int  # the scheduler's own count of copied bytes for that step


def greedy_run(model: Model, prompt: list[int], n: int, n_ctx: int = N_CTX) -> Run:
    """Decode the prompt, then n greedy tokens one at a time, recording logits, splits and copies."""
    sim = next((b for b in model.backends if isinstance(b, SimBackend)), None)
    s = Session(model, SessionParams(n_ctx=n_ctx, n_batch=64, n_ubatch=64))
    logits = [s.decode(Batch.of_sequence(prompt, 0))[-1]]
    check_plans(s.result.sg)
    prompt_splits = copied(s.result.sg)
    tokens: list[int] = []
    step = None
    for i in range(n):
        tokens.append(int(np.argmax(logits[-1])))
        if sim is not None:
            sim.reset_counters()
        logits.append(s.decode(Batch.of_sequence([tokens[-1]], len(prompt) + i))[-1])
        if step is None:
            check_plans(s.result.sg)
            counters = (sim.bytes_in, sim.bytes_out) if sim is not None else (0, 0)
            step = (copied(s.result.sg), counters, s.result.sg.copy_bytes)
    return Run(logits, tokens, prompt_splits, *step)


def placement_of(model: Model) -> dict[str, str]:
    return {name: t.buffer.backend.name for name, t in model.weights.tensors.items()}


# SIM runs the reference kernels, the CPU its compiled ones: they agree to f32 rounding, except where
# llama.cpp's roundings apply on the CPU alone: a key or value stored in the f16 cache can round to the
# neighbouring f16, and the CPU sums attention's values in f16 as ggml does (the reference in f32);
# measured up to 1.5e-3 in the tiny model's logits.
LOGITS_ATOL = 3e-3


def assert_same_run(got: Run, ref: Run, atol: float = LOGITS_ATOL) -> None:
    assert got.tokens == ref.tokens
    assert len(got.logits) == len(ref.logits)
    for a, b in zip(got.logits, ref.logits):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)


def assert_predicted(run: Run, shape_prompt: Shape, shape_step: Shape, ngl: int, tied: bool = False) -> None:
    p_prompt, p_step = predict(shape_prompt, ngl, tied), predict(shape_step, ngl, tied)
    assert run.prompt_splits == sorted_prediction(p_prompt)
    assert run.step_splits == sorted_prediction(p_step)
    assert run.step_sim == (p_step["sim_in"], p_step["sim_out"])
    assert run.step_sched_bytes == sum(b for _, c in p_step["splits"] for _, b in c)


# ---- the synthetic model ----------------------------------------------------------------------

N_LAYER = 3


@pytest.fixture(scope="module")
def tiny(tiny_llama_factory):
    return tiny_llama_factory(n_layer=N_LAYER)


@pytest.fixture(scope="module")
def tiny_ref(tiny) -> Run:
    return greedy_run(Model.load(tiny, [CPUBackend()]), PROMPT, 4)


def tiny_shapes(model: Model) -> tuple[Shape, Shape]:
    hp = model.hp
    prompt = Shape(hp.n_layer, hp.n_embd, hp.n_vocab, len(PROMPT), 1, n_kv_for(N_CTX, len(PROMPT)))
    step = Shape(hp.n_layer, hp.n_embd, hp.n_vocab, 1, 1, n_kv_for(N_CTX, len(PROMPT) + 1))
    return prompt, step


@pytest.mark.parametrize("ngl", [0, 1, 2, N_LAYER, N_LAYER + 1, 99])
def test_tiny_offload_places_weights_and_cache_by_layer(tiny, ngl):
    model = Model.load(tiny, [SimBackend(), CPUBackend()], ngl)
    on_sim = {il for il in range(N_LAYER) if il >= N_LAYER - ngl}
    head = "SIM" if ngl > N_LAYER else "CPU"
    expected = {}
    for name in model.weights.tensors:
        if name.startswith("blk."):
            expected[name] = "SIM" if int(name.split(".")[1]) in on_sim else "CPU"
        else:
            expected[name] = "CPU" if name == "token_embd.weight" else head
    assert placement_of(model) == expected
    s = Session(model, SessionParams(n_ctx=N_CTX, n_batch=64, n_ubatch=64))
    for il, rows in s.kv.layers.items():
        want = "SIM" if il in on_sim else "CPU"
        assert rows.k.buffer.backend.name == rows.v.buffer.backend.name == want
    row_bytes = N_CTX * model.hp.n_embd_kv * 2 * 2  # K and V, f16
    assert s.kv.bytes_by_backend().get("SIM", 0) == len(on_sim) * row_bytes


@pytest.mark.parametrize("ngl", [0, 1, 2, N_LAYER, N_LAYER + 1])
def test_tiny_offload_equals_cpu_and_copies_what_the_rules_predict(tiny, tiny_ref, ngl):
    model = Model.load(tiny, [SimBackend(), CPUBackend()], ngl)
    run = greedy_run(model, PROMPT, 4)
    assert_same_run(run, tiny_ref)
    assert_predicted(run, *tiny_shapes(model), ngl)


def test_tiny_offload_with_a_tied_head(tiny_llama_factory):
    """A tied head on the device gets its own copy of the embedding, which serves the lookup there too:
    the token ids are copied in place of the embedded rows, and no split is left on the CPU."""
    path = tiny_llama_factory(n_layer=N_LAYER, tied_output=True)
    ref = greedy_run(Model.load(path, [CPUBackend()]), PROMPT, 3)
    model = Model.load(path, [SimBackend(), CPUBackend()], N_LAYER + 1)
    emb, head = model.weights["token_embd.weight"], model.weights["output.weight"]
    assert (emb.buffer.backend.name, head.buffer.backend.name) == ("CPU", "SIM")
    np.testing.assert_array_equal(model.backends[0].get_tensor(head), model.backends[1].get_tensor(emb))
    run = greedy_run(model, PROMPT, 3)
    assert_same_run(run, ref)
    assert_predicted(run, *tiny_shapes(model), N_LAYER + 1, tied=True)


def test_tiny_all_logits_prompt_needs_no_output_ids(tiny):
    """With logits for every prompt token there is no out_ids input, so nothing of it is copied."""
    ref_s = Session(Model.load(tiny, [CPUBackend()]), SessionParams(n_ctx=N_CTX, n_batch=64, n_ubatch=64))
    model = Model.load(tiny, [SimBackend(), CPUBackend()], 2)
    s = Session(model, SessionParams(n_ctx=N_CTX, n_batch=64, n_ubatch=64))
    batch = Batch()
    for i, t in enumerate(PROMPT):
        batch.add(t, i, 0, logits=True)
    np.testing.assert_allclose(s.decode(batch), ref_s.decode(batch), rtol=0, atol=LOGITS_ATOL)
    hp = model.hp
    shape = Shape(hp.n_layer, hp.n_embd, hp.n_vocab, len(PROMPT), len(PROMPT), n_kv_for(N_CTX, len(PROMPT)))
    assert copied(s.result.sg) == sorted_prediction(predict(shape, 2))


@pytest.mark.parametrize("refused", ["rope", "soft_max"])
def test_tiny_refused_op_runs_on_the_cpu_between_copies(tiny, tiny_ref, refused):
    """All layers on SIM, which refuses rope (one per layer: the queries; the keys' RoPE is part of
    the cache write) or soft_max (one per layer): each such node is a CPU split of its own, reading a
    copy of its device input (its other input, positions or mask, is already on the CPU), and its
    result is copied back."""
    model = Model.load(tiny, [SimBackend(refuse=frozenset({refused})), CPUBackend()], N_LAYER + 1)
    s = Session(model, SessionParams(n_ctx=N_CTX, n_batch=64, n_ubatch=64, flash_attn=False))  # soft_max exists
    logits = [s.decode(Batch.of_sequence(PROMPT, 0))[-1]]
    sg = s.result.sg
    check_plans(sg)
    hp, n = model.hp, len(PROMPT)
    assert len(sg.splits) == 2 + 2 * N_LAYER
    refused_nodes = [x for x in sg.graph.nodes if x.op == refused]
    assert len(refused_nodes) == N_LAYER
    assert all(sg.backend_of[id(x)].name == "CPU" for x in refused_nodes)
    cpu_splits = [sp for sp in sg.splits[1:] if sp.backend.name == "CPU"]
    assert [sp.nodes for sp in cpu_splits] == [[x] for x in refused_nodes]
    if refused == "rope":  # q rows [tokens, n_head, head_dim]
        sizes = [n * hp.n_head * hp.head_dim * F32] * N_LAYER
    else:  # kq [n_head, tokens, n_kv]
        sizes = [hp.n_head * n * n_kv_for(N_CTX, n) * F32] * N_LAYER
    assert sorted(c.nbytes for sp in cpu_splits for c in sp.copies) == sizes
    # every refused node's result goes back to SIM: one copy each, of the same size as its input
    back = [c for sp in sg.splits if sp.backend.name == "SIM" for c in sp.copies
            if c.srcs[0].root in refused_nodes]
    assert sorted(c.nbytes for c in back) == sizes
    # the other inputs of the refused op are not copied to the CPU
    assert not any(c.srcs[0].is_input for sp in cpu_splits for c in sp.copies)
    for i in range(3):
        logits.append(s.decode(Batch.of_sequence([int(np.argmax(logits[-1]))], n + i))[-1])
    assert [int(np.argmax(x)) for x in logits[:-1]] == tiny_ref.tokens[:3]
    for a, b in zip(logits, tiny_ref.logits):  # the reference run attends with the fused op
        np.testing.assert_allclose(a, b, rtol=0, atol=LOGITS_ATOL)


def test_tiny_refused_cache_write_is_a_clear_error(tiny):
    """The KV cache of an offloaded layer lives on SIM; if SIM cannot write its rows, no other backend
    can (it could only write into a copy): the session refuses to start."""
    model = Model.load(tiny, [SimBackend(refuse=frozenset({"set_rows"})), CPUBackend()], 1)
    with pytest.raises(GraphError, match="SIM cannot run set_rows"):
        Session(model, SessionParams(n_ctx=N_CTX, n_batch=64, n_ubatch=64))


def test_tiny_offload_survives_a_k_shift_and_sequence_edits(tiny):
    """seq_rm, seq_add (re-rotating cached keys on the layer's backend) and seq_cp with layers on SIM."""
    def run(backends, ngl):
        s = Session(Model.load(tiny, backends, ngl),
                    SessionParams(n_ctx=N_CTX, n_batch=64, n_ubatch=64, n_seq_max=2))
        out = [s.decode(Batch.of_sequence(PROMPT, 0))]
        s.seq_rm(0, 1, 3)
        s.seq_add(0, 3, -1, -2)
        out.append(s.decode(Batch.of_sequence([7], len(PROMPT) - 2)))
        s.seq_cp(0, 1)
        out.append(s.decode(Batch.of_sequence([9, 10], len(PROMPT) - 1, seq=1)))
        return out

    ref = run([CPUBackend()], 0)
    for got, want in zip(run([SimBackend(), CPUBackend()], 2), ref):
        np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_ATOL)


# ---- SmolLM2 ------------------------------------------------------------------------------------

SMOL_STEPS = 3
SMOL_PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smol(smollm2_path):
    """Runs of SmolLM2: CPU-only, and with [SIM, CPU] at -ngl 0, 15 and n_layer + 1. -ngl 0 places
    nothing on SIM, so it reuses the CPU model's weights under the placement Model.load would give it;
    the other two are loaded once each, one at a time.

    In f32 numerics: SIM runs the reference kernels and the CPU its compiled ones, which agree to f32
    rounding; llama.cpp's 8-bit activation rounding would magnify that into logit differences of
    ~1e-2 (up to ~0.7 without fused attention), differences of kernels rather than of placement."""
    smollm2 = Model.load(smollm2_path, [CPUBackend()], numerics="f32")
    prompt = smollm2.tokenizer.tokenize(SMOL_PROMPT, add_special=True, parse_special=False)
    cpu = smollm2.backends[-1]
    placements: dict[int, dict[str, str]] = {}
    # one BLAS thread: on a busy 2-core machine several times faster than BLAS's own threads
    with threadpool_limits(limits=1, user_api="blas"):
        runs = {"cpu": greedy_run(smollm2, prompt, SMOL_STEPS)}
        runs.update(_smol_offloaded(smollm2, smollm2_path, prompt, cpu, placements))
    return dict(runs=runs, placements=placements, prompt=prompt, hp=smollm2.hp)


def _smol_offloaded(smollm2, path, prompt, cpu, placements: dict) -> dict:
    """Runs at each -ngl (filling `placements`), one model in memory at a time."""
    runs = {}
    n_layer = smollm2.hp.n_layer
    for ngl in (0, n_layer // 2, n_layer + 1):
        if ngl == 0:
            backends = [SimBackend(), cpu]
            placement = Placement.for_layers(n_layer, backends, 0)
            assert set(placement.layers) | {placement.input, placement.output} == {cpu}
            model = Model(smollm2.gguf, smollm2.hp, smollm2.arch, smollm2.tokenizer, smollm2.weights, placement,
                          backends, smollm2.contexts, 0.0, numerics="f32")
        else:
            model = Model.load(path, [SimBackend(), CPUBackend()], ngl, numerics="f32")
        placements[ngl] = placement_of(model)
        runs[ngl] = greedy_run(model, prompt, SMOL_STEPS)
        del model
    return runs


@pytest.mark.slow
def test_smollm2_offload_equals_cpu(smol):
    ref = smol["runs"]["cpu"]
    assert len(ref.tokens) == SMOL_STEPS
    for ngl, run in smol["runs"].items():
        if ngl != "cpu":
            assert_same_run(run, ref, SMOL_LOGITS_ATOL)


# SmolLM2's 30 layers carry such f16-cache rounding flips further (measured 1.1e-3 in logits of ~10).
SMOL_LOGITS_ATOL = 5e-3


@pytest.mark.slow
def test_smollm2_offload_places_the_last_layers(smol):
    n_layer = smol["hp"].n_layer
    for ngl, where in smol["placements"].items():
        sim_layers = {int(k.split(".")[1]) for k, v in where.items() if k.startswith("blk.") and v == "SIM"}
        assert sim_layers == set(range(n_layer - min(ngl, n_layer), n_layer))
        assert where["token_embd.weight"] == "CPU"
        head = "SIM" if ngl > n_layer else "CPU"
        assert where["output.weight"] == where["output_norm.weight"] == head


@pytest.mark.slow
def test_smollm2_offload_copies_what_the_rules_predict(smol):
    hp, n = smol["hp"], len(smol["prompt"])
    prompt = Shape(hp.n_layer, hp.n_embd, hp.n_vocab, n, 1, n_kv_for(N_CTX, n))
    step = Shape(hp.n_layer, hp.n_embd, hp.n_vocab, 1, 1, n_kv_for(N_CTX, n + 1))
    for ngl, run in smol["runs"].items():
        if ngl != "cpu":
            assert_predicted(run, prompt, step, ngl, tied=True)
    # the figures of one decoded token at -ngl 15 / n_layer + 1, written out for SmolLM2 (n_embd 576,
    # n_vocab 49152, 256 cells, a tied head): stream and feed-forward output 2304 B each, positions 4,
    # rows 4, mask 512; fully offloaded, the token id (4) in place of the embedded row
    mid, full = smol["runs"][hp.n_layer // 2], smol["runs"][hp.n_layer + 1]
    assert (len(mid.step_splits), sum(len(c) for _, c in mid.step_splits), mid.step_sched_bytes) == (3, 7, 9736)
    assert mid.step_sim == (5128, 4608)
    assert (len(full.step_splits), sum(len(c) for _, c in full.step_splits), full.step_sched_bytes) == (1, 4, 524)
    assert full.step_sim == (524, 196608)

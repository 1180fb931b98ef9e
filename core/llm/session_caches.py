"""A session's KV caches: made to fit the memory free (the one cache, or for a model with sliding-window
layers a second one sized to the window), the bytes they take, and the K-shift that re-rotates their keys
after positions moved (seq_add). Nothing here decodes; the session walks the caches every step."""
from __future__ import annotations

from ggrun.core.graph import Graph
from ggrun.core.llm.blocks import build_k_shift
from ggrun.core.llm.budget import Budget
from ggrun.core.llm.inputs import InpKShift
from ggrun.core.llm.kv_cache import (build_k_shift_blocks, cell_record_bytes, check_cache_types, KV_PAD, KVCache,
                                     planned_bytes)
from ggrun.core.llm.model import Model
from ggrun.core.llm.session_params import SessionParams
from ggrun.core.sched import Scheduler


def make_caches(model: Model, p: SessionParams, n_ubatch: int, virtual: bool, budget: Budget | None,
                cpu_name: str) -> tuple[KVCache, KVCache | None, dict[str, int]]:
    """The KV cache, and for an architecture with sliding-window layers (gemma3) a second one for
    those layers sized to the window (llama.cpp's iSWA: n_swa * n_seq + n_ubatch cells, padded),
    so their memory and attention work stop growing with the context; with the bytes per backend they
    take, checked against `budget` before anything is allocated (-c can ask for terabytes)."""
    swa = model.arch.swa_layers(model.hp)
    window = model.hp.extra.get("swa_window")
    check_cache_types(p.type_k, p.type_v, model.hp.head_dim, p.flash_attn)
    kw = dict(n_seq_max=p.n_seq_max, type_k=p.type_k, type_v=p.type_v, head_dim=model.hp.head_dim,
              virtual=virtual, llama_numerics=model.numerics == "llama")
    layers = model.placement.layers
    if not any(swa):
        specs = [dict(n_ctx=p.n_ctx, n_embd_kv=model.hp.n_embd_kv, layer_backends=layers, **kw)]
    else:
        n_swa = min(p.n_ctx, -(-(window * p.n_seq_max + n_ubatch) // KV_PAD) * KV_PAD)
        specs = [dict(n_ctx=p.n_ctx, n_embd_kv=model.hp.n_embd_kv,
                      layer_backends=[None if w else b for w, b in zip(swa, layers)], **kw),
                 dict(n_ctx=n_swa, n_embd_kv=model.hp.n_embd_kv,
                      layer_backends=[b if w else None for w, b in zip(swa, layers)], **kw,
                      window=window, name="cache_swa")]
    need: dict[str, int] = {}
    if budget is not None:
        need = kv_need(specs, cpu_name)
        budget.check({"KV cache": need})
    caches = [KVCache(**spec) for spec in specs]
    return caches[0], caches[1] if len(caches) > 1 else None, need


def kv_need(specs: list[dict], cpu_name: str) -> dict[str, int]:
    """Bytes per backend the caches of `specs` will take: K and V rows, and the cell records on the host."""
    need: dict[str, int] = {}
    for spec in specs:
        for name, n in planned_bytes(**spec).items():
            need[name] = need.get(name, 0) + n
        need[cpu_name] = need.get(cpu_name, 0) + spec["n_ctx"] * cell_record_bytes(spec["n_seq_max"])
    return need


def kv_bytes_by_backend(caches: tuple[KVCache, ...]) -> dict[str, int]:
    """Bytes of K and V rows the caches hold on each backend."""
    out: dict[str, int] = {}
    for cache in caches:
        for name, n in cache.bytes_by_backend().items():
            out[name] = out.get(name, 0) + n
    return out


def k_shift_graph(model: Model, cache: KVCache) -> tuple[Graph, InpKShift]:
    """The graph that re-rotates a cache's keys by their cells' shifts, and its shift input."""
    arch, hp = model.arch, model.hp
    build = build_k_shift_blocks if cache.type_k.is_quantized else build_k_shift
    return build(hp, cache, arch.rope_mode, lambda il: arch.rope_freq_base(hp, il),
                 arch.rope_factors(model.weights, hp, cache.n_ctx))


def apply_k_shift(model: Model, sched: Scheduler, cache: KVCache) -> None:
    """Re-rotate cached keys whose positions moved (seq_add), then clear the shift. A kept decode graph
    stays: seq_add bumped the cache's version, so it is rebuilt (and says why)."""
    graph, inp = k_shift_graph(model, cache)
    sg = sched.schedule(graph)
    sched.alloc(sg)
    sched.cpu.array(inp.tensor)[...] = cache.shift
    sched.compute(sg)
    cache.shift[:] = 0
    cache.has_shift = False

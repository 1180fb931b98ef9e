"""Benchmark of the graph allocator on a transformer-like graph of about 1,000 nodes built with
the real ops: planning time per node, and the planned size against the lower bound (the
largest total of bytes live at one step) and against giving every tensor its own memory.

Nothing is allocated or computed: weights are tensors without memory, so any size runs in
seconds. Usage: python scripts/bench/bench_alloc.py [--layers 35] [--tokens 512] [--reps 20]
"""
from __future__ import annotations

import argparse
import statistics
import time

from ggrun.core import ops
from ggrun.core.alloc import plan_graph
from ggrun.core.dtypes import DType
from ggrun.core.graph import Graph, build_graph
from ggrun.core.tensor import Tensor, new_tensor
from ggrun.core.validate import validate_plan

ALIGNMENT = 64  # the CPU backend's


def build_transformer(n_layer: int, n_tokens: int, n_embd: int = 2048, n_head: int = 32, n_head_kv: int = 8,
                      n_ff: int = 5632, n_vocab: int = 32000) -> Graph:
    """A llama-like forward pass over n_tokens tokens (attention over the batch itself)."""
    head_dim = n_embd // n_head
    kv_dim = head_dim * n_head_kv

    def weight(name: str, *shape: int) -> Tensor:
        return new_tensor(name, DType.F16, shape, is_weight=True)

    tokens = new_tensor("tokens", DType.I32, (n_tokens,), is_input=True)
    pos = new_tensor("pos", DType.I32, (n_tokens,), is_input=True)
    mask = new_tensor("kq_mask", DType.F32, (n_tokens + 31 & ~31, n_tokens), is_input=True)

    x = ops.get_rows(weight("tok_embd", n_vocab, n_embd), tokens)
    for il in range(n_layer):
        cur = ops.mul(ops.rms_norm(x, 1e-5), weight(f"blk.{il}.attn_norm", n_embd))
        q = ops.mul_mat(weight(f"blk.{il}.attn_q", n_embd, n_embd), cur)
        k = ops.mul_mat(weight(f"blk.{il}.attn_k", kv_dim, n_embd), cur)
        v = ops.mul_mat(weight(f"blk.{il}.attn_v", kv_dim, n_embd), cur)
        q = ops.rope(ops.reshape(q, (n_tokens, n_head, head_dim)), pos, head_dim)
        k = ops.rope(ops.reshape(k, (n_tokens, n_head_kv, head_dim)), pos, head_dim)
        v = ops.reshape(v, (n_tokens, n_head_kv, head_dim))
        q = ops.permute(q, (1, 0, 2))  # [heads, tokens, dim]
        k = ops.permute(k, (1, 0, 2))
        v = ops.permute(v, (1, 2, 0))  # [kv heads, dim, tokens]
        kq = ops.soft_max(ops.mul_mat(k, q), mask, scale=head_dim ** -0.5)
        kqv = ops.mul_mat(v, kq)  # [heads, tokens, dim]
        attn = ops.reshape(ops.cont(ops.permute(kqv, (1, 0, 2))), (n_tokens, n_embd))
        attn = ops.mul_mat(weight(f"blk.{il}.attn_output", n_embd, n_embd), attn)
        x = ops.add(attn, x)
        cur = ops.mul(ops.rms_norm(x, 1e-5), weight(f"blk.{il}.ffn_norm", n_embd))
        gate = ops.mul_mat(weight(f"blk.{il}.ffn_gate", n_ff, n_embd), cur)
        up = ops.mul_mat(weight(f"blk.{il}.ffn_up", n_ff, n_embd), cur)
        down = ops.mul_mat(weight(f"blk.{il}.ffn_down", n_embd, n_ff), ops.swiglu(gate, up))
        x = ops.add(down, x)
    x = ops.mul(ops.rms_norm(x, 1e-5), weight("output_norm", n_embd))
    logits = ops.mul_mat(weight("output", n_vocab, n_embd), x)
    return build_graph([logits])


def owns(t: Tensor) -> bool:
    """What a compute buffer holds: inputs and intermediates that own memory (not weights, not views)."""
    return not t.is_weight and t.view_src is None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=35)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()

    graph = build_transformer(args.layers, args.tokens)
    nodes, inputs = graph.nodes, graph.inputs()
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        plan = plan_graph(nodes, inputs, owns, ALIGNMENT)
        times.append(time.perf_counter() - t0)
    validate_plan(nodes, plan.offsets, plan.sizes)

    n = len(nodes)
    mib = 1 << 20
    best, mean = min(times), statistics.mean(times)
    print(f"graph: {args.layers} layers, {args.tokens} tokens: {n} nodes "
          f"({len(graph.compute_nodes())} with kernels), {len(plan.offsets)} tensors planned")
    print(f"plan_graph over {args.reps} runs: best {best * 1e3:.2f} ms, mean {mean * 1e3:.2f} ms; "
          f"per node: best {best / n * 1e6:.2f} us, mean {mean / n * 1e6:.2f} us (target < 10 us)")
    print(f"planned     {plan.size:>14,d} bytes  {plan.size / mib:9.1f} MiB")
    print(f"lower bound {plan.lower_bound:>14,d} bytes  {plan.lower_bound / mib:9.1f} MiB")
    print(f"no reuse    {plan.no_reuse:>14,d} bytes  {plan.no_reuse / mib:9.1f} MiB")
    print(f"planned / lower bound = {plan.size / plan.lower_bound:.4f}; "
          f"no reuse / planned = {plan.no_reuse / plan.size:.1f}; in place: {len(plan.inplace)} nodes")
    print("validator: plan ok")


if __name__ == "__main__":
    main()

"""An independent llama forward pass in plain float64 numpy, reading the GGUF file with the `gguf`
package: the expectation that ggrun's graph path is checked against on synthetic models.

A test helper only: it never imports ggrun's code (core, loaders), so agreeing with it means something.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize

_FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)


@dataclass
class ReferenceLlama:
    """Weights as float64 matrices (out, in); `q8_acts` names the matrices whose inputs llama.cpp
    rounds to 8-bit blocks (every block-quantized weight)."""

    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    eps: float
    w: dict[str, np.ndarray]
    q8_acts: set[str]

    @staticmethod
    def load(path: str | Path) -> "ReferenceLlama":
        r = GGUFReader(path)
        md = {k: f.contents() for k, f in r.fields.items()}
        arch = md["general.architecture"]
        w, q8 = {}, set()
        for t in r.tensors:
            qtype = QT(t.tensor_type)
            w[t.name] = np.asarray(dequantize(t.data, qtype), dtype=np.float64).reshape(tuple(reversed(t.shape.tolist())))
            if qtype not in _FLOAT_TYPES:
                q8.add(t.name)
        if "output.weight" not in w:  # tied head
            w["output.weight"] = w["token_embd.weight"]
            if "token_embd.weight" in q8:
                q8.add("output.weight")
        n_embd, n_head = md[f"{arch}.embedding_length"], md[f"{arch}.attention.head_count"]
        head_dim = n_embd // n_head
        return ReferenceLlama(
            n_layer=md[f"{arch}.block_count"], n_head=n_head,
            n_head_kv=md.get(f"{arch}.attention.head_count_kv", n_head), head_dim=head_dim,
            n_rot=md.get(f"{arch}.rope.dimension_count", head_dim),
            rope_base=md.get(f"{arch}.rope.freq_base", 10000.0),
            eps=md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5), w=w, q8_acts=q8)

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Logits [len(tokens), n_vocab] of one sequence at positions 0.., causal attention."""
        n = len(tokens)
        pos = np.arange(n)
        x = self.w["token_embd.weight"][np.asarray(tokens)]
        causal = np.tril(np.ones((n, n), dtype=bool))
        group = self.n_head // self.n_head_kv
        for il in range(self.n_layer):
            p = f"blk.{il}."
            h = self._norm(x, p + "attn_norm.weight")
            q = self._rope(self._mm(p + "attn_q.weight", h).reshape(n, self.n_head, self.head_dim), pos)
            k = self._rope(self._mm(p + "attn_k.weight", h).reshape(n, self.n_head_kv, self.head_dim), pos)
            v = self._mm(p + "attn_v.weight", h).reshape(n, self.n_head_kv, self.head_dim)
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # q head j reads kv head j // group
            scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(self.head_dim)
            scores = np.where(causal[None], scores, -np.inf)
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            attn = np.einsum("hts,shd->thd", probs, v).reshape(n, self.n_head * self.head_dim)
            x = x + self._mm(p + "attn_output.weight", attn)
            h = self._norm(x, p + "ffn_norm.weight")
            g, u = self._mm(p + "ffn_gate.weight", h), self._mm(p + "ffn_up.weight", h)
            x = x + self._mm(p + "ffn_down.weight", g / (1.0 + np.exp(-g)) * u)
        return self._mm("output.weight", self._norm(x, "output_norm.weight"))

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        return greedy_by_reevaluation(self.logits, prompt, n)

    def _mm(self, name: str, x: np.ndarray) -> np.ndarray:
        if name in self.q8_acts:
            x = round_q8_0(x)
        return x @ self.w[name].T

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.w[name]

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """llama's RoPE ("normal" mode): rotate adjacent pairs (2i, 2i+1) by pos * base^(-2i/n_rot)."""
        theta = pos[:, None] * self.rope_base ** (-np.arange(0, self.n_rot, 2) / self.n_rot)[None, :]
        cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        out = x.copy()
        x0, x1 = x[..., 0:self.n_rot:2], x[..., 1:self.n_rot:2]
        out[..., 0:self.n_rot:2] = x0 * cos - x1 * sin
        out[..., 1:self.n_rot:2] = x0 * sin + x1 * cos
        return out


def round_q8_0(x: np.ndarray) -> np.ndarray:
    """x as llama.cpp's CPU matmul sees it against a block-quantized weight (quantize_row_q8_0):
    blocks of 32 share the scale d = amax/127 (stored f16), values become round(x * 127/amax) * d."""
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    d = (amax / 127).astype(np.float16).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(amax > 0, np.rint(blocks * (127 / amax)), 0.0)
    return (q * d).reshape(x.shape)


def perplexity(logits: np.ndarray, tokens: list[int]) -> tuple[float, np.ndarray]:
    """(perplexity, negative log-likelihood of each next token) of one window's logits."""
    x = logits[:-1] - logits[:-1].max(axis=-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    nll = -logp[np.arange(len(tokens) - 1), np.asarray(tokens[1:])]
    return float(np.exp(nll.mean())), nll


def greedy_by_reevaluation(logits, prompt: list[int], n: int) -> list[int]:
    """n tokens chosen by argmax, each from a full re-evaluation (logits(seq)) of the sequence so far."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(logits(seq)[-1])))
    return seq[len(prompt):]

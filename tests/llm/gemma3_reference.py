"""An independent gemma3 forward pass in plain float64 numpy, reading the GGUF file with the `gguf`
package: the expectation that ggrun's gemma3 graph is checked against on synthetic models.

It follows llama.cpp's src/models/gemma3.cpp (the iswa variant) step by step: exact GELU (tanh form), no
f16 or 8-bit rounding anywhere. A test helper only: it never imports ggrun's code (core, loaders).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize

from tests.llm.llama_reference import greedy_by_reevaluation

SWA_PATTERN = 6  # layer il attends within the window when il % 6 < 5 (llama.cpp's set_swa_pattern(6))
ROPE_BASE_SWA = 10000.0  # gemma3's local RoPE base on sliding-window layers


@dataclass
class ReferenceGemma3:
    """Weights as float64 arrays (a matrix is (out, in)); `sliding_window` None when the file has none
    (every layer is then global: causal attention, the file's RoPE base)."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_base: float
    eps: float
    sliding_window: int | None
    w: dict[str, np.ndarray]

    @staticmethod
    def load(path: str | Path) -> "ReferenceGemma3":
        r = GGUFReader(path)
        md = {k: f.contents() for k, f in r.fields.items()}
        assert md["general.architecture"] == "gemma3", md["general.architecture"]
        w = {t.name: np.asarray(dequantize(t.data, QT(t.tensor_type)), dtype=np.float64)
             .reshape(tuple(reversed(t.shape.tolist()))) for t in r.tensors}
        n_embd, n_head = md["gemma3.embedding_length"], md["gemma3.attention.head_count"]
        return ReferenceGemma3(
            n_layer=md["gemma3.block_count"], n_embd=n_embd, n_head=n_head,
            n_head_kv=md.get("gemma3.attention.head_count_kv", n_head),
            head_dim=md.get("gemma3.attention.key_length", n_embd // n_head),
            rope_base=md.get("gemma3.rope.freq_base", 1_000_000.0),
            eps=md.get("gemma3.attention.layer_norm_rms_epsilon", 1e-6),
            sliding_window=md.get("gemma3.attention.sliding_window") or None, w=w)

    def is_swa(self, il: int) -> bool:
        return self.sliding_window is not None and il % SWA_PATTERN < SWA_PATTERN - 1

    def logits(self, tokens: list[int], window: bool = True) -> np.ndarray:
        """Logits [len(tokens), n_vocab] of one sequence at positions 0.. (tied head: token_embd).

        window=False ignores the sliding window (sliding-window layers attend to every earlier token)
        but keeps everything else, their local RoPE base included: what a model that forgot the mask
        would compute."""
        n = len(tokens)
        pos = np.arange(n)
        x = self.w["token_embd.weight"][np.asarray(tokens)] * np.sqrt(self.n_embd)
        causal = pos[None, :] <= pos[:, None]  # [token, key]
        group = self.n_head // self.n_head_kv
        for il in range(self.n_layer):
            p = f"blk.{il}."
            visible = causal
            base = self.rope_base
            if self.is_swa(il):  # a token at p sees keys at p' with p - p' < window
                if window:
                    visible = causal & (pos[:, None] - pos[None, :] < self.sliding_window)
                base = ROPE_BASE_SWA
            h = self._norm(x, p + "attn_norm.weight")
            q = self._mm(p + "attn_q.weight", h).reshape(n, self.n_head, self.head_dim)
            k = self._mm(p + "attn_k.weight", h).reshape(n, self.n_head_kv, self.head_dim)
            v = self._mm(p + "attn_v.weight", h).reshape(n, self.n_head_kv, self.head_dim)
            q = self._rope(self._norm(q, p + "attn_q_norm.weight"), pos, base) / np.sqrt(self.head_dim)
            k = self._rope(self._norm(k, p + "attn_k_norm.weight"), pos, base)
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # q head j reads kv head j // group
            scores = np.einsum("thd,shd->hts", q, k)  # kq scale 1: q was scaled already
            scores = np.where(visible[None], scores, -np.inf)
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            attn = np.einsum("hts,shd->thd", probs, v).reshape(n, self.n_head * self.head_dim)
            x = x + self._norm(self._mm(p + "attn_output.weight", attn), p + "post_attention_norm.weight")
            h = self._norm(x, p + "ffn_norm.weight")
            g, u = self._mm(p + "ffn_gate.weight", h), self._mm(p + "ffn_up.weight", h)
            h = self._mm(p + "ffn_down.weight", gelu_tanh(g) * u)
            x = x + self._norm(h, p + "post_ffw_norm.weight")
        return self._mm("token_embd.weight", self._norm(x, "output_norm.weight"))

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        return greedy_by_reevaluation(self.logits, prompt, n)

    def _mm(self, name: str, x: np.ndarray) -> np.ndarray:
        return x @ self.w[name].T

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        """RMS norm over the last axis times the stored weight (whole rows, or each head of q and k)."""
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.w[name]

    def _rope(self, x: np.ndarray, pos: np.ndarray, base: float) -> np.ndarray:
        """NEOX-mode RoPE over the whole head: dimension i of the first half pairs with i + head_dim/2,
        rotated by pos * base^(-2i/head_dim)."""
        half = self.head_dim // 2
        theta = pos[:, None] * base ** (-np.arange(0, self.head_dim, 2) / self.head_dim)[None, :]
        cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        x0, x1 = x[..., :half], x[..., half:]
        return np.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU in its tanh form, exactly: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))

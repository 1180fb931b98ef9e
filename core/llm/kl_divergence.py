"""llama-perplexity's KL divergence against a base model: the base run's log-probabilities saved to a
file (`--kl-divergence-base FILE`), and a later run of another model or quantization compared with
them token by token (`--kl-divergence`): mean KL divergence, the change in the probability of the right
token (Δp), how often both models rank the same token first ("Same top p"), and the ratio of the two
perplexities, with llama.cpp's uncertainties.

The file is llama.cpp's own format, so ggrun and llama-perplexity can read each other's files: the magic
"_logits_", u32 n_ctx, i32 n_vocab, i32 n_chunk, the n_chunk * n_ctx tokens as i32, then for each
chunk and scored position one row of nv = 2 * ceil(n_vocab / 2) + 4 u16: the f32 scale and f32 minimum
log-probability, then each token's log-probability quantized to 16 bits over the top 16 nats.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ggrun.core.errors import BadInput

MAGIC = b"_logits_"
ROW_BLOCK = 32  # rows converted at a time: a gemma row is 262,144 logits


def row_width(n_vocab: int) -> int:
    """u16 values per saved row: two f32 (scale, minimum) and the vocabulary rounded up to even."""
    return 2 * ((n_vocab + 1) // 2) + 4


def quantize_log_probs(logits: np.ndarray) -> np.ndarray:
    """Rows of logits as llama.cpp saves them (perplexity.cpp, log_softmax with log_prob): log-probabilities
    within 16 nats of the top one mapped linearly onto 0..65535 (round half to even, as its nearest_int),
    lower ones to 0; each row starts with its f32 scale and f32 minimum log-probability."""
    logits = np.asarray(logits, dtype=np.float32)
    n, n_vocab = logits.shape
    out = np.zeros((n, row_width(n_vocab)), dtype=np.uint16)
    hi = logits.max(axis=1)
    lo = np.maximum(logits.min(axis=1), hi - np.float32(16))
    log_sum = np.log(np.exp(logits - hi[:, None]).sum(axis=1, dtype=np.float64)).astype(np.float32)
    min_log_prob = lo - hi - log_sum
    scale = (hi - lo) / np.float32(65535)
    out[:, :4] = np.stack([scale, min_log_prob], axis=1).astype(np.float32).view(np.uint16)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(scale > 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
        q = np.rint(inv[:, None] * (logits - lo[:, None]))
    out[:, 4:4 + n_vocab] = np.where(logits > lo[:, None], q, 0).astype(np.uint16)
    return out


def dequantize_log_probs(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """Saved rows back to f32 log-probabilities: scale * q + minimum."""
    head = np.ascontiguousarray(rows[:, :4]).view(np.float32)
    return head[:, :1] * rows[:, 4:4 + n_vocab].astype(np.float32) + head[:, 1:2]


class LogProbWriter:
    """Writes a base run: the header with every evaluated token, then rows chunk by chunk."""

    def __init__(self, path: str | Path, n_ctx: int, n_vocab: int, n_chunks: int, tokens: np.ndarray) -> None:
        try:
            self.f: BinaryIO = open(path, "wb")
        except OSError as err:
            raise BadInput(f"--kl-divergence-base {path}: cannot write: {err.strerror}") from None
        self.f.write(MAGIC)
        self.f.write(np.array([n_ctx], dtype=np.uint32).tobytes())
        self.f.write(np.array([n_vocab, n_chunks], dtype=np.int32).tobytes())
        self.f.write(np.asarray(tokens[:n_chunks * n_ctx], dtype=np.int32).tobytes())

    def write(self, logits: np.ndarray) -> None:
        for s in range(0, len(logits), ROW_BLOCK):
            self.f.write(quantize_log_probs(logits[s:s + ROW_BLOCK]).tobytes())

    def close(self) -> None:
        self.f.close()


class LogProbReader:
    """Reads a base run written by LogProbWriter or by llama-perplexity --kl-divergence-base."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        try:
            self.f: BinaryIO = open(path, "rb")
        except OSError as err:
            raise BadInput(f"--kl-divergence-base {path}: cannot read: {err.strerror}") from None
        head = self.f.read(20)
        if len(head) < 20 or head[:8] != MAGIC:
            raise BadInput(f"{path} does not look like a file of log-probabilities (llama-perplexity's "
                           "--kl-divergence-base format)")
        self.n_ctx = int(np.frombuffer(head, dtype=np.uint32, count=1, offset=8)[0])
        self.n_vocab, self.n_chunks = (int(x) for x in np.frombuffer(head, dtype=np.int32, count=2, offset=12))
        if self.n_ctx < 4 or self.n_vocab < 1 or self.n_chunks < 1:
            raise BadInput(f"{path}: bad header (n_ctx {self.n_ctx}, n_vocab {self.n_vocab}, "
                           f"n_chunk {self.n_chunks})")
        n_tok = self.n_ctx * self.n_chunks
        self.tokens = np.frombuffer(self.f.read(4 * n_tok), dtype=np.int32)
        if len(self.tokens) != n_tok:
            raise BadInput(f"{path}: ends inside its tokens ({len(self.tokens)} of {n_tok})")
        self.n_rows = self.n_ctx - 1 - self.n_ctx // 2
        self.width = row_width(self.n_vocab)

    def chunk(self, index: int) -> np.ndarray:
        """The next chunk's saved rows [n_rows, width] (chunks are read in order)."""
        want = self.n_rows * self.width
        rows = np.frombuffer(self.f.read(2 * want), dtype=np.uint16)
        if len(rows) != want:
            raise BadInput(f"{self.path}: ends inside the log-probabilities of chunk {index + 1}")
        return rows.reshape(self.n_rows, self.width)

    def close(self) -> None:
        self.f.close()


def mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    """llama.cpp's mean of a per-token value and the uncertainty of that mean (0 for 10 values or fewer)."""
    if count < 1:
        return 0.0, 0.0
    mean = total / count
    var = total2 / count - mean * mean
    return mean, math.sqrt(var / (count - 1)) if var > 0 and count > 10 else 0.0


@dataclass
class KLStats:
    """llama.cpp's kl_divergence_result: sums over every compared token, and the per-token KL divergence
    and Δp values kept for the percentiles."""

    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0
    max_p_diff: float = 0.0
    n_same_top: int = 0
    count: int = 0
    kld_values: list[np.ndarray] = field(default_factory=list)
    p_diff_values: list[np.ndarray] = field(default_factory=list)

    def add(self, logits: np.ndarray, targets: np.ndarray, base_rows: np.ndarray) -> None:
        """Compare one chunk: this model's logits against the base's saved rows for the same tokens."""
        for s in range(0, len(targets), ROW_BLOCK):
            self._add_block(logits[s:s + ROW_BLOCK], targets[s:s + ROW_BLOCK], base_rows[s:s + ROW_BLOCK])

    def _add_block(self, logits: np.ndarray, targets: np.ndarray, base_rows: np.ndarray) -> None:
        logits = np.asarray(logits, dtype=np.float32)
        n, n_vocab = logits.shape
        idx = np.arange(n)
        hi = logits.max(axis=1)
        log_sum = np.log(np.exp(logits - hi[:, None]).sum(axis=1, dtype=np.float64)).astype(np.float32)
        nll = (hi + log_sum - logits[idx, targets]).astype(np.float32)
        base = dequantize_log_probs(base_rows, n_vocab)
        nll_base = -base[idx, targets]
        log_p = logits - (hi + log_sum)[:, None]
        kept = base > np.float32(-16)
        kld = np.where(kept, np.exp(base) * (base - log_p), np.float32(0)).sum(axis=1, dtype=np.float64)
        p_diff = np.exp(-nll) - np.exp(-nll_base)
        nll64, base64, kld64, pd64 = (x.astype(np.float64) for x in (nll, nll_base, kld, p_diff))
        self.sum_nll += float(nll64.sum())
        self.sum_nll2 += float((nll64 ** 2).sum())
        self.sum_nll_base += float(base64.sum())
        self.sum_nll_base2 += float((base64 ** 2).sum())
        self.sum_nll_nll_base += float((nll64 * base64).sum())
        self.sum_kld += float(kld64.sum())
        self.sum_kld2 += float((kld64 ** 2).sum())
        self.sum_p_diff += float(pd64.sum())
        self.sum_p_diff2 += float((pd64 ** 2).sum())
        self.sum_p_diff4 += float((pd64 ** 4).sum())
        self.max_p_diff = max(self.max_p_diff, float(np.abs(p_diff).max(initial=0.0)))
        self.n_same_top += int((logits.argmax(axis=1) == base.argmax(axis=1)).sum())
        self.count += n
        self.kld_values.append(kld.astype(np.float32))
        self.p_diff_values.append(p_diff.astype(np.float32))

    # ---- what llama.cpp prints, as numbers -------------------------------------------------------

    def ppl(self) -> tuple[float, float]:
        mean, unc = mean_and_uncertainty(self.sum_nll, self.sum_nll2, self.count)
        return math.exp(mean), math.exp(mean) * unc

    def ppl_base(self) -> tuple[float, float]:
        mean, unc = mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, self.count)
        return math.exp(mean), math.exp(mean) * unc

    def log_ppl_covariance(self) -> float:
        if self.count < 10:
            return 0.0
        n = self.count
        return (self.sum_nll_nll_base / n - (self.sum_nll / n) * (self.sum_nll_base / n)) / (n - 1)

    def log_ppl_ratio(self) -> tuple[float, float]:
        """ln(PPL(Q) / PPL(base)) and its uncertainty, through the covariance of the two nll series."""
        a, da = mean_and_uncertainty(self.sum_nll, self.sum_nll2, self.count)
        b, db = mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, self.count)
        return a - b, math.sqrt(max(da * da + db * db - 2.0 * self.log_ppl_covariance(), 0.0))

    def log_ppl_correlation(self) -> float:
        _, da = mean_and_uncertainty(self.sum_nll, self.sum_nll2, self.count)
        _, db = mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, self.count)
        return self.log_ppl_covariance() / (da * db) if da * db > 0 else math.nan

    def kld(self) -> tuple[float, float]:
        return mean_and_uncertainty(self.sum_kld, self.sum_kld2, self.count)

    def p_diff(self) -> tuple[float, float]:
        return mean_and_uncertainty(self.sum_p_diff, self.sum_p_diff2, self.count)

    def p_diff_rms(self) -> tuple[float, float]:
        mse, dmse = mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, self.count)
        rms = math.sqrt(mse)
        return rms, 0.5 / rms * dmse if rms > 0 else 0.0

    def same_top(self) -> tuple[float, float]:
        """Share of tokens where both models rank the same token first, with its binomial uncertainty."""
        if not self.count:
            return math.nan, math.nan
        p = self.n_same_top / self.count
        return p, math.sqrt(p * (1 - p) / (self.count - 1)) if self.count > 1 else 0.0

    def sorted_values(self) -> tuple[np.ndarray, np.ndarray]:
        """Every token's KL divergence and Δp, each sorted, for the percentiles."""
        return _sorted(self.kld_values), _sorted(self.p_diff_values)


def _sorted(parts: list[np.ndarray]) -> np.ndarray:
    return np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.float32)


def percentile(values: np.ndarray, fraction: float) -> float:
    """llama.cpp's percentile of sorted values: linear between the two nearest ranks."""
    if fraction <= 0:
        return float(values[0])
    if fraction >= 1:
        return float(values[-1])
    p = fraction * (len(values) - 1)
    i = int(p)
    p -= i
    return float((1 - p) * values[i] + p * values[min(i + 1, len(values) - 1)])


def median(values: np.ndarray) -> float:
    n = len(values)
    return float(0.5 * (values[n // 2] + values[n // 2 - 1]) if n % 2 == 0 else values[n // 2])

"""NaN and infinity in a model's stored values: the small float tensors (norms) refused at every load,
every tensor (quantized blocks' scales too) with --check-tensors, each as one line naming the tensor."""
from __future__ import annotations

import numpy as np
import pytest

from gguf.constants import GGMLQuantizationType as QT
from ggrun.core.quants import first_non_finite, quantize
from ggrun.loaders.gguf_file import open_gguf
from ggrun.loaders.synthetic import write_tiny_llama
from tests.cli.runner import ggrun


def _poison(path, name: str, byte_at: int, value: bytes) -> None:
    """Overwrite bytes of tensor `name` in the file at `path`, `byte_at` bytes into its data."""
    with open_gguf(path) as gf:
        offset = gf.tensors[name].offset
    with open(path, "r+b") as f:
        f.seek(offset + byte_at)
        f.write(value)


@pytest.mark.parametrize("qtype, dtype", [(QT.F32, np.float32), (QT.F16, np.float16)])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_float_values_found_by_their_bits(qtype, dtype, bad):
    values = np.linspace(-3, 3, 100).astype(dtype)
    assert first_non_finite(values.view(np.uint8), qtype) is None
    values[37] = bad
    assert first_non_finite(values.view(np.uint8), qtype) == 37


def test_bf16_values_found_by_their_bits():
    bits = (np.linspace(-3, 3, 64).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    assert first_non_finite(bits.view(np.uint8), QT.BF16) is None
    bits[5] = 0x7FC0  # bf16 NaN
    assert first_non_finite(bits.view(np.uint8), QT.BF16) == 5


@pytest.mark.parametrize("qtype, scale_at", [(QT.Q8_0, 0), (QT.Q4_0, 0)])
def test_quantized_blocks_found_by_their_scales(qtype, scale_at):
    raw = quantize(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32), qtype).reshape(-1).copy()
    assert first_non_finite(raw, qtype) is None
    block_bytes = len(raw) // 8
    raw[3 * block_bytes + scale_at:3 * block_bytes + scale_at + 2] = np.array([np.inf], np.float16).view(np.uint8)
    assert first_non_finite(raw, qtype) == 3


def test_a_nan_in_a_norm_weight_is_refused_at_load(capsys, monkeypatch, tmp_path):
    path = write_tiny_llama(tmp_path / "nan-norm.gguf")
    _poison(path, "blk.1.ffn_norm.weight", 4 * 10, np.array([np.nan], np.float32).tobytes())
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", path, "-no-cnv", "-p", "hello", "-n", "2")
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1].endswith(
        "tensor blk.1.ffn_norm.weight holds NaN or infinity (F32, value 10): the file is corrupt")


def test_check_tensors_reads_every_block(capsys, monkeypatch, tmp_path):
    path = write_tiny_llama(tmp_path / "inf-scale.gguf", weight_type=QT.Q8_0)
    _poison(path, "blk.0.ffn_up.weight", 34 * 5, np.array([np.inf], np.float16).tobytes())  # block 5's d
    args = ("run", "-m", path, "-no-cnv", "-p", "hello", "-n", "2", "--temp", "0")
    code, _, err = ggrun(capsys, monkeypatch, *args)
    assert code == 1 and "non-finite logits" in err, err  # a matrix's blocks are read only when asked
    code, out, err = ggrun(capsys, monkeypatch, *args, "--check-tensors")
    assert code == 2 and out == ""
    assert "tensor blk.0.ffn_up.weight holds NaN or infinity (Q8_0, block scale 5)" in err

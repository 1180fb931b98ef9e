"""The GGUF fuzzer as property tests (loaders/gguf_mutations.py): a tiny llama and a tiny gemma3 are mutated
one field at a time (header fields, metadata types, lengths and values, array element types, tensor
dimensions, types, offsets and names, truncations) and loaded as `ggrun run` loads them. Every such
corruption is one BadInput line of at most 300 characters naming the file, never another exception;
flips inside tensor data (and a tensor type of the same byte size) either decode or stop with the
non-finite-logits error. scripts/tools/fuzz_gguf.py runs the same mutations on real models through the CLI."""
from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT
from hypothesis import HealthCheck, given, settings, strategies as st

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.errors import BadInput
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.model import Model
from ggrun.core.llm.numerics import NonFiniteLogits
from ggrun.core.llm.session import Session, SessionParams
from ggrun.loaders.gguf_mutations import FAMILIES, MAY_RUN, MUST_REJECT, Mutation, mutate, read_layout
from ggrun.loaders.synthetic import write_tiny_gemma3, write_tiny_llama

SOURCES = {"llama": lambda p: write_tiny_llama(p, n_layer=2, weight_type=QT.Q4_0),  # and F32 norms
           "gemma3": lambda p: write_tiny_gemma3(p, n_layer=2, weight_type=QT.Q5_0)}


class Sources(dict):
    """arch -> (file bytes, layout); shown short when hypothesis reports a failing example."""

    def __repr__(self) -> str:
        return f"Sources({', '.join(self)})"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Sources:
    d = tmp_path_factory.mktemp("fuzz")
    out = Sources()
    for arch, write in SOURCES.items():
        path = write(d / f"{arch}.gguf")
        out[arch] = (path.read_bytes(), read_layout(path))
    return out


def _variant(tmp_path_factory, sources, arch: str, family: str, seed: int) -> tuple[Mutation, object]:
    data, lay = sources[arch]
    m = mutate(lay, np.random.default_rng(seed), family)
    path = tmp_path_factory.mktemp("variant") / "variant.gguf"
    path.write_bytes(m.apply_bytes(data))
    return m, path


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arch=st.sampled_from(sorted(SOURCES)), family=st.sampled_from(sorted(MUST_REJECT)),
       seed=st.integers(0, 2**32 - 1))
def test_every_corruption_is_one_line_naming_the_file(tmp_path_factory, sources, arch, family, seed):
    m, path = _variant(tmp_path_factory, sources, arch, family, seed)
    with pytest.raises(BadInput) as info:
        Model.load(path, [CPUBackend()])
    message = str(info.value)
    assert message.startswith(f"{path}: "), (m, message)
    assert "\n" not in message and len("error: " + message) <= 300, (m, message)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arch=st.sampled_from(sorted(SOURCES)), family=st.sampled_from(sorted(MAY_RUN)),
       seed=st.integers(0, 2**32 - 1))
def test_tensor_data_flips_decode_or_stop_on_non_finite_logits(tmp_path_factory, sources, arch, family, seed):
    m, path = _variant(tmp_path_factory, sources, arch, family, seed)
    try:
        model = Model.load(path, [CPUBackend()])
    except BadInput as err:  # a same-size retype may still be a type ggrun does not support; rewritten data may
        # put a NaN or an infinity in a float vector (a norm, a bias), which the load checks
        refused = family == "tensor-type-same-size" or "holds NaN or infinity" in str(err)
        assert refused and str(err).startswith(f"{path}: ") and "\n" not in str(err), (m, err)
        return
    s = Session(model, SessionParams(n_ctx=16, n_batch=16, n_ubatch=16))
    try:
        logits = s.decode(Batch.of_sequence([104, 101, 108], 0))
        assert np.isfinite(logits).all()
    except NonFiniteLogits:
        pass


def test_every_family_is_exercised(sources):
    """Each family can be drawn on both sources (a family with no target would raise), and the ones that
    must be rejected are all families but the two that may run."""
    for arch, (_, lay) in sources.items():
        for family in FAMILIES:
            assert mutate(lay, np.random.default_rng(0), family).family == family
    assert MUST_REJECT | MAY_RUN == set(FAMILIES) and not MUST_REJECT & MAY_RUN

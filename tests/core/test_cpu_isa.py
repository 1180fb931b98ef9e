"""The CPU kernels' instruction-set level (core/backends/cpu/isa.py): the best the CPU has, capped by
GGRUN_CPU_ISA; a level above the CPU's refused with one line and exit 2; a capped level compiling for
its own target (numba's CPU features lose the instruction sets above it) into a numba cache of its own."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ggrun.core.backends.cpu import isa
from ggrun.core.errors import BadInput

AVX2 = frozenset({"sse2", "avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni", "avx512bf16"}


def test_the_best_level_the_features_allow():
    assert isa.best_level(frozenset({"sse2"})) == "generic"
    assert isa.best_level(AVX2) == "avx2"
    assert isa.best_level(AVX512) == "avx512"
    assert isa.best_level(AVX512 - {"avx512vnni"}) == "avx2"  # AVX-512 without VNNI: the AVX2 kernels


def test_a_cap_below_the_cpu_is_used_and_one_above_it_refused():
    assert isa.choose(None, AVX512) == "avx512"
    assert isa.choose("", AVX2) == "avx2"
    assert isa.choose("avx2", AVX512) == "avx2"
    assert isa.choose(" Generic ", AVX512) == "generic"
    with pytest.raises(BadInput, match=r"GGRUN_CPU_ISA=avx512: this CPU lacks avx512bw, avx512f, avx512vl, "
                                       r"avx512vnni \(its best level is avx2\)"):
        isa.choose("avx512", AVX2)
    with pytest.raises(BadInput, match="GGRUN_CPU_ISA=sse4: choose one of avx512, avx2, generic"):
        isa.choose("sse4", AVX512)


def test_a_capped_level_drops_the_features_above_it():
    assert isa.numba_target("avx512", AVX512) is None  # the host's own target
    name, features = isa.numba_target("avx2", AVX512)
    flags = features.split(",")
    assert "+avx2" in flags and "+fma" in flags and "-avx512f" in flags and "-avx512vnni" in flags
    assert not [f for f in flags if f.startswith("+avx512")]
    _, features = isa.numba_target("generic", AVX512)
    flags = features.split(",")
    assert not [f for f in flags if f.startswith(("+avx2", "+avx512", "+fma"))]
    assert "+sse2" in flags and "+f16c" in flags  # (f16 conversions need F16C on x86: see isa.py)


def _python(code: str, level: str) -> subprocess.CompletedProcess:
    """Python running `code` under GGRUN_CPU_ISA=level, on the CPU as this process sees it (a capped
    run of the suite passes its numba target on), with ggrun's own numba cache directory."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env[isa.ENV] = level
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_an_unknown_or_missing_level_is_one_line_and_exit_2():
    for level in ("sse4",) + tuple(lv for lv in isa.LEVELS if lv not in isa.NEEDS or
                                   not isa.NEEDS[lv] <= isa.host_features()):
        proc = _python("import ggrun.core.backends.cpu", level)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"error: GGRUN_CPU_ISA={level}: ")


@pytest.mark.parametrize("level", isa.LEVELS)
def test_a_capped_process_compiles_for_its_level(level):
    """Its kernels, numba's target and numba's cache directory are the level's (nothing compiles here)."""
    if not isa.NEEDS[level] <= isa.host_features():
        pytest.skip(f"this CPU lacks level {level}")
    code = ("import numba; from ggrun.core.backends.cpu import matmul; from ggrun.core.backends.cpu.quant import codes;"
            "print(codes.SIMD, numba.config.CACHE_DIR, numba.config.CPU_FEATURES)")
    proc = _python(code, level)
    assert proc.returncode == 0, proc.stderr
    simd, cache, features = proc.stdout.split()
    assert simd == level
    assert cache.endswith(f"-{level}")
    if level == isa.best_level(isa.host_features()):
        assert features == os.environ.get("NUMBA_CPU_FEATURES", "None")  # the target this process has
    else:
        above = isa.LEVELS[isa.LEVELS.index(level) + 1]
        assert not {f"+{f}" for f in isa.NEEDS[above] - isa.NEEDS[level]} & set(features.split(","))

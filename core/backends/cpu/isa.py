"""The instruction-set level the CPU kernels are compiled for, chosen once per process: the best of
"avx512" (AVX-512 F/BW/VL with VNNI), "avx2" (AVX2, FMA, F16C) and "generic" (the portable kernels,
no AVX2 or FMA) that the CPU has, capped by the environment variable GGRUN_CPU_ISA (as ggml picks its CPU variant by
feature; the cap lets one machine run and test every path below its best).

A level below the CPU's best also caps what LLVM may emit for every kernel (numba's target features
lose the instruction sets above the level), so a capped run compiles what a CPU of that level would,
and a kernel that used an instruction above its level would fail to compile there rather than pass.
numba's compiled kernels are kept per level (jit.py names the cache directory by it).

No numba here: jit.py reads the target before numba is imported.
"""
from __future__ import annotations

import os
import sys

from ggrun.core.errors import BadInput

ENV = "GGRUN_CPU_ISA"
LEVELS = ("generic", "avx2", "avx512")  # lowest first
NEEDS = {
    "generic": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni"}),
}
# LLVM features a level does not have (by name prefix): everything that implies a higher level's,
# so that no feature left on turns a dropped one back on. "generic" keeps AVX and F16C where the CPU
# has them: every level's kernels convert f16 values, which without F16C LLVM turns into calls of
# compiler-rt's __truncsfhf2, a symbol numba's JIT does not link (the process would crash).
_AVX512 = ("avx512", "avx10", "amx", "evex512", "avxvnni", "avxifma", "avxneconvert")
_ABOVE = {
    "avx2": _AVX512,
    "generic": _AVX512 + ("avx2", "fma", "xop", "vaes", "sha512", "sm3", "sm4"),
}


def host_features() -> frozenset[str]:
    """CPU features numba compiles for: the host's, or those NUMBA_CPU_NAME/NUMBA_CPU_FEATURES name."""
    name = os.environ.get("NUMBA_CPU_NAME")
    if name and name != "host":
        feats = os.environ.get("NUMBA_CPU_FEATURES", "").split(",")
        return frozenset(f[1:] for f in feats if f.startswith("+"))
    import llvmlite.binding as llvm

    return frozenset(k for k, on in llvm.get_host_cpu_features().items() if on)


def best_level(features: frozenset[str]) -> str:
    """The highest level whose features are all in `features`."""
    return [level for level in LEVELS if NEEDS[level] <= features][-1]


def choose(requested: str | None, features: frozenset[str]) -> str:
    """The level for a GGRUN_CPU_ISA value (None or empty: the best the features allow); BadInput for
    an unknown level or one above what the CPU has."""
    best = best_level(features)
    if not requested:
        return best
    level = requested.strip().lower()
    if level not in LEVELS:
        raise BadInput(f"{ENV}={requested}: choose one of {', '.join(reversed(LEVELS))}")
    if LEVELS.index(level) > LEVELS.index(best):
        missing = ", ".join(sorted(NEEDS[level] - features))
        raise BadInput(f"{ENV}={requested}: this CPU lacks {missing} (its best level is {best})")
    return level


def numba_target(level: str, features: frozenset[str]) -> tuple[str, str] | None:
    """(NUMBA_CPU_NAME, NUMBA_CPU_FEATURES) that compile for `level` on this host, or None where the
    host's own target does (the level is the host's best)."""
    if level == best_level(features) or level not in _ABOVE:
        return None
    import llvmlite.binding as llvm

    name = os.environ.get("NUMBA_CPU_NAME", "host")
    name = llvm.get_host_cpu_name() if name == "host" else name
    dropped = _ABOVE[level]
    known = frozenset(llvm.get_host_cpu_features()) | features
    return name, ",".join(("+" if f in features and not f.startswith(dropped) else "-") + f for f in sorted(known))


def _level_or_exit() -> str:
    """The process's level; for a bad GGRUN_CPU_ISA, one line and exit 2 (as the CLI ends on bad
    input: this runs while the CLI imports its commands, before it can catch anything)."""
    try:
        return choose(os.environ.get(ENV), host_features())
    except BadInput as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


LEVEL = _level_or_exit()


def set_numba_target() -> None:
    """Point numba (not yet imported) at LEVEL's target where it is below the host's best."""
    target = numba_target(LEVEL, host_features())
    if target is not None:
        os.environ["NUMBA_CPU_NAME"], os.environ["NUMBA_CPU_FEATURES"] = target

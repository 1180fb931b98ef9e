#!/usr/bin/env python3
"""CUDA's int8 tensor-core products (mmqt, mmq_idt) run on the CPU, without a GPU, against the kernels they stand
beside (mmq, whose results a GPU has checked; for the experts, mmq over each expert's rows) and an exact f64 product: a check of their tiling, staging and
fragment layouts where device time is short.

common.cuh and matmul.cu are compiled as host C++ (g++ -std=c++20, CUDA's headers for cuda_fp16.h) over shim.h,
which makes each CUDA thread of a block a std::thread: __syncthreads and a warp's shuffles are barriers, mma.sync's
m16n8k32 int8 product follows the PTX ISA's fragment layouts, cp.async is a copy that checks its alignment. The
few lines that are PTX (mma, cp.async) or dynamic shared memory are replaced as the source is read; the kernels'
own code is compiled as it is. checks.cpp draws random weights of every MMQ type (sane scales), activations, and
compares. Slow (a std::thread per CUDA thread): a group of checks takes a minute or two.

    python3 scripts/tools/mmq_emulate/emulate.py [a|b|c|all]
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
CUDA = HERE.parents[2] / "core" / "backends" / "cuda"


def host_source() -> str:
    """common.cuh and matmul.cu with their PTX and dynamic shared memory replaced by shim.h's stand-ins."""
    src = (CUDA / "common.cuh").read_text() + "\n" + (CUDA / "matmul.cu").read_text()
    src = src.replace("#include <cuda_fp16.h>", "")
    src = src.replace('asm volatile("prefetch.global.L2 [%0];" ::"l"(c + off));', "(void)c;")
    src = _replace_function(src, "__device__ __forceinline__ void mma16816(",
                            "inline void mma16816(float *c, const u32 *a, u32 b0, u32 b1) { abort(); }\n")
    src = _replace_function(src, "__device__ __forceinline__ void mma_s8(",
                            "inline void mma_s8(int *c, const int *a, int b0, int b1) { mma_emu(c, a, b0, b1); }\n")
    for n in (16, 8):
        src = re.sub(rf"__device__ __forceinline__ void cp_async{n}\(void \*dst, const void \*src\) \{{\n.*\n\}}",
                     f"inline void cp_async{n}(void *dst, const void *src) {{ copy_async(dst, src, {n}); }}", src)
    src = src.replace('{ asm volatile("cp.async.commit_group;" ::: "memory"); }', "{}")
    src = src.replace('{ asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }', "{}")
    src = src.replace("extern __shared__ __align__(16) u8 mt_smem[];", "u8 *mt_smem = g_dyn;")
    src = src.replace("extern __shared__ int count[];", "int *count = (int *)g_dyn;")
    src = src.replace('extern "C" ', "")
    if re.search(r"asm volatile\(\"(mma|cp)", src):
        raise SystemExit("a PTX statement was left in the host source")
    return src


def _replace_function(src: str, head: str, new: str) -> str:
    at = src.index(head)
    end = src.index("\n}\n", at) + 3
    return src[:at] + new + src[end:]


def cuda_include() -> Path:
    nvcc = shutil.which("nvcc")
    for root in ([Path(nvcc).resolve().parents[1]] if nvcc else []) + [Path("/usr/local/cuda")]:
        if (root / "include" / "cuda_fp16.h").exists():
            return root / "include"
    raise SystemExit("cuda_fp16.h not found (CUDA's headers: install the CUDA toolkit)")


def main() -> None:
    group = sys.argv[1] if len(sys.argv) > 1 else "all"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "kernels.h").write_text(host_source())
        exe = Path(tmp) / "checks"
        subprocess.run(["g++", "-std=c++20", "-O1", "-w", f"-I{cuda_include()}", f"-I{HERE}", f"-I{tmp}",
                        str(HERE / "checks.cpp"), "-o", str(exe), "-lpthread"], check=True)
        sys.exit(subprocess.run([str(exe), group]).returncode)


if __name__ == "__main__":
    main()

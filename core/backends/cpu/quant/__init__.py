"""Compiled CPU kernels for GGUF block-quantized weights, one concern a module (ggml splits the same
over ggml-cpu/quants.c, arch/x86/quants.c and repack.cpp):

- codes.py: the type codes numba dispatches on, the 8-bit activation formats, scalar block helpers
- activations.py: activation rows quantized to 8-bit blocks (portable and AVX2)
- decode.py: stored rows decoded to f32 (portable and AVX2)
- portable.py: the scalar reference products (any CPU) and the ri64 kernels
- vec.py: the small LLVM vector language the AVX2 (and AVX-512) kernels are written in
- avx2.py: AVX2 products against weights in ggml's block layout
- avx2_r8.py: AVX2 products of weights repacked r8, and the fused multi-weight and GLU products
- avx512.py: AVX-512 (VNNI) products of weights repacked r16
- layouts.py: the r8, r16 and ri64 layouts the weights are repacked into once at load

numba's disk cache revalidates a kernel against its own file only; the modules whose kernels,
intrinsics or constants other modules compile in are listed in jit.SHARED_SOURCES, which names the
cache directory. Kernels never allocate: callers hand them views of planned memory.
"""

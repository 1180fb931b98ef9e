// Shared by every ggrun CUDA kernel: scalar types, GGUF block layouts and their per-element decoders
// (ggml's block_* structs, ggml-common.h), warp reductions. Type ids are ggml's type numbers.
#include <cuda_fp16.h>

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

// Programmatic dependent launch (sm_90, launch.py): a kernel launched with it may start while the one
// before it on the stream still runs. Every kernel calls pdl_begin before it reads anything another
// kernel wrote and before it returns: it waits until the kernel before has finished and its writes are
// visible (so also everything before that), then lets the next one start (whose blocks take the places
// this kernel's finished blocks leave, and wait there in turn). What a kernel does before pdl_begin
// overlaps the kernel before it, so it must not read what that kernel writes; it may read weights, the
// step's inputs (copied before the step's first kernel) and what earlier kernels wrote: a kernel can only
// have started early once every block of the one before it has passed pdl_begin.
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ask L2 for bytes [p, p + n): thread `t` of `nt` takes every nt-th 128-byte line
__device__ __forceinline__ void prefetch_l2(const void *p, i64 n, int t, int nt) {
    const char *c = (const char *)p;
    for (i64 off = (i64)t * 128; off < n; off += (i64)nt * 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(c + off));
}

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q2_K 10
#define T_Q3_K 11
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ4_NL 20
#define T_IQ4_XS 23
#define T_BF16 30
#define T_MXFP4 39

// elements and bytes of one block of each type (a float type is a "block" of one element)
template <int T> struct Block;
template <> struct Block<T_F32>  { static const int QK = 1;   static const int BYTES = 4; };
template <> struct Block<T_F16>  { static const int QK = 1;   static const int BYTES = 2; };
template <> struct Block<T_BF16> { static const int QK = 1;   static const int BYTES = 2; };
template <> struct Block<T_Q4_0> { static const int QK = 32;  static const int BYTES = 18; };
template <> struct Block<T_Q4_1> { static const int QK = 32;  static const int BYTES = 20; };
template <> struct Block<T_Q5_0> { static const int QK = 32;  static const int BYTES = 22; };
template <> struct Block<T_Q5_1> { static const int QK = 32;  static const int BYTES = 24; };
template <> struct Block<T_Q8_0> { static const int QK = 32;  static const int BYTES = 34; };
template <> struct Block<T_Q2_K> { static const int QK = 256; static const int BYTES = 84; };
template <> struct Block<T_Q3_K> { static const int QK = 256; static const int BYTES = 110; };
template <> struct Block<T_Q4_K> { static const int QK = 256; static const int BYTES = 144; };
template <> struct Block<T_Q5_K> { static const int QK = 256; static const int BYTES = 176; };
template <> struct Block<T_Q6_K> { static const int QK = 256; static const int BYTES = 210; };
template <> struct Block<T_IQ4_NL> { static const int QK = 32;  static const int BYTES = 18; };
template <> struct Block<T_IQ4_XS> { static const int QK = 256; static const int BYTES = 136; };
template <> struct Block<T_MXFP4>  { static const int QK = 32;  static const int BYTES = 17; };

__device__ __forceinline__ float ld_f16(const u8 *p) { return __half2float(*(const __half *)p); }
__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }

// 32 bits from a 2-byte aligned address (blocks of 18, 22 and 34 bytes align only to 2)
__device__ __forceinline__ int ld_i32_a2(const u8 *p) {
    const u16 *h = (const u16 *)p;
    return (int)((u32)h[0] | ((u32)h[1] << 16));
}

// 32 bits from an address of any alignment (MXFP4's blocks of 17 bytes)
__device__ __forceinline__ int ld_i32_a1(const u8 *p) {
    return (int)((u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24));
}

// The 16 values a 4-bit index of IQ4_NL / IQ4_XS (ggml's kvalues_iq4nl) and of MXFP4 (kvalues_mxfp4: twice
// the E2M1 values, so the block's E8M0 exponent is read as half its power of two) stands for.
__constant__ __align__(16) i8 IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
__constant__ __align__(16) i8 MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// MXFP4's exponent byte as ggml's GGML_E8M0_TO_FP32_HALF: 2^(e - 128), subnormal for e < 2
__device__ __forceinline__ float e8m0_half(u8 e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (u32)(e - 1) << 23);
}

// IQ4_XS: the six-bit scale of sub-block ib (32 elements) of the super-block at b, minus 32
__device__ __forceinline__ int iq4xs_scale(const u8 *b, int ib) {
    const int h = (int)b[2] | ((int)b[3] << 8);
    return (((b[4 + (ib >> 1)] >> (4 * (ib & 1))) & 0xF) | (((h >> (2 * ib)) & 3) << 4)) - 32;
}

// Q4_K / Q5_K: the six-bit scale and min of sub-block sb (ggml's get_scale_min_k4)
__device__ __forceinline__ void k4_scale_min(const u8 *s, int sb, float &sc, float &m) {
    if (sb < 4) {
        sc = s[sb] & 63;
        m = s[sb + 4] & 63;
    } else {
        sc = (s[sb + 4] & 0xF) | ((s[sb - 4] >> 6) << 4);
        m = (s[sb + 4] >> 4) | ((s[sb] >> 6) << 4);
    }
}

// Q3_K's six-bit signed scale of 16-element group g (ggml's packing of 12 bytes)
__device__ __forceinline__ int k3_scale(const u8 *s, int g) {
    const int lo = (s[g & 7] >> (4 * (g >> 3))) & 0xF, hi = (s[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

// element j of the block at b, as ggml's dequantize_row_* gives it
template <int T> __device__ __forceinline__ float dq(const u8 *b, int j);
template <> __device__ __forceinline__ float dq<T_F32>(const u8 *b, int j) { return *(const float *)b; }
template <> __device__ __forceinline__ float dq<T_F16>(const u8 *b, int j) { return ld_f16(b); }
template <> __device__ __forceinline__ float dq<T_BF16>(const u8 *b, int j) { return bf16_to_f32(*(const u16 *)b); }
template <> __device__ __forceinline__ float dq<T_Q8_0>(const u8 *b, int j) { return ld_f16(b) * (float)(i8)b[2 + j]; }
template <> __device__ __forceinline__ float dq<T_Q4_0>(const u8 *b, int j) {
    int q = j < 16 ? (b[2 + j] & 0xF) : (b[2 + j - 16] >> 4);
    return ld_f16(b) * (float)(q - 8);
}
template <> __device__ __forceinline__ float dq<T_Q4_1>(const u8 *b, int j) {
    int q = j < 16 ? (b[4 + j] & 0xF) : (b[4 + j - 16] >> 4);
    return ld_f16(b) * (float)q + ld_f16(b + 2);
}
template <> __device__ __forceinline__ float dq<T_Q5_0>(const u8 *b, int j) {
    u32 qh = (u32)ld_i32_a2(b + 2);
    int q = (j < 16 ? (b[6 + j] & 0xF) : (b[6 + j - 16] >> 4)) | (((qh >> j) & 1) << 4);
    return ld_f16(b) * (float)(q - 16);
}
template <> __device__ __forceinline__ float dq<T_Q5_1>(const u8 *b, int j) {
    u32 qh = *(const u32 *)(b + 4);
    int q = (j < 16 ? (b[8 + j] & 0xF) : (b[8 + j - 16] >> 4)) | (((qh >> j) & 1) << 4);
    return ld_f16(b) * (float)q + ld_f16(b + 2);
}
template <> __device__ __forceinline__ float dq<T_Q2_K>(const u8 *b, int j) {
    int h = j >> 7, r = j & 127, k = r >> 5, l = r & 31;
    int q = (b[16 + 32 * h + l] >> (2 * k)) & 3;
    int sc = b[j >> 4];
    return ld_f16(b + 80) * (float)(sc & 15) * (float)q - ld_f16(b + 82) * (float)(sc >> 4);
}
template <> __device__ __forceinline__ float dq<T_Q3_K>(const u8 *b, int j) {
    int h = j >> 7, r = j & 127, k = r >> 5, l = r & 31;
    int q = (b[32 + 32 * h + l] >> (2 * k)) & 3;
    if (!((b[l] >> (4 * h + k)) & 1)) q -= 4;
    return ld_f16(b + 108) * (float)k3_scale(b + 96, j >> 4) * (float)q;
}
template <> __device__ __forceinline__ float dq<T_Q4_K>(const u8 *b, int j) {
    int g = j >> 6, w = j & 63;
    int q = w < 32 ? (b[16 + 32 * g + w] & 0xF) : (b[16 + 32 * g + w - 32] >> 4);
    float sc, m;
    k4_scale_min(b + 4, j >> 5, sc, m);
    return ld_f16(b) * sc * (float)q - ld_f16(b + 2) * m;
}
template <> __device__ __forceinline__ float dq<T_Q5_K>(const u8 *b, int j) {
    int g = j >> 6, w = j & 63, sb = j >> 5;
    int q = w < 32 ? (b[48 + 32 * g + w] & 0xF) : (b[48 + 32 * g + w - 32] >> 4);
    q |= ((b[16 + (j & 31)] >> sb) & 1) << 4;
    float sc, m;
    k4_scale_min(b + 4, sb, sc, m);
    return ld_f16(b) * sc * (float)q - ld_f16(b + 2) * m;
}
// the lookup-table types: index j < 16 in the low nibble of byte j of qs, j >= 16 in the high one of j - 16
__device__ __forceinline__ int nibble(const u8 *qs, int j) { return j < 16 ? (qs[j] & 0xF) : (qs[j - 16] >> 4); }
template <> __device__ __forceinline__ float dq<T_IQ4_NL>(const u8 *b, int j) {
    return ld_f16(b) * (float)IQ4_VALUES[nibble(b + 2, j)];
}
template <> __device__ __forceinline__ float dq<T_MXFP4>(const u8 *b, int j) {
    return e8m0_half(b[0]) * (float)MXFP4_VALUES[nibble(b + 1, j)];
}
template <> __device__ __forceinline__ float dq<T_IQ4_XS>(const u8 *b, int j) {
    const int ib = j >> 5;
    return (ld_f16(b) * (float)iq4xs_scale(b, ib)) * (float)IQ4_VALUES[nibble(b + 8 + 16 * ib, j & 31)];
}
template <> __device__ __forceinline__ float dq<T_Q6_K>(const u8 *b, int j) {
    int half = j >> 7, r = j & 127, k = r >> 5, l = r & 31;
    int byte = b[64 * half + l + 32 * (k & 1)];
    int lo = k < 2 ? (byte & 0xF) : (byte >> 4);
    int hi = (b[128 + 32 * half + l] >> (2 * k)) & 3;
    return ld_f16(b + 208) * (float)(i8)b[192 + (j >> 4)] * (float)((lo | (hi << 4)) - 32);
}

// element `col` of a row of type T starting at `row`
template <int T> __device__ __forceinline__ float dq_at(const u8 *row, int col) {
    return dq<T>(row + (col / Block<T>::QK) * Block<T>::BYTES, col % Block<T>::QK);
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float gelu(float x) {
    const float c = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.0f + tanhf(c * x * (1.0f + 0.044715f * x * x)));
}
// the gate's activation of a gated unit: 1 silu (swiglu), 2 gelu (geglu)
template <int F> __device__ __forceinline__ float glu_act(float x) { return F == 1 ? silu(x) : gelu(x); }
// gpt-oss's gated unit (ggml's swiglu_oai): x = min(g, limit), x sigmoid(alpha x) (clamp(u, -limit, limit) + 1)
__device__ __forceinline__ float swiglu_oai_of(float g, float u, float alpha, float limit) {
    const float x = fminf(g, limit), y = fminf(fmaxf(u, -limit), limit);
    return x / (1.0f + expf(-alpha * x)) * (y + 1.0f);
}
// a gated unit of gate g and up u: F 1 swiglu, 2 geglu (act(g) u), 3 swiglu_oai (alpha and limit its constants)
#define GLU_OAI 3
template <int F> __device__ __forceinline__ float glu_pair(float g, float u, float alpha, float limit) {
    if constexpr (F == GLU_OAI) return swiglu_oai_of(g, u, alpha, limit);
    else return glu_act<F>(g) * u;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
// integer min / max over a warp (a single instruction from compute capability 8.0)
__device__ __forceinline__ int warp_min_i(int v) {
#if __CUDA_ARCH__ >= 800
    return __reduce_min_sync(0xffffffff, v);
#else
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
#endif
}
__device__ __forceinline__ int warp_max_i(int v) {
#if __CUDA_ARCH__ >= 800
    return __reduce_max_sync(0xffffffff, v);
#else
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
#endif
}
// integer sum over a warp
__device__ __forceinline__ int warp_sum_i(int v) {
#if __CUDA_ARCH__ >= 800
    return __reduce_add_sync(0xffffffff, v);
#else
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
#endif
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// One tensor-core product c += a b (mma.sync m16n8k16: f16 inputs, f32 sums). Fragment layouts (PTX ISA):
// lane = 4 * grp + tig; A (16 x 16) holds rows grp and grp + 8, columns 2 tig (+1) and 2 tig + 8 (+1) in
// a[0] (row grp), a[1] (row grp + 8), a[2] (row grp, columns + 8), a[3]; B (16 x 8) column grp, rows 2 tig
// (+1) in b0 and 2 tig + 8 (+1) in b1; C rows grp (c[0], c[1]) and grp + 8 (c[2], c[3]), columns 2 tig (+1).
__device__ __forceinline__ void mma16816(float *c, const u32 *a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D = A B + D on tensor cores for int8: A 16 x 32 (row-major fragments a[4]), B 32 x 8 (b0, b1), i32 sums
__device__ __forceinline__ void mma_s8(int *c, const int *a, int b0, int b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 32 activations in the 8-bit blocks the __dp4a products read (ggml's block_q8_1)
struct block_q8_1 {
    __half2 ds;  // scale d = amax / 127, and the sum of the block's original values
    i8 qs[32];
};

// lane j of a warp holds element j of a block: all 32 write it, quantized, to dst
__device__ __forceinline__ void quantize_warp(float v, block_q8_1 *dst) {
    const int lane = threadIdx.x & 31;
    const float amax = warp_max(fabsf(v)), sum = warp_sum(v), d = amax / 127.0f;
    dst->qs[lane] = amax == 0.0f ? 0 : (i8)roundf(v / d);
    if (lane == 0) dst->ds = make_half2(__float2half(d), __float2half(sum));
}

// the sum of v over a block of up to 1024 threads (every thread gets it); `sh` holds 32 floats
__device__ __forceinline__ float block_sum(float v, float *sh) {
    v = warp_sum(v);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < (blockDim.x + 31) / 32 ? sh[lane] : 0.0f;
    return warp_sum(v);
}

// Whether this block is the last of n to get here, counted by *ticket (the last block resets it to 0 when
// done): every thread calls it once its block has written what the last one merges, which then sees it.
__device__ __forceinline__ bool last_block(int *ticket, int n) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1) == n - 1;
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// load / store one element of a float tensor (T_F32, T_F16, T_BF16)
template <int T> __device__ __forceinline__ float ld(const void *p, i64 i);
template <> __device__ __forceinline__ float ld<T_F32>(const void *p, i64 i) { return ((const float *)p)[i]; }
template <> __device__ __forceinline__ float ld<T_F16>(const void *p, i64 i) { return __half2float(((const __half *)p)[i]); }
template <> __device__ __forceinline__ float ld<T_BF16>(const void *p, i64 i) { return bf16_to_f32(((const u16 *)p)[i]); }
template <int T> __device__ __forceinline__ void st(void *p, i64 i, float v);
template <> __device__ __forceinline__ void st<T_F32>(void *p, i64 i, float v) { ((float *)p)[i] = v; }
template <> __device__ __forceinline__ void st<T_F16>(void *p, i64 i, float v) { ((__half *)p)[i] = __float2half(v); }
template <> __device__ __forceinline__ void st<T_BF16>(void *p, i64 i, float v) {
    u32 bits = __float_as_uint(v);
    ((u16 *)p)[i] = (u16)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// Weight products. Few tokens (decode): activations quantized to q8_1 blocks and integer dot
// products (__dp4a) against the legacy block types, the k-quants and the lookup-table types (IQ4_NL,
// IQ4_XS, MXFP4: each 4-bit index replaced by its table's int8 value first), as ggml's mmvq; other types
// decode their blocks in the GEMV. Many tokens: weights decoded to f16 tiles for a cuBLAS GEMM (host side).

// x [rows, ncols] (row stride ldx elements) -> y [rows, ncols / 32] q8_1 blocks; one warp per block
extern "C" __global__ void quantize_q8_1(const float *x, block_q8_1 *y, int ncols, i64 ldx, int rows) {
    pdl_begin();
    i64 blk = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int nb = ncols / 32;
    if (blk >= (i64)rows * nb) return;
    int lane = threadIdx.x & 31;
    i64 r = blk / nb, b = blk % nb;
    quantize_warp(x[r * ldx + b * 32 + lane], y + blk);
}

// integer dot product of one weight block with one q8_1 block, scaled (ggml's vec_dot_*_q8_1)
template <int T> __device__ __forceinline__ float vdot(const u8 *b, const block_q8_1 &y);

template <> __device__ __forceinline__ float vdot<T_Q4_0>(const u8 *b, const block_q8_1 &y) {
    const int *u = (const int *)y.qs;
    int s = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int v = ld_i32_a2(b + 2 + 4 * i);
        s = __dp4a(v & 0x0F0F0F0F, u[i], s);
        s = __dp4a((v >> 4) & 0x0F0F0F0F, u[i + 4], s);
    }
    float2 ds = __half22float2(y.ds);
    return ld_f16(b) * ((float)s * ds.x - 8.0f * ds.y);
}
template <> __device__ __forceinline__ float vdot<T_Q4_1>(const u8 *b, const block_q8_1 &y) {
    const int *u = (const int *)y.qs;
    const int *q = (const int *)(b + 4);
    int s = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int v = q[i];
        s = __dp4a(v & 0x0F0F0F0F, u[i], s);
        s = __dp4a((v >> 4) & 0x0F0F0F0F, u[i + 4], s);
    }
    float2 ds = __half22float2(y.ds);
    return ld_f16(b) * ds.x * (float)s + ld_f16(b + 2) * ds.y;
}
// the fifth bits of 4 consecutive elements starting at bit `from` of qh, placed at bit 4 of each byte
__device__ __forceinline__ int q5_high(u32 qh, int from) {
    u32 h = qh >> from;
    return (int)(((h << 4) & 0x10) | ((h << 11) & 0x1000) | ((h << 18) & 0x100000) | ((h << 25) & 0x10000000));
}
template <> __device__ __forceinline__ float vdot<T_Q5_0>(const u8 *b, const block_q8_1 &y) {
    const int *u = (const int *)y.qs;
    u32 qh = (u32)ld_i32_a2(b + 2);
    int s = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int v = ld_i32_a2(b + 6 + 4 * i);
        s = __dp4a((v & 0x0F0F0F0F) | q5_high(qh, 4 * i), u[i], s);
        s = __dp4a(((v >> 4) & 0x0F0F0F0F) | q5_high(qh, 16 + 4 * i), u[i + 4], s);
    }
    float2 ds = __half22float2(y.ds);
    return ld_f16(b) * ((float)s * ds.x - 16.0f * ds.y);
}
template <> __device__ __forceinline__ float vdot<T_Q5_1>(const u8 *b, const block_q8_1 &y) {
    const int *u = (const int *)y.qs;
    u32 qh = *(const u32 *)(b + 4);
    const int *q = (const int *)(b + 8);
    int s = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int v = q[i];
        s = __dp4a((v & 0x0F0F0F0F) | q5_high(qh, 4 * i), u[i], s);
        s = __dp4a(((v >> 4) & 0x0F0F0F0F) | q5_high(qh, 16 + 4 * i), u[i + 4], s);
    }
    float2 ds = __half22float2(y.ds);
    return ld_f16(b) * ds.x * (float)s + ld_f16(b + 2) * ds.y;
}
template <> __device__ __forceinline__ float vdot<T_Q8_0>(const u8 *b, const block_q8_1 &y) {
    const int *u = (const int *)y.qs;
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) s = __dp4a(ld_i32_a2(b + 2 + 4 * i), u[i], s);
    return ld_f16(b) * __low2float(y.ds) * (float)s;
}

// the eight 4-bit indices of q4 as the int8 values of the 16-entry table `t` they stand for, packed for __dp4a:
// .x the low nibbles' four values, .y the high nibbles' (ggml's get_int_from_table_16). The table is read as
// four words, the same for every thread (a broadcast of constant memory); each index then picks its byte by
// __byte_perm in registers, where indexing the table by the indices would make a warp's threads read 32
// different constant addresses one after another
__device__ __forceinline__ int2 lut4_pair(int q4, const i8 *t) {
    const u32 *t32 = (const u32 *)t;
    const u32 q = (u32)q4;
    const u32 pick_high = 0x32103210u | ((q & 0x88888888u) >> 1);  // index bit 3: from bytes 8-15
    u32 part[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const u32 sel = q >> (16 * i);  // __byte_perm reads the low 3 bits of the selector's 4 low nibbles
        const u32 lo = __byte_perm(t32[0], t32[1], sel), hi = __byte_perm(t32[2], t32[3], sel);
        part[i] = __byte_perm(lo, hi, pick_high >> (16 * i));
    }
    return make_int2((int)__byte_perm(part[0], part[1], 0x6420), (int)__byte_perm(part[0], part[1], 0x7531));
}
// the integer sum of 32 table values (16 bytes of index pairs at qs) times a q8_1 block's quants
__device__ __forceinline__ int lut4_sum(const u8 *qs, const int *u, const i8 *t, bool aligned4) {
    int s = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int2 v = lut4_pair(aligned4 ? *(const int *)(qs + 4 * i) : ld_i32_a1(qs + 4 * i), t);
        s = __dp4a(v.x, u[i], s);
        s = __dp4a(v.y, u[i + 4], s);
    }
    return s;
}
template <> __device__ __forceinline__ float vdot<T_IQ4_NL>(const u8 *b, const block_q8_1 &y) {
    const int *u = (const int *)y.qs;
    int s = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {  // blocks of 18 bytes align only to 2
        const int2 v = lut4_pair(ld_i32_a2(b + 2 + 4 * i), IQ4_VALUES);
        s = __dp4a(v.x, u[i], s);
        s = __dp4a(v.y, u[i + 4], s);
    }
    return ld_f16(b) * __low2float(y.ds) * (float)s;
}
template <> __device__ __forceinline__ float vdot<T_MXFP4>(const u8 *b, const block_q8_1 &y) {
    const int s = lut4_sum(b + 1, (const int *)y.qs, MXFP4_VALUES, false);
    return e8m0_half(b[0]) * __low2float(y.ds) * (float)s;
}

// The k-quants against one q8_1 block: sub-block j (32 elements) of the 256 of the super-block at b, as
// ggml's vec_dot_q*_K_q8_1: a sub-block's min meets the sum of the block's int8 activations.
template <int T> __device__ __forceinline__ float vdot_k(const u8 *b, int j, const block_q8_1 &y);

// the sum of a q8_1 block's 32 int8 activations
__device__ __forceinline__ int q8_sum(const int *u) {
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) s = __dp4a(0x01010101, u[i], s);
    return s;
}
// Q4_K: sub-block j's nibbles are the low (j even) or high halves of bytes 32 (j / 2) .. + 31 of qs
template <> __device__ __forceinline__ float vdot_k<T_Q4_K>(const u8 *b, int j, const block_q8_1 &y) {
    const int *u = (const int *)y.qs, *q = (const int *)(b + 16 + 32 * (j >> 1));
    const int shift = 4 * (j & 1);
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) s = __dp4a((q[i] >> shift) & 0x0F0F0F0F, u[i], s);
    float sc, m;
    k4_scale_min(b + 4, j, sc, m);
    return __low2float(y.ds) * (ld_f16(b) * sc * (float)s - ld_f16(b + 2) * m * (float)q8_sum(u));
}
// Q5_K: as Q4_K, each element's fifth bit is bit j of its byte of qh
template <> __device__ __forceinline__ float vdot_k<T_Q5_K>(const u8 *b, int j, const block_q8_1 &y) {
    const int *u = (const int *)y.qs, *q = (const int *)(b + 48 + 32 * (j >> 1)), *h = (const int *)(b + 16);
    const int shift = 4 * (j & 1);
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int v = ((q[i] >> shift) & 0x0F0F0F0F) | (((h[i] >> j) & 0x01010101) << 4);
        s = __dp4a(v, u[i], s);
    }
    float sc, m;
    k4_scale_min(b + 4, j, sc, m);
    return __low2float(y.ds) * (ld_f16(b) * sc * (float)s - ld_f16(b + 2) * m * (float)q8_sum(u));
}
// Q6_K: sub-block j is part k = j % 4 of half j / 4: four low bits from ql, two high from qh, minus 32; a
// signed scale per 16 elements. Blocks of 210 bytes align only to 2.
template <> __device__ __forceinline__ float vdot_k<T_Q6_K>(const u8 *b, int j, const block_q8_1 &y) {
    const int *u = (const int *)y.qs;
    const int half = j >> 2, k = j & 3;
    const u8 *ql = b + 64 * half + 32 * (k & 1), *qh = b + 128 + 32 * half;
    const int shift = 4 * (k >> 1);
    int s0 = 0, s1 = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int lo = (ld_i32_a2(ql + 4 * i) >> shift) & 0x0F0F0F0F;
        const int hi = ((ld_i32_a2(qh + 4 * i) >> (2 * k)) & 0x03030303) << 4;
        const int v = __vsubss4(lo | hi, 0x20202020);
        if (i < 4) s0 = __dp4a(v, u[i], s0);
        else s1 = __dp4a(v, u[i], s1);
    }
    const i8 *sc = (const i8 *)(b + 192 + 8 * half + 2 * k);
    return ld_f16(b + 208) * __low2float(y.ds) * ((float)sc[0] * (float)s0 + (float)sc[1] * (float)s1);
}

// Q2_K: sub-block j is the two bits at shift 2 (j % 4) of bytes 32 (j / 4) .. + 31 of qs; its halves of 16
// elements each have their own byte of scales (scale in the low nibble, min in the high)
template <> __device__ __forceinline__ float vdot_k<T_Q2_K>(const u8 *b, int j, const block_q8_1 &y) {
    const int *u = (const int *)y.qs, *q = (const int *)(b + 16 + 32 * (j >> 2));
    const int shift = 2 * (j & 3);
    int s0 = 0, s1 = 0, m0 = 0, m1 = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int v = (q[i] >> shift) & 0x03030303;
        if (i < 4) s0 = __dp4a(v, u[i], s0), m0 = __dp4a(0x01010101, u[i], m0);
        else s1 = __dp4a(v, u[i], s1), m1 = __dp4a(0x01010101, u[i], m1);
    }
    const u8 sc0 = b[2 * j], sc1 = b[2 * j + 1];
    const float sums = (float)(sc0 & 15) * (float)s0 + (float)(sc1 & 15) * (float)s1;
    const float mins = (float)(sc0 >> 4) * (float)m0 + (float)(sc1 >> 4) * (float)m1;
    return __low2float(y.ds) * (ld_f16(b + 80) * sums - ld_f16(b + 82) * mins);
}
// Q3_K: as Q2_K's low bits (qs at 32), minus 4 where bit j of the element's byte of hmask is clear; a
// signed scale per 16 elements. Blocks of 110 bytes align only to 2.
template <> __device__ __forceinline__ float vdot_k<T_Q3_K>(const u8 *b, int j, const block_q8_1 &y) {
    const int *u = (const int *)y.qs;
    const u8 *q = b + 32 + 32 * (j >> 2);
    const int shift = 2 * (j & 3);
    int s0 = 0, s1 = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int lo = (ld_i32_a2(q + 4 * i) >> shift) & 0x03030303;
        const int hi = ((ld_i32_a2(b + 4 * i) >> j) & 0x01010101) << 2;
        const int v = __vsubss4(lo | hi, 0x04040404);
        if (i < 4) s0 = __dp4a(v, u[i], s0);
        else s1 = __dp4a(v, u[i], s1);
    }
    const float sums = (float)k3_scale(b + 96, 2 * j) * (float)s0 + (float)k3_scale(b + 96, 2 * j + 1) * (float)s1;
    return ld_f16(b + 108) * __low2float(y.ds) * sums;
}

// IQ4_XS: sub-block j's 16 bytes of index pairs at 8 + 16 j (blocks of 136 bytes: 4-aligned), its scale
template <> __device__ __forceinline__ float vdot_k<T_IQ4_XS>(const u8 *b, int j, const block_q8_1 &y) {
    const int s = lut4_sum(b + 8 + 16 * j, (const int *)y.qs, IQ4_VALUES, true);
    return ld_f16(b) * (float)iq4xs_scale(b, j) * __low2float(y.ds) * (float)s;
}

// vdot of the 32 weights of row `row` that q8_1 block b of the activations meets
template <int T> __device__ __forceinline__ float vdot_at(const u8 *row, int b, const block_q8_1 &y) {
    if constexpr (Block<T>::QK == 32) return vdot<T>(row + (i64)b * Block<T>::BYTES, y);
    else return vdot_k<T>(row + (i64)(b >> 3) * Block<T>::BYTES, b & 7, y);
}

// out[c, row] = W[row] . y[c] for NC token rows; a warp per weight row, its lanes over the blocks.
// Up to three weights of one type and width in one launch (q, k and v; gate and up): global row
// `row` falls in weight 0 (rows [0, m0)), 1 ([m0, m0 + m1)) or 2 (the rest, up to `rows`); each
// weight's product [NC, m_i] is contiguous at o_i. With B (mmvq_bias: a bias add after the product),
// weight i given a bias vector b_i (nullptr: none) also stores q_i[c, row] = out + b_i[row], after out.
template <int T, int NC, bool B>
__device__ __forceinline__ void mmvq_rows(const u8 *w0, const u8 *w1, const u8 *w2, float *o0, float *o1, float *o2,
                                          const float *b0, const float *b1, const float *b2, float *q0, float *q1,
                                          float *q2, int m0, int m1, const block_q8_1 *y, int ncols, i64 row_bytes,
                                          int rows, int pf) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const bool live = row < rows;
    const u8 *w = w0;
    float *out = o0, *biased = q0;
    const float *bias = b0;
    int ldo = m0;
    if (row >= m0 + m1) {
        w = w2, out = o2, ldo = rows - m0 - m1, row -= m0 + m1;
        if constexpr (B) bias = b2, biased = q2;
    } else if (row >= m0) {
        w = w1, out = o1, ldo = m1, row -= m0;
        if constexpr (B) bias = b1, biased = q1;
    }
    int lane = threadIdx.x & 31, nb = ncols / 32;
    const u8 *wr = w + row * row_bytes;
    if (live && pf) prefetch_l2(wr, row_bytes, lane, 32);
    pdl_begin();
    if (!live) return;
    float acc[NC];
#pragma unroll
    for (int c = 0; c < NC; c++) acc[c] = 0.0f;
    for (int b = lane; b < nb; b += 32) {
#pragma unroll
        for (int c = 0; c < NC; c++) acc[c] += vdot_at<T>(wr, b, y[(i64)c * nb + b]);
    }
#pragma unroll
    for (int c = 0; c < NC; c++) {
        float v = warp_sum(acc[c]);
        if (lane == 0) {
            out[(i64)c * ldo + row] = v;
            if constexpr (B) {
                if (bias != nullptr) biased[(i64)c * ldo + row] = v + bias[row];
            }
        }
    }
}

template <int T, int NC>
__global__ void mmvq(const u8 *w0, const u8 *w1, const u8 *w2, float *o0, float *o1, float *o2, int m0, int m1,
                     const block_q8_1 *y, int ncols, i64 row_bytes, int rows, int pf) {
    mmvq_rows<T, NC, false>(w0, w1, w2, o0, o1, o2, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, m0, m1, y,
                            ncols, row_bytes, rows, pf);
}

template <int T, int NC>
__global__ void mmvq_bias(const u8 *w0, const u8 *w1, const u8 *w2, float *o0, float *o1, float *o2, const float *b0,
                          const float *b1, const float *b2, float *q0, float *q1, float *q2, int m0, int m1,
                          const block_q8_1 *y, int ncols, i64 row_bytes, int rows, int pf) {
    mmvq_rows<T, NC, true>(w0, w1, w2, o0, o1, o2, b0, b1, b2, q0, q1, q2, m0, m1, y, ncols, row_bytes, rows, pf);
}

// One token's q, k and v products (mmvq's three weights; `pos` and `idx` of token 0) and what the layer does
// with them before attention (rope_qkv, rope.cu): q and k rotated (ROPE_NORMAL, no head norm; q times
// q_scale), q into q_out, k and v into row idx[0] of their caches (type D). A rotated pair is two
// consecutive rows, so two warps of one block: they meet in shared memory. The plain products are written
// too, as mmvq does.
template <int T, int D>
__global__ void mmvq_rope_qkv(const u8 *w0, const u8 *w1, const u8 *w2, float *o0, float *o1, float *o2, int m0,
                              int m1, const block_q8_1 *y, int ncols, i64 row_bytes, int rows, const int *pos,
                              const int *idx, float *q_out, void *k_dst, void *v_dst, i64 ldd_k, i64 ldd_v,
                              float q_scale, int n_dims, int d, float theta_scale, float freq_scale, int pf) {
    __shared__ float vals[32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    int row = blockIdx.x * (blockDim.x / 32) + warp, part = 0;
    const bool live = row < rows;
    const u8 *w = w0;
    float *out = o0;
    if (row >= m0 + m1) {
        w = w2, out = o2, part = 2, row -= m0 + m1;
    } else if (row >= m0) {
        w = w1, out = o1, part = 1, row -= m0;
    }
    const int nb = ncols / 32;
    const u8 *wr = w + row * row_bytes;
    if (live && pf) prefetch_l2(wr, row_bytes, lane, 32);
    pdl_begin();
    float v = 0.0f;
    if (live) {
        for (int b = lane; b < nb; b += 32) v += vdot_at<T>(wr, b, y[b]);
        v = warp_sum(v);
        if (lane == 0) out[row] = v;
    }
    if (lane == 0) vals[warp] = v;
    __syncthreads();
    if (!live || lane != 0) return;
    const int e = row % d;
    if (part < 2 && e < n_dims) {
        const float theta = freq_scale * (float)pos[0] * powf(theta_scale, (float)(e / 2));
        float sn, cs;
        sincosf(theta, &sn, &cs);
        const float x0 = vals[warp & ~1], x1 = vals[warp | 1];
        v = e & 1 ? x0 * sn + x1 * cs : x0 * cs - x1 * sn;
    }
    if (part == 0) q_out[row] = v * q_scale;
    else st<D>(part == 1 ? k_dst : v_dst, (i64)idx[0] * (part == 1 ? ldd_k : ldd_v) + row, v);
}

// out[c, row] = act(G[row] . y[c]) * (U[row] . y[c]): a gated feed-forward's first half (F: 1 swiglu,
// 2 geglu), both products of a row in one warp so neither leaves registers. With q8 (launched with
// 32 warps a block, rows a multiple of 32) the block also writes its 32 outputs of each token row as
// one q8_1 block of the next product's activations [NC, rows / 32].
template <int T, int NC, int F>
__global__ void mmvq_glu(const u8 *wg, const u8 *wu, const block_q8_1 *y, float *out, int ncols, i64 row_bytes,
                         int rows, block_q8_1 *q8, int pf) {
    __shared__ float vals[NC][32];
    const int warp = threadIdx.x / 32, row = blockIdx.x * (blockDim.x / 32) + warp;
    const int lane = threadIdx.x & 31, nb = ncols / 32;
    if (row < rows && pf) {
        prefetch_l2(wg + row * row_bytes, row_bytes, lane, 32);
        prefetch_l2(wu + row * row_bytes, row_bytes, lane, 32);
    }
    pdl_begin();
    if (row < rows) {
        const u8 *gr = wg + row * row_bytes, *ur = wu + row * row_bytes;
        float ag[NC], au[NC];
#pragma unroll
        for (int c = 0; c < NC; c++) ag[c] = au[c] = 0.0f;
        for (int b = lane; b < nb; b += 32) {
#pragma unroll
            for (int c = 0; c < NC; c++) {
                const block_q8_1 &yb = y[(i64)c * nb + b];
                ag[c] += vdot_at<T>(gr, b, yb);
                au[c] += vdot_at<T>(ur, b, yb);
            }
        }
#pragma unroll
        for (int c = 0; c < NC; c++) {
            const float g = warp_sum(ag[c]), u = warp_sum(au[c]), h = glu_act<F>(g) * u;
            if (lane == 0) {
                out[(i64)c * rows + row] = h;
                if (q8 != nullptr) vals[c][warp] = h;
            }
        }
    }
    if (q8 == nullptr) return;
    __syncthreads();
    if (warp < NC) quantize_warp(vals[warp][lane], q8 + (i64)warp * (rows / 32) + blockIdx.x);
}

// the same product for any weight type against f32 activations x [NC, ncols] (row stride ldx):
// the lanes decode consecutive elements. With B (gemv_bias) also biased[c, row] = out + bias[row].
template <int T, int NC, bool B>
__device__ __forceinline__ void gemv_rows(const u8 *w, const float *x, const float *bias, float *out, float *biased,
                                          int ncols, i64 row_bytes, i64 ldx, int rows, i64 ldo) {
    pdl_begin();
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    int lane = threadIdx.x & 31;
    const u8 *wr = w + row * row_bytes;
    float acc[NC];
#pragma unroll
    for (int c = 0; c < NC; c++) acc[c] = 0.0f;
    for (int e = lane; e < ncols; e += 32) {
        float v = dq_at<T>(wr, e);
#pragma unroll
        for (int c = 0; c < NC; c++) acc[c] += v * x[c * ldx + e];
    }
#pragma unroll
    for (int c = 0; c < NC; c++) {
        float v = warp_sum(acc[c]);
        if (lane == 0) {
            out[c * ldo + row] = v;
            if constexpr (B) biased[c * ldo + row] = v + bias[row];
        }
    }
}

template <int T, int NC>
__global__ void gemv(const u8 *w, const float *x, float *out, int ncols, i64 row_bytes, i64 ldx, int rows, i64 ldo) {
    gemv_rows<T, NC, false>(w, x, nullptr, out, nullptr, ncols, row_bytes, ldx, rows, ldo);
}

template <int T, int NC>
__global__ void gemv_bias(const u8 *w, const float *x, const float *bias, float *out, float *biased, int ncols,
                          i64 row_bytes, i64 ldx, int rows, i64 ldo) {
    gemv_rows<T, NC, true>(w, x, bias, out, biased, ncols, row_bytes, ldx, rows, ldo);
}

// rows [r0, r0 + n) of a weight decoded to f16, contiguous (a GEMM tile); thread per element
template <int T>
__global__ void dequant_f16(const u8 *w, __half *dst, int ncols, i64 row_bytes, i64 r0, i64 n) {
    pdl_begin();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * ncols) return;
    i64 r = r0 + i / ncols;
    dst[i] = __float2half(dq_at<T>(w + r * row_bytes, (int)(i % ncols)));
}

// the same tile, eight consecutive elements a thread written with one 16-byte store (ncols a multiple of 8):
// a thread per element wrote two bytes at a time and decoded its block's scale for each
template <int T>
__global__ void dequant_f16_x8(const u8 *w, __half *dst, int ncols, i64 row_bytes, i64 r0, i64 n) {
    pdl_begin();
    const i64 i = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (i >= n * ncols) return;
    const int c = (int)(i % ncols);
    const u8 *row = w + (r0 + i / ncols) * row_bytes;
    const u8 *blk = row + (c / Block<T>::QK) * Block<T>::BYTES;
    const int j = c % Block<T>::QK;
    __half2 h[4];
#pragma unroll
    for (int x = 0; x < 4; x++) {
        const float a = Block<T>::QK >= 8 ? dq<T>(blk, j + 2 * x) : dq_at<T>(row, c + 2 * x);
        const float b = Block<T>::QK >= 8 ? dq<T>(blk, j + 2 * x + 1) : dq_at<T>(row, c + 2 * x + 1);
        h[x] = __floats2half2_rn(a, b);
    }
    *(uint4 *)(dst + i) = *(const uint4 *)h;
}

// f32 rows [n, ncols] (row stride ldx) to contiguous f16 (the GEMM's activations)
extern "C" __global__ void f32_to_f16(const float *x, __half *dst, int ncols, i64 ldx, i64 n) {
    pdl_begin();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * ncols) return;
    dst[i] = __float2half(x[(i / ncols) * ldx + i % ncols]);
}

// out[r, :] = row ids[r] of a (any type) as f32: embeddings
template <int T>
__global__ void get_rows(const u8 *a, const int *ids, float *out, int ncols, i64 row_bytes, i64 n, i64 ldo) {
    pdl_begin();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * ncols) return;
    i64 r = i / ncols;
    int c = (int)(i % ncols);
    out[r * ldo + c] = dq_at<T>(a + (i64)ids[r] * row_bytes, c);
}

// products of float operands with any strides (attention without the fused op):
// out[b, n, m] = sum_k a[b / r, m, k] * b[b, n, k]; thread per output, k in a loop
template <int TA, int TB>
__global__ void mul_mat_float(const void *a, const void *bm, float *out, int M, int N, int K, int B, int r,
                              i64 sa0, i64 sa1, i64 sa2, i64 sb0, i64 sb1, i64 sb2) {
    pdl_begin();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)B * N * M) return;
    int m = (int)(i % M), n = (int)((i / M) % N), b = (int)(i / ((i64)M * N));
    i64 oa = (i64)(b / r) * sa0 + (i64)m * sa1, ob = (i64)b * sb0 + (i64)n * sb1;
    float s = 0.0f;
    for (int k = 0; k < K; k++) s += ld<TA>(a, oa + k * sa2) * ld<TB>(bm, ob + k * sb2);
    out[i] = s;
}

// ---- the experts' products (ggml's mul_mat_id): out[s, :] = W[ids[s]] . b[row of slot s] -----------------
// Slot s = t * k + j is token t's j-th chosen expert; its activation row is b's row t (one row a token,
// bstep 0) or s (a row a slot, bstep 1). W holds n_expert matrices [M, ncols] one after another
// (expert_bytes apart); out is [slots, M].

// Decode: mmvq over q8_1 activations y [rows of b, ncols / 32], a warp per weight row, blockIdx.y the slot:
// each slot reads only its own expert's rows. The ids come from the kernel before, so nothing is read
// before pdl_begin. With B (mmvq_id_bias: the experts' bias add after the product) the slot's row of the
// bias matrix [n_expert, M] (its expert's) is stored too, into rows_out (the get_rows node's result), and the
// biased product into biased, after out.
template <int T, bool B>
__device__ __forceinline__ void mmvq_id_rows(const u8 *w, const block_q8_1 *y, const int *ids, const float *bias,
                                             float *out, float *rows_out, float *biased, int ncols, i64 row_bytes,
                                             i64 expert_bytes, int M, int k, i64 ldi, int bstep) {
    pdl_begin();
    const int s = blockIdx.y, t = s / k, j = s % k;
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= M) return;
    const int lane = threadIdx.x & 31, nb = ncols / 32;
    const int e = ids[(i64)t * ldi + j];
    const u8 *wr = w + (i64)e * expert_bytes + (i64)row * row_bytes;
    const block_q8_1 *yr = y + (i64)(bstep ? s : t) * nb;
    float acc = 0.0f;
    for (int b = lane; b < nb; b += 32) acc += vdot_at<T>(wr, b, yr[b]);
    acc = warp_sum(acc);
    if (lane == 0) {
        const i64 o = (i64)s * M + row;
        out[o] = acc;
        if constexpr (B) {
            const float r = bias[(i64)e * M + row];
            rows_out[o] = r;
            biased[o] = acc + r;
        }
    }
}

template <int T>
__global__ void mmvq_id(const u8 *w, const block_q8_1 *y, const int *ids, float *out, int ncols, i64 row_bytes,
                        i64 expert_bytes, int M, int k, i64 ldi, int bstep) {
    mmvq_id_rows<T, false>(w, y, ids, nullptr, out, nullptr, nullptr, ncols, row_bytes, expert_bytes, M, k, ldi, bstep);
}

template <int T>
__global__ void mmvq_id_bias(const u8 *w, const block_q8_1 *y, const int *ids, const float *bias, float *out,
                             float *rows_out, float *biased, int ncols, i64 row_bytes, i64 expert_bytes, int M, int k,
                             i64 ldi, int bstep) {
    mmvq_id_rows<T, true>(w, y, ids, bias, out, rows_out, biased, ncols, row_bytes, expert_bytes, M, k, ldi, bstep);
}

// mmvq_id of a gated unit's gate and up matrices at once (one token's experts: blockIdx.y the slot) and the
// unit after them: go = G . y, uo = U . y (both products, as the nodes' results) and out = glu(go, uo) (F: 1
// swiglu, 2 geglu, 3 swiglu_oai with alpha and limit). With B (mmvq_id_glu_bias: gpt-oss's experts) each
// product's bias add comes first, as in mmvq_id_bias: the slot's rows of bg and bu into g_rows and u_rows, the
// sums into g_sum and u_sum, the unit of the sums into out; every result stored in the nodes' order.
template <int T, int F, bool B>
__device__ __forceinline__ void mmvq_id_glu_rows(const u8 *wg, const u8 *wu, const block_q8_1 *y, const int *ids,
                                                 const float *bg, const float *bu, float *go, float *g_rows,
                                                 float *g_sum, float *uo, float *u_rows, float *u_sum, float *out,
                                                 int ncols, i64 row_bytes, i64 expert_bytes, int M, int k, i64 ldi,
                                                 int bstep, float alpha, float limit) {
    pdl_begin();
    const int s = blockIdx.y, t = s / k, j = s % k;
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= M) return;
    const int lane = threadIdx.x & 31, nb = ncols / 32;
    const int e = ids[(i64)t * ldi + j];
    const i64 at = (i64)e * expert_bytes + (i64)row * row_bytes;
    const u8 *gr = wg + at, *ur = wu + at;
    const block_q8_1 *yr = y + (i64)(bstep ? s : t) * nb;
    float ag = 0.0f, au = 0.0f;
    for (int b = lane; b < nb; b += 32) {
        ag += vdot_at<T>(gr, b, yr[b]);
        au += vdot_at<T>(ur, b, yr[b]);
    }
    ag = warp_sum(ag);
    au = warp_sum(au);
    if (lane == 0) {
        const i64 o = (i64)s * M + row;
        if constexpr (B) {
            const float rg = bg[(i64)e * M + row], ru = bu[(i64)e * M + row], g = ag + rg, u = au + ru;
            go[o] = ag, g_rows[o] = rg, g_sum[o] = g;
            uo[o] = au, u_rows[o] = ru, u_sum[o] = u;
            out[o] = glu_pair<F>(g, u, alpha, limit);
        } else {
            go[o] = ag, uo[o] = au, out[o] = glu_pair<F>(ag, au, alpha, limit);
        }
    }
}

template <int T, int F>
__global__ void mmvq_id_glu(const u8 *wg, const u8 *wu, const block_q8_1 *y, const int *ids, float *go, float *uo,
                            float *out, int ncols, i64 row_bytes, i64 expert_bytes, int M, int k, i64 ldi, int bstep) {
    mmvq_id_glu_rows<T, F, false>(wg, wu, y, ids, nullptr, nullptr, go, nullptr, nullptr, uo, nullptr, nullptr, out,
                                  ncols, row_bytes, expert_bytes, M, k, ldi, bstep, 0.0f, 0.0f);
}

template <int T, int F>
__global__ void mmvq_id_glu_bias(const u8 *wg, const u8 *wu, const block_q8_1 *y, const int *ids, const float *bg,
                                 const float *bu, float *go, float *g_rows, float *g_sum, float *uo, float *u_rows,
                                 float *u_sum, float *out, int ncols, i64 row_bytes, i64 expert_bytes, int M, int k,
                                 i64 ldi, int bstep, float alpha, float limit) {
    mmvq_id_glu_rows<T, F, true>(wg, wu, y, ids, bg, bu, go, g_rows, g_sum, uo, u_rows, u_sum, out, ncols, row_bytes,
                                 expert_bytes, M, k, ldi, bstep, alpha, limit);
}

// Products of a few dozen token rows on int8 tensor cores (ggml's mmq): the activations as q8_1 blocks, each
// weight block's 32 quants as int8 (mq_frag: the elements an m16n8k32 A fragment holds, lo = tig * 4 .. + 3
// and hi = 16 + tig * 4 .. + 3, with its scale d and the coefficient m of the activations' sum, so that a
// block's product is d * dy * (sum of q * u) + m * sy, the same terms as vdot's): Q4_0 and Q5_0 keep their
// offsets in m (-8 d, -16 d) with the block's sum of values as sy (ds.y); the k-quants' mins meet
// dy * (the sum of the int8 activations), as vdot_k.
template <int T> struct MqSumQ { static constexpr bool v = false; };
template <> struct MqSumQ<T_Q4_K> { static constexpr bool v = true; };
template <> struct MqSumQ<T_Q5_K> { static constexpr bool v = true; };

template <int T> __device__ __forceinline__ void mq_frag(const u8 *row, int b, int tig, int &lo, int &hi, float &d,
                                                         float &m);
template <> __device__ __forceinline__ void mq_frag<T_Q4_0>(const u8 *row, int b, int tig, int &lo, int &hi,
                                                            float &d, float &m) {
    const u8 *k = row + (i64)b * 18;
    const int v = ld_i32_a2(k + 2 + 4 * tig);
    lo = v & 0x0F0F0F0F, hi = (v >> 4) & 0x0F0F0F0F, d = ld_f16(k), m = -8.0f * d;
}
template <> __device__ __forceinline__ void mq_frag<T_Q4_1>(const u8 *row, int b, int tig, int &lo, int &hi,
                                                            float &d, float &m) {
    const u8 *k = row + (i64)b * 20;
    const int v = *(const int *)(k + 4 + 4 * tig);
    lo = v & 0x0F0F0F0F, hi = (v >> 4) & 0x0F0F0F0F, d = ld_f16(k), m = ld_f16(k + 2);
}
template <> __device__ __forceinline__ void mq_frag<T_Q5_0>(const u8 *row, int b, int tig, int &lo, int &hi,
                                                            float &d, float &m) {
    const u8 *k = row + (i64)b * 22;
    const u32 qh = (u32)ld_i32_a2(k + 2);
    const int v = ld_i32_a2(k + 6 + 4 * tig);
    lo = (v & 0x0F0F0F0F) | q5_high(qh, 4 * tig), hi = ((v >> 4) & 0x0F0F0F0F) | q5_high(qh, 16 + 4 * tig);
    d = ld_f16(k), m = -16.0f * d;
}
template <> __device__ __forceinline__ void mq_frag<T_Q5_1>(const u8 *row, int b, int tig, int &lo, int &hi,
                                                            float &d, float &m) {
    const u8 *k = row + (i64)b * 24;
    const u32 qh = *(const u32 *)(k + 4);
    const int v = *(const int *)(k + 8 + 4 * tig);
    lo = (v & 0x0F0F0F0F) | q5_high(qh, 4 * tig), hi = ((v >> 4) & 0x0F0F0F0F) | q5_high(qh, 16 + 4 * tig);
    d = ld_f16(k), m = ld_f16(k + 2);
}
template <> __device__ __forceinline__ void mq_frag<T_Q8_0>(const u8 *row, int b, int tig, int &lo, int &hi,
                                                            float &d, float &m) {
    const u8 *k = row + (i64)b * 34;
    lo = ld_i32_a2(k + 2 + 4 * tig), hi = ld_i32_a2(k + 18 + 4 * tig), d = ld_f16(k), m = 0.0f;
}
template <> __device__ __forceinline__ void mq_frag<T_IQ4_NL>(const u8 *row, int b, int tig, int &lo, int &hi,
                                                              float &d, float &m) {
    const u8 *k = row + (i64)b * 18;
    const int v = ld_i32_a2(k + 2 + 4 * tig);
    const int2 lh = lut4_pair(v, IQ4_VALUES);
    lo = lh.x, hi = lh.y, d = ld_f16(k), m = 0.0f;
}
template <> __device__ __forceinline__ void mq_frag<T_MXFP4>(const u8 *row, int b, int tig, int &lo, int &hi,
                                                             float &d, float &m) {
    const u8 *k = row + (i64)b * 17;
    const int v = ld_i32_a1(k + 1 + 4 * tig);
    const int2 lh = lut4_pair(v, MXFP4_VALUES);
    lo = lh.x, hi = lh.y, d = e8m0_half(k[0]), m = 0.0f;
}
// k-quants: sub-block j = b % 8 of the super-block b / 8
template <> __device__ __forceinline__ void mq_frag<T_Q4_K>(const u8 *row, int b, int tig, int &lo, int &hi,
                                                            float &d, float &m) {
    const u8 *k = row + (i64)(b >> 3) * 144;
    const int j = b & 7, shift = 4 * (j & 1);
    const int *q = (const int *)(k + 16 + 32 * (j >> 1));
    lo = (q[tig] >> shift) & 0x0F0F0F0F, hi = (q[4 + tig] >> shift) & 0x0F0F0F0F;
    float sc, mn;
    k4_scale_min(k + 4, j, sc, mn);
    d = ld_f16(k) * sc, m = -ld_f16(k + 2) * mn;
}
template <> __device__ __forceinline__ void mq_frag<T_Q5_K>(const u8 *row, int b, int tig, int &lo, int &hi,
                                                            float &d, float &m) {
    const u8 *k = row + (i64)(b >> 3) * 176;
    const int j = b & 7, shift = 4 * (j & 1);
    const int *q = (const int *)(k + 48 + 32 * (j >> 1)), *h = (const int *)(k + 16);
    lo = ((q[tig] >> shift) & 0x0F0F0F0F) | (((h[tig] >> j) & 0x01010101) << 4);
    hi = ((q[4 + tig] >> shift) & 0x0F0F0F0F) | (((h[4 + tig] >> j) & 0x01010101) << 4);
    float sc, mn;
    k4_scale_min(k + 4, j, sc, mn);
    d = ld_f16(k) * sc, m = -ld_f16(k + 2) * mn;
}

#define MQ_WARPS 8  // warps of an mmq block

// mmq's sums of a tile set to zero
template <int NT> __device__ __forceinline__ void mq_zero(float (*acc)[4]) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
}
// The A fragment of an m16n8k32 product from q8_1 block b of weight rows wa (rows grp) and wb (grp + 8), with their
// scales and sum coefficients (mq_frag)
template <int T>
__device__ __forceinline__ void mq_frags(const u8 *wa, const u8 *wb, int b, int tig, int *a, float &da, float &ma,
                                         float &db, float &mb) {
    mq_frag<T>(wa, b, tig, a[0], a[2], da, ma);
    mq_frag<T>(wb, b, tig, a[1], a[3], db, mb);
}
// An m16n8k32 product's sums c added to acc[4] as one block's terms: rows grp (scale da, sum coefficient ma) and
// grp + 8 (db, mb) against C's two token columns, whose activations' scales and sum terms are y0 and y1
__device__ __forceinline__ void mq_acc(float *acc, const int *c, float da, float ma, float db, float mb, float2 y0,
                                       float2 y1) {
    acc[0] += da * y0.x * (float)c[0] + ma * y0.y;
    acc[1] += da * y1.x * (float)c[1] + ma * y1.y;
    acc[2] += db * y0.x * (float)c[2] + mb * y0.y;
    acc[3] += db * y1.x * (float)c[3] + mb * y1.y;
}
// An m16n8k32 product c of mmq added to acc[4]: the weight fragment's rows grp and grp + 8 (scales
// da/db, sum coefficients ma/mb) against 8 token rows' int8 quants (b0, b1: this lane's B column) whose q8_1
// scales and sums are y0, y1 (C's two columns). For the k-quants each lane of group g sums token g's int8s and
// C's columns read theirs (the mins meet dy * that sum).
template <int T>
__device__ __forceinline__ void mq_add(float *acc, const int *c, float da, float ma, float db, float mb, int b0,
                                       int b1, float2 y0, float2 y1, int tig) {
    if constexpr (MqSumQ<T>::v) {
        int s = __dp4a(0x01010101, b0, __dp4a(0x01010101, b1, 0));
        s += __shfl_xor_sync(0xffffffff, s, 1);
        s += __shfl_xor_sync(0xffffffff, s, 2);
        const int s0 = __shfl_sync(0xffffffff, s, 8 * tig), s1 = __shfl_sync(0xffffffff, s, 8 * tig + 4);
        y0.y = y0.x * (float)s0, y1.y = y1.x * (float)s1;
    }
    mq_acc(acc, c, da, ma, db, mb, y0, y1);
}
// The MQ_WARPS warps' partial sums: warps 1.. leave theirs in red for warp 0 (mq_total), which all wait for.
template <int NT>
__device__ __forceinline__ void mq_share(const float (*acc)[4], float (*red)[NT * 4][32], int warp, int lane) {
    if (warp > 0) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int x = 0; x < 4; x++) red[warp - 1][nt * 4 + x][lane] = acc[nt][x];
    }
    __syncthreads();
}
// Warp 0's sum of element (nt, x), its own partial sum then the others' in warp order (a fixed rounding).
template <int NT>
__device__ __forceinline__ float mq_total(const float (*acc)[4], const float (*red)[NT * 4][32], int nt, int x,
                                          int lane) {
    float v = acc[nt][x];
    for (int o = 0; o < MQ_WARPS - 1; o++) v += red[o][nt * 4 + x][lane];
    return v;
}

// out[t, row] = W[row] . y[t] for N token rows (y: q8_1 blocks [N, ncols / 32]; out's rows ldo apart). Block
// (x, y): weight rows 16 x .. + 15 against tokens 8 NT y .. + 8 NT - 1; its MQ_WARPS warps take every
// MQ_WARPS-th block of 32 columns (m16n8k32 products, NT a block) and are summed in a fixed order at the end.
template <int T, int NT>
__global__ void __launch_bounds__(MQ_WARPS * 32) mmq(const u8 *w, const block_q8_1 *y, float *out, int ncols,
                                                    i64 row_bytes, int M, int N, i64 ldo) {
    pdl_begin();
    __shared__ float red[MQ_WARPS - 1][NT * 4][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, grp = lane >> 2, tig = lane & 3;
    const int m0 = blockIdx.x * 16, n0 = blockIdx.y * NT * 8, nb = ncols / 32;
    const u8 *wa = w + (i64)min(m0 + grp, M - 1) * row_bytes, *wb = w + (i64)min(m0 + grp + 8, M - 1) * row_bytes;
    float acc[NT][4];
    mq_zero<NT>(acc);
#pragma unroll 2
    for (int b = warp; b < nb; b += MQ_WARPS) {
        int a[4];
        float da, ma, db, mb;
        mq_frags<T>(wa, wb, b, tig, a, da, ma, db, mb);
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int tb = n0 + nt * 8 + grp, t0 = n0 + nt * 8 + 2 * tig;  // B's column; C's two columns
            int b0 = 0, b1 = 0;
            if (tb < N) {
                const int *u = (const int *)y[(i64)tb * nb + b].qs;
                b0 = u[tig], b1 = u[4 + tig];
            }
            int c[4] = {0, 0, 0, 0};
            mma_s8(c, a, b0, b1);
            float2 y0 = make_float2(0.0f, 0.0f), y1 = y0;
            if (t0 < N) y0 = __half22float2(y[(i64)t0 * nb + b].ds);
            if (t0 + 1 < N) y1 = __half22float2(y[(i64)(t0 + 1) * nb + b].ds);
            mq_add<T>(acc[nt], c, da, ma, db, mb, b0, b1, y0, y1, tig);
        }
    }
    mq_share<NT>(acc, red, warp, lane);
    if (warp > 0) return;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const float v = mq_total<NT>(acc, red, nt, x, lane);
            const int row = m0 + grp + (x >= 2 ? 8 : 0), tok = n0 + nt * 8 + 2 * tig + (x & 1);
            if (row < M && tok < N) out[(i64)tok * ldo + row] = v;
        }
    }
}

// A prompt's slots grouped by expert (one block): offs[e] .. offs[e + 1] of `list` are the slots routed to
// expert e (in no particular order: each slot's product is computed alone). `cursor` is n_expert ints of
// scratch; the block's shared memory holds n_expert counts. With `tiles` (mmq_idt's), the list of its tiles too:
// each expert's slots bn at a time.
extern "C" __global__ void moe_group(const int *ids, int *offs, int *cursor, int *list, int n_tokens, int k,
                                     i64 ldi, int n_expert, int bn, int *tiles) {
    pdl_begin();
    extern __shared__ int count[];
    const int n = n_tokens * k;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < n; s += blockDim.x) atomicAdd(&count[ids[(i64)(s / k) * ldi + s % k]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int at = 0;
        for (int e = 0; e < n_expert; e++) {
            offs[e] = cursor[e] = at;
            at += count[e];
        }
        offs[n_expert] = at;
        if (tiles != nullptr) {  // mmq_idt's work: tiles[0] tiles, each an expert and its first slot, bn slots apart
            int j = 0;
            for (int e = 0; e < n_expert; e++)
                for (int f = offs[e]; f < offs[e + 1]; f += bn, j++) tiles[1 + 2 * j] = e, tiles[2 + 2 * j] = f;
            tiles[0] = j;
        }
    }
    __syncthreads();
    for (int s = threadIdx.x; s < n; s += blockDim.x) {
        const int e = ids[(i64)(s / k) * ldi + s % k];
        list[atomicAdd(&cursor[e], 1)] = s;
    }
}

// ---- mmq in ggml's tile layout: mmqt (weights) and mmq_idt (experts) ----------------------------------------------
// A block of MT_WARPS warps covers 16 WM weight rows by 8 NT WN token rows (WN = MT_WARPS / WM); each warp owns 16 of
// the weight rows and 8 NT of the token rows for the whole of K, so its sums take one block of 32 columns after the
// other in one order and never meet another warp's. K goes by in chunks of MT_KB blocks (256 columns: a k-quant
// super-block); each chunk's weight bytes and activations are copied into shared memory once (cp.async into two or
// three stages: the next chunks' copies run while this one's products do) and every warp reads them there. A block's terms are
// mmq's (mq_frag, mq_acc). The activations come as mt_quantize writes them: int8 quants [rows, ncols] and a float2
// per block of 32 [rows, ncols / 32], the scale and sum term mmq takes from a q8_1 block (for the k-quants, whose
// mins meet the sum of the int8 activations, that sum times the scale, worked out once here).
#define MT_KB 8
#define MT_WARPS 8
#define MT_QLD (MT_KB * 32 + 16)  // bytes of a token's quants in a stage: 68 words, so B fragments' rows miss each other's banks

// x [rows, ncols] (row stride ldx) -> q [rows, ncols] int8 and, per block of 32, the scale d with the block's sum
// (both as their f16 roundings, as a q8_1 block holds them) into s, and d with d times the sum of the int8s (the
// k-quants' sum term) into sq; either may be null. A warp a block.
extern "C" __global__ void mt_quantize(const float *x, i8 *q, float2 *s, float2 *sq, int ncols, i64 ldx, int rows) {
    pdl_begin();
    const i64 blk = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int nb = ncols / 32, lane = threadIdx.x & 31;
    if (blk >= (i64)rows * nb) return;
    const i64 r = blk / nb, b = blk % nb;
    const float v = x[r * ldx + b * 32 + lane];
    const float amax = warp_max(fabsf(v)), sum = warp_sum(v), d = amax / 127.0f;
    const int qi = amax == 0.0f ? 0 : (int)(i8)roundf(v / d);
    q[r * ncols + b * 32 + lane] = (i8)qi;
    const int isum = sq != nullptr ? warp_sum_i(qi) : 0;
    if (lane == 0) {
        const float dh = __half2float(__float2half(d));
        if (s != nullptr) s[blk] = make_float2(dh, __half2float(__float2half(sum)));
        if (sq != nullptr) sq[blk] = make_float2(dh, dh * (float)isum);
    }
}

// A weight row's bytes in one chunk (the last chunk of a 32-element type may hold fewer), the 16-byte words they can
// touch (a row's chunk starts anywhere: rows of 18-byte blocks align only to 2), and a row's stride in a stage: an
// odd number of words, so the 8 rows of an A fragment fall in different banks
template <int T> struct MtW {
    static constexpr int L = Block<T>::QK == 256 ? Block<T>::BYTES : MT_KB * Block<T>::BYTES;
    static constexpr int WORDS = (L + 30) / 16;
    static constexpr int LD = 16 * (WORDS | 1);
};
// a block's tile: BM weight rows, BN token rows, the bytes of one stage (weights, quants, scales) and the stages: three
// where they fit in MT_SMEM3 (two blocks a multiprocessor), so that two chunks' copies are in flight behind the products
#define MT_SMEM3 (112 * 1024)
template <int T, int WM, int NT> struct Mt {
    static constexpr int BM = 16 * WM, WN = MT_WARPS / WM, BN = 8 * NT * WN;
    static constexpr int QAT = BM * MtW<T>::LD, SAT = QAT + BN * MT_QLD, STAGE = SAT + MT_KB * BN * 8;
    static constexpr int STAGES = 3 * STAGE <= MT_SMEM3 ? 3 : 2;
};

__device__ __forceinline__ void cp_async16(void *dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async8(void *dst, const void *src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// until at most N of this thread's groups of copies are still in flight
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Chunk c into stage st: weight rows r0 .. r0 + BM - 1 of w (rows past M repeat row M - 1), each from the 16-byte word
// its bytes start in; the quants and scales of activation rows src[0 .. BN) (-1: none, left as they are)
template <int T, int WM, int NT>
__device__ __forceinline__ void mt_stage(u8 *st, const u8 *w, int r0, int M, i64 row_bytes, const i8 *q,
                                         const float2 *s, const int *src, int ncols, int c) {
    using C = Mt<T, WM, NT>;
    using W = MtW<T>;
    const int nb = ncols / 32, kbn = min(MT_KB, nb - c * MT_KB);
    const int len = Block<T>::QK == 256 ? W::L : kbn * Block<T>::BYTES;
    for (int i = threadIdx.x; i < C::BM * W::WORDS; i += MT_WARPS * 32) {
        const int r = i / W::WORDS, j = i % W::WORDS;
        const u8 *from = w + (i64)min(r0 + r, M - 1) * row_bytes + (i64)c * W::L;
        const u8 *base = (const u8 *)((u64)from & ~(u64)15);
        if (16 * j < (int)(from - base) + len) cp_async16(st + r * W::LD + 16 * j, base + 16 * j);
    }
    u8 *qs = st + C::QAT;
    for (int i = threadIdx.x; i < C::BN * 16; i += MT_WARPS * 32) {
        const int t = i >> 4, j = i & 15;
        if (src[t] >= 0 && j < 2 * kbn) cp_async16(qs + t * MT_QLD + 16 * j, q + (i64)src[t] * ncols + c * 256 + 16 * j);
    }
    float2 *ss = (float2 *)(st + C::SAT);
    for (int i = threadIdx.x; i < C::BN * MT_KB; i += MT_WARPS * 32) {
        const int kb = i / C::BN, t = i % C::BN;
        if (src[t] >= 0 && kb < kbn) cp_async8(ss + kb * C::BN + t, s + (i64)src[t] * nb + c * MT_KB + kb);
    }
}

// One warp's products of a staged chunk: its weight rows' fragments (ra, rb: rows grp and grp + 8 in the stage) against
// each of its NT groups of 8 token rows, for the chunk's kbn blocks in order
template <int T, int WM, int NT>
__device__ __forceinline__ void mt_chunk(const u8 *st, const u8 *ra, const u8 *rb, float (*acc)[4], int wn, int grp,
                                         int tig, int kbn) {
    using C = Mt<T, WM, NT>;
    const u8 *qs = st + C::QAT;
    const float2 *ss = (const float2 *)(st + C::SAT);
#pragma unroll
    for (int kb = 0; kb < MT_KB; kb++) {
        if (kb < kbn) {
            int a[4];
            float da, ma, db, mb;
            mq_frags<T>(ra, rb, kb, tig, a, da, ma, db, mb);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const int t = (wn * NT + nt) * 8;
                const int *u = (const int *)(qs + (t + grp) * MT_QLD + 32 * kb);
                int c[4] = {0, 0, 0, 0};
                mma_s8(c, a, u[tig], u[4 + tig]);
                const float4 y = *(const float4 *)(ss + kb * C::BN + t + 2 * tig);
                mq_acc(acc[nt], c, da, ma, db, mb, make_float2(y.x, y.y), make_float2(y.z, y.w));
            }
        }
    }
}

// A block's tile: weight rows r0 .. r0 + BM - 1 of w (M rows) by the activation rows src[0 .. BN), over K's chunks
// c0 .. c1 - 1; column j's sums go to out row dst[j] (row stride ldo; -1: none). src and dst in shared memory, set
// before the call.
template <int T, int WM, int NT>
__device__ __forceinline__ void mt_tile(const u8 *w, int r0, int M, const i8 *q, const float2 *s, const int *src,
                                        const int *dst, float *out, i64 ldo, int ncols, i64 row_bytes, u8 *smem,
                                        int c0, int c1) {
    using C = Mt<T, WM, NT>;
    using W = MtW<T>;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, grp = lane >> 2, tig = lane & 3;
    const int wm = warp % WM, wn = warp / WM, nb = ncols / 32;
    const int la = wm * 16 + grp;  // this lane's rows in the tile: la, la + 8
    const u8 *ga = w + (i64)min(r0 + la, M - 1) * row_bytes, *gb = w + (i64)min(r0 + la + 8, M - 1) * row_bytes;
    float acc[NT][4];
    mq_zero<NT>(acc);
#pragma unroll
    for (int i = 0; i < C::STAGES - 1; i++) {  // a group of copies a chunk, empty past the last
        if (c0 + i < c1) mt_stage<T, WM, NT>(smem + i * C::STAGE, w, r0, M, row_bytes, q, s, src, ncols, c0 + i);
        cp_commit();
    }
    for (int c = c0; c < c1; c++) {
        const int i = c - c0, next = c + C::STAGES - 1;  // into the stage chunk c - 1 was read from
        if (next < c1)
            mt_stage<T, WM, NT>(smem + ((i + C::STAGES - 1) % C::STAGES) * C::STAGE, w, r0, M, row_bytes, q, s, src,
                                ncols, next);
        cp_commit();
        cp_wait<C::STAGES - 1>();  // chunk c's copies are done
        __syncthreads();
        const u8 *st = smem + (i % C::STAGES) * C::STAGE;
        const int oa = (int)((u64)(ga + (i64)c * W::L) & 15), ob = (int)((u64)(gb + (i64)c * W::L) & 15);
        mt_chunk<T, WM, NT>(st, st + la * W::LD + oa, st + (la + 8) * W::LD + ob, acc, wn, grp, tig,
                            min(MT_KB, nb - c * MT_KB));
        __syncthreads();  // the stage is read before the next iteration copies a chunk into it
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int row = r0 + la + (x >= 2 ? 8 : 0), d = dst[(wn * NT + nt) * 8 + 2 * tig + (x & 1)];
            if (row < M && d >= 0) out[(i64)d * ldo + row] = acc[nt][x];
        }
    }
}

// out_i[t, row] = W_i[row] . y[t] for N token rows and up to three weights of one type and width (q, k and v; gate and
// up): block x is tile x of the weights' tiles of BM rows, 0's first (m0 rows, product [N, m0] at o0), then 1's, 2's;
// block y the token rows BN y .. The products lie one after another from o0 (o1 and o2 after it). With gridDim.z > 1
// (split K: tall weights, whose few tiles would each walk a long K on one multiprocessor) block z sums its share of
// K's chunks into part (pstride floats a share, laid out as the products from o0), and the last of a tile's blocks to
// finish (tickets: one per tile x and y, left at 0) adds the shares in order into the products.
template <int T, int WM, int NT>
__global__ void __launch_bounds__(MT_WARPS * 32, 2) mmqt(const u8 *w0, const u8 *w1, const u8 *w2, float *o0, float *o1,
                                                     float *o2, int m0, int m1, int m2, const i8 *q, const float2 *s,
                                                     int ncols, i64 row_bytes, int N, float *part, i64 pstride,
                                                     int *tickets) {
    using C = Mt<T, WM, NT>;
    extern __shared__ __align__(16) u8 mt_smem[];
    __shared__ int rows[C::BN];
    pdl_begin();
    const int t0 = (m0 + C::BM - 1) / C::BM, t1 = (m1 + C::BM - 1) / C::BM;
    int tile = blockIdx.x, M = m0;
    const u8 *w = w0;
    float *out = o0;
    if (tile >= t0 + t1) {
        w = w2, out = o2, M = m2, tile -= t0 + t1;
    } else if (tile >= t0) {
        w = w1, out = o1, M = m1, tile -= t0;
    }
    const int n0 = blockIdx.y * C::BN, nc = (ncols / 32 + MT_KB - 1) / MT_KB, split = gridDim.z;
    if (threadIdx.x < C::BN) rows[threadIdx.x] = n0 + (int)threadIdx.x < N ? n0 + (int)threadIdx.x : -1;
    __syncthreads();
    const int per = (nc + split - 1) / split, c0 = blockIdx.z * per, c1 = min(nc, c0 + per);
    const i64 at = out - o0;  // this weight's products from o0 (and its shares from part)
    mt_tile<T, WM, NT>(w, tile * C::BM, M, q, s, rows, rows, split == 1 ? out : part + blockIdx.z * pstride + at, M,
                       ncols, row_bytes, mt_smem, c0, c1);
    if (split == 1) return;
    int *ticket = tickets + blockIdx.y * gridDim.x + blockIdx.x;
    if (!last_block(ticket, split)) return;
    for (int i = threadIdx.x; i < C::BN * C::BM; i += MT_WARPS * 32) {  // consecutive threads, consecutive weight rows
        const int row = tile * C::BM + i % C::BM, d = rows[i / C::BM];
        if (row >= M || d < 0) continue;
        const float *p = part + at + (i64)d * M + row;
        float v = 0.0f;
        for (int z = 0; z < split; z++) v += __ldcg(p + z * pstride);  // other blocks wrote them: read from L2
        out[(i64)d * M + row] = v;
    }
    if (threadIdx.x == 0) *ticket = 0;
}

// mmqt for a prompt's experts (ggml's mmq with ids): block (x, y) multiplies weight rows BM x .. of tile y's expert by
// that tile's BN grouped slots (moe_group's tile list: tiles[0] tiles, tile y's expert tiles[1 + 2 y] and first slot
// tiles[2 + 2 y]; blocks past the last tile return at once), so that an expert holding many slots has as many blocks
// at work as its tiles; slot s reads activation row s (bstep 1) or its token's, s / k. out [slots, M]
template <int T, int WM, int NT>
__global__ void __launch_bounds__(MT_WARPS * 32, 2) mmq_idt(const u8 *w, const i8 *q, const float2 *s, const int *offs,
                                                        const int *list, const int *tiles, float *out, int ncols,
                                                        i64 row_bytes, i64 expert_bytes, int M, int k, int bstep) {
    using C = Mt<T, WM, NT>;
    extern __shared__ __align__(16) u8 mt_smem[];
    __shared__ int src[C::BN], dst[C::BN];
    pdl_begin();
    const int y = blockIdx.y;
    if (y >= tiles[0]) return;
    const int e = tiles[1 + 2 * y], first = tiles[2 + 2 * y], end = offs[e + 1];
    if (threadIdx.x < C::BN) {
        const int sl = first + (int)threadIdx.x < end ? list[first + threadIdx.x] : -1;
        dst[threadIdx.x] = sl, src[threadIdx.x] = sl < 0 ? -1 : bstep ? sl : sl / k;
    }
    __syncthreads();
    mt_tile<T, WM, NT>(w + (i64)e * expert_bytes, blockIdx.x * C::BM, M, q, s, src, dst, out, M, ncols, row_bytes,
                       mt_smem, 0, (ncols / 32 + MT_KB - 1) / MT_KB);
}

// Prompt: a grouped GEMM on tensor cores. Block (x, e, z): weight rows 64 x .. + 63 of expert e against its
// slots in tiles of 64, tiles z, z + gridDim.z, ... (a block past the expert's slots returns at once). Each
// step of 32 columns decodes the weight tile to f16 and gathers the slots' f16 activations (x16 [rows of b,
// ncols]) into shared memory; each of the 4 warps multiplies 16 weight rows by the 64 slots (mma16816).
// ncols a multiple of 8.
#define ID_M 64
#define ID_N 64
#define ID_K 32
#define ID_LD (ID_K + 8)  // halves a shared row: 80 bytes, so the fragments' rows fall in different banks
template <int T>
__global__ void __launch_bounds__(128) mmid_tc(const u8 *w, const __half *x16, const int *offs, const int *list,
                                               float *out, int ncols, i64 row_bytes, i64 expert_bytes, int M,
                                               int k, int bstep) {
    pdl_begin();
    __shared__ __align__(16) __half ws[ID_M * ID_LD], xs[ID_N * ID_LD];
    __shared__ int slot[ID_N];
    const int e = blockIdx.y, end = offs[e + 1];
    const int m0 = blockIdx.x * ID_M, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, grp = lane >> 2, tig = lane & 3;
    const u8 *we = w + (i64)e * expert_bytes;
    for (int first = offs[e] + blockIdx.z * ID_N; first < end; first += gridDim.z * ID_N) {
        __syncthreads();  // the last tile's slots are read
        if (threadIdx.x < ID_N) slot[threadIdx.x] = first + (int)threadIdx.x < end ? list[first + threadIdx.x] : -1;
        __syncthreads();
        float c[ID_N / 8][4];
#pragma unroll
        for (int nt = 0; nt < ID_N / 8; nt++) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0f;
        for (int k0 = 0; k0 < ncols; k0 += ID_K) {
            // 64 rows x 32 columns of each operand: 256 runs of 8 halves, two a thread
#pragma unroll
            for (int x = 0; x < 2; x++) {
                const int g = threadIdx.x + 128 * x, r = g >> 2, col = k0 + (g & 3) * 8, m = m0 + r;
                __half2 h[4];
                if (m < M && col < ncols) {
                    const u8 *row = we + (i64)m * row_bytes;
#pragma unroll
                    for (int q = 0; q < 4; q++)
                        h[q] = __floats2half2_rn(dq_at<T>(row, col + 2 * q), dq_at<T>(row, col + 2 * q + 1));
                } else {
                    h[0] = h[1] = h[2] = h[3] = __floats2half2_rn(0.0f, 0.0f);
                }
                *(uint4 *)(ws + r * ID_LD + (g & 3) * 8) = *(const uint4 *)h;
                const int s = slot[r];
                uint4 v = make_uint4(0, 0, 0, 0);
                if (s >= 0 && col < ncols) v = *(const uint4 *)(x16 + (i64)(bstep ? s : s / k) * ncols + col);
                *(uint4 *)(xs + r * ID_LD + (g & 3) * 8) = v;
            }
            __syncthreads();
#pragma unroll
            for (int kc = 0; kc < ID_K; kc += 16) {
                const __half *wa = ws + (warp * 16 + grp) * ID_LD + kc + 2 * tig;
                const u32 a[4] = {*(const u32 *)wa, *(const u32 *)(wa + 8 * ID_LD), *(const u32 *)(wa + 8),
                                  *(const u32 *)(wa + 8 * ID_LD + 8)};
#pragma unroll
                for (int nt = 0; nt < ID_N / 8; nt++) {
                    const __half *xb = xs + (nt * 8 + grp) * ID_LD + kc + 2 * tig;
                    mma16816(c[nt], a, *(const u32 *)xb, *(const u32 *)(xb + 8));
                }
            }
            __syncthreads();
        }
        const int ma = m0 + warp * 16 + grp, mb = ma + 8;
#pragma unroll
        for (int nt = 0; nt < ID_N / 8; nt++) {
#pragma unroll
            for (int x = 0; x < 4; x++) {
                const int m = x < 2 ? ma : mb, s = slot[nt * 8 + 2 * tig + (x & 1)];
                if (m < M && s >= 0) out[(i64)s * M + m] = c[nt][x];
            }
        }
    }
}

// Element-wise ops over up to 4-d strided operands (strides in elements), results contiguous
// unless said: copies and casts, broadcast add/mul, scale, activations, gated activations,
// row writes into the KV cache, softmax rows, greedy sampling's argmax of rows.

#define STRIDES4(p) i64 p##0, i64 p##1, i64 p##2, i64 p##3
// offset of flat index i of a contiguous [*, n1, n2, n3] in an operand with strides s0..s3
#define OFFSET4(i, s) ((i) / (n1 * n2 * n3) * s##0 + (i) / (n2 * n3) % n1 * s##1 + (i) / n3 % n2 * s##2 + (i) % n3 * s##3)

// dst (strides d*) = src (strides s*), converting S to D
template <int S, int D>
__global__ void copy4(const void *src, void *dst, i64 n, i64 n1, i64 n2, i64 n3, STRIDES4(s), STRIDES4(d)) {
    pdl_begin();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    st<D>(dst, OFFSET4(i, d), ld<S>(src, OFFSET4(i, s)));
}

// out = a OP b, b broadcast by zero strides; OP 0 add, 1 mul
template <int OP, int A, int B>
__global__ void binary4(const void *a, const void *b, float *out, i64 n, i64 n1, i64 n2, i64 n3,
                        STRIDES4(a), STRIDES4(b)) {
    pdl_begin();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = ld<A>(a, OFFSET4(i, a)), y = ld<B>(b, OFFSET4(i, b));
    out[i] = OP == 0 ? x + y : x * y;
}

// out = f(a): 0 scale by s, 1 silu, 2 gelu
template <int F>
__global__ void unary4(const float *a, float *out, float s, i64 n, i64 n1, i64 n2, i64 n3, STRIDES4(a)) {
    pdl_begin();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = a[OFFSET4(i, a)];
    out[i] = F == 0 ? x * s : F == 1 ? silu(x) : gelu(x);
}

// out[r, :] = act(g[r, :]) * u[r, :]: 1 silu (swiglu), 2 gelu (geglu)
template <int F>
__global__ void gated(const float *g, const float *u, float *out, int n, i64 rows, i64 ldg, i64 ldu) {
    pdl_begin();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * n) return;
    i64 r = i / n, c = i % n;
    float x = g[r * ldg + c];
    out[i] = glu_act<F>(x) * u[r * ldu + c];
}

// gpt-oss's gated unit (ggml's swiglu_oai, common.cuh's swiglu_oai_of) of rows of g and u
extern "C" __global__ void swiglu_oai(const float *g, const float *u, float *out, int n, i64 rows, i64 ldg, i64 ldu,
                                      float alpha, float limit) {
    pdl_begin();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * n) return;
    i64 r = i / n, c = i % n;
    out[i] = swiglu_oai_of(g[r * ldg + c], u[r * ldu + c], alpha, limit);
}

// dst[idx[r], :] = src[r, :] (the KV cache write), converting f32 to D
template <int D>
__global__ void set_rows(const float *src, const int *idx, void *dst, int n, i64 rows, i64 lds, i64 ldd) {
    pdl_begin();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * n) return;
    i64 r = i / n, c = i % n;
    st<D>(dst, (i64)idx[r] * ldd + c, src[r * lds + c]);
}

// a bias add and the cache write of its rows: v = src[r, :] + bias (broadcast over the rows) goes to sum[r, :]
// (the add's result, contiguous) and to dst[idx[r], :]
template <int D>
__global__ void set_rows_bias(const float *src, const float *bias, float *sum, const int *idx, void *dst, int n,
                              i64 rows, i64 lds, i64 ldd) {
    pdl_begin();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * n) return;
    i64 r = i / n, c = i % n;
    const float v = src[r * lds + c] + bias[c];
    sum[i] = v;
    st<D>(dst, (i64)idx[r] * ldd + c, v);
}

// softmax(a * scale + mask) over rows of n; row r of the matrix uses mask row r % R (M: mask type, -1 none).
// With sinks (gpt-oss's attention sinks; a is [heads, R, n]), row r counts one more logit, sinks[r / R],
// whose share is dropped.
template <int M>
__global__ void soft_max(const float *a, const void *mask, const float *sinks, float *out, int n, int R, i64 lda,
                         i64 ldm, float scale) {
    pdl_begin();
    __shared__ float sh[32];
    i64 r = blockIdx.x;
    const float *x = a + r * lda;
    float *o = out + r * (i64)n;
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = x[i] * scale;
        if constexpr (M >= 0) v += ld<M>(mask, (r % R) * ldm + i);
        o[i] = v;
        mx = fmaxf(mx, v);
    }
    mx = warp_max(mx);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = mx;
    __syncthreads();
    mx = sinks != nullptr ? sinks[r / R] : -INFINITY;
    for (int w = 0; w < (blockDim.x + 31) / 32; w++) mx = fmaxf(mx, sh[w]);
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float e = mx == -INFINITY ? 0.0f : expf(o[i] - mx);
        o[i] = e;
        s += e;
    }
    s = block_sum(s, sh);
    if (sinks != nullptr) s += expf(sinks[r / R] - mx);
    float inv = 1.0f / s;
    for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] *= inv;
}

// Greedy sampling (ops.argmax): each row's index of its largest value, the first of equal maxima, or -1
// where the row holds NaN or infinity. Values compare as integer keys whose order is the floats' (-0 and
// +0 equal, as np.argmax has them): --use_fast_math would compare denormals as zero.
#define KEY_NONE (-2147483647 - 1)
#define IDX_NONE 2147483647
__device__ __forceinline__ int order_key(u32 b) { return (b >> 31) ? -(int)(b & 0x7fffffffu) : (int)b; }

// the largest key over the block and the smallest index holding it: every thread gets both; `shk` and
// `shi` hold 32 ints each
__device__ __forceinline__ void block_argmax(int &key, int &idx, int *shk, int *shi) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int m = warp_max_i(key);
    idx = warp_min_i(key == m ? idx : IDX_NONE);
    __syncthreads();
    if (lane == 0) {
        shk[warp] = m;
        shi[warp] = idx;
    }
    __syncthreads();
    const bool held = lane < (blockDim.x + 31) / 32;
    key = held ? shk[lane] : KEY_NONE;
    m = warp_max_i(key);
    idx = warp_min_i(held && key == m ? shi[lane] : IDX_NONE);
    key = m;
}

// Row blockIdx.x of x [rows, ldx], elements [blockIdx.y * chunk, + chunk) in this block. A row split over
// several blocks (gridDim.y > 1) leaves each block's (key, index or -1) in part [rows][gridDim.y][2]; the
// last of the row's blocks to get there (a ticket in `tickets`, which it resets to 0) merges them, so one
// launch serves a 128k-wide row with enough blocks to read it at memory speed.
extern "C" __global__ void argmax_rows(const float *x, int *out, int *part, int *tickets, int n, i64 ldx, int chunk) {
    pdl_begin();
    __shared__ int shk[32], shi[32];
    const i64 r = blockIdx.x;
    const u32 *row = (const u32 *)(x + r * ldx);
    const int split = gridDim.y, start = (int)blockIdx.y * chunk, end = min(n, start + chunk);
    int key = KEY_NONE, idx = IDX_NONE, bad = 0;
#pragma unroll 4
    for (int i = start + threadIdx.x; i < end; i += blockDim.x) {
        const u32 b = row[i];
        bad |= (b & 0x7f800000u) == 0x7f800000u;
        const int k = order_key(b);
        if (k > key) {  // a thread's indices rise: the first of its equal maxima stays
            key = k;
            idx = i;
        }
    }
    block_argmax(key, idx, shk, shi);
    bad = __syncthreads_or(bad);
    if (split == 1) {
        if (threadIdx.x == 0) out[r] = bad ? -1 : idx;
        return;
    }
    int *mine = part + 2 * (r * split + blockIdx.y);
    if (threadIdx.x == 0) {
        mine[0] = key;
        mine[1] = bad ? -1 : idx;
    }
    if (!last_block(tickets + r, split)) return;
    key = KEY_NONE, idx = IDX_NONE, bad = 0;
    for (int c = threadIdx.x; c < split; c += blockDim.x) {  // other blocks wrote them: read from L2
        const int *theirs = part + 2 * (r * split + c);
        const int k = __ldcg(theirs), i = __ldcg(theirs + 1);
        bad |= i < 0;
        if (k > key) {
            key = k;
            idx = i;
        }
    }
    block_argmax(key, idx, shk, shi);
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) {
        out[r] = bad ? -1 : idx;
        tickets[r] = 0;
    }
}

// A split's host inputs straight from its pinned region to their places, read through the device's
// mapping of pinned memory: one launch in place of a copy per input (uploads.py). Block i copies input i,
// table[3 i .. 3 i + 2] = (byte offset in the region, device address, bytes), 16 bytes a thread where
// both ends are 16-byte aligned, the rest byte by byte.
extern "C" __global__ void gather_inputs(const u8 *region, const i64 *table) {
    pdl_begin();
    const i64 off = table[3 * blockIdx.x], n = table[3 * blockIdx.x + 2];
    u8 *dst = (u8 *)table[3 * blockIdx.x + 1];
    const u8 *src = region + off;
    const i64 n16 = (((i64)src | (i64)dst) & 15) == 0 ? n / 16 : 0;
    for (i64 i = threadIdx.x; i < n16; i += blockDim.x) ((uint4 *)dst)[i] = ((const uint4 *)src)[i];
    for (i64 i = n16 * 16 + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

// x [n] f32 to out (pinned host memory, written through the device's mapping) and flags[b] = whether
// some value block b wrote is not finite: a step's logits and their check in one launch (get_checked)
extern "C" __global__ void fetch_checked(const float *x, i64 n, float *out, int *flags) {
    pdl_begin();
    int bad = 0;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float v = x[i];
        out[i] = v;
        bad |= !isfinite(v);
    }
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) flags[blockIdx.x] = bad;
}

// A mixture of experts' routing, a warp per token row of p [rows, n] (row stride ldp, n <= 1024): ids [rows, k]
// the k largest entries' indices, largest first, the lower index first among equal values (ggml's
// argsort_top_k; a stable argsort of -p)
extern "C" __global__ void moe_topk(const float *p, int *ids, int n, int k, i64 ldp, int rows) {
    pdl_begin();
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float *x = p + (i64)row * ldp;
    u32 taken = 0;  // bit q: element lane + 32 q was chosen
    for (int r = 0; r < k; r++) {
        float best = -INFINITY;
        int bi = IDX_NONE;
        for (int i = lane, q = 0; i < n; i += 32, q++) {
            const float v = x[i];
            if (!((taken >> q) & 1) && (bi == IDX_NONE || v > best)) best = v, bi = i;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffff, best, o);
            const int oi = __shfl_xor_sync(0xffffffff, bi, o);
            if (oi != IDX_NONE && (bi == IDX_NONE || ob > best || (ob == best && oi < bi))) best = ob, bi = oi;
        }
        if (bi != IDX_NONE && (bi & 31) == lane) taken |= 1u << (bi >> 5);
        if (lane == 0) ids[(i64)row * k + r] = bi;
    }
}

// The chosen experts' weights, a warp per token row (k <= 32): w[row, j] = p[row, ids[row, j]]; with norm,
// divided by their sum (in double, as ggml sums rows; at least 2^-14, as llama.cpp clamps it)
extern "C" __global__ void moe_weights(const float *p, const int *ids, float *w, int k, i64 ldp, i64 ldi, int rows,
                                       int norm) {
    pdl_begin();
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float v = lane < k ? p[(i64)row * ldp + ids[(i64)row * ldi + lane]] : 0.0f;
    float out = v;
    if (norm) {
        double s = (double)v;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        out = v / fmaxf((float)s, 6.103515625e-5f);
    }
    if (lane < k) w[(i64)row * k + lane] = out;
}

// A mixture of experts' output (the graph's mul by the weights and its adds of the experts' rows, one
// launch): out [rows, M] the sum over j in order of e [rows, k, M] times w [rows, k], each product rounded
// before it is added, as the separate nodes round them. The mul's own result is not written: only the
// adds read it, and the planner may have put their sum where it lies.
extern "C" __global__ void moe_sum(const float *e, const float *w, float *out, int M, int k, i64 rows) {
    pdl_begin();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * M) return;
    const i64 t = i / M, c = i % M;
    float s = 0.0f;
    for (int j = 0; j < k; j++) {
        const float v = __fmul_rn(e[(t * k + j) * M + c], w[t * k + j]);
        s = j == 0 ? v : __fadd_rn(s, v);
    }
    out[i] = s;
}

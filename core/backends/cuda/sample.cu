// Sampling where the logits are computed (ops.sample): a block per row of logits runs llama.cpp's sampler
// chain as core/llm/sampling.py's Sampler and the reference kernel (backends/kernels.py) compute it, and
// writes only the chosen token id.
//
// The logit bias and the penalties change a few entries of a row; rather than copy the row, their ids
// and new values are listed (in the op's scratch) and flagged in a bitmap in shared memory, and each
// pass reads an entry's value through `value` (the row's, or the listed one where flagged). Greedy
// rows take the first largest value. Otherwise the top-k candidates are found by a radix select over
// keys that order as the floats do (4 passes of 8 bits; equal values: lower ids first), sorted in shared
// memory, and the rest runs on those k: probabilities in f32 with numpy's pairwise sum (the reference
// sums with numpy), the top-p and min-p cuts, the temperature, and the draw through a float64 cumulative
// sum. Compiled without --use_fast_math and with --fmad=false (module.py), so every f32 step rounds as
// numpy's does; exp may differ from numpy's in the last bit, which changes a token only where the draw
// lands within that of a boundary. A row of more than SK_MAX candidates (top-k 0 or above it) is
// marked -2: the session samples that row from its logits on the host (session.py). -1: the raw row
// holds NaN or infinity (the numerics guard, as ops.argmax).

#define SK_MAX 1024  // candidates sorted in shared memory
#define ST 1024      // threads of a block
#define PW_BLOCK 128  // numpy's pairwise summation block

// a key whose unsigned order is the floats' order (-0 as +0)
__device__ __forceinline__ u32 fkey(float f) {
    const u32 b = __float_as_uint(f == 0.0f ? 0.0f : f);
    return (b >> 31) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float kfloat(u32 k) { return __uint_as_float((k >> 31) ? (k & 0x7fffffffu) : ~k); }

// numpy's pairwise_sum of a[lo, lo + n): in order below 8, else eight lanes, halves above PW_BLOCK
__device__ float pw_block(const float *a, int lo, int n) {
    if (n < 8) {
        float res = -0.0f;
        for (int i = lo; i < lo + n; i++) res += a[i];
        return res;
    }
    float r0 = a[lo], r1 = a[lo + 1], r2 = a[lo + 2], r3 = a[lo + 3];
    float r4 = a[lo + 4], r5 = a[lo + 5], r6 = a[lo + 6], r7 = a[lo + 7];
    int i = 8;
    for (; i < n - (n % 8); i += 8) {
        r0 += a[lo + i], r1 += a[lo + i + 1], r2 += a[lo + i + 2], r3 += a[lo + i + 3];
        r4 += a[lo + i + 4], r5 += a[lo + i + 5], r6 += a[lo + i + 6], r7 += a[lo + i + 7];
    }
    float res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7));
    for (; i < n; i++) res += a[lo + i];
    return res;
}

__device__ float pw_sum(const float *a, int lo, int n) {
    if (n <= PW_BLOCK) return pw_block(a, lo, n);
    int n2 = n / 2;
    n2 -= n2 % 8;
    return pw_sum(a, lo, n2) + pw_sum(a, lo + n2, n - n2);
}

// entry i of the row after the bias and penalties
__device__ __forceinline__ float value(const float *row, const u32 *bits, const int *mid, const float *mv, int m, int i) {
    if (!((bits[i >> 5] >> (i & 31)) & 1u)) return row[i];
    for (int k = 0; k < m; k++)
        if (mid[k] == i) return mv[k];
    return row[i];
}

// exclusive prefix count of `flag` over the block (in thread order) and the block's total
__device__ __forceinline__ int block_rank(bool flag, int &total, int *wsum) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 ballot = __ballot_sync(0xffffffffu, flag);
    if (lane == 0) wsum[warp] = __popc(ballot);
    __syncthreads();
    int before = 0;
    total = 0;
    for (int w = 0; w < ST / 32; w++) {
        before += w < warp ? wsum[w] : 0;
        total += wsum[w];
    }
    __syncthreads();
    return before + __popc(ballot & ((1u << lane) - 1u));
}

// params [rows, 7]: temp, top_k, top_p, min_p, repeat, frequency and presence penalty; u [rows]: the draws;
// recent [rows, W] (-1: none); bias ids / values [rows, NB] (id -1: none); mod_ids / mod_vals [rows, W + NB]
// scratch; dynamic shared memory: (n + 31) / 32 words of flags
extern "C" __global__ void __launch_bounds__(ST) sample_rows(
    const float *logits, i64 ldl, int n, const float *params, const double *u, const int *recent, int W,
    const int *bias_ids, const float *bias_vals, int NB, int *mod_ids, float *mod_vals, int *out) {
    pdl_begin();
    extern __shared__ u32 bits[];
    __shared__ unsigned long long cand[SK_MAX];
    __shared__ float pr[SK_MAX];
    __shared__ int hist[256], wsum[ST / 32], wi[ST / 32];
    __shared__ float wv[ST / 32];
    __shared__ int s_m, s_bad, s_keep, s_prefix, s_need, s_g;
    __shared__ float s_total;
    const int r = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float *row = logits + (i64)r * ldl;
    const float *p = params + (i64)r * 7;
    const float temp = p[0], top_p = p[2], min_p = p[3], rp = p[4], fp = p[5], pp = p[6];
    const int top_k = (int)p[1];
    int *mid = mod_ids + (i64)r * (W + NB);
    float *mv = mod_vals + (i64)r * (W + NB);
    const int *rec = recent + (i64)r * W;
    for (int i = tid; i < (n + 31) / 32; i += ST) bits[i] = 0;
    if (tid == 0) {  // the bias, added in order (an id listed twice gets both)
        int m = 0;
        for (int j = 0; j < NB; j++) {
            const int id = bias_ids[(i64)r * NB + j];
            if (id < 0 || id >= n) continue;
            int k = 0;
            while (k < m && mid[k] != id) k++;
            if (k == m) mid[m] = id, mv[m] = row[id], m++;
            mv[k] += bias_vals[(i64)r * NB + j];
        }
        s_m = m;
        s_bad = 0;
    }
    __syncthreads();
    const int nb = s_m;
    if (rp != 1.0f || fp != 0.0f || pp != 0.0f) {  // the penalties: a thread per distinct recent token
        for (int w = tid; w < W; w += ST) {
            const int t = rec[w];
            if (t < 0 || t >= n) continue;
            bool first = true;
            for (int x = 0; x < w && first; x++) first = rec[x] != t;
            if (!first) continue;
            int cnt = 0;
            for (int x = w; x < W; x++) cnt += rec[x] == t;
            int k = 0;
            while (k < nb && mid[k] != t) k++;
            float v = k < nb ? mv[k] : row[t];
            v = v <= 0.0f ? v * rp : v / rp;
            v = v - (float)cnt * fp - pp;
            if (k == nb) k = atomicAdd(&s_m, 1), mid[k] = t;
            mv[k] = v;
        }
    }
    __syncthreads();
    const int m = s_m;
    for (int k = tid; k < m; k += ST) atomicOr(&bits[mid[k] >> 5], 1u << (mid[k] & 31));
    __syncthreads();
    __threadfence_block();

    // the raw row's finiteness, and the first largest value
    float best = -INFINITY;
    int besti = n, bad = 0;
    for (int i = tid; i < n; i += ST) {
        const float raw = row[i];
        bad |= !isfinite(raw);
        const float v = value(row, bits, mid, mv, m, i);
        if (v > best || (besti == n && v == best)) best = v, besti = i;
    }
    if (__syncthreads_or(bad)) {
        if (tid == 0) out[r] = -1;
        return;
    }
    if (temp <= 0.0f) {
        for (int o = 16; o; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, besti, o);
            if (ov > best || (ov == best && oi < besti)) best = ov, besti = oi;
        }
        if (lane == 0) wv[warp] = best, wi[warp] = besti;
        __syncthreads();
        if (tid == 0) {
            for (int w = 1; w < ST / 32; w++)
                if (wv[w] > best || (wv[w] == best && wi[w] < besti)) best = wv[w], besti = wi[w];
            out[r] = besti < n ? besti : 0;
        }
        return;
    }
    const int k = (top_k > 0 && top_k < n) ? top_k : n;
    if (k > SK_MAX) {
        if (tid == 0) out[r] = -2;
        return;
    }

    // the k-th largest key, 8 bits a pass; s_need: how many entries equal to it are taken (lowest ids)
    if (tid == 0) s_prefix = 0, s_need = k;
    u32 mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += ST) hist[b] = 0;
        __syncthreads();
        const u32 prefix = (u32)s_prefix;
        for (int i0 = 0; i0 < n; i0 += ST) {
            const int i = i0 + tid;
            const bool in = i < n && (fkey(value(row, bits, mid, mv, m, i)) & mask) == prefix;
            const int bin = in ? (fkey(value(row, bits, mid, mv, m, i)) >> shift) & 255 : -1;
            const u32 same = __match_any_sync(0xffffffffu, bin);
            if (in && lane == __ffs(same) - 1) atomicAdd(&hist[bin], __popc(same));
        }
        __syncthreads();
        if (tid == 0) {
            int need = s_need, b = 255;
            while (hist[b] < need) need -= hist[b], b--;
            s_need = need;
            s_prefix = (int)(prefix | ((u32)b << shift));
        }
        mask |= 255u << shift;
        __syncthreads();
    }
    const u32 kth = (u32)s_prefix;
    const int need = s_need, n_greater = k - need;
    if (tid == 0) s_g = 0;
    __syncthreads();
    int taken = 0;  // entries equal to the k-th key taken so far
    for (int i0 = 0; i0 < n; i0 += ST) {
        const int i = i0 + tid;
        const u32 key = i < n ? fkey(value(row, bits, mid, mv, m, i)) : 0;
        if (i < n && key > kth) cand[atomicAdd(&s_g, 1)] = ((unsigned long long)key << 32) | (u32)(~i);
        int total;
        const bool eq = i < n && key == kth;
        const int rank = block_rank(eq, total, wsum);
        if (eq && taken + rank < need) cand[n_greater + taken + rank] = ((unsigned long long)key << 32) | (u32)(~i);
        taken += total;
    }
    int kp = 1;
    while (kp < k) kp <<= 1;
    for (int i = k + tid; i < kp; i += ST) cand[i] = 0;
    __syncthreads();
    for (int size = 2; size <= kp; size <<= 1) {  // bitonic sort, largest first
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < kp; i += ST) {
                const int j = i ^ stride;
                if (j > i) {
                    const unsigned long long a = cand[i], b = cand[j];
                    const bool desc = (i & size) == 0;
                    if (desc ? a < b : a > b) cand[i] = b, cand[j] = a;
                }
            }
            __syncthreads();
        }
    }

    // the candidates' probabilities, the top-p and min-p cuts, the temperature and the draw
    const float v0 = kfloat((u32)(cand[0] >> 32));
    for (int i = tid; i < k; i += ST) pr[i] = expf(kfloat((u32)(cand[i] >> 32)) - v0);
    __syncthreads();
    if (tid == 0) s_total = pw_sum(pr, 0, k);
    __syncthreads();
    for (int i = tid; i < k; i += ST) pr[i] = pr[i] / s_total;
    __syncthreads();
    if (tid == 0) {
        int keep = k;
        if (top_p < 1.0f) {
            float acc = 0.0f;
            for (int i = 0; i < k; i++) {
                acc += pr[i];
                if (acc >= top_p) {
                    keep = min(keep, i + 1);
                    break;
                }
            }
        }
        if (min_p > 0.0f) {
            const float floor = min_p * pr[0];
            int count = 0;
            for (int i = 0; i < k; i++) count += pr[i] >= floor;
            keep = min(keep, max(1, count));
        }
        s_keep = keep;
    }
    __syncthreads();
    const int keep = s_keep;
    for (int i = tid; i < keep; i += ST) pr[i] = expf((kfloat((u32)(cand[i] >> 32)) - v0) / temp);
    __syncthreads();
    if (tid == 0) {
        const float total = pw_sum(pr, 0, keep);
        double acc = 0.0;
        for (int i = 0; i < keep; i++) acc += (double)(pr[i] / total);
        const double last = acc, draw = u[r];
        int pick = keep - 1;
        acc = 0.0;
        for (int i = 0; i < keep; i++) {
            acc += (double)(pr[i] / total);
            if (acc / last > draw) {
                pick = i;
                break;
            }
        }
        out[r] = (int)(~(u32)cand[pick]);
    }
}

// Sampling where the logits are computed (ops.sample): a block per row of logits runs llama.cpp's sampler
// chain as core/llm/sampling.py's Sampler and the reference kernel (backends/kernels.py) compute it, and
// writes only the chosen token id.
//
// The logit bias and the penalties change a few entries of a row; rather than copy the row, their ids
// and new values are listed (in the op's scratch) and flagged in a bitmap in shared memory, and each
// pass reads an entry's value through `value` (the row's, or the listed one where flagged). Greedy
// rows take the first largest value. Otherwise the top-k candidates are found by a radix select over
// keys that order as the floats do (equal values: lower ids first), sorted in shared memory, and the rest
// runs on those k. The select reads the row twice: the pass that checks it also counts its keys' top 12
// bits, which tells the bin of the k-th key, and a second pass gathers that bin and the ones above it into
// shared memory, where the rest of the select runs. Where that bin holds more than L_CAP entries, or more
// entries equal the k-th key than are taken, the select runs over the row instead (select_row: 4 passes
// of 8 bits, then one in order of ids). A row of 128k logits took ~0.4 ms with the 6 passes, each a load
// in flight per thread; the passes now keep 4 each: probabilities in f32 with numpy's pairwise sum (the reference
// sums with numpy), the top-p and min-p cuts, the temperature, and the draw through a float64 cumulative
// sum. Compiled without --use_fast_math and with --fmad=false (module.py), so every f32 step rounds as
// numpy's does; exp may differ from numpy's in the last bit, which changes a token only where the draw
// lands within that of a boundary. A row of more than SK_MAX candidates (top-k 0 or above it) is
// marked -2: the session samples that row from its logits on the host (session.py). -1: the raw row
// holds NaN or infinity (the numerics guard, as ops.argmax).

#define SK_MAX 1024  // candidates sorted in shared memory
#define ST 1024      // threads of a block
#define PW_BLOCK 128  // numpy's pairwise summation block
#define FB_SHIFT 20   // the first histogram's bins: a key's top 12 bits
#define FB_BINS 4096
#define L_CAP 4096    // entries of the k-th key's bin and above gathered in shared memory (32 KiB)
#define UNROLL 4      // loads of 4 entries a thread has in flight at once (each_entry)

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

// f(i, raw, value) for each of this thread's entries i of the row (its raw value, and its value after the bias
// and penalties, looked up only where flagged), in increasing order of i, in rounds of UNROLL loads of 4 entries
// (16 bytes) in flight together where the row is 16-byte aligned, then the entries past the last 4: a block a
// row is bound by its loads in flight, and 4-byte loads kept a 1024-thread block's row at ~16 KB in flight
// (H200, 64 rows of 128k logits: 85 us a step)
template <typename F>
__device__ __forceinline__ void each_entry(const float *row, const u32 *bits, const int *mid, const float *mv, int m,
                                           int n, F f) {
    const int n4 = ((size_t)row & 15) == 0 ? n / 4 : 0;
    const float4 *row4 = (const float4 *)row;
    for (int q0 = threadIdx.x; q0 < n4; q0 += UNROLL * ST) {
        float4 raw[UNROLL];
#pragma unroll
        for (int j = 0; j < UNROLL; j++) raw[j] = q0 + j * ST < n4 ? row4[q0 + j * ST] : make_float4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < UNROLL; j++) {
            const int q = q0 + j * ST;
            if (q >= n4) break;
            const float rv[4] = {raw[j].x, raw[j].y, raw[j].z, raw[j].w};
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int i = 4 * q + c;
                f(i, rv[c], ((bits[i >> 5] >> (i & 31)) & 1u) ? value(row, bits, mid, mv, m, i) : rv[c]);
            }
        }
    }
    for (int i = 4 * n4 + threadIdx.x; i < n; i += ST) {
        const float raw = row[i];
        f(i, raw, ((bits[i >> 5] >> (i & 31)) & 1u) ? value(row, bits, mid, mv, m, i) : raw);
    }
}

// exclusive prefix sum of v over the block (in thread order) and the block's total
__device__ __forceinline__ int block_excl_sum(int v, int &total, int *wsum) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl = v;
    for (int o = 1; o < 32; o <<= 1) {
        const int x = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += x;
    }
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    int before = 0;
    total = 0;
    for (int w = 0; w < ST / 32; w++) {
        before += w < warp ? wsum[w] : 0;
        total += wsum[w];
    }
    __syncthreads();
    return before + incl - v;
}

// one radix pass of `width` bits at `shift` over the keys (in keys[0, nk) or, keys null, the row's): the
// bin of the need-th largest key among those whose bits under `mask` equal *prefix; updates *prefix and *need
__device__ void radix_pass(const float *row, const u32 *bits, const int *mid, const float *mv, int m, int n,
                           const u64 *keys, int nk, int shift, int width, u32 mask, int *prefix, int *need,
                           int *hist) {
    const int tid = threadIdx.x, lane = tid & 31;
    const int nbins = 1 << width;
    for (int b = tid; b < nbins; b += ST) hist[b] = 0;
    __syncthreads();
    const u32 pre = (u32)*prefix;
    const int total = keys ? nk : n;
    for (int i0 = 0; i0 < total; i0 += ST) {
        const int i = i0 + tid;
        u32 key = 0;
        if (i < total) key = keys ? (u32)(keys[i] >> 32) : fkey(value(row, bits, mid, mv, m, i));
        const bool in = i < total && (key & mask) == pre;
        const int bin = in ? (int)((key >> shift) & (u32)(nbins - 1)) : -1;
        const u32 same = __match_any_sync(0xffffffffu, bin);
        if (in && lane == __ffs(same) - 1) atomicAdd(&hist[bin], __popc(same));
    }
    __syncthreads();
    if (tid == 0) {
        int nd = *need, b = nbins - 1;
        while (hist[b] < nd) nd -= hist[b], b--;
        *need = nd;
        *prefix = (int)(pre | ((u32)b << shift));
    }
    __syncthreads();
}

// the k candidates over the whole row: the k-th largest key in 4 passes of 8 bits, then the keys above it
// and the lowest ids of those equal to it, in order of ids
__device__ void select_row(const float *row, const u32 *bits, const int *mid, const float *mv, int m, int n, int k,
                           u64 *cand, int *hist, int *wsum, int *s_prefix, int *s_need, int *s_g) {
    const int tid = threadIdx.x;
    if (tid == 0) *s_prefix = 0, *s_need = k;
    __syncthreads();
    u32 mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        radix_pass(row, bits, mid, mv, m, n, nullptr, 0, shift, 8, mask, s_prefix, s_need, hist);
        mask |= 255u << shift;
    }
    const u32 kth = (u32)*s_prefix;
    const int need = *s_need, n_greater = k - need;
    if (tid == 0) *s_g = 0;
    __syncthreads();
    int taken = 0;  // entries equal to the k-th key taken so far
    for (int i0 = 0; i0 < n; i0 += ST) {
        const int i = i0 + tid;
        const u32 key = i < n ? fkey(value(row, bits, mid, mv, m, i)) : 0;
        if (i < n && key > kth) cand[atomicAdd(s_g, 1)] = ((u64)key << 32) | (u32)(~i);
        int total;
        const bool eq = i < n && key == kth;
        const int rank = block_excl_sum(eq ? 1 : 0, total, wsum);
        if (eq && taken + rank < need) cand[n_greater + taken + rank] = ((u64)key << 32) | (u32)(~i);
        taken += total;
    }
    __syncthreads();
}

// the k candidates from the first histogram (`fine`: FB_BINS counts of the keys' top 12 bits): the bin of the
// k-th key, then the row's entries of that bin and above gathered into `keys` (over `fine`), where the rest of
// the select runs; false, and cand left to select_row, where more than L_CAP entries would be gathered or more
// entries equal the k-th key than are taken (which lowest ids take them is select_row's ordered pass)
__device__ bool gather_select(const float *row, const u32 *bits, const int *mid, const float *mv, int m, int n, int k,
                              const int *fine, u64 *keys, u64 *cand, int *hist, int *wsum, int *s_prefix,
                              int *s_need, int *s_g, int *s_bin, int *s_above, int *s_inbin, int *s_eq) {
    static_assert(FB_BINS == 4 * ST, "a thread sums 4 bins");
    const int tid = threadIdx.x;
    int c[4], sum = 0;  // thread t: bins FB_BINS - 1 - 4t down to FB_BINS - 4 - 4t (the largest keys first)
    for (int j = 0; j < 4; j++) c[j] = fine[FB_BINS - 1 - 4 * tid - j], sum += c[j];
    int total;
    const int before = block_excl_sum(sum, total, wsum);  // every thread has read its bins after this
    if (before < k && k <= before + sum) {
        int acc = before;
        for (int j = 0; j < 4; j++) {
            if (acc + c[j] >= k) {
                *s_bin = FB_BINS - 1 - 4 * tid - j, *s_above = acc, *s_inbin = c[j];
                break;
            }
            acc += c[j];
        }
    }
    if (tid == 0) *s_g = 0;
    __syncthreads();
    const int bin = *s_bin, above = *s_above, nl = above + *s_inbin;
    if (nl > L_CAP) return false;
    each_entry(row, bits, mid, mv, m, n, [&](int i, float, float v) {
        const u32 key = fkey(v);
        if ((int)(key >> FB_SHIFT) >= bin) keys[atomicAdd(s_g, 1)] = ((u64)key << 32) | (u32)(~i);
    });
    if (tid == 0) *s_prefix = (int)((u32)bin << FB_SHIFT), *s_need = k - above;
    __syncthreads();
    radix_pass(row, bits, mid, mv, m, n, keys, nl, 12, 8, 0xfff00000u, s_prefix, s_need, hist);
    radix_pass(row, bits, mid, mv, m, n, keys, nl, 4, 8, 0xfffff000u, s_prefix, s_need, hist);
    radix_pass(row, bits, mid, mv, m, n, keys, nl, 0, 4, 0xfffffff0u, s_prefix, s_need, hist);
    const u32 kth = (u32)*s_prefix;
    const int need = *s_need, n_greater = k - need;
    if (tid == 0) *s_g = 0, *s_eq = 0;
    __syncthreads();
    for (int e = tid; e < nl; e += ST) {
        const u64 entry = keys[e];
        const u32 key = (u32)(entry >> 32);
        if (key > kth) {
            cand[atomicAdd(s_g, 1)] = entry;
        } else if (key == kth) {
            const int at = atomicAdd(s_eq, 1);
            if (at < need) cand[n_greater + at] = entry;
        }
    }
    __syncthreads();
    return *s_eq == need;
}

// params [rows, 7]: temp, top_k, top_p, min_p, repeat, frequency and presence penalty; u [rows]: the draws;
// recent [rows, W] (-1: none); bias ids / values [rows, NB] (id -1: none); mod_ids / mod_vals [rows, W + NB]
// scratch; dynamic shared memory: (n + 63) / 64 pairs of words of flags, then L_CAP * 8 bytes where the first
// histogram (FB_BINS words) and then the gathered keys live
extern "C" __global__ void __launch_bounds__(ST) sample_rows(
    const float *logits, i64 ldl, int n, const float *params, const double *u, const int *recent, int W,
    const int *bias_ids, const float *bias_vals, int NB, int *mod_ids, float *mod_vals, int *out) {
    pdl_begin();
    extern __shared__ u32 bits[];
    u64 *gathered = (u64 *)(bits + 2 * ((n + 63) / 64));
    int *fine = (int *)gathered;  // the first histogram, until the keys are gathered over it
    __shared__ u64 cand[SK_MAX];
    __shared__ float pr[SK_MAX];
    __shared__ int hist[256], wsum[ST / 32], wi[ST / 32];
    __shared__ float wv[ST / 32];
    __shared__ int s_m, s_keep, s_prefix, s_need, s_g, s_bin, s_above, s_inbin, s_eq;
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

    // the raw row's finiteness, the first largest value and, for a row that samples, the first histogram
    const int k = (top_k > 0 && top_k < n) ? top_k : n;
    const bool counts = temp > 0.0f && k <= SK_MAX;
    if (counts)
        for (int b = tid; b < FB_BINS; b += ST) fine[b] = 0;
    __syncthreads();
    float best = -INFINITY;
    int besti = n, bad = 0;
    each_entry(row, bits, mid, mv, m, n, [&](int i, float raw, float v) {
        bad |= !isfinite(raw);
        if (v > best || (besti == n && v == best)) best = v, besti = i;
        if (counts) atomicAdd(&fine[fkey(v) >> FB_SHIFT], 1);
    });
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
    if (k > SK_MAX) {
        if (tid == 0) out[r] = -2;
        return;
    }
    if (!gather_select(row, bits, mid, mv, m, n, k, fine, gathered, cand, hist, wsum, &s_prefix, &s_need, &s_g,
                       &s_bin, &s_above, &s_inbin, &s_eq))
        select_row(row, bits, mid, mv, m, n, k, cand, hist, wsum, &s_prefix, &s_need, &s_g);

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

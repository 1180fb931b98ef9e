// Fused attention, softmax(q k^T * scale + mask) v, without a score matrix in memory.
//
// A block serves one KV head and FA_WARPS query rows of its group (a row: one token and one of
// the query heads sharing that KV head), a warp one row. Keys and values come through shared
// memory 32 at a time (a tile every row of the block masks out is skipped); lane j scores key j,
// then every lane accumulates its share of the head dimension (online softmax, f32). For few rows
// (decode) the keys are split over blocks (flash-decoding): each writes its partial maximum, sum
// and output, and `attn_combine` merges them.
//
// Every kernel takes `sinks` (f32 [heads], or null): gpt-oss's attention sinks, one more logit per head that
// joins each row's softmax with no value (ggml_flash_attn_ext_add_sinks). A row counts its sink once, in the
// first key chunk (so merging chunks stays as it is): as the running maximum and sum it starts from (a first
// key of no value: flash_attn), in the maximum its weights are taken under (attn_decode), or folded in after
// its last key (fold_sink). Without sinks the null pointer is tested once a row, and nothing else changes.

#define FA_WARPS 4
#define FA_KEYS 32
#define DECODE_ROWS 32  // query rows per KV head that attn_decode serves (ops.py: DECODE_ROWS)

// One more logit, sink, joins a row whose maximum m and sum l cover its keys: m becomes the larger of the two,
// l is rescaled to it and gains the sink's share; returns the factor that rescales the row's unnormalized
// output (the sink adds nothing to it).
__device__ __forceinline__ float fold_sink(float sink, float &m, float &l) {
    const float mn = fmaxf(m, sink);
    const float c = m == -INFINITY ? 0.0f : __expf(m - mn);
    l = l * c + __expf(sink - mn);
    m = mn;
    return c;
}

// EPL: head-dimension elements per lane (d <= 32 * EPL); TK: the cache's type
template <int TK, int EPL>
__global__ void __launch_bounds__(FA_WARPS * 32) flash_attn(
    const float *q, const void *k, const void *v, const __half *mask, const float *sinks, float *out, float *part,
    int d, int T, int r, int n_kv, int chunk,
    i64 sq0, i64 sq1, i64 sk0, i64 sk1, i64 sv0, i64 sv1, i64 ldm, float scale) {
    pdl_begin();
    extern __shared__ __align__(16) float smem[];
    const int dp = d + 1;  // padded rows: lane j reading row j hits bank (j * dp + e) % 32
    float *ks = smem, *vs = ks + FA_KEYS * dp, *qs = vs + FA_KEYS * dp;
    const int g = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rr = blockIdx.x * FA_WARPS + warp;  // this warp's row
    const bool has_row = rr < T * r;
    const int t = has_row ? rr / r : 0, h = g * r + (has_row ? rr % r : 0);
    const int kv_begin = blockIdx.z * chunk, kv_end = min(n_kv, kv_begin + chunk);
    float *qr = qs + warp * dp;
    for (int e = lane; e < d; e += 32) qr[e] = has_row ? q[(i64)h * sq0 + (i64)t * sq1 + e] : 0.0f;
    const __half *mrow = mask + (i64)t * ldm;
    float m = -INFINITY, l = 0.0f, o[EPL];
    if (sinks != nullptr && blockIdx.z == 0) m = sinks[h], l = 1.0f;  // the sink: a first key, of no value
#pragma unroll
    for (int x = 0; x < EPL; x++) o[x] = 0.0f;

    for (int kv0 = kv_begin; kv0 < kv_end; kv0 += FA_KEYS) {
        const int kv = kv0 + lane;
        const float mk = has_row && kv < kv_end ? __half2float(mrow[kv]) : -INFINITY;
        const bool live = __any_sync(0xffffffff, mk != -INFINITY);
        if (!__syncthreads_or(live)) continue;  // every row of the block masks this tile out
        for (int j = warp; j < FA_KEYS; j += FA_WARPS) {
            const int kj = kv0 + j;
            const bool in = kj < kv_end;
            for (int e = lane; e < d; e += 32) {
                ks[j * dp + e] = in ? ld<TK>(k, (i64)g * sk0 + (i64)kj * sk1 + e) : 0.0f;
                vs[j * dp + e] = in ? ld<TK>(v, (i64)g * sv0 + (i64)kj * sv1 + e) : 0.0f;
            }
        }
        __syncthreads();
        if (live) {
            float s = -INFINITY;
            if (mk != -INFINITY) {
                const float *kr = ks + lane * dp;
                float dot = 0.0f;
                for (int e = 0; e < d; e++) dot += qr[e] * kr[e];
                s = dot * scale + mk;
            }
            const float m_new = fmaxf(m, warp_max(s));
            const float p = m_new == -INFINITY ? 0.0f : __expf(s - m_new);
            const float corr = m_new == -INFINITY ? 1.0f : __expf(m - m_new);
            l = l * corr + warp_sum(p);
            m = m_new;
#pragma unroll
            for (int x = 0; x < EPL; x++) o[x] *= corr;
#pragma unroll 8
            for (int jj = 0; jj < FA_KEYS; jj++) {
                const float pj = __shfl_sync(0xffffffff, p, jj);
#pragma unroll
                for (int x = 0; x < EPL; x++) {
                    const int e = lane + 32 * x;
                    if (e < d) o[x] += pj * vs[jj * dp + e];
                }
            }
        }
        __syncthreads();
    }
    if (!has_row) return;
    const int hq = gridDim.y * r;
    const i64 orow = (i64)t * hq + h;
    if (part == nullptr) {
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
        for (int x = 0; x < EPL; x++) {
            const int e = lane + 32 * x;
            if (e < d) out[orow * d + e] = o[x] * inv;
        }
    } else {  // partial result of this key chunk: [split][row][m, l, o...]
        float *pr = part + ((i64)blockIdx.z * T * hq + orow) * (d + 2);
        if (lane == 0) {
            pr[0] = m;
            pr[1] = l;
        }
#pragma unroll
        for (int x = 0; x < EPL; x++) {
            const int e = lane + 32 * x;
            if (e < d) pr[2 + e] = o[x];
        }
    }
}

// merge the key chunks' partial results of each output row (a block per row)
extern "C" __global__ void attn_combine(const float *part, float *out, int d, int n_rows, int n_split) {
    pdl_begin();
    i64 row = blockIdx.x;
    float mx = -INFINITY;
    for (int s = 0; s < n_split; s++) mx = fmaxf(mx, part[((i64)s * n_rows + row) * (d + 2)]);
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        float num = 0.0f, den = 0.0f;
        for (int s = 0; s < n_split; s++) {
            const float *pr = part + ((i64)s * n_rows + row) * (d + 2);
            float w = pr[0] == -INFINITY ? 0.0f : expf(pr[0] - mx);
            num += w * pr[2 + e];
            den += w * pr[1];
        }
        out[row * d + e] = den > 0.0f ? num / den : 0.0f;
    }
}

// eight consecutive elements of a float tensor from a 16-byte aligned element offset
template <int T> __device__ __forceinline__ void ld8(const void *p, i64 i, float *out);
template <> __device__ __forceinline__ void ld8<T_F32>(const void *p, i64 i, float *out) {
    const float4 a = *(const float4 *)((const float *)p + i), b = *(const float4 *)((const float *)p + i + 4);
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}
template <> __device__ __forceinline__ void ld8<T_F16>(const void *p, i64 i, float *out) {
    const uint4 u = *(const uint4 *)((const __half *)p + i);
    const __half2 *h = (const __half2 *)&u;
#pragma unroll
    for (int x = 0; x < 4; x++) {
        const float2 f = __half22float2(h[x]);
        out[2 * x] = f.x, out[2 * x + 1] = f.y;
    }
}
template <> __device__ __forceinline__ void ld8<T_BF16>(const void *p, i64 i, float *out) {
    const uint4 u = *(const uint4 *)((const u16 *)p + i);
    const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int x = 0; x < 4; x++) out[2 * x] = __uint_as_float(w[x] << 16), out[2 * x + 1] = __uint_as_float(w[x] & 0xFFFF0000u);
}

// Decode attention over several key chunks (blockIdx.y of gridDim.y): each block has written its rows'
// partial maximum, sum and unnormalized output to `part` ([chunk][T * hq rows][D + 2]); the last block
// of KV head blockIdx.x and row block blockIdx.z to get here (a ticket in `tickets`, one per head and row
// block, which it resets to 0) merges its rows row0 .. row0 + n - 1 of the group's R into `out` (and their
// q8_1 blocks), so one launch does all. Every thread of the block calls it.
template <int D>
__device__ __forceinline__ void merge_chunks(const float *part, float *out, block_q8_1 *q8, int *tickets, int row0,
                                             int n, int T, int r) {
    const int g = blockIdx.x, split = gridDim.y, hq = gridDim.x * r, lane = threadIdx.x & 31;
    int *ticket = tickets + g * gridDim.z + blockIdx.z;
    if (!last_block(ticket, split)) return;
    for (int x = threadIdx.x; x < n * D; x += blockDim.x) {  // whole warps: a warp's 32 elements are one q8 block
        const int i = row0 + x / D, e = x % D;
        const i64 orow = (i64)(i / r) * hq + g * r + i % r;
        float mx = -INFINITY;
        for (int c = 0; c < split; c++) mx = fmaxf(mx, __ldcg(part + ((i64)c * T * hq + orow) * (D + 2)));
        float num = 0.0f, den = 0.0f;
        for (int c = 0; c < split; c++) {
            const float *pr = part + ((i64)c * T * hq + orow) * (D + 2);  // other blocks wrote it: read from L2
            const float mc = __ldcg(pr), w = mc == -INFINITY ? 0.0f : __expf(mc - mx);
            num += w * __ldcg(pr + 2 + e);
            den += w * __ldcg(pr + 1);
        }
        const float res = den > 0.0f ? num / den : 0.0f;
        out[orow * D + e] = res;
        if (q8 != nullptr) quantize_warp(res, q8 + (orow * D + e - lane) / 32);
    }
    if (threadIdx.x == 0) *ticket = 0;
}

// Each of a lane's U x N partial dot products summed over the LPK lanes that share a key (xor shuffles),
// so every one of those lanes has the whole dot.
template <int LPK, int U, int N>
__device__ __forceinline__ void sum_key_lanes(float (&x)[U][N]) {
#pragma unroll
    for (int off = LPK / 2; off > 0; off >>= 1)
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int i = 0; i < N; i++) x[u][i] += __shfl_xor_sync(0xffffffff, x[u][i], off);
}

#define DEC_THREADS 128
#define DEC_RT 4  // query rows the value pass accumulates at once (registers: DEC_RT * 8)
#define DEC_UNROLL 4  // keys each thread loads before using them (loads in flight together)

// Decode attention (flash-decoding for few query rows): a block per KV head g and chunk of keys; the
// R = T * r query rows of the group (token t, query head g * r + i) sit in shared memory. Latency, not
// bandwidth, bounds this kernel, so each pass issues its loads together: the mask first (a row's
// scores start as its mask values, and the chunk's visible span [lo, hi) is found), then the keys of
// that span, D / 8 lanes per key with eight elements each (one 16-byte load), DEC_UNROLL keys per
// thread at once, partial dots summed by shuffles. A warp per row turns scores into weights. Values:
// a thread per eight elements and a share of the keys, four rows at a time, summed over the key
// shares through shared memory. With several chunks each block writes its partial maximum, sum and
// output; the last block of a group to finish (a ticket in `tickets`, which it resets to 0) merges
// them, so one launch does all. With q8 the output rows are also written as q8_1 blocks [T, hq * D / 32],
// the activations of the projection that reads them (a warp's 32 consecutive elements are one block).
template <int TK, int D>
__global__ void __launch_bounds__(DEC_THREADS) attn_decode(
    const float *q, const void *k, const void *v, const __half *mask, const float *sinks, float *out, float *part,
    int *tickets,
    int d, int T, int r, int n_kv, int chunk, i64 sq0, i64 sq1, i64 sk0, i64 sk1, i64 sv0, i64 sv1, i64 ldm,
    float scale, block_q8_1 *q8, int mask_in, int pf) {
    constexpr int LPK = D / 8, KPB = DEC_THREADS / LPK;  // lanes per key, keys per block step
    extern __shared__ __align__(16) float smem[];
    __shared__ float row_m[DECODE_ROWS], row_l[DECODE_ROWS];
    __shared__ int lo, hi;
    const int R = T * r, g = blockIdx.x, split = gridDim.y, s = blockIdx.y, hq = gridDim.x * r;
    const int kv0 = s * chunk, C = min(n_kv, kv0 + chunk) - kv0;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, o = threadIdx.x % LPK, kl = threadIdx.x / LPK;
    float *qs = smem, *ss = qs + R * D, *red = ss + R * chunk;  // q [R][D], scores [R][chunk], sums [KPB][RT][D]
    if (threadIdx.x == 0) lo = C, hi = 0;
    __syncthreads();
    if (!mask_in) pdl_begin();  // a mask a kernel of the step made (ops.kq_mask): read once that kernel is done
    // the mask (a step input, copied before any kernel of the step) before pdl_begin: scores start as the
    // mask values, and the chunk's visible span [lo, hi) is found
    for (int jj = 0; jj < C; jj += DEC_THREADS) {  // every lane of a warp runs as many rounds (reductions below)
        const int j = jj + threadIdx.x;
        bool seen = false;
        for (int t = 0; t < T && j < C; t++) {
            const float mk = __half2float(mask[(i64)t * ldm + kv0 + j]);
            seen |= mk != -INFINITY;
            for (int i = t * r; i < (t + 1) * r; i++) ss[i * chunk + j] = mk;
        }
        // the warp's visible span, then one shared atomic a warp rather than one a visible key
        const int wlo = warp_min_i(seen ? j : C), whi = warp_max_i(seen ? j + 1 : 0);
        if (lane == 0 && whi > 0) atomicMin(&lo, wlo), atomicMax(&hi, whi);
    }
    __syncthreads();
    for (int j = lo + threadIdx.x; pf && j < hi; j += DEC_THREADS) {  // the visible cached rows, into L2
        prefetch_l2((const u8 *)k + ((i64)g * sk0 + (i64)(kv0 + j) * sk1) * Block<TK>::BYTES, D * Block<TK>::BYTES, 0, 1);
        prefetch_l2((const u8 *)v + ((i64)g * sv0 + (i64)(kv0 + j) * sv1) * Block<TK>::BYTES, D * Block<TK>::BYTES, 0, 1);
    }
    pdl_begin();
    for (int x = threadIdx.x; x < R * D; x += DEC_THREADS) {
        const int i = x / D, e = x % D;
        qs[x] = q[(i64)(g * r + i % r) * sq0 + (i64)(i / r) * sq1 + e];
    }
    __syncthreads();
    const int j0 = lo, j1 = hi;
    for (int jb = j0; jb < j1; jb += KPB * DEC_UNROLL) {
        float kx[DEC_UNROLL][8];
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; u++) {
            const int j = jb + u * KPB + kl;
            if (j < j1) ld8<TK>(k, (i64)g * sk0 + (i64)(kv0 + j) * sk1 + o * 8, kx[u]);
        }
        // DEC_RT rows and DEC_UNROLL keys at once: independent dots and shuffles, not one chain per row
        for (int i0 = 0; i0 < R; i0 += DEC_RT) {
            float dot[DEC_UNROLL][DEC_RT];
#pragma unroll
            for (int i = 0; i < DEC_RT; i++) {
                const float4 *qr = (const float4 *)(qs + min(i0 + i, R - 1) * D + o * 8);
                const float4 qa = qr[0], qb = qr[1];
#pragma unroll
                for (int u = 0; u < DEC_UNROLL; u++) {
                    const float *kk = kx[u];
                    dot[u][i] = qa.x * kk[0] + qa.y * kk[1] + qa.z * kk[2] + qa.w * kk[3] + qb.x * kk[4] +
                                qb.y * kk[5] + qb.z * kk[6] + qb.w * kk[7];
                }
            }
            sum_key_lanes<LPK>(dot);
            if (o == 0) {
#pragma unroll
                for (int u = 0; u < DEC_UNROLL; u++) {
                    const int j = jb + u * KPB + kl;
#pragma unroll
                    for (int i = 0; i < DEC_RT; i++) {
                        float *sc = ss + (i0 + i) * chunk + j;
                        if (j < j1 && i0 + i < R && *sc != -INFINITY) *sc += dot[u][i] * scale;
                    }
                }
            }
        }
    }
    __syncthreads();
    const bool sink = sinks != nullptr && s == 0;  // the first chunk's rows count their head's sink
    for (int i = warp; i < R; i += DEC_THREADS / 32) {
        float m = -INFINITY;
        for (int j = j0 + lane; j < j1; j += 32) m = fmaxf(m, ss[i * chunk + j]);
        m = warp_max(m);
        if (sink) m = fmaxf(m, sinks[g * r + i % r]);  // weights under a maximum that includes the sink
        float l = 0.0f;
        for (int j = j0 + lane; j < j1; j += 32) {
            const float p = m == -INFINITY ? 0.0f : __expf(ss[i * chunk + j] - m);
            ss[i * chunk + j] = p;
            l += p;
        }
        l = warp_sum(l);
        if (sink) l += __expf(sinks[g * r + i % r] - m);
        if (lane == 0) row_m[i] = m, row_l[i] = l;
    }
    __syncthreads();
    for (int i0 = 0; i0 < R; i0 += DEC_RT) {
        float acc[DEC_RT][8];
#pragma unroll
        for (int i = 0; i < DEC_RT; i++)
#pragma unroll
            for (int x = 0; x < 8; x++) acc[i][x] = 0.0f;
        for (int jb = j0; jb < j1; jb += KPB * DEC_UNROLL) {
            float vx[DEC_UNROLL][8];
#pragma unroll
            for (int u = 0; u < DEC_UNROLL; u++) {
                const int j = jb + u * KPB + kl;
                if (j < j1) ld8<TK>(v, (i64)g * sv0 + (i64)(kv0 + j) * sv1 + o * 8, vx[u]);
            }
#pragma unroll
            for (int u = 0; u < DEC_UNROLL; u++) {
                const int j = jb + u * KPB + kl;
                if (j >= j1) continue;
#pragma unroll
                for (int i = 0; i < DEC_RT; i++) {
                    const float p = i0 + i < R ? ss[(i0 + i) * chunk + j] : 0.0f;
#pragma unroll
                    for (int x = 0; x < 8; x++) acc[i][x] += p * vx[u][x];
                }
            }
        }
#pragma unroll
        for (int i = 0; i < DEC_RT; i++)
#pragma unroll
            for (int x = 0; x < 8; x++) red[(kl * DEC_RT + i) * D + o * 8 + x] = acc[i][x];
        __syncthreads();
        for (int x = threadIdx.x; x < DEC_RT * D; x += DEC_THREADS) {
            const int i = i0 + x / D, e = x % D;
            if (i >= R) continue;
            float sum = 0.0f;
            for (int c = 0; c < KPB; c++) sum += red[c * DEC_RT * D + x];
            const i64 orow = (i64)(i / r) * hq + g * r + i % r;
            if (split == 1) {
                const float res = row_l[i] > 0.0f ? sum / row_l[i] : 0.0f;
                out[orow * D + e] = res;
                if (q8 != nullptr) quantize_warp(res, q8 + (orow * D + e - lane) / 32);
            } else {
                float *pr = part + ((i64)s * T * hq + orow) * (D + 2);
                if (e == 0) pr[0] = row_m[i], pr[1] = row_l[i];
                pr[2 + e] = sum;
            }
        }
        __syncthreads();
    }
    if (split > 1) merge_chunks<D>(part, out, q8, tickets, 0, R, T, r);
}

#define DS_WARPS 8  // warps of attn_decode_rows
#define DS_ROWS 4   // query rows of a KV head's group an attn_decode_rows or attn_decode_tok block serves
#define DS_UNROLL 4  // keys each lane group of attn_decode_rows loads at once
#define DT_UNROLL 2  // attn_decode_tok's: at 4 its 128 registers (two blocks a multiprocessor) spilled 104 bytes

// a key's and its value's eight elements for this lane (zeros past the span)
template <int TK, int D>
__device__ __forceinline__ void ds_load(const void *k, const void *v, i64 ko, i64 vo, bool live, float *kx, float *vx) {
    if (live) {
        ld8<TK>(k, ko, kx);
        ld8<TK>(v, vo, vx);
    } else {  // past the span: weight 0, and values that keep 0 * value finite
#pragma unroll
        for (int x = 0; x < 8; x++) kx[x] = vx[x] = 0.0f;
    }
}

// A round's scores: sc[u][i] = the dot of row i's query (scaled) with key u, from this lane's slices
// qr[i] and kx[u] and those of the other LPK - 1 lanes that hold the key.
template <int LPK, int U>
__device__ __forceinline__ void ds_scores(const float (&qr)[DS_ROWS][8], const float (&kx)[U][8],
                                          float (&sc)[U][DS_ROWS]) {
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
        for (int i = 0; i < DS_ROWS; i++) {
            float dot = 0.0f;
#pragma unroll
            for (int x = 0; x < 8; x++) dot += qr[i][x] * kx[u][x];
            sc[u][i] = dot;
        }
    sum_key_lanes<LPK>(sc);
}

// A round's scores sc, masked (mask(u, i): key u's mask value for row i, -INFINITY: hidden), folded into
// each row's running maximum m, sum l and weighted value slice acc (online softmax); a row that sees none
// of the round's keys is left as it is.
template <int U, typename Mask>
__device__ __forceinline__ void ds_fold(float (&sc)[U][DS_ROWS], const float (&vx)[U][8],
                                        float (&m)[DS_ROWS], float (&l)[DS_ROWS], float (&acc)[DS_ROWS][8], Mask mask) {
#pragma unroll
    for (int i = 0; i < DS_ROWS; i++) {
        float mn = m[i];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const float mk = mask(u, i);
            sc[u][i] = mk == -INFINITY ? -INFINITY : sc[u][i] + mk;
            mn = fmaxf(mn, sc[u][i]);
        }
        if (mn == -INFINITY) continue;  // nothing visible to this row yet
        const float corr = __expf(m[i] - mn);
        l[i] *= corr;
#pragma unroll
        for (int x = 0; x < 8; x++) acc[i][x] *= corr;
#pragma unroll
        for (int u = 0; u < U; u++) {
            const float p = __expf(sc[u][i] - mn);
            l[i] += p;
#pragma unroll
            for (int x = 0; x < 8; x++) acc[i][x] += p * vx[u][x];
        }
        m[i] = mn;
    }
}

// After the last round: the warp's key groups merged by shuffles (lanes o of every group hold the same
// elements), then group 0 writes the warp's rows (maximum, sum, weighted values) to its shared slots.
template <int LPK, int D>
__device__ __forceinline__ void ds_merge_lanes(float (&m)[DS_ROWS], float (&l)[DS_ROWS], float (&acc)[DS_ROWS][8],
                                               int warp, int o, int kl, float (*wacc)[DS_ROWS][D],
                                               float (*wm)[DS_ROWS], float (*wl)[DS_ROWS]) {
#pragma unroll
    for (int off = LPK; off < 32; off <<= 1)
#pragma unroll
        for (int i = 0; i < DS_ROWS; i++) {
            const float mo = __shfl_xor_sync(0xffffffff, m[i], off), lo_ = __shfl_xor_sync(0xffffffff, l[i], off);
            const float mn = fmaxf(m[i], mo);
            const float a = mn == -INFINITY ? 0.0f : __expf(m[i] - mn), b = mn == -INFINITY ? 0.0f : __expf(mo - mn);
            l[i] = l[i] * a + lo_ * b;
#pragma unroll
            for (int x = 0; x < 8; x++) acc[i][x] = acc[i][x] * a + __shfl_xor_sync(0xffffffff, acc[i][x], off) * b;
            m[i] = mn;
        }
    if (kl == 0) {
#pragma unroll
        for (int i = 0; i < DS_ROWS; i++) {
#pragma unroll
            for (int x = 0; x < 8; x++) wacc[warp][i][o * 8 + x] = acc[i][x];
            if (o == 0) wm[warp][i] = m[i], wl[warp][i] = l[i];
        }
    }
}

// Row i's element e merged over the warps' shared slots: the largest maximum mx, and the unnormalized
// output num and sum den rescaled to it (the row's value is num / den).
template <int D>
__device__ __forceinline__ void ds_merge_warps(const float (*wacc)[DS_ROWS][D], const float (*wm)[DS_ROWS],
                                               const float (*wl)[DS_ROWS], int i, int e, float &mx, float &num,
                                               float &den) {
    mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < DS_WARPS; w++) mx = fmaxf(mx, wm[w][i]);
    num = 0.0f, den = 0.0f;
#pragma unroll
    for (int w = 0; w < DS_WARPS; w++) {
        const float f = wm[w][i] == -INFINITY ? 0.0f : __expf(wm[w][i] - mx);
        num += f * wacc[w][i][e];
        den += f * wl[w][i];
    }
}

// Decode attention for a few query rows of a KV head (one token of a group of heads, the common decode
// step, or a few tokens), DS_ROWS of them a block: blockIdx.z takes the group's rows z * DS_ROWS on, so a
// group of 8 or 16 rows is 2 or 4 blocks reading the same keys (from L2 but for the first), each as fast
// as one of 4 rows (H200, qwen3-30b-a3b's 32 query heads over 4 KV heads, d 128, 140 cells: 8.1 us against
// attn_decode's 35; two tokens of it, 16 rows, 8.2 against 66). Built for latency: every warp takes its own keys, D / 8 lanes per key (eight elements
// each, one 16-byte load of f16), and loads DS_UNROLL keys and their values together, so a pass over a
// few hundred keys is one or two round trips to memory. The first round's keys and values are loaded
// before pdl_begin (while the kernel before runs), all but the rows this step writes (`fresh`, the step's
// T cache rows; null: every row waits), which come after it with the queries, straight into registers.
// Each lane keeps a running maximum, sum and weighted value sum per row (online softmax), so values need
// no second pass; lanes of a warp merge by shuffles, warps through shared memory. Same arguments, chunks
// and merging of chunks as attn_decode (tickets: one per KV head and row block).
template <int TK, int D>
__global__ void __launch_bounds__(DS_WARPS * 32) attn_decode_rows(
    const float *q, const void *k, const void *v, const __half *mask, const float *sinks, float *out, float *part,
    int *tickets,
    int d, int T, int r, int n_kv, int chunk, i64 sq0, i64 sq1, i64 sk0, i64 sk1, i64 sv0, i64 sv1, i64 ldm,
    float scale, block_q8_1 *q8, const int *fresh, int mask_in, int pf) {
    constexpr int LPK = D / 8, KPW = 32 / LPK, KPB = KPW * DS_WARPS;  // lanes a key, keys a warp step, a block step
    __shared__ __align__(16) float wacc[DS_WARPS][DS_ROWS][D];
    __shared__ float wm[DS_WARPS][DS_ROWS], wl[DS_WARPS][DS_ROWS];
    __shared__ int lo, hi;
    const int R = T * r, g = blockIdx.x, s = blockIdx.y, hq = gridDim.x * r;
    const int row0 = blockIdx.z * DS_ROWS, nr = min(DS_ROWS, R - row0);  // this block's rows of the group
    const int t0 = row0 / r, t1 = (row0 + nr - 1) / r;  // and their tokens
    const int kv0 = s * chunk, C = min(n_kv, kv0 + chunk) - kv0;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, o = lane % LPK, kl = lane / LPK;
    if (threadIdx.x == 0) lo = C, hi = 0;
    __syncthreads();
    if (!mask_in) pdl_begin();  // a mask a kernel of the step made (ops.kq_mask): read once that kernel is done
    // the chunk's visible span from the mask (a step input: read before pdl_begin)
    for (int jj = 0; jj < C; jj += DS_WARPS * 32) {
        const int j = jj + threadIdx.x;
        bool seen = false;
        for (int t = t0; t <= t1 && j < C; t++) seen |= __half2float(mask[(i64)t * ldm + kv0 + j]) != -INFINITY;
        const int wlo = warp_min_i(seen ? j : C), whi = warp_max_i(seen ? j + 1 : 0);
        if (lane == 0 && whi > 0) atomicMin(&lo, wlo), atomicMax(&hi, whi);
    }
    __syncthreads();
    const int j0 = lo, j1 = hi;
    // the first round: rows written in earlier steps into registers, the rest of the span into L2
    int jw = j0 + warp * KPW;
    float kx[DS_UNROLL][8], vx[DS_UNROLL][8];
    bool late[DS_UNROLL];
#pragma unroll
    for (int u = 0; u < DS_UNROLL; u++) {
        const int j = jw + kl + u * KPB;
        bool now = fresh != nullptr && j < j1;
        for (int t = 0; t < T && now; t++) now = fresh[t] != kv0 + j;
        late[u] = !now;
        ds_load<TK, D>(k, v, (i64)g * sk0 + (i64)(kv0 + j) * sk1 + o * 8,
                       (i64)g * sv0 + (i64)(kv0 + j) * sv1 + o * 8, now, kx[u], vx[u]);
    }
    for (int j = j0 + KPB * DS_UNROLL + threadIdx.x; pf && j < j1; j += DS_WARPS * 32) {
        prefetch_l2((const u8 *)k + ((i64)g * sk0 + (i64)(kv0 + j) * sk1) * Block<TK>::BYTES, D * Block<TK>::BYTES, 0, 1);
        prefetch_l2((const u8 *)v + ((i64)g * sv0 + (i64)(kv0 + j) * sv1) * Block<TK>::BYTES, D * Block<TK>::BYTES, 0, 1);
    }
    pdl_begin();
    float qr[DS_ROWS][8], m[DS_ROWS], l[DS_ROWS], acc[DS_ROWS][8];
#pragma unroll
    for (int i = 0; i < DS_ROWS; i++) {  // rows past the block's repeat its last (never written)
        const int ii = row0 + min(i, nr - 1);
        const float *qrow = q + (i64)(g * r + ii % r) * sq0 + (i64)(ii / r) * sq1 + o * 8;
        m[i] = -INFINITY, l[i] = 0.0f;
#pragma unroll
        for (int x = 0; x < 8; x++) qr[i][x] = qrow[x] * scale, acc[i][x] = 0.0f;
    }
#pragma unroll
    for (int u = 0; u < DS_UNROLL; u++) {
        const int j = jw + kl + u * KPB;
        if (late[u])
            ds_load<TK, D>(k, v, (i64)g * sk0 + (i64)(kv0 + j) * sk1 + o * 8,
                           (i64)g * sv0 + (i64)(kv0 + j) * sv1 + o * 8, j < j1, kx[u], vx[u]);
    }
    i64 mrow[DS_ROWS];  // where each row's mask values for the chunk start: row i's token is (row0 + i) / r
#pragma unroll
    for (int i = 0; i < DS_ROWS; i++) mrow[i] = (i64)((row0 + min(i, nr - 1)) / r) * ldm + kv0;
    for (; jw < j1; jw += KPB * DS_UNROLL) {  // the same rounds for a warp's lanes (shuffles)
        const int jb = jw + kl;
        if (jw > j0 + warp * KPW) {
#pragma unroll
            for (int u = 0; u < DS_UNROLL; u++) {
                const int j = jb + u * KPB;
                ds_load<TK, D>(k, v, (i64)g * sk0 + (i64)(kv0 + j) * sk1 + o * 8,
                               (i64)g * sv0 + (i64)(kv0 + j) * sv1 + o * 8, j < j1, kx[u], vx[u]);
            }
        }
        float sc[DS_UNROLL][DS_ROWS];
        ds_scores<LPK>(qr, kx, sc);
        ds_fold(sc, vx, m, l, acc, [&](int u, int i) {
            const int j = jb + u * KPB;
            return j < j1 ? __half2float(mask[mrow[i] + j]) : -INFINITY;
        });
    }
    ds_merge_lanes<LPK, D>(m, l, acc, warp, o, kl, wacc, wm, wl);
    __syncthreads();
    for (int x = threadIdx.x; x < nr * D; x += DS_WARPS * 32) {  // whole warps: a warp's 32 elements are one q8 block
        const int i = row0 + x / D, e = x % D;
        float mx, num, den;
        ds_merge_warps<D>(wacc, wm, wl, x / D, e, mx, num, den);
        if (sinks != nullptr && s == 0) num *= fold_sink(sinks[g * r + i % r], mx, den);
        const i64 orow = (i64)(i / r) * hq + g * r + i % r;
        if (gridDim.y == 1) {
            const float res = den > 0.0f ? num / den : 0.0f;
            out[orow * D + e] = res;
            if (q8 != nullptr) quantize_warp(res, q8 + (orow * D + e - lane) / 32);
        } else {
            float *pr = part + ((i64)s * T * hq + orow) * (D + 2);
            if (e == 0) pr[0] = mx, pr[1] = den;
            pr[2 + e] = num;
        }
    }
    if (gridDim.y > 1) merge_chunks<D>(part, out, q8, tickets, row0, nr, T, r);
}

#define DT_MAX_TILES 2048  // tiles of 32 cells attn_tiles and flash_attn_tc list (caches of up to 65536 cells)

// The tiles of 32 cells that any of the mask's rows t0..t1 sees (a value other than -inf), flagged in flag[]
// (shared memory, one byte a tile): a micro-batch of many sequences sees a few tiles of the whole cache each
// (llm/kv_blocks.py keeps a sequence's cells in blocks of their own), so attention reads those and skips the
// rest. NT threads (the whole block) call it; each reads 16 bytes of a row at a time, U loads in flight, four
// threads a tile. Rows 16-byte aligned, n_kv a multiple of 8 and at most DT_MAX_TILES * 32 (the binders'
// checks). The flags are complete after the block's next __syncthreads.
template <int NT>
__device__ void flag_tiles(const __half *mask, i64 ldm, int t0, int t1, int n_kv, unsigned char *flag) {
    constexpr int U = 4;  // loads in flight a thread: a pass over a long row is a few round trips, not dozens
    const int lane = threadIdx.x & 31, n_t = (n_kv + 31) / 32;
    for (int base = 0; base < n_t * 32; base += NT * 8 * U) {
        bool seen[U];
#pragma unroll
        for (int u = 0; u < U; u++) seen[u] = false;
        for (int t = t0; t <= t1; t++) {
            uint4 w[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int c = base + (u * NT + threadIdx.x) * 8;
                w[u] = c < n_kv ? *(const uint4 *)(mask + (i64)t * ldm + c) : make_uint4(0xfc00fc00u, 0xfc00fc00u,
                                                                                         0xfc00fc00u, 0xfc00fc00u);
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const u32 ws[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
#pragma unroll
                for (int x = 0; x < 4; x++) seen[u] |= (ws[x] & 0xffffu) != 0xfc00u || (ws[x] >> 16) != 0xfc00u;
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            bool sn = seen[u];
            sn |= __shfl_xor_sync(0xffffffff, sn, 1);
            sn |= __shfl_xor_sync(0xffffffff, sn, 2);
            const int c = base + (u * NT + threadIdx.x) * 8;
            if ((lane & 3) == 0 && c < n_t * 32) flag[c / 32] = sn;
        }
    }
}

// The flagged tiles of n_t listed in order into tiles[], their count into *count, by warp 0 (ballots), so the
// tiles' order, and the sums' rounding, do not depend on timing; the other warps pass.
__device__ __forceinline__ void collect_tiles(const unsigned char *flag, int n_t, int *tiles, int *count) {
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    int n = 0;
    for (int base = 0; base < n_t; base += 32) {
        const int i = base + lane;
        const bool f = i < n_t && flag[i];
        const u32 b = __ballot_sync(0xffffffff, f);
        if (f) tiles[n + __popc(b & ((1u << lane) - 1))] = i;
        n += __popc(b);
    }
    if (lane == 0) *count = n;
}

// flag_tiles then collect_tiles into shared memory: the tiles any of rows t0..t1 sees, their count returned to
// every thread of the block.
template <int NT>
__device__ int list_tiles(const __half *mask, i64 ldm, int t0, int t1, int n_kv, int *tiles, unsigned char *flag,
                          int *count) {
    flag_tiles<NT>(mask, ldm, t0, t1, n_kv, flag);
    __syncthreads();
    collect_tiles(flag, (n_kv + 31) / 32, tiles, count);
    __syncthreads();
    return *count;
}

#define CASCADE_MIN_TILES 8  // a prefix every token of a step sees whole is read once for all from 256 cells on
#define CASCADE_SPLIT 4       // key chunks the PREFIX pass splits the shared prefix into (blockIdx.z)

// The tiles of 32 cells that a decode step's tokens share, read once for all of them (flash_attn_tc's PREFIX
// pass): the fewest leading tiles a token sees whole (`full`, attn_tiles'), over the tokens that see
// CASCADE_MIN_TILES or more (a padding row sees cell 0 alone, a sequence of no shared prefix a few), where those are
// half the step's tokens or more; else 0 (sequences in blocks of their own: the first sees its own cells from cell 0
// on, and reading them for every row would be waste). A token that sees fewer reads every tile itself. The whole
// block calls it, once.
__device__ int cascade_span(const int *full, int T) {
    __shared__ int span, n;
    if (threadIdx.x == 0) span = 0x7fffffff, n = 0;
    __syncthreads();
    for (int t = threadIdx.x; t < T; t += blockDim.x)
        if (full[t] >= CASCADE_MIN_TILES) atomicMin(&span, full[t]), atomicAdd(&n, 1);
    __syncthreads();
    return 2 * n >= T ? span : 0;
}

// The leading tiles of 32 cells mask row `mrow` sees whole (every value 0: not hidden, nothing added), by the
// whole block: its share of a prefix of cells every sequence of a step holds (a shared system prompt). Stops at
// the first pass over 8 * blockDim.x cells that finds a value other than 0.
__device__ int leading_full_tiles(const __half *mrow, int n_kv) {
    __shared__ int first;  // the first group of 8 cells that holds a value other than 0
    if (threadIdx.x == 0) first = n_kv;
    __syncthreads();
    for (int base = 0; base < n_kv; base += blockDim.x * 8) {
        const int c = base + threadIdx.x * 8;
        bool other = false;
        if (c < n_kv) {
            const uint4 w = *(const uint4 *)(mrow + c);
            other = ((w.x | w.y | w.z | w.w) & 0x7fff7fffu) != 0;
            if (other) atomicMin(&first, c);
        }
        if (__syncthreads_or(other)) break;
    }
    __syncthreads();
    return first / 32;
}

// Prompt attention on tensor cores (mma16816, common.cuh: f16 inputs, f32 sums) for an f16 cache and head
// dimension D, flash-attention-2 style: a block is 4 warps, a warp 16 query rows of one KV head's group
// (row rr: token rr / r, query head g * r + rr % r) whose queries (scaled, f16), scores, running
// maxima and sums and outputs stay in registers in the mma fragments' layouts. Tiles of 32 keys and
// values go through shared memory; a tile that every row of the block masks out is skipped, and with
// `listed` only the tiles list_tiles finds any of the block's rows to see are visited at all (a micro-batch
// of many sequences' prompts: each block's rows see their own sequence's few tiles). One key chunk (no split).
#define TC_KEYS 32
__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *(u32 *)&h;
}
__device__ __forceinline__ u32 pack_u16(u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); }

// With PREFIX (the PREFIX pass of a decode step of many sequences that share a prefix of cells: a cascade): the
// tiles 0 .. S - 1 that every sharing token sees whole (cascade_span of attn_tiles' `full`), unmasked, split over
// blockIdx.z's CASCADE_SPLIT chunks, each block's rows written as partial results to `part` ([chunk][T * hq
// rows][D + 2]: unnormalized output, maximum, sum) for attn_decode_tok to merge, rather than normalized to `out`.
// So the keys of a shared system prompt are read once a block of 16 tokens, not once a token. H200, llama-1b's 32
// query heads over 8 KV heads, each token over a shared 1024-cell prefix and 72 cells of its own: 64 tokens 41.5
// us a layer against 53.4 token by token, 128 tokens 70 against 106 (16 chunks: 49 and 104; 8: 42 and 74).
template <int D, bool PREFIX>
__global__ void __launch_bounds__(128) flash_attn_tc(
    const float *q, const __half *k, const __half *v, const __half *mask, const float *sinks, float *out,
    int d, int T, int r, int n_kv, i64 sq0, i64 sq1, i64 sk0, i64 sk1, i64 sv0, i64 sv1, i64 ldm, float scale,
    int listed, const int *full, float *part) {
    pdl_begin();
    __shared__ __align__(16) __half ks[TC_KEYS * D], vs[TC_KEYS * D];
    __shared__ int tiles[PREFIX ? 1 : DT_MAX_TILES];
    __shared__ unsigned char flag[PREFIX ? 1 : DT_MAX_TILES];
    __shared__ int n_listed;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, grp = lane >> 2, tig = lane & 3;
    const int g = blockIdx.y, R = T * r, row0 = (blockIdx.x * 4 + warp) * 16;
    const int first = blockIdx.x * 64, last = min(R, first + 64) - 1;  // the block's rows
    int t_lo = 0, t_hi;  // the tiles the block visits (of the list, with `listed`)
    if constexpr (PREFIX) {
        const int span = cascade_span(full, T);
        t_lo = blockIdx.z * span / CASCADE_SPLIT, t_hi = (blockIdx.z + 1) * span / CASCADE_SPLIT;
    } else {
        t_hi = listed ? list_tiles<128>(mask, ldm, first / r, last / r, n_kv, tiles, flag, &n_listed)
                      : (n_kv + TC_KEYS - 1) / TC_KEYS;
    }
    const int ra = row0 + grp, rb = ra + 8;  // this thread's two rows
    u32 qa[D / 16][4];
#pragma unroll
    for (int kc = 0; kc < D / 16; kc++) {
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int rr = (x & 1) ? rb : ra, e = kc * 16 + 2 * tig + ((x & 2) ? 8 : 0);
            float lo = 0.0f, hi = 0.0f;
            if (rr < R) {
                const float *qr = q + (i64)(g * r + rr % r) * sq0 + (i64)(rr / r) * sq1 + e;
                lo = qr[0] * scale, hi = qr[1] * scale;
            }
            qa[kc][x] = pack_h2(lo, hi);
        }
    }
    const __half *ma = mask + (i64)(ra < R ? ra / r : 0) * ldm, *mb = mask + (i64)(rb < R ? rb / r : 0) * ldm;
    float o[D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; dn++) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;  // l: this thread's share of the row sums
    for (int ti = t_lo; ti < t_hi; ti++) {
        const int kv0 = (!PREFIX && listed ? tiles[ti] : ti) * TC_KEYS;
        float s[TC_KEYS / 8][4];
        bool any = false;
#pragma unroll
        for (int nt = 0; nt < TC_KEYS / 8; nt++) {
#pragma unroll
            for (int x = 0; x < 4; x++) {
                const int kv = kv0 + nt * 8 + 2 * tig + (x & 1);
                const bool a = x < 2;
                const bool in = (a ? ra : rb) < R && kv < n_kv;
                const float mk = PREFIX ? (in ? 0.0f : -INFINITY) : in ? __half2float((a ? ma : mb)[kv]) : -INFINITY;
                s[nt][x] = mk;  // the mask, the scores added below
                any |= mk != -INFINITY;
            }
        }
        const bool live = __any_sync(0xffffffff, any);
        if (!__syncthreads_or(live)) continue;  // also: every warp is done with the last tile
        for (int x = threadIdx.x; x < TC_KEYS * D / 8; x += 128) {
            const int j = x / (D / 8), e = (x % (D / 8)) * 8, kj = kv0 + j;
            uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
            if (kj < n_kv) {
                kx = *(const uint4 *)(k + (i64)g * sk0 + (i64)kj * sk1 + e);
                vx = *(const uint4 *)(v + (i64)g * sv0 + (i64)kj * sv1 + e);
            }
            *(uint4 *)(ks + j * D + e) = kx;
            *(uint4 *)(vs + j * D + e) = vx;
        }
        __syncthreads();
        if (!live) continue;
        float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < TC_KEYS / 8; nt++) {
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const __half *kr = ks + (nt * 8 + grp) * D + 2 * tig;
#pragma unroll
            for (int kc = 0; kc < D / 16; kc++)
                mma16816(c, qa[kc], *(const u32 *)(kr + kc * 16), *(const u32 *)(kr + kc * 16 + 8));
#pragma unroll
            for (int x = 0; x < 4; x++) s[nt][x] = s[nt][x] == -INFINITY ? -INFINITY : s[nt][x] + c[x];
            mx_a = fmaxf(mx_a, fmaxf(s[nt][0], s[nt][1]));
            mx_b = fmaxf(mx_b, fmaxf(s[nt][2], s[nt][3]));
        }
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffff, mx_a, off));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffff, mx_b, off));
        }
        const float na = fmaxf(m_a, mx_a), nb = fmaxf(m_b, mx_b);
        const float ca = na == -INFINITY ? 1.0f : __expf(m_a - na), cb = nb == -INFINITY ? 1.0f : __expf(m_b - nb);
        m_a = na, m_b = nb;
        l_a *= ca, l_b *= cb;
#pragma unroll
        for (int nt = 0; nt < TC_KEYS / 8; nt++) {
#pragma unroll
            for (int x = 0; x < 4; x++) {
                const float mm = x < 2 ? na : nb;
                s[nt][x] = mm == -INFINITY ? 0.0f : __expf(s[nt][x] - mm);
            }
            l_a += s[nt][0] + s[nt][1];
            l_b += s[nt][2] + s[nt][3];
        }
#pragma unroll
        for (int dn = 0; dn < D / 8; dn++) o[dn][0] *= ca, o[dn][1] *= ca, o[dn][2] *= cb, o[dn][3] *= cb;
#pragma unroll
        for (int kc = 0; kc < TC_KEYS / 16; kc++) {
            const u32 pa[4] = {pack_h2(s[2 * kc][0], s[2 * kc][1]), pack_h2(s[2 * kc][2], s[2 * kc][3]),
                               pack_h2(s[2 * kc + 1][0], s[2 * kc + 1][1]), pack_h2(s[2 * kc + 1][2], s[2 * kc + 1][3])};
            const u16 *vr = (const u16 *)vs + (kc * 16 + 2 * tig) * D + grp;
#pragma unroll
            for (int dn = 0; dn < D / 8; dn++) {
                const u16 *vc = vr + dn * 8;
                mma16816(o[dn], pa, pack_u16(vc[0], vc[D]), pack_u16(vc[8 * D], vc[9 * D]));
            }
        }
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        l_a += __shfl_xor_sync(0xffffffff, l_a, off);
        l_b += __shfl_xor_sync(0xffffffff, l_b, off);
    }
    const int hq = gridDim.y * r;
    if constexpr (PREFIX) {  // partial results: the unnormalized output, the maximum and the sum of each row
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int rr = half ? rb : ra;
            if (rr >= R) continue;
            float *prow = part + (((i64)blockIdx.z * T + rr / r) * hq + g * r + rr % r) * (D + 2);
#pragma unroll
            for (int dn = 0; dn < D / 8; dn++) {
                prow[dn * 8 + 2 * tig] = o[dn][2 * half];
                prow[dn * 8 + 2 * tig + 1] = o[dn][2 * half + 1];
            }
            if (tig == 0) prow[D] = half ? m_b : m_a, prow[D + 1] = half ? l_b : l_a;
        }
    } else {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int rr = half ? rb : ra;
            float l = half ? l_b : l_a;
            if (sinks != nullptr) {
                float m = half ? m_b : m_a;
                const float c = fold_sink(sinks[g * r + rr % r], m, l);
#pragma unroll
                for (int dn = 0; dn < D / 8; dn++) o[dn][2 * half] *= c, o[dn][2 * half + 1] *= c;
            }
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            if (rr >= R) continue;
            float *orow = out + ((i64)(rr / r) * hq + g * r + rr % r) * d + 2 * tig;
#pragma unroll
            for (int dn = 0; dn < D / 8; dn++) {
                orow[dn * 8] = o[dn][2 * half] * inv;
                orow[dn * 8 + 1] = o[dn][2 * half + 1] * inv;
            }
        }
    }
}


// The tiles of 32 cells each token of a decode step of many sequences sees, for attn_decode_tok: token
// t = blockIdx.x's count, then its tiles in order, at tiles[t * (n_t + 1)] (n_t: n_kv / 32 rounded up). Once
// a token, not once a KV head and row block: a step of 128 sequences over 32768 cells reads its mask once
// (8 MB), where every block of attention scanning its row read it 8 or 16 times over. The scan of a mask
// that is a step input (mask_in) runs before pdl_begin, beside the kernel before; the list is written after
// it (its memory may be one that kernel still uses). Rows 16-byte aligned, n_kv a multiple of 8 and at most
// DT_MAX_TILES * 32 (the binder's checks).
extern "C" __global__ void __launch_bounds__(256) attn_tiles(const __half *mask, i64 ldm, int n_kv, int *tiles,
                                                            int mask_in, int *full) {
    __shared__ unsigned char flag[DT_MAX_TILES];
    const int n_t = (n_kv + 31) / 32;
    if (!mask_in) pdl_begin();  // a mask a kernel of the step made (ops.kq_mask): read once that kernel is done
    flag_tiles<256>(mask, ldm, blockIdx.x, blockIdx.x, n_kv, flag);
    // with `full` (flash_attn_tc's PREFIX pass follows), the leading tiles the token sees whole too
    const int whole = full != nullptr ? leading_full_tiles(mask + (i64)blockIdx.x * ldm, n_kv) : 0;
    __syncthreads();
    pdl_begin();
    int *list = tiles + (i64)blockIdx.x * (n_t + 1);
    collect_tiles(flag, n_t, list + 1, list);
    if (full != nullptr && threadIdx.x == 0) full[blockIdx.x] = whole;
}

// Decode attention for a step of many sequences, one token each (GraphParams.one_per_seq): a block per KV
// head g, token t = blockIdx.y and DS_ROWS of the group's r query heads (blockIdx.z: heads z * DS_ROWS on)
// over the cells its own sequence holds, not over the whole cache: the tiles attn_tiles listed for the
// token (the launch before), then the keys of those tiles only, as attn_decode_rows reads a span: D / 8 lanes
// per key, DT_UNROLL keys at once, online softmax per lane, lanes merged by shuffles and warps through shared
// memory. Queries, keys and values were written before attn_tiles ran, so the queries are read before
// pdl_begin; the list after it. After the PREFIX pass (`part`), whose every block passed pdl_begin before this
// kernel could start, attn_tiles is done too: the token's own tiles are read beside the PREFIX pass, and only
// the merge of its partial rows (and the output's writing) waits for it. Two blocks a multiprocessor (registers capped at 128; DT_UNROLL keys a lane group
// at once keeps them unspilled): a step of 128 sequences is 1024 blocks or more, and throughput, not one block's
// latency, is what counts. H200, 64 sequences, 32 query heads over 8 KV heads, d 64, with attn_tiles: 16.1 us a
// step over 129 cells each, 54.9 over a shared 1024-cell prefix and 72 of its own (4 keys at once, 104 bytes
// spilled: 22.7 and 70.3; a scan of the mask row in each block, 167 registers, 27.6 over the 129).
template <int TK, int D>
__global__ void __launch_bounds__(DS_WARPS * 32, 2) attn_decode_tok(
    const float *q, const void *k, const void *v, const __half *mask, const float *sinks, float *out,
    const int *tiles, int r, int n_kv, i64 sq0, i64 sq1, i64 sk0, i64 sk1, i64 sv0, i64 sv1, i64 ldm, float scale,
    const int *full, const float *part) {
    constexpr int LPK = D / 8, KPW = 32 / LPK, KPB = KPW * DS_WARPS;
    __shared__ __align__(16) float wacc[DS_WARPS][DS_ROWS][D];
    __shared__ float wm[DS_WARPS][DS_ROWS], wl[DS_WARPS][DS_ROWS];
    const int g = blockIdx.x, t = blockIdx.y, hq = gridDim.x * r;
    const int row0 = blockIdx.z * DS_ROWS, nr = min(DS_ROWS, r - row0);  // this block's heads of the group
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, o = lane % LPK, kl = lane / LPK;
    const __half *mrow = mask + (i64)t * ldm;
    float qr[DS_ROWS][8], m[DS_ROWS], l[DS_ROWS], acc[DS_ROWS][8];
#pragma unroll
    for (int i = 0; i < DS_ROWS; i++) {  // rows past the block's repeat its last (never written)
        const int ii = row0 + min(i, nr - 1);
        const float *qrow = q + (i64)(g * r + ii) * sq0 + (i64)t * sq1 + o * 8;
        m[i] = -INFINITY, l[i] = 0.0f;
#pragma unroll
        for (int x = 0; x < 8; x++) qr[i][x] = qrow[x] * scale, acc[i][x] = 0.0f;
    }
    if (part == nullptr) pdl_begin();
    const int *list = tiles + (i64)t * ((n_kv + 31) / 32 + 1);
    const int nk = list[0] * 32;
    // with `part` (the PREFIX pass ran), a token that sees the shared tiles whole leaves them (its list's first) to it
    const int span = part != nullptr ? cascade_span(full, gridDim.y) : 0;
    const int shared = span > 0 && full[t] >= span ? span : 0;
    for (int jw = shared * 32 + warp * KPW; jw < nk; jw += KPB * DT_UNROLL) {
        const int jb = jw + kl;
        float kx[DT_UNROLL][8], vx[DT_UNROLL][8], mk[DT_UNROLL];
#pragma unroll
        for (int u = 0; u < DT_UNROLL; u++) {
            const int j = jb + u * KPB;
            const bool live = j < nk;
            const int cell = live ? list[1 + (j >> 5)] * 32 + (j & 31) : 0;
            ds_load<TK, D>(k, v, (i64)g * sk0 + (i64)cell * sk1 + o * 8, (i64)g * sv0 + (i64)cell * sv1 + o * 8, live,
                           kx[u], vx[u]);
            mk[u] = live ? __half2float(mrow[cell]) : -INFINITY;
        }
        float sc[DT_UNROLL][DS_ROWS];
        ds_scores<LPK>(qr, kx, sc);
        ds_fold(sc, vx, m, l, acc, [&](int u, int) { return mk[u]; });
    }
    ds_merge_lanes<LPK, D>(m, l, acc, warp, o, kl, wacc, wm, wl);
    __syncthreads();
    if (part != nullptr) pdl_begin();  // the PREFIX pass's partial rows, read once it is done
    for (int x = threadIdx.x; x < nr * D; x += DS_WARPS * 32) {
        const int i = row0 + x / D, e = x % D;
        float mx, num, den;
        ds_merge_warps<D>(wacc, wm, wl, x / D, e, mx, num, den);
        for (int z = 0; shared && z < CASCADE_SPLIT; z++) {  // the PREFIX pass's chunks of the shared tiles
            const float *p = part + (((i64)z * gridDim.y + t) * hq + g * r + i) * (D + 2);
            if (p[D] == -INFINITY) continue;
            const float nm = fmaxf(mx, p[D]), a = mx == -INFINITY ? 0.0f : __expf(mx - nm), b = __expf(p[D] - nm);
            num = num * a + p[e] * b, den = den * a + p[D + 1] * b, mx = nm;
        }
        if (sinks != nullptr) num *= fold_sink(sinks[g * r + i], mx, den);
        out[((i64)t * hq + g * r + i) * D + e] = den > 0.0f ? num / den : 0.0f;
    }
}

// The KQ mask of a micro-batch made on the device (ops.kq_mask): token t = blockIdx.y sees cell c when the cell
// holds t's sequence (bit s % 32 of the cell's word s / 32) at a position from 0 up to t's, and with a window
// (window > 0) fewer than `window` positions back; a token of sequence -1 (a padding row) sees cell 0 only.
// A thread a cell, the cells' positions and bits read once per token row from L2.
extern "C" __global__ void kq_mask(const int *cell_pos, const u32 *cell_seqs, const int *tok_pos, const int *tok_seq,
                                   __half *out, int n_kv, int words, int window) {
    pdl_begin();
    const int t = blockIdx.y, s = tok_seq[t], p = tok_pos[t];
    const __half hidden = __ushort_as_half((unsigned short)0xfc00u), seen = __ushort_as_half((unsigned short)0);
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < n_kv; c += gridDim.x * blockDim.x) {
        bool vis;
        if (s < 0) {
            vis = c == 0;
        } else {
            const int cp = cell_pos[c];
            vis = cp >= 0 && cp <= p && ((cell_seqs[(i64)c * words + (s >> 5)] >> (s & 31)) & 1u) != 0u
                  && (window <= 0 || p - cp < window);
        }
        out[(i64)t * n_kv + c] = vis ? seen : hidden;
    }
}

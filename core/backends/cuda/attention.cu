// Fused attention, softmax(q k^T * scale + mask) v, without a score matrix in memory.
//
// A block serves one KV head and FA_WARPS query rows of its group (a row: one token and one of
// the query heads sharing that KV head), a warp one row. Keys and values come through shared
// memory 32 at a time (a tile every row of the block masks out is skipped); lane j scores key j,
// then every lane accumulates its share of the head dimension (online softmax, f32). For few rows
// (decode) the keys are split over blocks (flash-decoding): each writes its partial maximum, sum
// and output, and `attn_combine` merges them.

#define FA_WARPS 4
#define FA_KEYS 32

// EPL: head-dimension elements per lane (d <= 32 * EPL); TK: the cache's type
template <int TK, int EPL>
__global__ void __launch_bounds__(FA_WARPS * 32) flash_attn(
    const float *q, const void *k, const void *v, const __half *mask, float *out, float *part,
    int d, int T, int r, int n_kv, int chunk,
    i64 sq0, i64 sq1, i64 sk0, i64 sk1, i64 sv0, i64 sv1, i64 ldm, float scale) {
    extern __shared__ float smem[];
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

// Fused attention, softmax(q k^T * scale + mask) v, without a score matrix in memory.
//
// A block serves one KV head and 8 query rows of its group (a row: one token and one of the
// query heads sharing that KV head), a warp two rows. Keys and values come through shared
// memory 32 at a time; lane j scores key j, then every lane accumulates its share of the head
// dimension (online softmax, f32). For few rows (decode) the keys are split over blocks
// (flash-decoding): each writes its partial maximum, sum and output, and `attn_combine` merges them.

#define FA_WARPS 4
#define FA_ROWS_PER_WARP 2
#define FA_ROWS (FA_WARPS * FA_ROWS_PER_WARP)
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
    const int rows = T * r, row0 = blockIdx.x * FA_ROWS;
    const int kv_begin = blockIdx.z * chunk, kv_end = min(n_kv, kv_begin + chunk);

    for (int i = threadIdx.x; i < FA_ROWS * d; i += blockDim.x) {
        int rr = row0 + i / d, e = i % d;
        float val = 0.0f;
        if (rr < rows) val = q[(i64)(g * r + rr % r) * sq0 + (i64)(rr / r) * sq1 + e];
        qs[(i / d) * dp + e] = val;
    }
    float m[FA_ROWS_PER_WARP], l[FA_ROWS_PER_WARP], o[FA_ROWS_PER_WARP][EPL];
#pragma unroll
    for (int j = 0; j < FA_ROWS_PER_WARP; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
#pragma unroll
        for (int x = 0; x < EPL; x++) o[j][x] = 0.0f;
    }
    for (int kv0 = kv_begin; kv0 < kv_end; kv0 += FA_KEYS) {
        __syncthreads();
        for (int i = threadIdx.x; i < FA_KEYS * d; i += blockDim.x) {
            int j = i / d, e = i % d, kv = kv0 + j;
            bool in = kv < kv_end;
            ks[j * dp + e] = in ? ld<TK>(k, (i64)g * sk0 + (i64)kv * sk1 + e) : 0.0f;
            vs[j * dp + e] = in ? ld<TK>(v, (i64)g * sv0 + (i64)kv * sv1 + e) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < FA_ROWS_PER_WARP; j++) {
            int lr = warp * FA_ROWS_PER_WARP + j, rr = row0 + lr;
            if (rr >= rows) continue;
            int kv = kv0 + lane;
            float s = -INFINITY;
            if (kv < kv_end) {
                const float *qr = qs + lr * dp, *kr = ks + lane * dp;
                float dot = 0.0f;
                for (int e = 0; e < d; e++) dot += qr[e] * kr[e];
                s = dot * scale + __half2float(mask[(i64)(rr / r) * ldm + kv]);
            }
            float m_new = fmaxf(m[j], warp_max(s));
            float p = m_new == -INFINITY ? 0.0f : expf(s - m_new);
            float corr = m_new == -INFINITY ? 1.0f : expf(m[j] - m_new);
            l[j] = l[j] * corr + warp_sum(p);
            m[j] = m_new;
#pragma unroll
            for (int x = 0; x < EPL; x++) o[j][x] *= corr;
            for (int jj = 0; jj < FA_KEYS; jj++) {
                float pj = __shfl_sync(0xffffffff, p, jj);
#pragma unroll
                for (int x = 0; x < EPL; x++) {
                    int e = lane + 32 * x;
                    if (e < d) o[j][x] += pj * vs[jj * dp + e];
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < FA_ROWS_PER_WARP; j++) {
        int rr = row0 + warp * FA_ROWS_PER_WARP + j;
        if (rr >= rows) continue;
        int t = rr / r, h = g * r + rr % r, hq = gridDim.y * r;
        i64 orow = (i64)t * hq + h;
        if (part == nullptr) {
            float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
#pragma unroll
            for (int x = 0; x < EPL; x++) {
                int e = lane + 32 * x;
                if (e < d) out[orow * d + e] = o[j][x] * inv;
            }
        } else {  // partial result of this key chunk: [split][row][m, l, o...]
            float *pr = part + ((i64)blockIdx.z * T * hq + orow) * (d + 2);
            if (lane == 0) {
                pr[0] = m[j];
                pr[1] = l[j];
            }
#pragma unroll
            for (int x = 0; x < EPL; x++) {
                int e = lane + 32 * x;
                if (e < d) pr[2 + e] = o[j][x];
            }
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

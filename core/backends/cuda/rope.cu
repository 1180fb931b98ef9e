// Rotary position embedding, optionally after a per-head rms_norm (gemma3's q/k norms) and
// before an output scale, or written straight into a KV-cache row. A block per (token, head),
// a thread per rotated pair; angles in f32 as ggml's CUDA rope computes them.

// YaRN (ggml's rope_yarn) where ext_factor is not 0: pair i's angle mixes the interpolated (freq_scale) and
// the original one by a ramp between pairs corr_low and corr_high; cos and sin are scaled by mscale
// (1 without YaRN).
struct RopeArgs {
    int n_dims, d, heads, neox;
    float theta_scale, freq_scale, out_scale, eps, ext_factor, mscale, corr_low, corr_high;
};

#define ROPE_PARAMS int n_dims, int d, int heads, int neox, float theta_scale, float freq_scale, float out_scale, \
    float eps, float ext_factor, float mscale, float corr_low, float corr_high
#define ROPE_ARGS RopeArgs{n_dims, d, heads, neox, theta_scale, freq_scale, out_scale, eps, ext_factor, mscale, \
    corr_low, corr_high}

// cos and sin of pair i's angle at position pos; with frequency factors ff (Phi-3's LongRoPE, Llama 3's
// rope_freqs) the angle is first divided by ff[i], as ggml's rope divides theta_extrap before rope_yarn
__device__ __forceinline__ void rope_angle(const RopeArgs &p, int pos, int i, float &c, float &s,
                                           const float *ff = nullptr) {
    if (ff != nullptr) {
        const float extrap = (float)pos * powf(p.theta_scale, (float)i) / ff[i], interp = p.freq_scale * extrap;
        float theta = interp;
        if (p.ext_factor != 0.0f) {
            const float y = ((float)i - p.corr_low) / fmaxf(0.001f, p.corr_high - p.corr_low);
            const float mix = (1.0f - fminf(1.0f, fmaxf(0.0f, y))) * p.ext_factor;
            theta = interp * (1.0f - mix) + extrap * mix;
        }
        sincosf(theta, &s, &c);
    } else if (p.ext_factor == 0.0f) {
        sincosf(p.freq_scale * (float)pos * powf(p.theta_scale, (float)i), &s, &c);
    } else {
        const float extrap = (float)pos * powf(p.theta_scale, (float)i), interp = p.freq_scale * extrap;
        const float y = ((float)i - p.corr_low) / fmaxf(0.001f, p.corr_high - p.corr_low);
        const float mix = (1.0f - fminf(1.0f, fmaxf(0.0f, y))) * p.ext_factor;
        sincosf(interp * (1.0f - mix) + extrap * mix, &s, &c);
    }
    c *= p.mscale;
    s *= p.mscale;
}

// rotate head (t, h) = (blk / heads, blk % heads) of a (row stride lda per token, d per head) at
// position pos[t]; the result's element e goes to put(e, value). With W >= 0 the head is rms_norm'ed
// and multiplied by w first. Launched with max(32, n_dims / 2) threads: thread i rotates pair i.
// With B (a bias add before the RoPE) the head is a plus bias [heads * d] (broadcast over the tokens), and
// that sum is stored too, into sum [T, heads * d] (the add's result), before any rotated value.
template <int W, bool B = false, typename Put>
__device__ __forceinline__ void rope_head(int blk, const float *a, const int *pos, const void *w, const RopeArgs &p,
                                          i64 lda, Put put, const float *bias = nullptr, float *sum = nullptr,
                                          const float *ff = nullptr) {
    __shared__ float sh[32];
    int t = blk / p.heads, h = blk % p.heads;
    const float *x = a + t * lda + (i64)h * p.d;
    auto raw = [&](int e) {
        float v = x[e];
        if constexpr (B) v += bias[(i64)h * p.d + e];
        return v;
    };
    auto keep = [&](int e) {
        if constexpr (B) sum[((i64)t * p.heads + h) * p.d + e] = raw(e);
    };
    float inv = 1.0f;
    if constexpr (W >= 0) {
        float s = 0.0f;
        for (int i = threadIdx.x; i < p.d; i += blockDim.x) s += raw(i) * raw(i);
        inv = rsqrtf(block_sum(s, sh) / p.d + p.eps);
    }
    auto in = [&](int e) {
        float v = raw(e);
        if constexpr (W >= 0) v = v * inv * ld<W>(w, e);
        return v;
    };
    int i = threadIdx.x;
    bool active = i < p.n_dims / 2;
    int e0 = p.neox ? i : 2 * i, e1 = p.neox ? i + p.n_dims / 2 : 2 * i + 1;
    float x0 = 0.0f, x1 = 0.0f, c = 0.0f, s = 0.0f;
    if (active) {
        rope_angle(p, pos[t], i, c, s, ff);
        x0 = in(e0);
        x1 = in(e1);
        keep(e0);
        keep(e1);
    }
    float pass[8];
    int np = 0;
    for (int e = p.n_dims + threadIdx.x; e < p.d && np < 8; e += blockDim.x) {
        pass[np++] = in(e);
        keep(e);
    }
    __syncthreads();  // every read of the head (the norm's too) before a write that may alias it
    if (active) {
        put(e0, (x0 * c - x1 * s) * p.out_scale);
        put(e1, (x0 * s + x1 * c) * p.out_scale);
    }
    np = 0;
    for (int e = p.n_dims + threadIdx.x; e < p.d && np < 8; e += blockDim.x) put(e, pass[np++] * p.out_scale);
}

template <int W>
__global__ void rope(const float *a, const int *pos, const void *w, float *out, i64 lda, ROPE_PARAMS) {
    pdl_begin();
    RopeArgs p = ROPE_ARGS;
    int t = blockIdx.x / p.heads, h = blockIdx.x % p.heads;
    float *o = out + ((i64)t * p.heads + h) * p.d;
    rope_head<W>(blockIdx.x, a, pos, w, p, lda, [&](int e, float v) { o[e] = v; });
}

// rope with frequency factors ff [n_dims / 2] dividing each pair's angle (rope_angle)
template <int W>
__global__ void rope_ff(const float *a, const int *pos, const void *w, const float *ff, float *out, i64 lda,
                        ROPE_PARAMS) {
    pdl_begin();
    RopeArgs p = ROPE_ARGS;
    int t = blockIdx.x / p.heads, h = blockIdx.x % p.heads;
    float *o = out + ((i64)t * p.heads + h) * p.d;
    rope_head<W>(blockIdx.x, a, pos, w, p, lda, [&](int e, float v) { o[e] = v; }, nullptr, nullptr, ff);
}

// a bias add and the RoPE of its result (attention's q or k with a bias): head (t, h) of a + bias is stored in
// sum and rotated into out, as rope's
template <int W>
__global__ void rope_bias(const float *a, const float *bias, float *sum, const int *pos, const void *w, float *out,
                          i64 lda, ROPE_PARAMS) {
    pdl_begin();
    RopeArgs p = ROPE_ARGS;
    int t = blockIdx.x / p.heads, h = blockIdx.x % p.heads;
    float *o = out + ((i64)t * p.heads + h) * p.d;
    rope_head<W, true>(blockIdx.x, a, pos, w, p, lda, [&](int e, float v) { o[e] = v; }, bias, sum);
}

// the keys' RoPE fused with the cache write: head h of token t goes to row idx[t] of dst (type D)
template <int W, int D>
__global__ void rope_set_rows(const float *a, const int *pos, const int *idx, const void *w, void *dst,
                              i64 lda, i64 ldd, ROPE_PARAMS) {
    pdl_begin();
    RopeArgs p = ROPE_ARGS;
    int t = blockIdx.x / p.heads, h = blockIdx.x % p.heads;
    i64 base = (i64)idx[t] * ldd + (i64)h * p.d;
    rope_head<W>(blockIdx.x, a, pos, w, p, lda, [&](int e, float v) { st<D>(dst, base + e, v); });
}

// a bias add and the keys' RoPE into the cache after it: head (t, h) of a + bias is stored in sum and rotated
// into row idx[t] of dst, as rope_set_rows'
template <int W, int D>
__global__ void rope_set_rows_bias(const float *a, const float *bias, float *sum, const int *pos, const int *idx,
                                   const void *w, void *dst, i64 lda, i64 ldd, ROPE_PARAMS) {
    pdl_begin();
    RopeArgs p = ROPE_ARGS;
    int t = blockIdx.x / p.heads, h = blockIdx.x % p.heads;
    i64 base = (i64)idx[t] * ldd + (i64)h * p.d;
    rope_head<W, true>(blockIdx.x, a, pos, w, p, lda, [&](int e, float v) { st<D>(dst, base + e, v); }, bias, sum);
}

// a decode layer's three writes before attention in one launch: the queries' RoPE (q_heads blocks a
// token), the keys' RoPE into their cache rows (k.heads blocks a token), the values' cache rows (as
// many). Keys and values of token t go to row idx[t] of their caches (both of type D).
template <int W, int D>
__global__ void rope_qkv(const float *q, const float *k, const float *v, const int *pos, const int *idx,
                         const void *wq, const void *wk, float *q_out, void *k_dst, void *v_dst, i64 ldq, i64 ldk,
                         i64 ldv, i64 ldd_k, i64 ldd_v, int T, int q_heads, float q_scale, ROPE_PARAMS) {
    pdl_begin();
    RopeArgs kp = ROPE_ARGS;  // the keys' (heads: the KV heads)
    const int nq = T * q_heads, nk = T * kp.heads;
    int blk = blockIdx.x;
    if (blk < nq) {
        RopeArgs qp = kp;
        qp.heads = q_heads, qp.out_scale = q_scale;
        float *o = q_out + (i64)blk * qp.d;
        rope_head<W>(blk, q, pos, wq, qp, ldq, [&](int e, float x) { o[e] = x; });
        return;
    }
    blk -= nq;
    if (blk < nk) {
        const i64 base = (i64)idx[blk / kp.heads] * ldd_k + (i64)(blk % kp.heads) * kp.d;
        rope_head<W>(blk, k, pos, wk, kp, ldk, [&](int e, float x) { st<D>(k_dst, base + e, x); });
        return;
    }
    blk -= nk;
    const int t = blk / kp.heads, h = blk % kp.heads;
    const float *src = v + t * ldv + (i64)h * kp.d;
    const i64 base = (i64)idx[t] * ldd_v + (i64)h * kp.d;
    for (int e = threadIdx.x; e < kp.d; e += blockDim.x) st<D>(v_dst, base + e, src[e]);
}

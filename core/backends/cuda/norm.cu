// Row normalizations, each fused with the multiplications and the residual add that follow it
// in the graph (ggml's CUDA fusions). A block per row; sums in f32.

// out = x / sqrt(mean(x^2) + eps) [* w]  (W: the weight's type, -1 for none)
template <int W>
__global__ void rms_norm(const float *x, const void *w, float *out, int n, i64 ldx, i64 ldo, float eps) {
    pdl_begin();
    __shared__ float sh[32];
    const float *xr = x + blockIdx.x * ldx;
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += xr[i] * xr[i];
    float inv = rsqrtf(block_sum(s, sh) / n + eps);
    float *o = out + blockIdx.x * ldo;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xr[i] * inv;
        if constexpr (W >= 0) v *= ld<W>(w, i);
        o[i] = v;
    }
}

// out = (x - mean) / sqrt(var + eps)
extern "C" __global__ void layer_norm(const float *x, float *out, int n, i64 ldx, i64 ldo, float eps) {
    pdl_begin();
    __shared__ float sh[32];
    const float *xr = x + blockIdx.x * ldx;
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += xr[i];
    float mean = block_sum(s, sh) / n;
    float v2 = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) v2 += (xr[i] - mean) * (xr[i] - mean);
    float inv = rsqrtf(block_sum(v2, sh) / n + eps);
    float *o = out + blockIdx.x * ldo;
    for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = (xr[i] - mean) * inv;
}

// the residual add and the next norm: stream = x + h (or x + rms_norm(h) * post), normed = rms_norm(stream) * w;
// out holds [stream rows; normed rows] (normed at out + rows * n). Each thread keeps its elements of the
// row in registers between the passes (rows up to NORM_VPT * blockDim.x elements; longer rows re-read).
// With q8 (n a multiple of 32) the normed rows are also written as q8_1 blocks [rows, n / 32], the
// activations of the product that reads them: a warp's 32 consecutive elements are one block.
#define NORM_VPT 8
template <int W, bool POST>
__global__ void add_rms_norm(const float *x, const float *h, const void *w, const void *post, float *out,
                             int n, i64 rows, float eps, block_q8_1 *q8) {
    __shared__ float sh[32];
    i64 r = blockIdx.x;
    const float *xr = x + r * n, *hr = h + r * n;
    float *stream = out + r * n, *normed = out + (rows + r) * n;
    float hv[NORM_VPT], sv[NORM_VPT], wv[NORM_VPT];
    const int nt = blockDim.x;
#pragma unroll
    for (int k = 0; k < NORM_VPT; k++) {  // the weight, while the kernel before runs
        const int i = threadIdx.x + k * nt;
        wv[k] = i < n ? ld<W>(w, i) : 0.0f;
    }
    pdl_begin();
#pragma unroll
    for (int k = 0; k < NORM_VPT; k++) {
        const int i = threadIdx.x + k * nt;
        hv[k] = i < n ? hr[i] : 0.0f;
        sv[k] = i < n ? xr[i] : 0.0f;
    }
    float hinv = 1.0f;
    if constexpr (POST) {
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < NORM_VPT; k++) s += hv[k] * hv[k];
        for (int i = threadIdx.x + NORM_VPT * nt; i < n; i += nt) s += hr[i] * hr[i];
        hinv = rsqrtf(block_sum(s, sh) / n + eps);
    }
    float s2 = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_VPT; k++) {
        const int i = threadIdx.x + k * nt;
        if (i < n) {
            if constexpr (POST) sv[k] += hv[k] * hinv * ld<W>(post, i);
            else sv[k] += hv[k];
            stream[i] = sv[k];
            s2 += sv[k] * sv[k];
        }
    }
    for (int i = threadIdx.x + NORM_VPT * nt; i < n; i += nt) {
        float v;
        if constexpr (POST) v = xr[i] + hr[i] * hinv * ld<W>(post, i);
        else v = xr[i] + hr[i];
        stream[i] = v;
        s2 += v * v;
    }
    float inv = rsqrtf(block_sum(s2, sh) / n + eps);
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < NORM_VPT; k++) {
        const int i = threadIdx.x + k * nt;
        if (i < n) {
            const float y = sv[k] * inv * wv[k];
            normed[i] = y;
            if (q8 != nullptr) quantize_warp(y, q8 + (r * n + i - lane) / 32);
        }
    }
    for (int i = threadIdx.x + NORM_VPT * nt; i < n; i += nt) {
        const float y = stream[i] * inv * ld<W>(w, i);
        normed[i] = y;
        if (q8 != nullptr) quantize_warp(y, q8 + (r * n + i - lane) / 32);
    }
}

// Row normalizations, each fused with the multiplications and the residual add that follow it
// in the graph (ggml's CUDA fusions). A block per row; sums in f32.

// out = x / sqrt(mean(x^2) + eps) [* w]  (W: the weight's type, -1 for none)
template <int W>
__global__ void rms_norm(const float *x, const void *w, float *out, int n, i64 ldx, i64 ldo, float eps) {
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
// out holds [stream rows; normed rows] (normed at out + rows * n)
template <int W, bool POST>
__global__ void add_rms_norm(const float *x, const float *h, const void *w, const void *post, float *out,
                             int n, i64 rows, float eps) {
    __shared__ float sh[32];
    i64 r = blockIdx.x;
    const float *xr = x + r * n, *hr = h + r * n;
    float *stream = out + r * n, *normed = out + (rows + r) * n;
    float hinv = 1.0f;
    if constexpr (POST) {
        float s = 0.0f;
        for (int i = threadIdx.x; i < n; i += blockDim.x) s += hr[i] * hr[i];
        hinv = rsqrtf(block_sum(s, sh) / n + eps);
    }
    float s2 = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v;
        if constexpr (POST) v = xr[i] + hr[i] * hinv * ld<W>(post, i);
        else v = xr[i] + hr[i];
        stream[i] = v;
        s2 += v * v;
    }
    float inv = rsqrtf(block_sum(s2, sh) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) normed[i] = stream[i] * inv * ld<W>(w, i);
}

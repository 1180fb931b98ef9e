// The CUDA features matmul.cu's kernels use, on the CPU (emulate.py): a block's threads are std::threads, run
// block after block; __shared__ is static (one block at a time); a warp's shuffles and mma.sync meet at a barrier
#include <cuda_fp16.h>
#include <barrier>
#include <thread>
#include <vector>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#define __global__
#define __device__
#define __forceinline__ inline
#define __constant__
#define __launch_bounds__(...)
#define __shared__ static
struct WarpCtx { std::barrier<> *bar; long long buf[32]; int fa[32][4]; int fb[32][2]; };
thread_local WarpCtx *g_warp; thread_local int g_lane;
thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;
std::barrier<> *g_block_bar;
unsigned char *g_dyn;
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline void __threadfence() {}
template <class T> T shfl_idx(T v, int src) {
    std::memcpy(&g_warp->buf[g_lane], &v, sizeof(T));
    g_warp->bar->arrive_and_wait();
    T r; std::memcpy(&r, &g_warp->buf[src & 31], sizeof(T));
    g_warp->bar->arrive_and_wait();
    return r;
}
template <class T> T __shfl_sync(unsigned, T v, int src) { return shfl_idx(v, src); }
template <class T> T __shfl_xor_sync(unsigned, T v, int o) { return shfl_idx(v, g_lane ^ o); }
// cp.async as a plain copy (a block's stages are read only after the barrier that follows), its alignment checked
inline void copy_async(void *dst, const void *src, size_t n) {
    if (((size_t)dst | (size_t)src) & (n - 1)) { fprintf(stderr, "cp.async of %zu bytes misaligned\n", n); abort(); }
    memcpy(dst, src, n);
}
inline int atomicAdd(int *p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
template <class T> T __ldcg(const T *p) { return *p; }
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    unsigned long long v = (unsigned long long)x | ((unsigned long long)y << 32);
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}
inline unsigned __vsubss4(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int i = 0; i < 4; i++) {
        int d = (int)(signed char)(a >> (8 * i)) - (int)(signed char)(b >> (8 * i));
        d = d < -128 ? -128 : d > 127 ? 127 : d;
        r |= (unsigned)(d & 0xff) << (8 * i);
    }
    return r;
}
inline int __vsubss4(int a, int b) { return (int)__vsubss4((unsigned)a, (unsigned)b); }
inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline unsigned __float_as_uint(float v) { unsigned u; std::memcpy(&u, &v, 4); return u; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
// m16n8k32 s8: the PTX ISA's fragment layouts
inline void mma_emu(int *c, const int *a, int b0, int b1) {
    WarpCtx *w = g_warp; int l = g_lane;
    for (int i = 0; i < 4; i++) w->fa[l][i] = a[i];
    w->fb[l][0] = b0, w->fb[l][1] = b1;
    w->bar->arrive_and_wait();
    auto A = [&](int r, int k) { int reg = (k >= 16 ? 2 : 0) + (r >= 8); return (int)(signed char)(w->fa[(r & 7) * 4 + ((k & 15) >> 2)][reg] >> (8 * (k & 3))); };
    auto B = [&](int k, int n) { return (int)(signed char)(w->fb[n * 4 + ((k & 15) >> 2)][k >= 16] >> (8 * (k & 3))); };
    const int grp = l >> 2, tig = l & 3;
    const int rr[4] = {grp, grp, grp + 8, grp + 8}, nn[4] = {2 * tig, 2 * tig + 1, 2 * tig, 2 * tig + 1};
    int out[4];
    for (int i = 0; i < 4; i++) { int s = 0; for (int k = 0; k < 32; k++) s += A(rr[i], k) * B(k, nn[i]); out[i] = c[i] + s; }
    w->bar->arrive_and_wait();
    for (int i = 0; i < 4; i++) c[i] = out[i];
}
// run f over a grid, block after block, a std::thread a CUDA thread
inline void launch(dim3 grid, dim3 block, size_t smem, std::function<void()> f) {
    static unsigned char *dyn = (unsigned char *)aligned_alloc(16, 256 << 10);
    g_dyn = dyn;
    memset(dyn, 0x7f, 256 << 10);
    const int n = block.x * block.y * block.z;
    for (unsigned bz = 0; bz < grid.z; bz++) for (unsigned by = 0; by < grid.y; by++) for (unsigned bx = 0; bx < grid.x; bx++) {
        std::barrier<> bbar(n);
        std::vector<WarpCtx> warps((n + 31) / 32);
        for (auto &w : warps) w.bar = new std::barrier<>(32);
        g_block_bar = &bbar;
        std::vector<std::thread> ts;
        for (int t = 0; t < n; t++) ts.emplace_back([&, t] {
            threadIdx = dim3(t, 0, 0), blockIdx = dim3(bx, by, bz), blockDim = block, gridDim = grid;
            g_warp = &warps[t / 32], g_lane = t % 32;
            f();
            g_warp->bar->arrive_and_drop();
            bbar.arrive_and_drop();
        });
        for (auto &t : ts) t.join();
        for (auto &w : warps) delete w.bar;
    }
}

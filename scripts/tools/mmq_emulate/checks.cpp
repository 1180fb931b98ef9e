// mmqt and mmq_idt on the CPU (emulate.py) against mmq / mmq_id and an exact product, for every MMQ type: odd
// weight heights, K of several chunks (the last part-filled), rows of odd bytes, several weights of one launch
#include "shim.h"
#include "kernels.h"
#include <random>
#include <string>
static std::mt19937 rng(1);
static float urand(float a, float b) { return std::uniform_real_distribution<float>(a, b)(rng); }
static void put_f16(u8 *p, float v) { __half h = __float2half(v); memcpy(p, &h, 2); }

template <int T> std::vector<u8> weights(int M, int K) {
    const int QK = Block<T>::QK, BY = Block<T>::BYTES;
    const int nblk = M * (K / QK);
    std::vector<u8> w(nblk * BY + 64);
    for (auto &b : w) b = rng() & 0xff;
    for (int i = 0; i < nblk; i++) {
        u8 *b = w.data() + (size_t)i * BY;
        if (T == T_MXFP4) b[0] = 118 + rng() % 10;
        else put_f16(b, urand(0.001f, 0.02f));
        if (T == T_Q4_1 || T == T_Q5_1 || T == T_Q4_K || T == T_Q5_K) put_f16(b + 2, urand(0.0f, 0.02f));
    }
    return w;
}

static double relerr(const std::vector<float> &a, const std::vector<float> &b) {
    double e = 0, n = 0;
    for (size_t i = 0; i < a.size(); i++) e += (double)(a[i] - b[i]) * (a[i] - b[i]), n += (double)b[i] * b[i];
    return e / n;
}

template <int T, int WM, int NT> bool check_mmqt(int M, int K, int N, int split = 1) {
    auto w = weights<T>(M, K);
    const i64 row_bytes = (i64)(K / Block<T>::QK) * Block<T>::BYTES;
    std::vector<float> x(N * K);
    for (auto &v : x) v = urand(-1, 1);
    const int nb = K / 32;
    std::vector<block_q8_1> y(N * nb);
    launch(dim3((N * nb + 7) / 8), dim3(256), 0, [&] { quantize_q8_1(x.data(), y.data(), K, K, N); });
    std::vector<float> ref(N * M, NAN), out(N * M, NAN);
    launch(dim3((M + 15) / 16, (N + 63) / 64), dim3(256), 0, [&] { mmq<T, 8>(w.data(), y.data(), ref.data(), K, row_bytes, M, N, M); });
    std::vector<i8> q(N * K);
    std::vector<float2> s(N * nb), sq(N * nb);
    launch(dim3((N * nb + 7) / 8), dim3(256), 0, [&] { mt_quantize(x.data(), q.data(), s.data(), sq.data(), K, K, N); });
    using C = Mt<T, WM, NT>;
    const float2 *sc = MqSumQ<T>::v ? sq.data() : s.data();
    // the weight as three of rows M/2, M/4 and the rest: one launch
    const int m0 = M / 2, m1 = M / 4, m2 = M - m0 - m1;
    const int tiles = (m0 + C::BM - 1) / C::BM + (m1 + C::BM - 1) / C::BM + (m2 + C::BM - 1) / C::BM;
    std::vector<float> prod(N * M, NAN), part(split * N * M, NAN);  // the three products one after another
    float *o0 = prod.data(), *o1 = o0 + N * m0, *o2 = o1 + N * m1;
    const int ytiles = (N + C::BN - 1) / C::BN;
    std::vector<int> tickets(tiles * ytiles, 0);
    launch(dim3(tiles, ytiles, split), dim3(256), C::STAGES * C::STAGE, [&] {
        mmqt<T, WM, NT>(w.data(), w.data() + m0 * row_bytes, w.data() + (m0 + m1) * row_bytes, o0, o1, o2, m0, m1, m2,
                        q.data(), sc, K, row_bytes, N, part.data(), (i64)N * M, tickets.data()); });
    for (int t : tickets) if (t != 0) { printf("FAIL a ticket left at %d\n", t); return false; }
    for (int t = 0; t < N; t++) for (int r = 0; r < M; r++)
        out[t * M + r] = r < m0 ? o0[t * m0 + r] : r < m0 + m1 ? o1[t * m1 + r - m0] : o2[t * m2 + r - m0 - m1];
    // exact reference: dequantized weights times x
    std::vector<float> ex(N * M);
    for (int r = 0; r < M; r++) {
        std::vector<float> wr(K);
        for (int c = 0; c < K; c++) wr[c] = dq_at<T>(w.data() + r * row_bytes, c);
        for (int t = 0; t < N; t++) { double a = 0; for (int c = 0; c < K; c++) a += (double)wr[c] * x[t * K + c]; ex[t * M + r] = a; }
    }
    const double e1 = relerr(out, ref), e2 = relerr(out, ex), e3 = relerr(ref, ex);
    const bool ok = e1 < 1e-9 && e2 < 5e-4;
    printf("%s mmqt<%d,%d,%d> M=%d K=%d N=%d split=%d: nmse vs mmq %.2e, vs exact %.2e (mmq vs exact %.2e)\n", ok ? "ok  " : "FAIL", T, WM, NT, M, K, N, split, e1, e2, e3);
    return ok;
}

template <int T, int WM, int NT> bool check_idt(int n_expert, int kk, int M, int K, int ntok, bool per_slot,
                                                bool skewed = false) {
    auto w = weights<T>(n_expert * M, K);
    const i64 row_bytes = (i64)(K / Block<T>::QK) * Block<T>::BYTES;
    const int rows = ntok * (per_slot ? kk : 1), nb = K / 32, slots = ntok * kk;
    std::vector<float> x(rows * K);
    for (auto &v : x) v = urand(-1, 1);
    std::vector<int> ids(ntok * kk);
    for (int t = 0; t < ntok; t++) {
        std::vector<int> e(n_expert); for (int i = 0; i < n_expert; i++) e[i] = i;
        std::shuffle(e.begin(), e.end(), rng);
        if (skewed) std::swap(e[0], *std::find(e.begin(), e.end(), 0));  // every token's first expert is expert 0
        for (int j = 0; j < kk; j++) ids[t * kk + j] = e[j];
    }
    using C = Mt<T, WM, NT>;
    const int max_tiles = (slots + C::BN - 1) / C::BN + n_expert;
    std::vector<int> offs(n_expert + 1), cursor(n_expert), list(slots), tiles(1 + 2 * max_tiles);
    launch(dim3(1), dim3(256), n_expert * 4, [&] { moe_group(ids.data(), offs.data(), cursor.data(), list.data(), ntok, kk, kk, n_expert, C::BN, tiles.data()); });
    std::vector<block_q8_1> y(rows * nb);
    launch(dim3((rows * nb + 7) / 8), dim3(256), 0, [&] { quantize_q8_1(x.data(), y.data(), K, K, rows); });
    std::vector<float> ref(slots * M, NAN), out(slots * M, NAN);
    const i64 eb = (i64)M * row_bytes;
    // reference: each expert's weights times every activation row by mmq, then each slot's row of its expert's
    std::vector<float> dense(rows * M);
    for (int e = 0; e < n_expert; e++) {
        launch(dim3((M + 15) / 16, (rows + 63) / 64), dim3(256), 0, [&] { mmq<T, 8>(w.data() + e * eb, y.data(), dense.data(), K, row_bytes, M, rows, M); });
        for (int sl = 0; sl < slots; sl++)
            if (ids[sl] == e) std::copy_n(dense.data() + (i64)(per_slot ? sl : sl / kk) * M, M, ref.data() + (i64)sl * M);
    }
    std::vector<i8> q(rows * K);
    std::vector<float2> s(rows * nb), sq(rows * nb);
    launch(dim3((rows * nb + 7) / 8), dim3(256), 0, [&] { mt_quantize(x.data(), q.data(), s.data(), sq.data(), K, K, rows); });
    launch(dim3((M + C::BM - 1) / C::BM, max_tiles), dim3(256), C::STAGES * C::STAGE, [&] {
        mmq_idt<T, WM, NT>(w.data(), q.data(), MqSumQ<T>::v ? sq.data() : s.data(), offs.data(), list.data(), tiles.data(), out.data(), K, row_bytes, eb, M, kk, per_slot); });
    const double e1 = relerr(out, ref);
    const bool ok = e1 < 1e-9;
    printf("%s mmq_idt<%d,%d,%d> E=%d k=%d M=%d K=%d tokens=%d %s%s (%d tiles): nmse vs mmq %.2e\n", ok ? "ok  " : "FAIL", T, WM, NT, n_expert, kk, M, K, ntok, per_slot ? "slots" : "tokens", skewed ? " skewed" : "", tiles[0], e1);
    return ok;
}

int main(int argc, char **argv) {
    bool ok = true;
    const std::string what = argc > 1 ? argv[1] : "all";
    if (what == "all" || what == "a") {
        ok &= check_mmqt<T_Q4_0, 4, 2>(200, 1056, 37);
        ok &= check_mmqt<T_MXFP4, 2, 2>(200, 1056, 70);
        ok &= check_mmqt<T_Q4_K, 4, 1>(150, 1024, 20);
        ok &= check_mmqt<T_Q5_K, 2, 4>(67, 512, 130);
        ok &= check_mmqt<T_Q4_0, 2, 1>(200, 2336, 16, 4);  // split K: 10 chunks in shares of 3, 3, 3, 1
        ok &= check_mmqt<T_Q4_K, 4, 2>(150, 2048, 37, 3);
        ok &= check_mmqt<T_Q4_0, 8, 2>(300, 1056, 16);  // a warp per 16 weight rows, all the block's token rows
        ok &= check_mmqt<T_Q4_K, 8, 8>(150, 1024, 70, 2);
    }
    if (what == "all" || what == "b") {
        ok &= check_mmqt<T_Q4_1, 4, 4>(100, 1056, 64);
        ok &= check_mmqt<T_Q5_0, 4, 8>(90, 1056, 129);
        ok &= check_mmqt<T_Q5_1, 2, 1>(70, 96, 17);
        ok &= check_mmqt<T_Q8_0, 4, 2>(140, 1056, 33);
        ok &= check_mmqt<T_IQ4_NL, 2, 2>(67, 1056, 40);
    }
    if (what == "all" || what == "c") {
        ok &= check_idt<T_Q4_K, 4, 2>(8, 4, 70, 1024, 40, false);
        ok &= check_idt<T_MXFP4, 4, 1>(8, 4, 70, 1056, 30, true);
        ok &= check_idt<T_Q4_0, 4, 4>(4, 2, 50, 288, 100, false);
        ok &= check_idt<T_Q4_K, 4, 2>(8, 4, 70, 1024, 100, false, true);  // expert 0: 100 slots, 4 tiles of 32
    }
    printf(ok ? "ALL OK\n" : "SOME FAILED\n");
    return ok ? 0 : 1;
}

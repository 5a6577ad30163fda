// y = x w^T for a few rows of x (2-8: speculate's check of gamma + 1 tokens), fp32, each weight row
// read from memory once for all the rows. See few_row_linear.py for why and what it measured.
//
// GCC's vector extensions, not one instruction set's intrinsics: with -march=native a `lanes` is
// one AVX-512 register, two AVX2 ones or four NEON ones, whichever the CPU has.
#include <stdint.h>
#include <string.h>

typedef float lanes __attribute__((vector_size(64)));
static const int64_t WIDTH = 16;

static inline lanes load(const float* p) {
    lanes v;
    memcpy(&v, p, sizeof v);  // unaligned: a weight row of 576 floats starts anywhere
    return v;
}

static inline float total(lanes v) {
    float s = 0;
    for (int64_t i = 0; i < WIDTH; ++i) s += v[i];
    return s;
}

// NB weight rows from n0 against all R rows of x: R x NB sums held in registers over the whole row.
// Each step also fetches the same stretch of the weight rows `ahead` rows on: the hardware's
// prefetcher, meeting a new row every 2 KiB, otherwise starts each one late (without it, 6 rows
// took 1.5 a row's time, with it 1.2).
template <int R, int NB>
static inline void block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t ahead) {
    lanes acc[R][NB] = {};
    int64_t k = 0;
    for (; k + WIDTH <= K; k += WIDTH) {
        lanes wv[NB];
        for (int j = 0; j < NB; ++j) {
            wv[j] = load(w + (n0 + j) * K + k);
            __builtin_prefetch(w + (n0 + j + ahead) * K + k, 0, 3);
        }
        for (int r = 0; r < R; ++r) {
            lanes xv = load(x + r * K + k);
            for (int j = 0; j < NB; ++j) acc[r][j] += xv * wv[j];
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NB; ++j) {
            float s = total(acc[r][j]);
            for (int64_t t = k; t < K; ++t) s += x[r * K + t] * w[(n0 + j) * K + t];
            y[r * N + n0 + j] = s;
        }
}

// NB so that R x NB sums and NB weight vectors fit in 32 registers
template <int R, int NB>
static void rows(const float* x, const float* w, float* y, int64_t K, int64_t N, int threads) {
    int64_t blocks = N / NB;
    #pragma omp parallel for num_threads(threads) schedule(static) if(threads > 1)
    for (int64_t b = 0; b < blocks; ++b) block<R, NB>(x, w, y, K, N, b * NB, NB);
    for (int64_t n = blocks * NB; n < N; ++n) block<R, 1>(x, w, y, K, N, n, 1);
}

extern "C" int few_row_linear(const float* x, const float* w, float* y, int64_t R, int64_t K, int64_t N, int threads) {
    switch (R) {
        case 2: rows<2, 8>(x, w, y, K, N, threads); return 0;
        case 3: rows<3, 6>(x, w, y, K, N, threads); return 0;
        case 4: rows<4, 4>(x, w, y, K, N, threads); return 0;
        case 5: rows<5, 4>(x, w, y, K, N, threads); return 0;
        case 6: rows<6, 4>(x, w, y, K, N, threads); return 0;
        case 7: rows<7, 3>(x, w, y, K, N, threads); return 0;
        case 8: rows<8, 3>(x, w, y, K, N, threads); return 0;
    }
    return 1;  // a row count this kernel was not built for (one row is torch's GEMV)
}

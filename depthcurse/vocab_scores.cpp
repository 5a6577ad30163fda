// Each row of logits' loss, KL from a reference distribution and whether its top-1 token is the
// reference's, in one read of the row and its reference: select's scorer, where the vocabulary's
// work (log-softmax, gather, product, argmax: each a pass over every logit) took 15% of exact's time.
// See vocab_scores.py for why and what it measured.
//
// Row r (of R, each V logits) is scored against reference row r % P (P rows: probabilities p, the
// term sum p log p, the top-1 token) and its next token targets[r % P], so several removals' logits
// are scored against one reference without copying it. With lse = log sum exp(x):
//   loss = lse - x[target]
//   KL(p || softmax(x)) = sum p log p - sum p (x - lse) = self - (sum p x - lse sum p)
// Sums of a row are taken in float lanes over blocks of BLOCK logits, each block's lanes added in
// double: no float sum runs over more than BLOCK / WIDTH terms. exp is a polynomial (Cephes' expf),
// within 2 ulp of the C library's.
//
// GCC's vector extensions, not one instruction set's intrinsics: with -march=native a `lanes` is
// one AVX-512 register, two AVX2 ones or four NEON ones, whichever the CPU has.
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float lanes __attribute__((vector_size(64)));
typedef int32_t ints __attribute__((vector_size(64)));
typedef double wide __attribute__((vector_size(128)));
static const int64_t WIDTH = 16;
static const int64_t BLOCK = 1024;

static inline lanes load(const float* p) {
    lanes v;
    memcpy(&v, p, sizeof v);  // unaligned: a row of 49,152 logits after a row of 49,153 starts anywhere
    return v;
}

static inline lanes splat(float x) { return lanes{} + x; }

static inline double total(const wide& v) {
    double s = 0;
    for (int64_t i = 0; i < WIDTH; ++i) s += v[i];
    return s;
}

// exp(x) for x <= 0 (x - the row's max); below -87.3 it would leave float's normal range, and the
// clamp's 1e-38 instead of 0 is below a sum's rounding (its largest term is exp(0) = 1)
static inline lanes exp_lanes(lanes x) {
    x = x < splat(-87.3f) ? splat(-87.3f) : x;
    const lanes magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
    lanes n = (x * splat(1.44269504088896341f) + magic) - magic;
    x = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    lanes z = x * x;
    lanes y = splat(1.9875691500e-4f);
    y = y * x + splat(1.3981999507e-3f);
    y = y * x + splat(8.3334519073e-3f);
    y = y * x + splat(4.1665795894e-2f);
    y = y * x + splat(1.6666665459e-1f);
    y = y * x + splat(5.0000001201e-1f);
    y = y * z + x + splat(1.0f);
    ints e = (__builtin_convertvector(n, ints) + 127) << 23;  // 2^n, built in the exponent's bits
    return y * (lanes)e;
}

static inline wide widen(const lanes& v) { return __builtin_convertvector(v, wide); }

// log sum exp(x) of a row whose max is `top`: the second read of the row, from cache (a row of
// 49,152 logits is 192 KiB)
static double log_sum_exp(const float* x, int64_t V, float top) {
    const int64_t body = V - V % WIDTH;
    wide sums = {};
    for (int64_t b = 0; b < body; b += BLOCK) {
        lanes s = {};
        const int64_t end = b + BLOCK < body ? b + BLOCK : body;
        for (int64_t k = b; k < end; k += WIDTH) s += exp_lanes(load(x + k) - splat(top));
        sums += widen(s);
    }
    double sum = total(sums);
    for (int64_t k = body; k < V; ++k) sum += exp((double)x[k] - top);
    return top + log(sum);
}

static void row(const float* x, int64_t V, int64_t target, const float* p, float self, int64_t top1,
                float* loss, float* kl, float* agree) {
    const int64_t body = V - V % WIDTH;
    // one read: the max and where it first is, and (against a reference) sum p x and sum p
    lanes best = splat(-INFINITY);
    ints where = {}, at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    wide px = {}, ps = {};
    for (int64_t b = 0; b < body; b += BLOCK) {
        lanes dot = {}, mass = {};
        const int64_t end = b + BLOCK < body ? b + BLOCK : body;
        for (int64_t k = b; k < end; k += WIDTH) {
            lanes v = load(x + k);
            ints here = at + (int32_t)k;
            ints above = v > best;  // strictly: each lane keeps its first maximum
            best = above ? v : best;
            where = above ? here : where;
            if (p) {
                lanes q = load(p + k);
                dot += q * v;
                mass += q;
            }
        }
        px += widen(dot);
        ps += widen(mass);
    }
    float top = -INFINITY;
    int64_t first = 0;
    for (int64_t i = 0; i < WIDTH; ++i)
        if (body && (best[i] > top || (best[i] == top && where[i] < first))) top = best[i], first = where[i];
    double dot = total(px), mass = total(ps);
    for (int64_t k = body; k < V; ++k) {
        if (x[k] > top || (body == 0 && k == 0)) top = x[k], first = k;
        if (p) dot += (double)p[k] * x[k], mass += p[k];
    }
    const double lse = log_sum_exp(x, V, top);
    *loss = (float)(lse - x[target]);
    if (p) {
        const double d = self - (dot - lse * mass);
        *kl = d > 0 ? (float)d : 0.0f;  // KL >= 0; the sums' rounding can leave an equal model a hair below
        *agree = first == top1 ? 1.0f : 0.0f;
    }
}

// probs, self, top1, kl, agree null: losses alone (no reference)
extern "C" int vocab_scores(const float* logits, int64_t R, int64_t V, const int64_t* targets, int64_t P,
                            const float* probs, const float* self, const int64_t* top1,
                            float* loss, float* kl, float* agree, int threads) {
    if (V < 1 || P < 1) return 1;
    #pragma omp parallel for num_threads(threads) schedule(static) if(threads > 1)
    for (int64_t r = 0; r < R; ++r) {
        const int64_t q = r % P;
        row(logits + r * V, V, targets[q], probs ? probs + q * V : nullptr, probs ? self[q] : 0.0f,
            probs ? top1[q] : 0, loss + r, probs ? kl + r : nullptr, probs ? agree + r : nullptr);
    }
    return 0;
}

// depth-use's read of a lens row: KL(output || lens) = sum p (log p - log q), q = softmax(x), p the
// output's probabilities (log p given beside them), and the lens's top K tokens, the most probable
// first and a tie's first token first (as torch's max; K <= 8). sum p (log p - x) is taken in double
// from the floats as given, so a lens that barely moves the output keeps its small KL.
static inline bool any(const ints& m) {
    int32_t o = 0;
    for (int64_t i = 0; i < WIDTH; ++i) o |= m[i];
    return o != 0;
}

static void lens_row(const float* x, int64_t V, const float* lp, const float* p, int64_t K, float* kl, int64_t* top) {
    const int64_t body = V - V % WIDTH;
    float vals[8];
    int64_t idx[8];
    for (int64_t j = 0; j < K; ++j) vals[j] = -INFINITY, idx[j] = 0;
    int64_t held = 0;  // how many of the K places are filled
    auto offer = [&](float v, int64_t i) {  // in index order: a value equal to one held stays after it
        if (held == K && !(v > vals[K - 1])) return;
        int64_t j = held < K ? held++ : K - 1;
        while (j > 0 && v > vals[j - 1]) vals[j] = vals[j - 1], idx[j] = idx[j - 1], --j;
        vals[j] = v, idx[j] = i;
    };
    lanes best = splat(-INFINITY);
    wide gap = {}, ps = {};
    for (int64_t b = 0; b < body; b += BLOCK) {
        lanes mass = {};
        const int64_t end = b + BLOCK < body ? b + BLOCK : body;
        for (int64_t k = b; k < end; k += WIDTH) {
            lanes v = load(x + k);
            best = v > best ? v : best;
            if (K && (held < K || any(v > splat(vals[K - 1]))))
                for (int64_t i = 0; i < WIDTH; ++i) offer(v[i], k + i);
            if (p) {
                lanes q = load(p + k);
                gap += widen(q) * (widen(load(lp + k)) - widen(v));
                mass += q;
            }
        }
        ps += widen(mass);
    }
    float top1 = -INFINITY;
    for (int64_t i = 0; i < WIDTH && body; ++i) top1 = best[i] > top1 ? best[i] : top1;
    double sum_gap = total(gap), sum_p = total(ps);
    for (int64_t k = body; k < V; ++k) {
        top1 = x[k] > top1 || (body == 0 && k == 0) ? x[k] : top1;
        if (K) offer(x[k], k);
        if (p) sum_gap += (double)p[k] * ((double)lp[k] - x[k]), sum_p += p[k];
    }
    for (int64_t j = 0; j < K; ++j) top[j] = idx[j];
    if (!p) return;
    *kl = (float)(sum_gap + log_sum_exp(x, V, top1) * sum_p);
}

// lp, p, kl null: the top K alone; top null (K 0): the KL alone
extern "C" int lens_scores(const float* logits, int64_t R, int64_t V, const float* lp, const float* p, int64_t K,
                           float* kl, int64_t* top, int threads) {
    if (V < 1 || K < 0 || K > 8 || K > V || (K && !top) || (!K && !p)) return 1;
    #pragma omp parallel for num_threads(threads) schedule(static) if(threads > 1)
    for (int64_t r = 0; r < R; ++r)
        lens_row(logits + r * V, V, p ? lp + r * V : nullptr, p ? p + r * V : nullptr, K, p ? kl + r : nullptr, K ? top + r * K : nullptr);
    return 0;
}

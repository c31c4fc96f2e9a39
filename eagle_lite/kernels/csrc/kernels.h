// The building blocks of eagle_lite's native CPU ops, shared by the op files (grid_linear.cpp, rms_norm.cpp,
// tree_attention.cpp, decoder_layer.cpp). Every function here does the fp32 arithmetic of the torch code
// it replaces; where the order of a sum differs, the comment says so. Compiled with -mavx2 -mfma
// -ffp-contract=off: a multiply followed by an add is never fused into one rounding unless written as an FMA.
// The AVX-512 functions (EAGLE_LITE_AVX512) are compiled for that target alone and run only where the CPU has it.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace eagle_lite {

// The small helpers of a product's inner loop: a call there (a rebuilt group's weights passed through memory) costs
// more than the work.
#define EAGLE_LITE_INLINE inline __attribute__((always_inline))

inline float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// exp(x) for 8 floats (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial for e^r, 2^n
// put into the exponent bits); within ~2 ulp of the exact value, and exactly 0 for x = -inf (hidden keys).
inline __m256 exp8(__m256 x) {
    const __m256 hidden = _mm256_cmp_ps(x, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365447505f)), _mm256_set1_ps(88.3762626647949f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(hidden, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// ---- RMSNorm of one row, as transformers' Llama-family norms compute it: w * (x * rsqrt(mean(x^2) + eps)).
// The same fp32 operations, except that the sum of squares is accumulated in another order (8 lanes, then
// across them), as any reduction kernel may.
inline void rms_norm_row(const float* x, const float* w, int64_t H, float eps, float* y) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < H; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    const float variance = horizontal_sum(acc) / static_cast<float>(H);
    const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(variance + eps));
    for (int64_t i = 0; i < H; i += 8) {
        const __m256 normed = _mm256_mul_ps(_mm256_loadu_ps(x + i), inv);
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), normed));
    }
}

// ---- Products with weights stored as integer codes on a per-group grid (one scale, or scale and offset,
// per 32 inputs), the layouts GGUF files use:
//   Q4: W[j, 32g + i] = (q * d) + m, q in 0..15          (Q4_1; Q4_0: m = -8 d; Q4_K: d * scale, -(dmin * min))
//   Q8: W[j, 32g + i] = q * d,       q in -128..127      (Q8_0; Q5_0 is q in -16..15)
// Each weight is rebuilt in fp32 exactly as the stored fp32 weight was made (a multiply, then an add, never
// fused), then multiplied into fp32 accumulators: the products of a dense fp32 GEMM, summed in another order.
// Q4 codes: codes[j, 16g + b] holds element 32g + b in its low nibble and 32g + 16 + b in its high one;
// scales[j, 2g] = d, scales[j, 2g + 1] = m. Q8 codes: codes[j, 32g + i] (int8); scales[j, g] = d.
struct Q4 {
    static constexpr int64_t kBytes = 16;   // code bytes per group of 32
    static constexpr int64_t kScales = 2;   // fp32 scales per group
    static constexpr at::ScalarType kType = at::kByte;
    EAGLE_LITE_INLINE static void rebuild(const uint8_t* q, const float* s, __m256 w[4]) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
        const __m128i mask = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(raw, mask);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        const __m256 d = _mm256_set1_ps(s[0]), m = _mm256_set1_ps(s[1]);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int p = 0; p < 4; ++p) {
            const __m256 code = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p]));
            w[p] = _mm256_add_ps(_mm256_mul_ps(code, d), m);
        }
    }
    // The p-th 8 weights of the group alone, the same values `rebuild` gives.
    template <int p>
    EAGLE_LITE_INLINE static __m256 rebuild_one(const uint8_t* q, const float* s) {
        __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * (p & 1)));
        if constexpr (p >= 2) raw = _mm_srli_epi16(raw, 4);
        const __m256 code = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(raw, _mm_set1_epi8(0x0F))));
        return _mm256_add_ps(_mm256_mul_ps(code, _mm256_set1_ps(s[0])), _mm256_set1_ps(s[1]));
    }
};

struct Q8 {
    static constexpr int64_t kBytes = 32;
    static constexpr int64_t kScales = 1;
    static constexpr at::ScalarType kType = at::kChar;
    EAGLE_LITE_INLINE static void rebuild(const uint8_t* q, const float* s, __m256 w[4]) {
        const __m256 d = _mm256_set1_ps(s[0]);
        for (int p = 0; p < 4; ++p) {
            const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * p));
            w[p] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), d);
        }
    }
    template <int p>
    EAGLE_LITE_INLINE static __m256 rebuild_one(const uint8_t* q, const float* s) {
        const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * p));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), _mm256_set1_ps(s[0]));
    }
};

// K8: 8-bit codes with a (d, m) pair per 16 inputs, W[j, 32g + 16h + i] = (q * d_h) + m_h: GGUF's K-quants
// Q5_K (q in 0..31, d_0 = d_1 = d * scale, m_0 = m_1 = -(dmin * min), one pair per sub-block of 32) and Q6_K
// (q in -32..31, d_h = d * scale_h, m_h = -0.0: adding -0.0 returns any fp32 value unchanged, -0.0 and +0.0 included).
// codes[j, 32g + i] (int8); scales[j, 4g + 2h] = d_h, scales[j, 4g + 2h + 1] = m_h.
struct K8 {
    static constexpr int64_t kBytes = 32;
    static constexpr int64_t kScales = 4;
    static constexpr at::ScalarType kType = at::kChar;
    EAGLE_LITE_INLINE static void rebuild(const uint8_t* q, const float* s, __m256 w[4]) {
        for (int p = 0; p < 4; ++p) {
            const __m256 d = _mm256_set1_ps(s[2 * (p / 2)]), m = _mm256_set1_ps(s[2 * (p / 2) + 1]);
            const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * p));
            w[p] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), d), m);
        }
    }
    template <int p>
    EAGLE_LITE_INLINE static __m256 rebuild_one(const uint8_t* q, const float* s) {
        const __m256 d = _mm256_set1_ps(s[2 * (p / 2)]), m = _mm256_set1_ps(s[2 * (p / 2) + 1]);
        const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * p));
        return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), d), m);
    }
};

// How far ahead of the group being rebuilt its codes are prefetched (a few-row product streams the weights from
// memory: measured on the 2-core box, a 49k x 576 Q8 product of one row took 13% less with it 1 KB ahead; on the
// 2-core AMD EPYC Zen 5 host, 8 KB ahead took Gemma 3's 262k x 640 lm_head from 4.2-4.9 ms to 3.6-4.4 ms a row).
constexpr int64_t kPrefetchBytes = 8192;

// Row invariance: every output (row r, column j) keeps kChains accumulators, the p-th 8 products of each group into
// accumulator p % kChains, summed in order and then across lanes at the end, whatever the tile's shape. So a row's
// result does not depend on how many rows share the product: a plain step's one row and the same row in a tree's
// verify get the same bits (tests/test_row_invariance.py). The chains keep the FMA units busy through their ~4-cycle
// latency with one row, and one column at a time streams its codes in order: a one-row product over weights that
// stream from memory (a model's layers, a large lm_head) ran 1.3-1.6x slower with four columns at once, one chain
// each, on the AMD EPYC Zen 4 host held to AVX2. Registers bound a tile: kChains accumulators a row beside the
// group's 4 weights in the 16 ymm registers.
constexpr int kChains = 4;

// An output's chains summed in their one order, then across lanes: the last step of every AVX2 grid product.
EAGLE_LITE_INLINE float sum_chains(const __m256 chains[kChains]) {
    __m256 total = chains[0];
    for (int c = 1; c < kChains; ++c) total = _mm256_add_ps(total, chains[c]);
    return horizontal_sum(total);
}

// Output columns [j0, j1) for ROWS rows of x: each weight group is rebuilt once and used ROWS times.
template <typename Codec, int ROWS>
void rows_tile(const float* x, int64_t K, const uint8_t* codes, const float* scales, float* y, int64_t N,
               int64_t j0, int64_t j1) {
    const int64_t groups = K / 32;
    for (int64_t j = j0; j < j1; ++j) {
        __m256 acc[ROWS][kChains];
        for (int r = 0; r < ROWS; ++r)
            for (int c = 0; c < kChains; ++c) acc[r][c] = _mm256_setzero_ps();
        const uint8_t* qj = codes + j * groups * Codec::kBytes;
        const float* sj = scales + j * groups * Codec::kScales;
        for (int64_t g = 0; g < groups; ++g) {
            __m256 w[4];
            _mm_prefetch(reinterpret_cast<const char*>(qj + g * Codec::kBytes + kPrefetchBytes), _MM_HINT_T0);
            Codec::rebuild(qj + g * Codec::kBytes, sj + g * Codec::kScales, w);
            const float* xg = x + g * 32;
            for (int r = 0; r < ROWS; ++r) {
                const float* xr = xg + r * K;
                for (int p = 0; p < 4; ++p)
                    acc[r][p % kChains] = _mm256_fmadd_ps(w[p], _mm256_loadu_ps(xr + 8 * p), acc[r][p % kChains]);
            }
        }
        for (int r = 0; r < ROWS; ++r) y[r * N + j] = sum_chains(acc[r]);
    }
}

// One pass of `rows_tile_passes`: chain P of every row over one column, into part[r][P]. It rebuilds only the P-th 8
// weights of each group (`rebuild_one`: the same values) into one accumulator a row, so the rows are the independent
// chains; the column's codes, read in pass 0, are in the L1 cache for the others.
template <typename Codec, int ROWS, int P>
EAGLE_LITE_INLINE void chain_pass(const float* x, int64_t K, int64_t groups, const uint8_t* qj, const float* sj,
                                  __m256 part[][kChains]) {
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        if constexpr (P == 0)
            _mm_prefetch(reinterpret_cast<const char*>(qj + g * Codec::kBytes + kPrefetchBytes), _MM_HINT_T0);
        const __m256 w = Codec::template rebuild_one<P>(qj + g * Codec::kBytes, sj + g * Codec::kScales);
        const float* xg = x + g * 32 + 8 * P;
        for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xg + r * K), acc[r]);
    }
    for (int r = 0; r < ROWS; ++r) part[r][P] = acc[r];
}

// `rows_tile` for more rows than the registers hold kChains accumulators of: the same sums, one chain at a time,
// added in `rows_tile`'s order (`sum_chains`): the same bits.
template <typename Codec, int ROWS>
void rows_tile_passes(const float* x, int64_t K, const uint8_t* codes, const float* scales, float* y, int64_t N,
                      int64_t j0, int64_t j1) {
    static_assert(kChains == 4, "one pass per product of a group");
    const int64_t groups = K / 32;
    for (int64_t j = j0; j < j1; ++j) {
        __m256 part[ROWS][kChains];
        const uint8_t* qj = codes + j * groups * Codec::kBytes;
        const float* sj = scales + j * groups * Codec::kScales;
        chain_pass<Codec, ROWS, 0>(x, K, groups, qj, sj, part);
        chain_pass<Codec, ROWS, 1>(x, K, groups, qj, sj, part);
        chain_pass<Codec, ROWS, 2>(x, K, groups, qj, sj, part);
        chain_pass<Codec, ROWS, 3>(x, K, groups, qj, sj, part);
        for (int r = 0; r < ROWS; ++r) y[r * N + j] = sum_chains(part[r]);
    }
}

// Tiles of at most 12 rows: up to 3 in `rows_tile` (kChains accumulators a row beside 4 weights fill the 16
// registers), 4 to 12 in `rows_tile_passes` (one accumulator a row beside one weight).
constexpr int64_t kMaxTileRows = 12;
constexpr int64_t kRegisterRows = 3;

template <typename Codec, int ROWS>
void run_tile(int64_t rows, const float* x, int64_t K, const uint8_t* codes, const float* scales, float* y,
              int64_t N, int64_t j0, int64_t j1) {
    if constexpr (ROWS > 1) {
        if (rows < ROWS) return run_tile<Codec, ROWS - 1>(rows, x, K, codes, scales, y, N, j0, j1);
    }
    if constexpr (ROWS <= kRegisterRows)
        rows_tile<Codec, ROWS>(x, K, codes, scales, y, N, j0, j1);
    else
        rows_tile_passes<Codec, ROWS>(x, K, codes, scales, y, N, j0, j1);
}

// ---- The same products 16 lanes wide, on a CPU with AVX-512 (checked at run time, `wide_products`): each weight
// is rebuilt by the same multiply and add, and the products are summed in yet another order. Half the
// instructions per weight: the weights' rebuild is what bounds a few-row product once they are in cache.
#define EAGLE_LITE_AVX512 __attribute__((target("avx512f")))

// A group's 16 possible weights, q * d + m for q = 0..15 (the same multiply and add), fill one register; each
// weight is then looked up by its code (vpermps reads the low 4 bits of each index): a group of 32 takes a widening,
// a shift and 2 lookups, against 2 widenings, 2 conversions, 2 multiplies and 2 adds.
struct Q4x16 {
    EAGLE_LITE_AVX512 EAGLE_LITE_INLINE static void rebuild(const uint8_t* q, const float* s, __m512 w[2]) {
        const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 table = _mm512_add_ps(_mm512_mul_ps(levels, _mm512_set1_ps(s[0])), _mm512_set1_ps(s[1]));
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
        w[0] = _mm512_permutexvar_ps(bytes, table);                        // low nibbles: elements 0..15
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);  // high nibbles: elements 16..31
    }
};

struct Q8x16 {
    EAGLE_LITE_AVX512 EAGLE_LITE_INLINE static void rebuild(const uint8_t* q, const float* s, __m512 w[2]) {
        const __m512 d = _mm512_set1_ps(s[0]);
        for (int p = 0; p < 2; ++p) {
            const __m128i sixteen = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * p));
            w[p] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sixteen)), d);
        }
    }
};

struct K8x16 {
    EAGLE_LITE_AVX512 EAGLE_LITE_INLINE static void rebuild(const uint8_t* q, const float* s, __m512 w[2]) {
        for (int p = 0; p < 2; ++p) {
            const __m128i sixteen = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * p));
            w[p] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sixteen)),
                                               _mm512_set1_ps(s[2 * p])), _mm512_set1_ps(s[2 * p + 1]));
        }
    }
};

template <typename Codec> struct Wide;
template <> struct Wide<Q4> { using type = Q4x16; };
template <> struct Wide<Q8> { using type = Q8x16; };
template <> struct Wide<K8> { using type = K8x16; };

// `rows_tile` 16 lanes wide. Here each output keeps two accumulators, a group's first 16 products into one and its
// last 16 into the other, added at the end: that order is the same at every tile size (row invariance, as above),
// since 32 registers hold two accumulators for each of a tile's up to 8 rows (at least 8 chains keep both FMA units
// busy through their latency, and one column streams its codes in order, which a one-row product over a large
// lm_head needs).
template <typename Codec, int ROWS>
EAGLE_LITE_AVX512 void rows_tile16(const float* x, int64_t K, const uint8_t* codes, const float* scales, float* y,
                                   int64_t N, int64_t j0, int64_t j1) {
    const int64_t groups = K / 32;
    for (int64_t j = j0; j < j1; ++j) {
        __m512 acc[ROWS][2];
        for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        const uint8_t* qj = codes + j * groups * Codec::kBytes;
        const float* sj = scales + j * groups * Codec::kScales;
        for (int64_t g = 0; g < groups; ++g) {
            __m512 w[2];
            _mm_prefetch(reinterpret_cast<const char*>(qj + g * Codec::kBytes + kPrefetchBytes), _MM_HINT_T0);
            Wide<Codec>::type::rebuild(qj + g * Codec::kBytes, sj + g * Codec::kScales, w);
            const float* xg = x + g * 32;
            for (int r = 0; r < ROWS; ++r) {
                const float* xr = xg + r * K;
                for (int p = 0; p < 2; ++p) acc[r][p] = _mm512_fmadd_ps(w[p], _mm512_loadu_ps(xr + 16 * p), acc[r][p]);
            }
        }
        for (int r = 0; r < ROWS; ++r) y[r * N + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
    }
}

template <typename Codec, int ROWS>
EAGLE_LITE_AVX512 void run_tile16(int64_t rows, const float* x, int64_t K, const uint8_t* codes, const float* scales,
                                  float* y, int64_t N, int64_t j0, int64_t j1) {
    if constexpr (ROWS > 1) {
        if (rows < ROWS) return run_tile16<Codec, ROWS - 1>(rows, x, K, codes, scales, y, N, j0, j1);
    }
    rows_tile16<Codec, ROWS>(x, K, codes, scales, y, N, j0, j1);
}

// Tiles of up to 8 rows (two accumulators a row, above; on the 2-core AMD EPYC Zen 4 host a 16-row product took
// ~1.5x two 8-row ones).
constexpr int64_t kMaxTileRows16 = 8;

// Whether grid products (and attention's value sums) run 16 lanes wide: the CPU has AVX-512F and EAGLE_LITE_AVX512
// is not "0" (read at each call, so a process can time or test both).
inline bool wide_products() {
    static const bool supported = __builtin_cpu_supports("avx512f");
    if (!supported) return false;
    const char* env = std::getenv("EAGLE_LITE_AVX512");
    return env == nullptr || std::strcmp(env, "0") != 0;
}

// A tile's rows of x are read once a group for every column: they stay in the L1 cache where they take at most this
// many bytes (on the 2-core AMD EPYC Zen 4 host, 32 KB of L1 data: an 8-row tile of a 1536-input product, 48 KB of
// rows, took longer than two 4-row tiles).
constexpr int64_t kTileRowBytes = 28 * 1024;

// 8 lanes: columns in blocks of this many, every tile of rows over a block before the next block, so the block's
// codes stream from memory once and the later tiles re-read them from the cache (64 columns of a 1536-input Q8
// product: 96 KB, within the L2 cache).
constexpr int64_t kBlockCols = 64;

// y [M, N] = x [M, K] W^T over the threads (columns split between them).
template <typename Codec>
void grid_product(const float* x, int64_t M, int64_t K, const uint8_t* codes, const float* scales, float* y,
                  int64_t N) {
    const bool wide = wide_products();
    const int64_t most = std::min<int64_t>(wide ? kMaxTileRows16 : kMaxTileRows,
                                           std::max<int64_t>(1, kTileRowBytes / (K * 4)));
    at::parallel_for(0, N, 16, [&](int64_t j0, int64_t j1) {
        const int64_t tiles = (M + most - 1) / most;
        const int64_t block = wide ? j1 - j0 : kBlockCols;   // 16 lanes: whole ranges, as measured
        for (int64_t b0 = j0; b0 < j1; b0 += block) {
            const int64_t b1 = std::min(j1, b0 + block);
            for (int64_t t = 0, r0 = 0; t < tiles; ++t) {
                const int64_t rows = M / tiles + (t < M % tiles ? 1 : 0);
                if (wide)
                    run_tile16<Codec, kMaxTileRows16>(rows, x + r0 * K, K, codes, scales, y + r0 * N, N, b0, b1);
                else
                    run_tile<Codec, kMaxTileRows>(rows, x + r0 * K, K, codes, scales, y + r0 * N, N, b0, b1);
                r0 += rows;
            }
        }
    });
}

template <typename Codec>
void check_grid(const at::Tensor& codes, const at::Tensor& scales, int64_t K, const char* what) {
    TORCH_CHECK(K % 32 == 0, what, ": the input size (", K, ") must be a multiple of 32");
    TORCH_CHECK(codes.scalar_type() == Codec::kType && codes.is_contiguous() && codes.dim() == 2 &&
                codes.size(1) == K / 32 * Codec::kBytes, what, ": codes of the wrong type or shape");
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                scales.size(0) == codes.size(0) && scales.size(1) == K / 32 * Codec::kScales,
                what, ": scales must be contiguous float32 [N, groups * ", Codec::kScales, "]");
}

// ---- Attention.
// q . k over D = 8 * n floats, four keys at a time so the FMA chains run side by side.
inline void dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3, int64_t D,
                 float out[4]) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
    }
    out[0] = horizontal_sum(a0); out[1] = horizontal_sum(a1); out[2] = horizontal_sum(a2); out[3] = horizontal_sum(a3);
}

constexpr int64_t kMaxHeadDim = 256;

// The optional [T, S] boolean mask of an attention op, contiguous (held in `held`); nullptr for none.
inline const bool* visible_flags(const c10::optional<at::Tensor>& mask, int64_t T, int64_t S, at::Tensor& held,
                                 const char* what) {
    if (!mask.has_value()) return nullptr;
    held = mask->contiguous();
    TORCH_CHECK(held.scalar_type() == at::kBool && held.dim() == 2 && held.size(0) == T && held.size(1) == S,
                what, ": mask must be bool [", T, ", ", S, "]");
    return held.data_ptr<bool>();
}

// Attention of R query rows that share one key/value head (a GQA group's heads, times the new tokens):
// out_r = sum_s p_r[s] v[s], p_r = softmax over the keys row r sees of scale * q_r . k[s]. Row r sees keys
// [0, seen[r]) where visible[r] (S flags, or nullptr: all of them) allows. The fp32 arithmetic of SDPA (dot
// products, max-subtracted exponentials, weighted sum) in another order, the exponential from a polynomial
// as torch's own vectorized kernels do.
// The rows walk the keys together, kKeyBlock at a time, so each block of keys and values is read from memory
// once for all of them and then from L1, rather than once per row: at 2,500 tokens of context one kv head's
// keys and values (1.3 MB) outgrow the L2 cache, and a 7-node tree's 21 rows per kv head streamed them 21
// times a layer (~40 ms a forward in attention alone). Each row's own arithmetic and order are those of a
// row on its own (the same 4-key dot products, the keys in ascending order), so the result does not depend
// on which rows share a pass.
constexpr int64_t kKeyBlock = 64;   // keys (and values) per block: 16 KB each at D = 64, in L1 together

struct AttendRow {
    const float* q;     // D floats
    int64_t seen;       // keys [0, seen) may be read
    const bool* visible;  // S flags or nullptr
    float* out;         // D floats
};

// acc[0, 8 * C) += sum over keys s in [b, end) of p[s] v[s], the keys in ascending order. C: the head size / 8 when
// it is one of the common ones (the compiler then keeps the C accumulators in registers; with a size known only
// at run time it loaded and stored each of them for every key, half the attention's time), else 0 and `chunks`.
template <int C>
inline void weigh_values(const float* p, int64_t b, int64_t end, const float* vh, int64_t vs, float* acc,
                         int64_t chunks = C) {
    __m256 a[C > 0 ? C : kMaxHeadDim / 8];
    for (int64_t c = 0; c < chunks; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
    for (int64_t s = b; s < end; ++s) {
        if (p[s] == 0.0f) continue;
        const __m256 w = _mm256_set1_ps(p[s]);
        const float* vr = vh + s * vs;
        for (int64_t c = 0; c < chunks; ++c) a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * c), a[c]);
    }
    for (int64_t c = 0; c < chunks; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}

// `weigh_values` 16 lanes wide (AVX-512, C16 = head size / 16): each lane does the same FMAs over the same keys
// in the same order, so the result is bit for bit the 8-lane one, in half the instructions.
template <int C16>
EAGLE_LITE_AVX512 void weigh_values16(const float* p, int64_t b, int64_t end, const float* vh, int64_t vs,
                                      float* acc) {
    __m512 a[C16];
    for (int c = 0; c < C16; ++c) a[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int64_t s = b; s < end; ++s) {
        if (p[s] == 0.0f) continue;
        const __m512 w = _mm512_set1_ps(p[s]);
        const float* vr = vh + s * vs;
        for (int c = 0; c < C16; ++c) a[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 16 * c), a[c]);
    }
    for (int c = 0; c < C16; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
}

// Whether the 8 flags at `v` are all set (bool is one byte, 0 or 1).
inline bool all_visible8(const bool* v) {
    uint64_t eight;
    std::memcpy(&eight, v, 8);
    return eight == 0x0101010101010101ULL;
}

// p: scratch of R * (S + 4) floats; acc: scratch of R * D floats.
inline void attend_rows(const AttendRow* rows, int64_t R, const float* kh, int64_t ks, const float* vh, int64_t vs,
                        int64_t S, int64_t D, float scale, float* p, float* acc) {
    const float inf = std::numeric_limits<float>::infinity();
    int64_t longest = 0;
    std::vector<float> best(R, -inf), total(R, 0.0f);
    for (int64_t r = 0; r < R; ++r) longest = std::max(longest, rows[r].seen);
    // scores, four keys at a time as dot4 computes them
    for (int64_t b = 0; b < longest; b += kKeyBlock) {
        for (int64_t r = 0; r < R; ++r) {
            const AttendRow& row = rows[r];
            const int64_t n = row.seen, end = std::min(b + kKeyBlock, n);
            float* pr = p + r * (S + 4);
            for (int64_t s = b; s < end; s += 4) {
                float d4[4];
                const int64_t s1 = std::min(s + 1, n - 1), s2 = std::min(s + 2, n - 1), s3 = std::min(s + 3, n - 1);
                dot4(row.q, kh + s * ks, kh + s1 * ks, kh + s2 * ks, kh + s3 * ks, D, d4);
                for (int i = 0; i < 4 && s + i < n; ++i) {
                    const float x = (row.visible && !row.visible[s + i]) ? -inf : d4[i] * scale;
                    pr[s + i] = x;
                    best[r] = std::max(best[r], x);
                }
            }
        }
    }
    // exponentials and their sum, row by row: the k-th key the row sees goes to lane k % 8 of the sum, in the order
    // of the keys (a tail of fewer than 8 padded with hidden keys, whose exponential is 0). A key's rank among the
    // keys a row sees is its position in the sequence (a tree node's ancestors are its path, in order), so a row
    // sums the same terms in the same order whether it is a plain step's one row over its cache or a tree node
    // among hidden siblings (row invariance: tests/test_row_invariance.py).
    const float hidden_key = -inf;
    for (int64_t r = 0; r < R; ++r) {
        const int64_t n = rows[r].seen;
        const bool* vis = rows[r].visible;
        float* pr = p + r * (S + 4);
        const __m256 shift = _mm256_set1_ps(best[r]);
        __m256 sum8 = _mm256_setzero_ps();
        float lane[8];
        int64_t slot[8];
        int filled = 0;
        auto flush = [&]() {
            for (int i = filled; i < 8; ++i) lane[i] = hidden_key;
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(lane), shift));
            sum8 = _mm256_add_ps(sum8, e);
            _mm256_storeu_ps(lane, e);
            for (int i = 0; i < filled; ++i) pr[slot[i]] = lane[i];
            filled = 0;
        };
        int64_t s = 0;
        while (s < n) {
            if (filled == 0 && s + 8 <= n && (vis == nullptr || all_visible8(vis + s))) {   // 8 keys seen in a row
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(pr + s), shift));
                _mm256_storeu_ps(pr + s, e);
                sum8 = _mm256_add_ps(sum8, e);
                s += 8;
                continue;
            }
            if (vis != nullptr && !vis[s]) {
                pr[s] = 0.0f;
            } else {
                lane[filled] = pr[s];
                slot[filled++] = s;
                if (filled == 8) flush();
            }
            ++s;
        }
        if (filled > 0) flush();
        total[r] = horizontal_sum(sum8);
    }
    // weighted sums of the values, each row's keys in ascending order
    const int64_t chunks = D / 8;
    const bool wide = wide_products();
    std::fill(acc, acc + R * D, 0.0f);
    for (int64_t b = 0; b < longest; b += kKeyBlock) {
        for (int64_t r = 0; r < R; ++r) {
            const int64_t end = std::min(b + kKeyBlock, rows[r].seen);
            if (end <= b) continue;
            const float* pr = p + r * (S + 4);
            float* ar = acc + r * D;
            // a head size known when compiled keeps the accumulators in registers
            if (wide && chunks % 4 == 0 && (chunks <= 16 || chunks == 32)) {
                switch (chunks) {
                    case 32: weigh_values16<16>(pr, b, end, vh, vs, ar); break;
                    case 4: weigh_values16<2>(pr, b, end, vh, vs, ar); break;
                    case 8: weigh_values16<4>(pr, b, end, vh, vs, ar); break;
                    case 12: weigh_values16<6>(pr, b, end, vh, vs, ar); break;
                    default: weigh_values16<8>(pr, b, end, vh, vs, ar);
                }
                continue;
            }
            switch (chunks) {
                case 4: weigh_values<4>(pr, b, end, vh, vs, ar); break;
                case 8: weigh_values<8>(pr, b, end, vh, vs, ar); break;
                case 12: weigh_values<12>(pr, b, end, vh, vs, ar); break;
                case 16: weigh_values<16>(pr, b, end, vh, vs, ar); break;
                default: weigh_values<0>(pr, b, end, vh, vs, ar, chunks);
            }
        }
    }
    for (int64_t r = 0; r < R; ++r) {
        const __m256 inv = _mm256_set1_ps(1.0f / total[r]);
        for (int64_t c = 0; c < chunks; ++c)
            _mm256_storeu_ps(rows[r].out + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + 8 * c), inv));
    }
}

// out [T, H, D] for T queries of H heads sharing Hkv = H / G key/value heads: query (h, t) at q + h * qh + t * qt,
// keys of kv head hk at k + hk * kh + s * ks (values likewise). visible: [T, S] flags, or nullptr: then token t
// sees keys [0, causal_from + t] where causal_from >= 0 (a chain after a prefix), else all S keys.
// The G * T rows of each kv head are split into a few tasks (enough to keep every thread busy), each of which
// reads that head's keys and values once.
inline void attend_heads(const float* q, int64_t qh, int64_t qt, const float* k, int64_t kh, int64_t ks,
                         const float* v, int64_t vh, int64_t vs, int64_t H, int64_t Hkv, int64_t T, int64_t S,
                         int64_t D, const bool* visible, int64_t causal_from, float scale, float* out) {
    const int64_t group = H / Hkv, per_head = group * T;
    const int64_t threads = at::get_num_threads();
    const int64_t splits = std::min(per_head, std::max<int64_t>(1, (2 * threads + Hkv - 1) / Hkv));
    const int64_t chunk = (per_head + splits - 1) / splits;
    at::parallel_for(0, Hkv * splits, 1, [&](int64_t task0, int64_t task1) {
        std::vector<float> p(chunk * (S + 4)), acc(chunk * D);
        std::vector<AttendRow> rows(chunk);
        for (int64_t task = task0; task < task1; ++task) {
            const int64_t hk = task / splits, first = (task % splits) * chunk;
            const int64_t last = std::min(per_head, first + chunk);
            if (first >= last) continue;
            for (int64_t i = first; i < last; ++i) {
                const int64_t h = hk * group + i / T, t = i % T;
                const int64_t seen = (visible || causal_from < 0) ? S : causal_from + t + 1;
                rows[i - first] = {q + h * qh + t * qt, seen, visible ? visible + t * S : nullptr,
                                   out + (t * H + h) * D};
            }
            attend_rows(rows.data(), last - first, k + hk * kh, ks, v + hk * vh, vs, S, D, scale, p.data(), acc.data());
        }
    });
}

}  // namespace eagle_lite

// y = x W^T for fp32 rows x [M, K] and a weight W [N, K] stored as small integer codes on a per-group grid
// (one scale, or scale and offset, per 32 inputs), the layouts GGUF files use:
//   grid4_linear: W[j, 32g + i] = (q * d) + m, q in 0..15          (Q4_1; Q4_0 is m = -8 d)
//   grid8_linear: W[j, 32g + i] = q * d,       q in -128..127      (Q8_0)
//
// Each weight is rebuilt in fp32 exactly as the stored fp32 weight was made (a multiply, then an add:
// this file is compiled with -ffp-contract=off so they are never fused), then multiplied into fp32
// accumulators: the same products as a dense fp32 GEMM, summed in another order. Reading 5 or 9 bits a
// weight instead of 32 is the point: a few-row product over a 135M model is memory-bound.
//
// Q4 codes: codes[j, 16g + b] holds element 32g + b in its low nibble and 32g + 16 + b in its high one;
// scales[j, 2g] = d, scales[j, 2g + 1] = m. Q8 codes: codes[j, 32g + i] (int8); scales[j, g] = d.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

struct Q4 {
    static constexpr int64_t kBytes = 16;   // code bytes per group of 32
    static constexpr int64_t kScales = 2;   // fp32 scales per group
    static constexpr at::ScalarType kType = at::kByte;
    static inline void rebuild(const uint8_t* q, const float* s, __m256 w[4]) {
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
};

struct Q8 {
    static constexpr int64_t kBytes = 32;
    static constexpr int64_t kScales = 1;
    static constexpr at::ScalarType kType = at::kChar;
    static inline void rebuild(const uint8_t* q, const float* s, __m256 w[4]) {
        const __m256 d = _mm256_set1_ps(s[0]);
        for (int p = 0; p < 4; ++p) {
            const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * p));
            w[p] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), d);
        }
    }
};

inline float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Independent accumulator chains per row: an FMA waits ~4 cycles for the previous one into the same
// register, so with few rows the 4 products of a group go to separate chains (summed at the end) to keep
// the FMA units busy; with many rows the rows themselves are the independent chains. Registers bound it:
// ROWS * chains accumulators + 4 weights + 2 scales fit the 16 ymm registers.
template <int ROWS>
constexpr int chains() { return ROWS <= 2 ? 4 : (ROWS <= 5 ? 2 : 1); }

// Output columns [j0, j1) for ROWS rows of x: each weight group is rebuilt once and used ROWS times.
template <typename Codec, int ROWS>
void rows_tile(const float* x, int64_t K, const uint8_t* codes, const float* scales, float* y, int64_t N,
               int64_t j0, int64_t j1) {
    constexpr int C = chains<ROWS>();
    const int64_t groups = K / 32;
    for (int64_t j = j0; j < j1; ++j) {
        __m256 acc[ROWS][C];
        for (int r = 0; r < ROWS; ++r)
            for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
        const uint8_t* qj = codes + j * groups * Codec::kBytes;
        const float* sj = scales + j * groups * Codec::kScales;
        for (int64_t g = 0; g < groups; ++g) {
            __m256 w[4];
            Codec::rebuild(qj + g * Codec::kBytes, sj + g * Codec::kScales, w);
            const float* xg = x + g * 32;
            for (int r = 0; r < ROWS; ++r) {
                const float* xr = xg + r * K;
                for (int p = 0; p < 4; ++p)
                    acc[r][p % C] = _mm256_fmadd_ps(w[p], _mm256_loadu_ps(xr + 8 * p), acc[r][p % C]);
            }
        }
        for (int r = 0; r < ROWS; ++r) {
            __m256 total = acc[r][0];
            for (int c = 1; c < C; ++c) total = _mm256_add_ps(total, acc[r][c]);
            y[r * N + j] = horizontal_sum(total);
        }
    }
}

// Rows are split into near-equal tiles of at most 12 (measured on the 2-core box: 9-12 rows in one
// tile instead of 8 + the rest save ~15%; past 12 the accumulators no longer fit the 16 registers).
constexpr int64_t kMaxTileRows = 12;

template <typename Codec, int ROWS>
void run_tile(int64_t rows, const float* x, int64_t K, const uint8_t* codes, const float* scales, float* y,
              int64_t N, int64_t j0, int64_t j1) {
    if constexpr (ROWS > 1) {
        if (rows < ROWS) return run_tile<Codec, ROWS - 1>(rows, x, K, codes, scales, y, N, j0, j1);
    }
    rows_tile<Codec, ROWS>(x, K, codes, scales, y, N, j0, j1);
}

template <typename Codec>
at::Tensor grid_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
                "grid_linear: x must be a contiguous 2-D float32 CPU tensor");
    const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
    TORCH_CHECK(K % 32 == 0, "grid_linear: the input size (", K, ") must be a multiple of 32");
    TORCH_CHECK(codes.scalar_type() == Codec::kType && codes.is_contiguous() && codes.dim() == 2 &&
                codes.size(1) == K / 32 * Codec::kBytes, "grid_linear: codes of the wrong type or shape");
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                scales.size(0) == N && scales.size(1) == K / 32 * Codec::kScales,
                "grid_linear: scales must be contiguous float32 [N, groups * ", Codec::kScales, "]");
    at::Tensor y = at::empty({M, N}, x.options());
    const float* xp = x.data_ptr<float>();
    const uint8_t* qp = static_cast<const uint8_t*>(codes.data_ptr());
    const float* sp = scales.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, N, 16, [&](int64_t j0, int64_t j1) {
        const int64_t tiles = (M + kMaxTileRows - 1) / kMaxTileRows;
        for (int64_t t = 0, r0 = 0; t < tiles; ++t) {
            const int64_t rows = M / tiles + (t < M % tiles ? 1 : 0);
            run_tile<Codec, kMaxTileRows>(rows, xp + r0 * K, K, qp, sp, yp + r0 * N, N, j0, j1);
            r0 += rows;
        }
    });
    return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle_lite, m) {
    m.def("grid4_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
    m.def("grid8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle_lite, CPU, m) {
    m.impl("grid4_linear", &grid_linear<Q4>);
    m.impl("grid8_linear", &grid_linear<Q8>);
}

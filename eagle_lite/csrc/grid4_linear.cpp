// y = x W^T for fp32 rows x [M, K] and a weight W [N, K] stored as 4-bit codes on a per-group grid:
// W[j, 32g + i] = (q * d) + m, with q in 0..15 and one (d, m) pair per 32 inputs (GGUF's Q4_1 layout).
//
// Each weight is rebuilt in fp32 exactly as the stored fp32 weight was made (one multiply, one add, two
// roundings; this file is compiled with -ffp-contract=off so they are never fused), then multiplied
// into fp32 accumulators: the same products as a dense fp32 GEMM, summed in another order. Reading
// 5 bits a weight instead of 32 is the point: a few-row product over a 135M model is memory-bound.
//
// Codes: qs[j, 16g + b] holds element 32g + b in its low nibble and 32g + 16 + b in its high nibble.
// Scales: dm[j, 2g] = d, dm[j, 2g + 1] = m.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

inline void dequant_group(const uint8_t* q, float d, float m, __m256 w[4]) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int p = 0; p < 4; ++p) {
        const __m256 code = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p]));
        w[p] = _mm256_add_ps(_mm256_mul_ps(code, vd), vm);
    }
}

inline float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Output columns [j0, j1) for ROWS rows of x: each weight group is rebuilt once and used ROWS times.
template <int ROWS>
void rows_tile(const float* x, int64_t K, const uint8_t* qs, const float* dm, float* y, int64_t N,
               int64_t j0, int64_t j1) {
    const int64_t groups = K / 32;
    for (int64_t j = j0; j < j1; ++j) {
        __m256 acc[ROWS];
        for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
        const uint8_t* qj = qs + j * (K / 2);
        const float* dmj = dm + j * groups * 2;
        for (int64_t g = 0; g < groups; ++g) {
            __m256 w[4];
            dequant_group(qj + g * 16, dmj[2 * g], dmj[2 * g + 1], w);
            const float* xg = x + g * 32;
            for (int r = 0; r < ROWS; ++r) {
                const float* xr = xg + r * K;
                acc[r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[r]);
                acc[r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[r]);
                acc[r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[r]);
                acc[r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[r]);
            }
        }
        for (int r = 0; r < ROWS; ++r) y[r * N + j] = horizontal_sum(acc[r]);
    }
}

// Rows are split into near-equal tiles of at most 12 (measured on the 2-core box: 9-12 rows in one
// tile instead of 8 + the rest save ~15%; past 12 the accumulators no longer fit the 16 registers).
constexpr int64_t kMaxTileRows = 12;

template <int ROWS>
void run_tile(int64_t rows, const float* x, int64_t K, const uint8_t* qs, const float* dm, float* y, int64_t N,
              int64_t j0, int64_t j1) {
    if constexpr (ROWS > 1) {
        if (rows < ROWS) return run_tile<ROWS - 1>(rows, x, K, qs, dm, y, N, j0, j1);
    }
    rows_tile<ROWS>(x, K, qs, dm, y, N, j0, j1);
}

at::Tensor grid4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
                "grid4_linear: x must be a contiguous 2-D float32 CPU tensor");
    const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
    TORCH_CHECK(K % 32 == 0, "grid4_linear: the input size (", K, ") must be a multiple of 32");
    TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.dim() == 2 && qs.size(1) == K / 2,
                "grid4_linear: codes must be contiguous uint8 [N, K/2]");
    TORCH_CHECK(dm.scalar_type() == at::kFloat && dm.is_contiguous() && dm.dim() == 2 && dm.size(0) == N &&
                dm.size(1) == K / 16, "grid4_linear: scales must be contiguous float32 [N, K/16]");
    at::Tensor y = at::empty({M, N}, x.options());
    const float* xp = x.data_ptr<float>();
    const uint8_t* qp = qs.data_ptr<uint8_t>();
    const float* dp = dm.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, N, 16, [&](int64_t j0, int64_t j1) {
        const int64_t tiles = (M + kMaxTileRows - 1) / kMaxTileRows;
        for (int64_t t = 0, r0 = 0; t < tiles; ++t) {
            const int64_t rows = M / tiles + (t < M % tiles ? 1 : 0);
            run_tile<kMaxTileRows>(rows, xp + r0 * K, K, qp, dp, yp + r0 * N, N, j0, j1);
            r0 += rows;
        }
    });
    return y;
}

}  // namespace

TORCH_LIBRARY(eagle_lite, m) {
    m.def("grid4_linear(Tensor x, Tensor qs, Tensor dm) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle_lite, CPU, m) {
    m.impl("grid4_linear", &grid4_linear);
}

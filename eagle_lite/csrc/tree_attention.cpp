// Attention of a few new tokens (a verified draft tree, or one decoding step) over the KV cache:
//   out[t, h, :] = sum_s p[t, h, s] v[h / G, s, :],  p = softmax over visible s of scale * q[h, t, :] . k[h / G, s, :]
// for H query heads sharing Hkv = H / G key/value heads (grouped-query attention), mask[t, s] marking the
// keys token t may see (the tree's ancestors plus the whole prefix). torch's CPU SDPA spends ~60-120 us a
// call on this shape (1-16 queries, a few hundred keys, 9 heads) in setup; this loop does the same fp32
// arithmetic (the dot products, the max-subtracted exponentials and the weighted sum, in another order,
// the exponential from a polynomial as torch's own vectorized kernels do).
// The output is [T, H, D], the layout transformers' attention interface returns, so no transpose follows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <limits>
#include <vector>

namespace {

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

at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const c10::optional<at::Tensor>& mask, double scale) {
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "tree_attention: q [H, T, D], k/v [Hkv, S, D]");
    TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
                "tree_attention: float32 only");
    const int64_t H = q.size(0), T = q.size(1), D = q.size(2), Hkv = k.size(0), S = k.size(1);
    TORCH_CHECK(D % 8 == 0 && k.size(2) == D && v.size(2) == D && v.size(0) == Hkv && v.size(1) == S &&
                Hkv > 0 && H % Hkv == 0, "tree_attention: shapes do not match (D must be a multiple of 8)");
    TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "tree_attention: D must be contiguous");
    const bool* visible = nullptr;
    at::Tensor m;
    if (mask.has_value()) {
        m = mask->contiguous();
        TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 2 && m.size(0) == T && m.size(1) == S,
                    "tree_attention: mask must be bool [T, S]");
        visible = m.data_ptr<bool>();
    }
    at::Tensor out = at::empty({T, H, D}, q.options());
    const float* qp = q.data_ptr<float>();
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t group = H / Hkv;
    const float sc = static_cast<float>(scale);
    at::parallel_for(0, H * T, 1, [&](int64_t r0, int64_t r1) {
        std::vector<float> p(S + 4);
        for (int64_t r = r0; r < r1; ++r) {
            const int64_t h = r / T, t = r % T, hk = h / group;
            const float* qr = qp + h * q.stride(0) + t * q.stride(1);
            const float* kh = kp + hk * k.stride(0);
            const float* vh = vp + hk * v.stride(0);
            const bool* row = visible ? visible + t * S : nullptr;
            const int64_t ks = k.stride(1), vs = v.stride(1);
            float best = -std::numeric_limits<float>::infinity();
            for (int64_t s = 0; s < S; s += 4) {
                float d4[4];
                const int64_t s1 = std::min(s + 1, S - 1), s2 = std::min(s + 2, S - 1), s3 = std::min(s + 3, S - 1);
                dot4(qr, kh + s * ks, kh + s1 * ks, kh + s2 * ks, kh + s3 * ks, D, d4);
                for (int i = 0; i < 4 && s + i < S; ++i) {
                    const float x = (row && !row[s + i]) ? -std::numeric_limits<float>::infinity() : d4[i] * sc;
                    p[s + i] = x;
                    best = std::max(best, x);
                }
            }
            const __m256 shift = _mm256_set1_ps(best);
            __m256 sum8 = _mm256_setzero_ps();
            int64_t s = 0;
            for (; s + 8 <= S; s += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.data() + s), shift));
                _mm256_storeu_ps(p.data() + s, e);
                sum8 = _mm256_add_ps(sum8, e);
            }
            float total = horizontal_sum(sum8);
            for (; s < S; ++s) {
                p[s] = std::exp(p[s] - best);           // exp(-inf) = 0 for hidden keys
                total += p[s];
            }
            __m256 acc[16];
            const int64_t chunks = D / 8;
            TORCH_CHECK(chunks <= 16, "tree_attention: head_dim above 128");
            for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm256_setzero_ps();
            for (int64_t s = 0; s < S; ++s) {
                if (p[s] == 0.0f) continue;
                const __m256 w = _mm256_set1_ps(p[s]);
                const float* vr = vh + s * vs;
                for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * c), acc[c]);
            }
            const __m256 inv = _mm256_set1_ps(1.0f / total);
            float* outr = op + (t * H + h) * D;
            for (int64_t c = 0; c < chunks; ++c) _mm256_storeu_ps(outr + 8 * c, _mm256_mul_ps(acc[c], inv));
        }
    });
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle_lite, m) {
    m.def("tree_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle_lite, CPU, m) {
    m.impl("tree_attention", &tree_attention);
}

// RMSNorm over the last dimension of fp32 rows, as transformers' Llama-family norms compute it:
//   y = weight * (x * rsqrt(mean(x^2) + eps))
// in one pass per row (kernels.h: rms_norm_row) instead of seven small torch ops (~40 us a call on 1-12
// rows on the 2-core box, of which the mean alone is ~20).
#include "kernels.h"

namespace {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
                "rms_norm: x must be a contiguous float32 CPU tensor");
    const int64_t H = x.size(-1);
    TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 1 &&
                weight.size(0) == H && H % 8 == 0, "rms_norm: weight must be contiguous float32 [H], H % 8 == 0");
    at::Tensor y = at::empty_like(x);
    const int64_t rows = x.numel() / H;
    const float* xp = x.data_ptr<float>();
    const float* wp = weight.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const float epsf = static_cast<float>(eps);
    auto body = [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) eagle_lite::rms_norm_row(xp + r * H, wp, H, epsf, yp + r * H);
    };
    if (rows >= 64) at::parallel_for(0, rows, 16, body); else body(0, rows);
    return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle_lite, m) {
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle_lite, CPU, m) {
    m.impl("rms_norm", &rms_norm);
}

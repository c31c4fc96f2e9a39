// y = x W^T for fp32 rows x [M, K] and a weight W [N, K] stored as small integer codes on a per-group grid
// (kernels.h: the Q4 and Q8 layouts GGUF files use):
//   grid4_linear: W[j, 32g + i] = (q * d) + m, q in 0..15          (Q4_1; Q4_0 is m = -8 d)
//   grid8_linear: W[j, 32g + i] = q * d,       q in -128..127      (Q8_0; Q5_0 is q in -16..15)
//   gridk_linear: W[j, 32g + 16h + i] = (q * d_h) + m_h, int8 q     (Q5_K, Q6_K)
// The same products as a dense fp32 GEMM, summed in another order. Reading 5 or 9 bits a weight instead
// of 32 is the point: a few-row product over a 135M model is memory-bound.
#include "kernels.h"

namespace {

using namespace eagle_lite;

template <typename Codec>
at::Tensor grid_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
                "grid_linear: x must be a contiguous 2-D float32 CPU tensor");
    const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
    check_grid<Codec>(codes, scales, K, "grid_linear");
    at::Tensor y = at::empty({M, N}, x.options());
    grid_product<Codec>(x.data_ptr<float>(), M, K, static_cast<const uint8_t*>(codes.data_ptr()),
                        scales.data_ptr<float>(), y.data_ptr<float>(), N);
    return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle_lite, m) {
    m.def("grid4_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
    m.def("grid8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
    m.def("gridk_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle_lite, CPU, m) {
    m.impl("grid4_linear", &grid_linear<Q4>);
    m.impl("grid8_linear", &grid_linear<Q8>);
    m.impl("gridk_linear", &grid_linear<K8>);
}

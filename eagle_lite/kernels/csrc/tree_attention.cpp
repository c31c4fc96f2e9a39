// Attention of a few new tokens (a verified draft tree, or one decoding step) over the KV cache:
//   out[t, h, :] = sum_s p[t, h, s] v[h / G, s, :],  p = softmax over visible s of scale * q[h, t, :] . k[h / G, s, :]
// for H query heads sharing Hkv = H / G key/value heads (grouped-query attention), mask[t, s] marking the
// keys token t may see (the tree's ancestors plus the whole prefix). torch's CPU SDPA spends ~60-120 us a
// call on this shape (1-16 queries, a few hundred keys, 9 heads) in setup; this loop (kernels.h:
// attend_row) does the same fp32 arithmetic in another order.
// The output is [T, H, D], the layout transformers' attention interface returns, so no transpose follows.
#include "kernels.h"

namespace {

at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const c10::optional<at::Tensor>& mask, double scale) {
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "tree_attention: q [H, T, D], k/v [Hkv, S, D]");
    TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
                "tree_attention: float32 only");
    const int64_t H = q.size(0), T = q.size(1), D = q.size(2), Hkv = k.size(0), S = k.size(1);
    TORCH_CHECK(D % 8 == 0 && D <= eagle_lite::kMaxHeadDim && k.size(2) == D && v.size(2) == D &&
                v.size(0) == Hkv && v.size(1) == S && Hkv > 0 && H % Hkv == 0,
                "tree_attention: shapes do not match (D must be a multiple of 8, at most 256)");
    TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "tree_attention: D must be contiguous");
    at::Tensor held;
    const bool* visible = eagle_lite::visible_flags(mask, T, S, held, "tree_attention");
    at::Tensor out = at::empty({T, H, D}, q.options());
    eagle_lite::attend_heads(q.data_ptr<float>(), q.stride(0), q.stride(1), k.data_ptr<float>(), k.stride(0), k.stride(1),
                             v.data_ptr<float>(), v.stride(0), v.stride(1), H, Hkv, T, S, D, visible, -1,
                             static_cast<float>(scale), out.data_ptr<float>());
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle_lite, m) {
    m.def("tree_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle_lite, CPU, m) {
    m.impl("tree_attention", &tree_attention);
}

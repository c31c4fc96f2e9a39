// One Llama decoder layer of a few new tokens over a KV cache, in one call:
//   h   = x + o_proj(attention(rope(q), rope(k) -> cache, v -> cache))      q, k, v = qkv_proj(rms_norm_1(x))
//   out = h + down_proj(silu(gate) * up)                                     gate, up = gate_up_proj(rms_norm_2(h))
// with every projection from GGUF grid codes (kernels.h). transformers' LlamaDecoderLayer runs ~125 torch
// ops a layer for this (views, splits, the rotary's cat/neg/mul/add, the cache write, the residual adds),
// about 12 ms of Python and op dispatch in a one-token SmolLM2 forward on the 2-core box; here each
// layer is one op. The arithmetic is transformers': the rotary `(q * cos) + (rotate_half(q) * sin)` and the
// residual adds to the bit (separate roundings, -ffp-contract=off), the norms, products and attention as
// the kernels of kernels.h compute them (fp32, sums in another order), silu as x / (1 + exp(-x)) with the
// polynomial exponential. eagle_lite/fused_layer.py checks the result against the layer's own forward
// before it uses this op.
// With `embeds` (an EAGLE-3 draft layer, heads/eagle3_layer.py) the attention reads twice the width:
//   q, k, v = qkv_proj([rms_norm_0(embeds); rms_norm_1(x)])                 x stays the residual stream
// With `skips` the first skips[i] rows of segment i only write their keys and values to the cache (a draft
// head's catch-up: no one reads those rows' outputs, only later rows' attention reads their keys); their
// query, attention, o_proj and MLP are left out, and the output holds the other rows alone, in order. The kept
// rows' results are what they are without skips (a row's arithmetic is its own).
// With `extra_norms` (Gemma 3: the weights of its q_norm [D], k_norm [D], post-attention and post-MLP norms [H], one
// after the other, each as the norm multiplies by: 1 + w) each head's q and k rows are normed before the rotary, and the attention's and the MLP's outputs are normed
// before their residual adds; `act` 1 is GELU (tanh approximation, torch's own kernel) in place of silu.
#include "kernels.h"

namespace {

using namespace eagle_lite;

void product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, at::Tensor& y,
             const char* what) {
    const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
    TORCH_CHECK(y.size(0) == M && y.size(1) == N, what, ": output of the wrong shape");
    if (codes.scalar_type() == at::kChar && scales.size(1) == K / 32 * K8::kScales) {   // Q5_K / Q6_K
        check_grid<K8>(codes, scales, K, what);
        grid_product<K8>(x.data_ptr<float>(), M, K, static_cast<const uint8_t*>(codes.data_ptr()),
                         scales.data_ptr<float>(), y.data_ptr<float>(), N);
    } else if (codes.scalar_type() == at::kByte) {
        check_grid<Q4>(codes, scales, K, what);
        grid_product<Q4>(x.data_ptr<float>(), M, K, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                         y.data_ptr<float>(), N);
    } else {
        check_grid<Q8>(codes, scales, K, what);
        grid_product<Q8>(x.data_ptr<float>(), M, K, static_cast<const uint8_t*>(codes.data_ptr()),
                         scales.data_ptr<float>(), y.data_ptr<float>(), N);
    }
}

void norm_rows(const at::Tensor& x, const float* w, double eps, at::Tensor& y) {
    const int64_t H = x.size(1);
    for (int64_t r = 0; r < x.size(0); ++r)
        rms_norm_row(x.data_ptr<float>() + r * H, w, H, static_cast<float>(eps), y.data_ptr<float>() + r * H);
}

// transformers' apply_rotary_pos_emb on one head row: (x * cos) + (rotate_half(x) * sin), rotate_half(x) =
// cat(-x2, x1); two roundings then an add, as torch computes it elementwise.
inline void rope_row(const float* x, const float* c, const float* s, int64_t D, float* y) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; ++i) {
        const float a = x[i] * c[i];
        const float b = (-x[i + half]) * s[i];
        y[i] = a + b;
    }
    for (int64_t i = half; i < D; ++i) {
        const float a = x[i] * c[i];
        const float b = x[i - half] * s[i];
        y[i] = a + b;
    }
}

// One sequence's share of a forward: rows [row, row + rows) of x, whose keys/values go to that sequence's cache
// (this layer's [kv_heads, slots, head_dim] views) at slots [start, start + rows); they attend over the cache's
// first start + rows slots as `visible` ([rows, start + rows] flags, or nullptr: causal) says. Its first `skip`
// rows only write keys and values; the others are rows [kept, kept + rows - skip) of the output.
struct Segment {
    float* kp;
    float* vp;
    int64_t kh, ks, vh, vs;   // strides of the key/value views: per kv head, per slot
    int64_t slots;
    int64_t start, row, rows;
    const bool* visible;
    int64_t skip = 0, kept = 0;
};

Segment segment_of(at::Tensor& keys, at::Tensor& values, int64_t start, int64_t row, int64_t rows,
                   const bool* visible, int64_t skip, int64_t kept) {
    TORCH_CHECK(skip >= 0 && skip < rows, "decoder_layer: skip ", skip, " must leave at least one of ", rows,
                " rows");
    return {keys.data_ptr<float>(), values.data_ptr<float>(), keys.stride(0), keys.stride(1), values.stride(0),
            values.stride(1), keys.size(1), start, row, rows, visible, skip, kept};
}

void check_cache(const at::Tensor& keys, const at::Tensor& values, int64_t start, int64_t T) {
    TORCH_CHECK(keys.dim() == 3 && values.sizes() == keys.sizes() && keys.scalar_type() == at::kFloat &&
                values.scalar_type() == at::kFloat && keys.stride(2) == 1 && values.stride(2) == 1,
                "decoder_layer: keys/values must be float32 [kv_heads, slots, head_dim] with head_dim contiguous");
    TORCH_CHECK(start >= 0 && start + T <= keys.size(1), "decoder_layer: ", start + T, " tokens do not fit ",
                keys.size(1), " cache slots");
}

// The layer over every segment's rows: the products, norms and MLP over all rows at once (each row's arithmetic
// is its own: the result of a row does not depend on the rows beside it), the rotary, cache writes and attention
// segment by segment, each over its own cache.
at::Tensor layer_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                      const std::vector<Segment>& segments, int64_t Hkv, int64_t D,
                      const at::Tensor& norm1, const at::Tensor& norm2, double eps1, double eps2,
                      at::TensorList codes, at::TensorList scales, int64_t heads, double scale,
                      const c10::optional<at::Tensor>& embeds, const c10::optional<at::Tensor>& norm0, double eps0,
                      const c10::optional<at::Tensor>& extra, double extra_eps, int64_t act_kind) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
                "decoder_layer: x must be a contiguous float32 CPU tensor [T, hidden]");
    const int64_t T = x.size(0), H = x.size(1);
    int64_t Tk = 0;   // the rows kept (computed through to the output)
    for (const Segment& g : segments) Tk += g.rows - g.skip;
    TORCH_CHECK(heads > 0 && heads % Hkv == 0 && D % 8 == 0 && D <= kMaxHeadDim && H % 8 == 0,
                "decoder_layer: unsupported head layout");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D,
                "decoder_layer: cos/sin must be contiguous float32 [T, head_dim]");
    TORCH_CHECK(norm1.is_contiguous() && norm2.is_contiguous() && norm1.numel() == H && norm2.numel() == H &&
                norm1.scalar_type() == at::kFloat && norm2.scalar_type() == at::kFloat,
                "decoder_layer: norm weights must be contiguous float32 [hidden]");
    TORCH_CHECK(codes.size() == 4 && scales.size() == 4, "decoder_layer: codes/scales of qkv, o, gate_up, down");
    const int64_t qn = heads * D, kn = Hkv * D, inter = codes[2].size(0) / 2;
    TORCH_CHECK(codes[0].size(0) == qn + 2 * kn && codes[1].size(0) == H && codes[2].size(0) == 2 * inter &&
                codes[3].size(0) == H, "decoder_layer: projection sizes do not match the head layout");
    const auto opts = x.options();
    TORCH_CHECK(!extra.has_value() || (extra->numel() == 2 * D + 2 * H && extra->is_contiguous() &&
                                       extra->scalar_type() == at::kFloat),
                "decoder_layer: extra_norms is float32 [2 * head_dim + 2 * hidden] (q, k, post-attention, post-MLP)");
    TORCH_CHECK(act_kind == 0 || act_kind == 1, "decoder_layer: act is 0 (silu) or 1 (gelu, tanh)");
    const float xeps = static_cast<float>(extra_eps);
    const float* qnw = extra.has_value() ? extra->data_ptr<float>() : nullptr;
    const float* knw = extra.has_value() ? qnw + D : nullptr;
    float normed_head[kMaxHeadDim];
    // a head's row of q or k, normed first where the layer norms them, through the rotary
    auto head_rope = [&](const float* in, const float* w, const float* c, const float* s, float* out) {
        if (w != nullptr) {
            rms_norm_row(in, w, D, xeps, normed_head);
            in = normed_head;
        }
        rope_row(in, c, s, D, out);
    };

    // attention block
    at::Tensor normed = at::empty({T, H}, opts);
    at::Tensor qkv = at::empty({T, qn + 2 * kn}, opts);
    if (embeds.has_value()) {   // EAGLE-3: [norm_0(embeds); norm_1(x)], 2H wide
        const at::Tensor& e = *embeds;
        TORCH_CHECK(norm0.has_value() && norm0->is_contiguous() && norm0->numel() == H &&
                    norm0->scalar_type() == at::kFloat, "decoder_layer: embeds need their norm's float32 [hidden]");
        TORCH_CHECK(e.dim() == 2 && e.size(0) == T && e.size(1) == H && e.scalar_type() == at::kFloat &&
                    e.is_contiguous(), "decoder_layer: embeds must be contiguous float32 [T, hidden]");
        at::Tensor wide = at::empty({T, 2 * H}, opts);
        float* wp = wide.data_ptr<float>();
        for (int64_t r = 0; r < T; ++r) {
            rms_norm_row(e.data_ptr<float>() + r * H, norm0->data_ptr<float>(), H, static_cast<float>(eps0),
                         wp + r * 2 * H);
            rms_norm_row(x.data_ptr<float>() + r * H, norm1.data_ptr<float>(), H, static_cast<float>(eps1),
                         wp + r * 2 * H + H);
        }
        product(wide, codes[0], scales[0], qkv, "decoder_layer qkv");
    } else {
        norm_rows(x, norm1.data_ptr<float>(), eps1, normed);
        product(normed, codes[0], scales[0], qkv, "decoder_layer qkv");
    }
    at::Tensor q = at::empty({Tk, heads, D}, opts);
    float* qp = q.data_ptr<float>();
    const float* qkvp = qkv.data_ptr<float>();
    const float* cosp = cos.data_ptr<float>();
    const float* sinp = sin.data_ptr<float>();
    at::Tensor attn = at::empty({Tk, heads * D}, opts);
    float* ap = attn.data_ptr<float>();
    for (const Segment& g : segments) {
        for (int64_t t = g.row; t < g.row + g.rows; ++t) {
            const float* row = qkvp + t * (qn + 2 * kn);
            const float* c = cosp + t * D;
            const float* s = sinp + t * D;
            const int64_t slot = g.start + t - g.row;
            if (t >= g.row + g.skip) {
                const int64_t k = g.kept + t - g.row - g.skip;
                for (int64_t h = 0; h < heads; ++h) head_rope(row + h * D, qnw, c, s, qp + (k * heads + h) * D);
            }
            for (int64_t h = 0; h < Hkv; ++h) {
                head_rope(row + qn + h * D, knw, c, s, g.kp + h * g.kh + slot * g.ks);
                std::copy(row + qn + kn + h * D, row + qn + kn + (h + 1) * D, g.vp + h * g.vh + slot * g.vs);
            }
        }
        // the kept rows attend; no mask: causal, token t sees the prefix and the new tokens up to itself
        const int64_t S = g.start + g.rows;
        attend_heads(qp + g.kept * heads * D, D, heads * D, g.kp, g.kh, g.ks, g.vp, g.vh, g.vs, heads, Hkv,
                     g.rows - g.skip, S, D, g.visible ? g.visible + g.skip * S : nullptr, g.start + g.skip,
                     static_cast<float>(scale), ap + g.kept * heads * D);
    }
    at::Tensor o = at::empty({Tk, H}, opts);
    product(attn, codes[1], scales[1], o, "decoder_layer o");
    if (extra.has_value()) norm_rows(o, knw + D, extra_eps, o);   // in place: a row's sum of squares comes first
    at::Tensor h = at::empty({Tk, H}, opts);
    const float* xp = x.data_ptr<float>();
    float* hp = h.data_ptr<float>();
    const float* op = o.data_ptr<float>();
    for (const Segment& g : segments) {
        const float* xs = xp + (g.row + g.skip) * H;
        const int64_t n = (g.rows - g.skip) * H, at = g.kept * H;
        for (int64_t i = 0; i < n; ++i) hp[at + i] = xs[i] + op[at + i];
    }

    // MLP block
    normed = normed.narrow(0, 0, Tk);   // the kept rows' share of the buffer: contiguous, no new allocation
    norm_rows(h, norm2.data_ptr<float>(), eps2, normed);
    at::Tensor gate_up = at::empty({Tk, 2 * inter}, opts);
    product(normed, codes[2], scales[2], gate_up, "decoder_layer gate_up");
    at::Tensor act = at::empty({Tk, inter}, opts);
    const float* gup = gate_up.data_ptr<float>();
    float* actp = act.data_ptr<float>();
    if (act_kind == 1) {   // gelu(gate) * up: torch's gelu kernel (transformers' GELUTanh), then one multiply
        const at::Tensor g = at::gelu(gate_up.narrow(1, 0, inter), "tanh");
        const float* gp = g.data_ptr<float>();
        for (int64_t t = 0; t < Tk; ++t)
            for (int64_t i = 0; i < inter; ++i) actp[t * inter + i] = gp[t * inter + i] * gup[t * 2 * inter + inter + i];
    }
    for (int64_t t = 0; t < Tk && act_kind == 0; ++t) {
        const float* g = gup + t * 2 * inter;
        const float* u = g + inter;
        float* a = actp + t * inter;
        int64_t i = 0;
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= inter; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
        for (; i < inter; ++i) a[i] = (g[i] / (1.0f + std::exp(-g[i]))) * u[i];
    }
    at::Tensor down = at::empty({Tk, H}, opts);
    product(act, codes[3], scales[3], down, "decoder_layer down");
    if (extra.has_value()) norm_rows(down, knw + D + H, extra_eps, down);
    at::Tensor out = at::empty({Tk, H}, opts);
    float* outp = out.data_ptr<float>();
    const float* dp = down.data_ptr<float>();
    for (int64_t i = 0; i < Tk * H; ++i) outp[i] = hp[i] + dp[i];
    return out;
}

at::Tensor decoder_layer(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& keys,
                         at::Tensor& values, int64_t start, const c10::optional<at::Tensor>& mask,
                         const at::Tensor& norm1, const at::Tensor& norm2, double eps1, double eps2,
                         at::TensorList codes, at::TensorList scales, int64_t heads, double scale,
                         const c10::optional<at::Tensor>& embeds, const c10::optional<at::Tensor>& norm0,
                         double eps0, int64_t skip, const c10::optional<at::Tensor>& extra, double extra_eps,
                         int64_t act) {
    TORCH_CHECK(x.dim() == 2, "decoder_layer: x must be [T, hidden]");
    const int64_t T = x.size(0);
    check_cache(keys, values, start, T);
    at::Tensor held;
    const bool* visible = eagle_lite::visible_flags(mask, T, start + T, held, "decoder_layer");
    return layer_rows(x, cos, sin, {segment_of(keys, values, start, 0, T, visible, skip, 0)}, keys.size(0),
                      keys.size(2), norm1, norm2, eps1, eps2, codes, scales, heads, scale, embeds, norm0, eps0, extra,
                      extra_eps, act);
}

// Several sequences' new tokens packed into the rows of x (Target.verify): segment i is rows[i] rows over
// keys[i]/values[i] (this layer's views of its own cache) after starts[i] committed slots, under masks[i]
// ([rows[i], starts[i] + rows[i]] bool). Each segment's rows get exactly what decoder_layer gives them alone.
at::Tensor decoder_layer_packed(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                at::TensorList keys, at::TensorList values, at::IntArrayRef starts,
                                at::IntArrayRef rows, at::TensorList masks, const at::Tensor& norm1,
                                const at::Tensor& norm2, double eps1, double eps2, at::TensorList codes,
                                at::TensorList scales, int64_t heads, double scale,
                                const c10::optional<at::Tensor>& embeds, const c10::optional<at::Tensor>& norm0,
                                double eps0, at::OptionalIntArrayRef skips, const c10::optional<at::Tensor>& extra,
                                double extra_eps, int64_t act) {
    const int64_t n = static_cast<int64_t>(keys.size());
    TORCH_CHECK(n > 0 && static_cast<int64_t>(values.size()) == n && static_cast<int64_t>(starts.size()) == n &&
                static_cast<int64_t>(rows.size()) == n && static_cast<int64_t>(masks.size()) == n,
                "decoder_layer_packed: one key view, value view, start, row count and mask per segment");
    TORCH_CHECK(!skips.has_value() || static_cast<int64_t>(skips->size()) == n,
                "decoder_layer_packed: one skip per segment");
    TORCH_CHECK(x.dim() == 2, "decoder_layer_packed: x must be [T, hidden]");
    std::vector<at::Tensor> held(n);
    std::vector<Segment> segments;
    int64_t row = 0, kept = 0;
    for (int64_t i = 0; i < n; ++i) {
        at::Tensor k = keys[i], v = values[i];
        check_cache(k, v, starts[i], rows[i]);
        TORCH_CHECK(k.size(0) == keys[0].size(0) && k.size(2) == keys[0].size(2),
                    "decoder_layer_packed: every cache must have the same head layout");
        const bool* visible = eagle_lite::visible_flags(masks[i], rows[i], starts[i] + rows[i], held[i],
                                                        "decoder_layer_packed");
        const int64_t skip = skips.has_value() ? (*skips)[i] : 0;
        segments.push_back(segment_of(k, v, starts[i], row, rows[i], visible, skip, kept));
        row += rows[i];
        kept += rows[i] - skip;
    }
    TORCH_CHECK(row == x.size(0), "decoder_layer_packed: the segments' rows (", row, ") must be x's (", x.size(0),
                ")");
    return layer_rows(x, cos, sin, segments, keys[0].size(0), keys[0].size(2), norm1, norm2, eps1, eps2, codes,
                      scales, heads, scale, embeds, norm0, eps0, extra, extra_eps, act);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle_lite, m) {
    m.def("decoder_layer(Tensor x, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, int start, "
          "Tensor? mask, Tensor norm1, Tensor norm2, float eps1, float eps2, Tensor[] codes, Tensor[] scales, "
          "int heads, float scale, Tensor? embeds=None, Tensor? norm0=None, float eps0=0.0, int skip=0, "
          "Tensor? extra_norms=None, float extra_eps=0.0, int act=0) -> Tensor");
    m.def("decoder_layer_packed(Tensor x, Tensor cos, Tensor sin, Tensor(a!)[] keys, Tensor(b!)[] values, "
          "int[] starts, int[] rows, Tensor[] masks, Tensor norm1, Tensor norm2, float eps1, float eps2, "
          "Tensor[] codes, Tensor[] scales, int heads, float scale, Tensor? embeds=None, Tensor? norm0=None, "
          "float eps0=0.0, int[]? skips=None, Tensor? extra_norms=None, float extra_eps=0.0, int act=0) "
          "-> Tensor");
}

TORCH_LIBRARY_IMPL(eagle_lite, CPU, m) {
    m.impl("decoder_layer", &decoder_layer);
    m.impl("decoder_layer_packed", &decoder_layer_packed);
}

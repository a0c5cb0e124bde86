// The attention sub-layer: projections, RoPE with each token's GLOBAL position, and the
// context-parallel strategy (any algorithm, any layout). The strategy sees only this rank's
// shard [B, Tl, H, D] and the global positions of its tokens; it returns this shard's output
// and LSE, exactly the rows a single-rank attention over the whole sequence would give.
#include "model/transformer.h"

namespace ctxpar::model {

void attention_forward(const ModelConfig& m, const LayerParams& w, Strategy& strategy,
                       const Tokens& tokens, const RopeTable& rope, int64_t batch, BlockActs& a,
                       float* y) {
  const int64_t tl = rope.tokens, n = batch * tl, c = m.dim, d = m.head_dim;
  const int64_t q_width = int64_t(m.heads) * d, kv_width = int64_t(m.kv_heads) * d;
  linear_forward(a.xn1.data(), w.wq, a.q.data(), n, c, q_width);
  linear_forward(a.xn1.data(), w.wk, a.k.data(), n, c, kv_width);
  linear_forward(a.xn1.data(), w.wv, a.v.data(), n, c, kv_width);
  rope_apply(a.q.data(), rope, batch, m.heads, d, false);
  rope_apply(a.k.data(), rope, batch, m.kv_heads, d, false);
  TensorView q(a.q.data(), DType::f32, {batch, tl, m.heads, d});
  TensorView k(a.k.data(), DType::f32, {batch, tl, m.kv_heads, d});
  TensorView v(a.v.data(), DType::f32, {batch, tl, m.kv_heads, d});
  TensorView out(a.att.data(), DType::f32, {batch, tl, m.heads, d});
  TensorView lse(a.lse.data(), DType::f32, {batch, m.heads, tl});
  strategy.forward(q, k, v, tokens, out, lse);
  linear_forward(a.att.data(), w.wo, y, n, q_width, c);
}

void attention_backward(const ModelConfig& m, const LayerParams& w, const LayerParams& g,
                        Strategy& strategy, const Tokens& tokens, const RopeTable& rope,
                        int64_t batch, const BlockActs& a, const float* dy, float* dxn1,
                        AttentionScratch& s) {
  const int64_t tl = rope.tokens, n = batch * tl, c = m.dim, d = m.head_dim;
  const int64_t q_width = int64_t(m.heads) * d, kv_width = int64_t(m.kv_heads) * d;
  linear_backward(dy, a.att.data(), w.wo, s.datt.data(), g.wo, n, q_width, c, false);
  auto view = [&](const std::vector<float>& b, int64_t h) {
    return TensorView(const_cast<float*>(b.data()), DType::f32, {batch, tl, h, d});
  };
  TensorView lse(const_cast<float*>(a.lse.data()), DType::f32, {batch, m.heads, tl});
  strategy.backward(view(a.q, m.heads), view(a.k, m.kv_heads), view(a.v, m.kv_heads), tokens,
                    view(a.att, m.heads), lse, view(s.datt, m.heads), view(s.dq, m.heads),
                    view(s.dk, m.kv_heads), view(s.dv, m.kv_heads));
  // q and k were rotated after the projection, so their gradients rotate back first.
  rope_apply(s.dq.data(), rope, batch, m.heads, d, true);
  rope_apply(s.dk.data(), rope, batch, m.kv_heads, d, true);
  linear_backward(s.dq.data(), a.xn1.data(), w.wq, dxn1, g.wq, n, c, q_width, false);
  linear_backward(s.dk.data(), a.xn1.data(), w.wk, dxn1, g.wk, n, c, kv_width, true);
  linear_backward(s.dv.data(), a.xn1.data(), w.wv, dxn1, g.wv, n, c, kv_width, true);
}

}  // namespace ctxpar::model

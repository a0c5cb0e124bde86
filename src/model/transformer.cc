// One training step of the transformer on this rank's shard:
//
//   tokens -> embed -> [ RMSNorm -> attention (CP strategy) -> +residual
//                        RMSNorm -> SwiGLU MLP               -> +residual ] x L
//          -> RMSNorm -> logits = x E^T (tied) -> cross-entropy / global count
//
// and the backward in reverse. Buffers are allocated once, sized by the local token count
// N = B * T/P, so every activation this rank holds is proportional to T/P.
#include "model/transformer.h"

#include <algorithm>
#include <cstring>

#include "ctxpar/error.h"

namespace ctxpar::model {

namespace {
template <typename... V>
size_t bytes_of(const V&... v) {
  return ((v.capacity() * sizeof(float)) + ...);
}
}  // namespace

Transformer::Transformer(const ModelConfig& config, Strategy& strategy,
                         std::vector<int64_t> positions, int64_t batch)
    : config_(config), strategy_(strategy), positions_(std::move(positions)), batch_(batch) {
  config_.validate();
  rope_ = rope_table(positions_, config_.head_dim, config_.rope_base);
  const int64_t tl = static_cast<int64_t>(positions_.size());
  rows_ = batch_ * tl;
  const int64_t n = rows_, c = config_.dim, f = config_.hidden;
  const int64_t qw = int64_t(config_.heads) * config_.head_dim;
  const int64_t kvw = int64_t(config_.kv_heads) * config_.head_dim;
  acts_.resize(config_.layers);
  for (auto& a : acts_) {
    a.x_in.resize(n * c);
    a.rstd1.resize(n);
    a.xn1.resize(n * c);
    a.q.resize(n * qw);
    a.k.resize(n * kvw);
    a.v.resize(n * kvw);
    a.att.resize(n * qw);
    a.lse.resize(batch_ * config_.heads * tl);
    a.x_mid.resize(n * c);
    a.rstd2.resize(n);
    a.xn2.resize(n * c);
    a.h1.resize(n * f);
    a.h3.resize(n * f);
    a.g.resize(n * f);
    held_bytes_ += bytes_of(a.x_in, a.rstd1, a.xn1, a.q, a.k, a.v, a.att, a.lse, a.x_mid, a.rstd2,
                            a.xn2, a.h1, a.h3, a.g);
  }
  x_.resize(n * c);
  xf_.resize(n * c);
  rstdf_.resize(n);
  xnf_.resize(n * c);
  logits_.resize(n * config_.vocab);
  dx_.resize(n * c);
  dxn_.resize(n * c);
  tmp_.resize(n * c);
  dg_.resize(n * f);
  dh1_.resize(n * f);
  dh3_.resize(n * f);
  attn_scratch_.datt.resize(n * qw);
  attn_scratch_.dq.resize(n * qw);
  attn_scratch_.dk.resize(n * kvw);
  attn_scratch_.dv.resize(n * kvw);
  held_bytes_ += bytes_of(x_, xf_, rstdf_, xnf_, logits_, dx_, dxn_, tmp_, dg_, dh1_, dh3_,
                          attn_scratch_.datt, attn_scratch_.dq, attn_scratch_.dk, attn_scratch_.dv);
  held_bytes_ += rope_.cos.capacity() * 8;
}

void Transformer::set_tokens(std::vector<int64_t> positions,
                             const std::vector<int64_t>& rope_positions,
                             std::vector<int32_t> documents) {
  CTXPAR_CHECK(positions.size() == positions_.size() && rope_positions.size() == positions.size() &&
                   documents.size() == positions.size(),
               "Transformer::set_tokens: ", positions.size(), " positions, ", rope_positions.size(),
               " RoPE positions and ", documents.size(), " document ids for ", positions_.size(),
               " local tokens");
  positions_ = std::move(positions);
  documents_ = std::move(documents);
  rope_ = rope_table(rope_positions, config_.head_dim, config_.rope_base);
}

LossSums Transformer::forward_backward(const float* weights, float* grads, const uint8_t* tokens,
                                       const uint8_t* labels, const uint8_t* weight,
                                       double global_count) {
  const ModelConfig& m = config_;
  const int64_t n = rows_, c = m.dim, f = m.hidden, v = m.vocab;
  ModelParams w = bind_params(m, const_cast<float*>(weights));
  ModelParams g = bind_params(m, grads);
  Tokens toks;
  toks.positions = std::span<const int64_t>(positions_);
  toks.documents = std::span<const int32_t>(documents_);

  // ---- forward ----
  embedding_forward(tokens, w.embed, x_.data(), n, c);
  for (int l = 0; l < m.layers; ++l) {
    BlockActs& a = acts_[l];
    const LayerParams& lw = w.layers[l];
    std::memcpy(a.x_in.data(), x_.data(), n * c * 4);
    rmsnorm_forward(a.x_in.data(), lw.attn_norm, a.xn1.data(), a.rstd1.data(), n, c, m.norm_eps);
    attention_forward(m, lw, strategy_, toks, rope_, batch_, a, tmp_.data());
    strategy_peak_ = std::max(strategy_peak_, strategy_.last_stats().peak_bytes);
    for (int64_t i = 0; i < n * c; ++i) x_[i] += tmp_[i];
    std::memcpy(a.x_mid.data(), x_.data(), n * c * 4);
    rmsnorm_forward(a.x_mid.data(), lw.mlp_norm, a.xn2.data(), a.rstd2.data(), n, c, m.norm_eps);
    linear_forward(a.xn2.data(), lw.w1, a.h1.data(), n, c, f);
    linear_forward(a.xn2.data(), lw.w3, a.h3.data(), n, c, f);
    swiglu_forward(a.h1.data(), a.h3.data(), a.g.data(), n * f);
    linear_forward(a.g.data(), lw.w2, tmp_.data(), n, f, c);
    for (int64_t i = 0; i < n * c; ++i) x_[i] += tmp_[i];
  }
  std::memcpy(xf_.data(), x_.data(), n * c * 4);
  rmsnorm_forward(xf_.data(), w.final_norm, xnf_.data(), rstdf_.data(), n, c, m.norm_eps);
  linear_forward(xnf_.data(), w.embed, logits_.data(), n, c, v);
  // logits_ becomes dloss/dlogits in place.
  LossSums sums =
      cross_entropy_forward_backward(logits_.data(), labels, weight, n, v, global_count);

  // ---- backward ----
  linear_backward(logits_.data(), xnf_.data(), w.embed, dxn_.data(), g.embed, n, c, v, false);
  std::fill(dx_.begin(), dx_.end(), 0.0f);
  rmsnorm_backward(dxn_.data(), xf_.data(), w.final_norm, rstdf_.data(), dx_.data(), g.final_norm,
                   n, c);
  for (int l = m.layers - 1; l >= 0; --l) {
    const BlockActs& a = acts_[l];
    const LayerParams& lw = w.layers[l];
    const LayerParams& lg = g.layers[l];
    // MLP: dx_ is the gradient of the block output; the residual passes it through unchanged.
    linear_backward(dx_.data(), a.g.data(), lw.w2, dg_.data(), lg.w2, n, f, c, false);
    swiglu_backward(dg_.data(), a.h1.data(), a.h3.data(), dh1_.data(), dh3_.data(), n * f);
    linear_backward(dh1_.data(), a.xn2.data(), lw.w1, dxn_.data(), lg.w1, n, c, f, false);
    linear_backward(dh3_.data(), a.xn2.data(), lw.w3, dxn_.data(), lg.w3, n, c, f, true);
    rmsnorm_backward(dxn_.data(), a.x_mid.data(), lw.mlp_norm, a.rstd2.data(), dx_.data(),
                     lg.mlp_norm, n, c);
    // Attention: dx_ is now the gradient of x_mid.
    attention_backward(m, lw, lg, strategy_, toks, rope_, batch_, a, dx_.data(), dxn_.data(),
                       attn_scratch_);
    strategy_peak_ = std::max(strategy_peak_, strategy_.last_stats().peak_bytes);
    rmsnorm_backward(dxn_.data(), a.x_in.data(), lw.attn_norm, a.rstd1.data(), dx_.data(),
                     lg.attn_norm, n, c);
  }
  embedding_backward(tokens, dx_.data(), g.embed, n, c);
  return sums;
}

}  // namespace ctxpar::model

// The attention sub-layer on P ranks (projections, RoPE at global positions, the strategy)
// against a single-rank attention made directly from kernel.h calls (one ForwardState, one
// block) over the whole sequence: the P = 1 cross-check. Rule: |diff| <= 1e-5 (fp32 kernel,
// O(1) values, the only difference is the order of the online-softmax merges).
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>

#include "ctxpar/comm.h"
#include "ctxpar/kernel.h"
#include "ctxpar/layout.h"
#include "model/transformer.h"

namespace ctxpar::model {
namespace {

TEST(AttentionLayer, ShardedEqualsSingleRankKernelCalls) {
  ModelConfig m;
  m.dim = 32;
  m.heads = 4;
  m.kv_heads = 2;
  m.head_dim = 16;
  const int64_t t = 48, b = 2, c = m.dim, d = m.head_dim;
  const int64_t qw = m.heads * d, kvw = m.kv_heads * d;
  std::vector<float> w;
  init_params(m, w, 11);
  for (float& x : w) x *= 20.0f;  // sharp attention
  ModelParams p = bind_params(m, w.data());
  const LayerParams& lw = p.layers[0];
  std::vector<float> xn(b * t * c);
  fill_normal(TensorView(xn.data(), DType::f32, {b * t * c}), 5);

  // Single rank, straight from the kernel: q, k, v of the whole sequence at positions 0..T-1.
  std::vector<int64_t> all(t);
  for (int64_t i = 0; i < t; ++i) all[i] = i;
  RopeTable full_rope = rope_table(all, d, m.rope_base);
  std::vector<float> q(b * t * qw), k(b * t * kvw), v(b * t * kvw);
  linear_forward(xn.data(), lw.wq, q.data(), b * t, c, qw);
  linear_forward(xn.data(), lw.wk, k.data(), b * t, c, kvw);
  linear_forward(xn.data(), lw.wv, v.data(), b * t, c, kvw);
  rope_apply(q.data(), full_rope, b, m.heads, d, false);
  rope_apply(k.data(), full_rope, b, m.kv_heads, d, false);
  Tokens toks;
  toks.positions = all;
  ForwardState state(b, t, m.heads, d);
  attention_forward_block(TensorView(q.data(), DType::f32, {b, t, m.heads, d}), toks,
                          TensorView(k.data(), DType::f32, {b, t, m.kv_heads, d}),
                          TensorView(v.data(), DType::f32, {b, t, m.kv_heads, d}), toks,
                          Mask::causal_mask(), state);
  Tensor out(DType::f32, {b, t, m.heads, d}), lse(DType::f32, {b, m.heads, t});
  attention_forward_finalize(state, out, lse);

  for (LayoutKind kind : {LayoutKind::zigzag, LayoutKind::striped}) {
    const int ranks = 3;
    const Layout layout(kind, t, ranks);
    std::mutex mu;
    float worst = 0;
    run_threads(ranks, [&](Communicator& comm) {
      StrategyOptions so;
      so.mask = Mask::causal_mask();
      auto strategy = Strategy::create(comm, so);
      const auto pos = layout.positions(comm.rank());
      const int64_t tl = pos.size();
      RopeTable rope = rope_table(pos, d, m.rope_base);
      BlockActs a;
      a.xn1.resize(b * tl * c);
      for (int64_t bb = 0; bb < b; ++bb)
        for (int64_t i = 0; i < tl; ++i)
          std::copy_n(xn.data() + (bb * t + pos[i]) * c, c, a.xn1.data() + (bb * tl + i) * c);
      a.q.resize(b * tl * qw);
      a.k.resize(b * tl * kvw);
      a.v.resize(b * tl * kvw);
      a.att.resize(b * tl * qw);
      a.lse.resize(b * m.heads * tl);
      std::vector<float> y(b * tl * c);
      Tokens mine;
      mine.positions = pos;
      attention_forward(m, lw, *strategy, mine, rope, b, a, y.data());
      float local = 0;
      for (int64_t bb = 0; bb < b; ++bb)
        for (int64_t i = 0; i < tl; ++i)
          for (int64_t j = 0; j < qw; ++j)
            local = std::max(local, std::fabs(a.att[(bb * tl + i) * qw + j] -
                                              out.ptr<float>()[(bb * t + pos[i]) * qw + j]));
      std::lock_guard<std::mutex> lock(mu);
      worst = std::max(worst, local);
    });
    EXPECT_LE(worst, 1e-5f) << layout_name(kind);
  }
}

}  // namespace
}  // namespace ctxpar::model

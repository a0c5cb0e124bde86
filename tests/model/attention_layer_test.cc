// The attention sub-layer on P ranks (projections, RoPE at global positions, the strategy)
// and a single-rank attention made directly from kernel.h calls (one ForwardState, one block)
// over the whole sequence: the P = 1 cross-check. Both are held to the kernel tests' rule
// against the fp64 reference of the q, k, v they were given:
//   max |out - ref64| <= 2 * max |naive32 - ref64| + 1e-5 * max(1, max |ref64|).
// (A fixed |sharded - single| <= 1e-5 held on AVX-512 but not on AVX2: the attention here is
// sharp, so fp32 rounding of the scores is amplified, and differently per SIMD width.)
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>

#include "ctxpar/comm.h"
#include "ctxpar/kernel.h"
#include "ctxpar/layout.h"
#include "ctxpar/reference.h"
#include "model/transformer.h"

namespace ctxpar::model {
namespace {

struct RuleCheck {
  double err = 0, bound = 0;
};
// The kernel tests' rule for the attention output of q, k, v [B, T, H, D] under `mask`.
RuleCheck check_rule(const std::vector<float>& out, const TensorView& q, const TensorView& k,
                     const TensorView& v, const Tokens& tokens, const Mask& mask) {
  const auto ref = reference::attention_f64(q, tokens, k, v, tokens, mask);
  const auto naive = reference::attention_naive_f32(q, tokens, k, v, tokens, mask);
  double naive_err = 0, ref_max = 0, err = 0;
  for (size_t i = 0; i < ref.o.size(); ++i) {
    naive_err = std::max(naive_err, std::fabs(naive.o[i] - ref.o[i]));
    ref_max = std::max(ref_max, std::fabs(ref.o[i]));
    err = std::max(err, std::fabs(static_cast<double>(out[i]) - ref.o[i]));
  }
  return {err, reference::accuracy_tolerance(naive_err, ref_max)};
}

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
  {
    const std::vector<float> single(out.ptr<float>(), out.ptr<float>() + out.numel());
    const RuleCheck r = check_rule(single, TensorView(q.data(), DType::f32, {b, t, m.heads, d}),
                                   TensorView(k.data(), DType::f32, {b, t, m.kv_heads, d}),
                                   TensorView(v.data(), DType::f32, {b, t, m.kv_heads, d}), toks,
                                   Mask::causal_mask());
    EXPECT_LE(r.err, r.bound) << "single-rank kernel calls";
  }

  for (LayoutKind kind : {LayoutKind::zigzag, LayoutKind::striped}) {
    const int ranks = 3;
    const Layout layout(kind, t, ranks);
    // The ranks' own q, k, v (after their projections and RoPE) and outputs, in global order.
    std::vector<float> gq(b * t * qw), gk(b * t * kvw), gv(b * t * kvw), gatt(b * t * qw);
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
      for (int64_t bb = 0; bb < b; ++bb)  // each rank writes only its own rows
        for (int64_t i = 0; i < tl; ++i) {
          const int64_t g = bb * t + pos[i], l = bb * tl + i;
          std::copy_n(a.q.data() + l * qw, qw, gq.data() + g * qw);
          std::copy_n(a.att.data() + l * qw, qw, gatt.data() + g * qw);
          std::copy_n(a.k.data() + l * kvw, kvw, gk.data() + g * kvw);
          std::copy_n(a.v.data() + l * kvw, kvw, gv.data() + g * kvw);
        }
    });
    const RuleCheck r = check_rule(gatt, TensorView(gq.data(), DType::f32, {b, t, m.heads, d}),
                                   TensorView(gk.data(), DType::f32, {b, t, m.kv_heads, d}),
                                   TensorView(gv.data(), DType::f32, {b, t, m.kv_heads, d}), toks,
                                   Mask::causal_mask());
    EXPECT_LE(r.err, r.bound) << layout_name(kind) << " on " << ranks << " ranks";
  }
}

}  // namespace
}  // namespace ctxpar::model

// Padding tokens (position kPaddingPosition, what a Layout adds to reach its granule): a problem
// with padding rows and keys inserted anywhere must give, on its real tokens, the answer of the
// same problem without them (the fp64 reference of the compacted problem, by the tolerance
// rule), and exactly nothing on the padding: O = 0, LSE = -inf, dQ = 0 on padding queries and
// dK = dV = 0 on padding keys.
#include <gtest/gtest.h>

#include <cmath>

#include "kernel/kernel_support.h"

namespace ctxpar::test {
namespace {

// Inserts a padding token before every `every`-th token and `tail` more at the end: zero rows
// in the tensors, kPaddingPosition in the positions. keep[i] is the real index of padded row i
// (-1 for padding).
struct Padded {
  Inputs in;
  std::vector<int64_t> q_keep, k_keep;
};

std::vector<int64_t> padded_order(int64_t n, int64_t every, int64_t tail) {
  std::vector<int64_t> keep;
  for (int64_t i = 0; i < n; ++i) {
    if (i % every == 0) keep.push_back(-1);
    keep.push_back(i);
  }
  for (int64_t i = 0; i < tail; ++i) keep.push_back(-1);
  return keep;
}

Tensor scatter_rows(const Tensor& real, const std::vector<int64_t>& keep) {
  Shape s = real.shape();
  s[1] = static_cast<int64_t>(keep.size());
  Tensor out(real.dtype(), s);
  for (int64_t b = 0; b < s[0]; ++b)
    for (size_t i = 0; i < keep.size(); ++i)
      if (keep[i] >= 0)
        copy_into(real.view().slice(0, b, b + 1).slice(1, keep[i], keep[i] + 1),
                  out.view().slice(0, b, b + 1).slice(1, int64_t(i), int64_t(i) + 1));
  return out;
}

Padded pad(const Inputs& real, int64_t q_every, int64_t k_every, int64_t tail) {
  Padded p;
  p.q_keep = padded_order(real.q.dim(1), q_every, tail);
  p.k_keep = padded_order(real.k.dim(1), k_every, tail + 3);
  p.in.q = scatter_rows(real.q, p.q_keep);
  p.in.dout = scatter_rows(real.dout, p.q_keep);
  p.in.k = scatter_rows(real.k, p.k_keep);
  p.in.v = scatter_rows(real.v, p.k_keep);
  auto tokens = [](const std::vector<int64_t>& keep, const std::vector<int64_t>& pos,
                   const std::vector<int32_t>& doc, std::vector<int64_t>& pos_out,
                   std::vector<int32_t>& doc_out) {
    for (int64_t i : keep) {
      pos_out.push_back(i < 0 ? kPaddingPosition : pos[i]);
      if (!doc.empty()) doc_out.push_back(i < 0 ? 0 : doc[i]);
    }
  };
  tokens(p.q_keep, real.q_pos, real.q_doc, p.in.q_pos, p.in.q_doc);
  tokens(p.k_keep, real.k_pos, real.k_doc, p.in.k_pos, p.in.k_doc);
  return p;
}

// The padded output's real rows, gathered into the compacted order ([B, T, H, D] with token
// dim `dim`, or [B, H, T] with dim 2).
Tensor gather_real(const Tensor& padded, const std::vector<int64_t>& keep, int dim, int64_t n) {
  Shape s = padded.shape();
  s[dim] = n;
  Tensor out(padded.dtype(), s);
  for (size_t i = 0; i < keep.size(); ++i)
    if (keep[i] >= 0)
      copy_into(padded.view().slice(dim, int64_t(i), int64_t(i) + 1),
                out.view().slice(dim, keep[i], keep[i] + 1));
  return out;
}

// Every padding entry of `t` along `dim` equals `want` (0 or -inf), exactly.
bool padding_is(const Tensor& t, const std::vector<int64_t>& keep, int dim, float want) {
  for (size_t i = 0; i < keep.size(); ++i) {
    if (keep[i] >= 0) continue;
    const Tensor row = Tensor::copy_of(t.view().slice(dim, int64_t(i), int64_t(i) + 1));
    for (int64_t e = 0; e < row.numel(); ++e)
      if (!(row.ptr<float>()[e] == want)) return false;
  }
  return true;
}

TEST(Padding, RealTokensExactPaddingInvisible) {
  Mask window;
  window.window_left = 20, window.window_right = 5;
  Mask docs = Mask::causal_mask();
  docs.documents = true;
  for (const Mask& mask : {Mask::none(), Mask::causal_mask(), window, docs})
    for (int64_t every : {3, 64}) {
      Case c;
      c.tq = 90, c.tk = 130, c.hq = 4, c.hkv = 2, c.d = 32, c.mask = mask, c.q_offset = 40;
      c.doc_len = 37;
      const Inputs real = make_inputs(c);
      const Padded p = pad(real, every, every + 1, 70);  // 70: a whole padding tile at the end
      const auto ref = reference::attention_f64(real.q, real.q_tokens(), real.k, real.v,
                                                real.k_tokens(), mask, real.dout);
      const auto naive = reference::attention_naive_f32(real.q, real.q_tokens(), real.k, real.v,
                                                        real.k_tokens(), mask, real.dout);
      const Outputs fast = run_fast(p.in, mask, 1);
      const std::string what = c.name() + " padding every " + std::to_string(every);
      auto check = [&](const char* name, const Tensor& t, const std::vector<double>& n,
                       const std::vector<double>& r) {
        EXPECT_LE(max_err(t, r), reference::accuracy_tolerance(max_err(n, r), max_abs(r)))
            << name << ": " << what;
      };
      check("o", gather_real(fast.o, p.q_keep, 1, c.tq), naive.o, ref.o);
      check("lse", gather_real(fast.lse, p.q_keep, 2, c.tq), naive.lse, ref.lse);
      check("dq", gather_real(fast.dq, p.q_keep, 1, c.tq), naive.dq, ref.dq);
      check("dk", gather_real(fast.dk, p.k_keep, 1, c.tk), naive.dk, ref.dk);
      check("dv", gather_real(fast.dv, p.k_keep, 1, c.tk), naive.dv, ref.dv);
      EXPECT_TRUE(padding_is(fast.o, p.q_keep, 1, 0.0f)) << what;
      EXPECT_TRUE(padding_is(fast.lse, p.q_keep, 2, -INFINITY)) << what;
      EXPECT_TRUE(padding_is(fast.dq, p.q_keep, 1, 0.0f)) << what;
      EXPECT_TRUE(padding_is(fast.dk, p.k_keep, 1, 0.0f)) << what;
      EXPECT_TRUE(padding_is(fast.dv, p.k_keep, 1, 0.0f)) << what;
      // A tile of padding alone is skipped, not computed.
      EXPECT_GT(fast.fwd.tiles_skipped, 0) << what;
    }
}

// The fp64 reference itself follows mask.h's padding rule under every mask (it missed it under
// a mask without rules: a padding key was visible, caught by tests/fused): on the real rows the
// padded problem's reference is the real problem's, exactly (a padding key adds exp(-inf) = 0).
TEST(Padding, ReferenceLeavesPaddingOut) {
  for (const Mask& mask : {Mask::none(), Mask::causal_mask()}) {
    Case c;
    c.tq = 20, c.tk = 30, c.hq = 2, c.hkv = 2, c.d = 16, c.mask = mask;
    const Inputs real = make_inputs(c);
    const Padded p = pad(real, 4, 5, 3);
    const auto ref =
        reference::attention_f64(real.q, real.q_tokens(), real.k, real.v, real.k_tokens(), mask);
    const auto padded =
        reference::attention_f64(p.in.q, p.in.q_tokens(), p.in.k, p.in.v, p.in.k_tokens(), mask);
    const int64_t hd = c.hq * c.d;
    for (size_t i = 0; i < p.q_keep.size(); ++i) {
      const int64_t r = p.q_keep[i];
      for (int64_t e = 0; e < hd; ++e) {
        const double got = padded.o[i * hd + e];
        ASSERT_EQ(got, r < 0 ? 0.0 : ref.o[r * hd + e]) << mask.describe() << " row " << i;
      }
    }
  }
}

}  // namespace
}  // namespace ctxpar::test

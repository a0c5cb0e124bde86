// attention_forward, the whole forward in one call (Note [The whole forward in one call] in
// simd_forward.cc): its O and LSE are the bits of attention_forward_block on a fresh
// ForwardState then attention_forward_finalize, for every product path this CPU takes (the
// automatic choice: AMX tiles, vdpbf16ps or fp32; and fp32 forced), both bf16 tiers, fp32 and
// bf16 O, masks that leave rows with nothing visible, ragged and grouped shapes, 1 and 2
// threads; and they pass the project's accuracy rule against the fp64 reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "ctxpar/kernel.h"
#include "kernel_support.h"
#include "same_bits.h"

namespace ctxpar::test {
namespace {

struct Whole {
  Tensor o, lse;
};

// Block on a fresh state, then finalize: the definition.
Whole by_state(const Inputs& in, const Mask& mask, DType out_dtype, const KernelConfig& cfg) {
  const int64_t b = in.q.dim(0), tq = in.q.dim(1), hq = in.q.dim(2), d = in.q.dim(3);
  ForwardState state(b, tq, hq, d);
  attention_forward_block(in.q, in.q_tokens(), in.k, in.v, in.k_tokens(), mask, state, cfg);
  Whole w{Tensor(out_dtype, {b, tq, hq, d}), Tensor(DType::f32, {b, hq, tq})};
  attention_forward_finalize(state, w.o, w.lse, cfg);
  return w;
}

Whole in_one_call(const Inputs& in, const Mask& mask, DType out_dtype, const KernelConfig& cfg) {
  const int64_t b = in.q.dim(0), tq = in.q.dim(1), hq = in.q.dim(2), d = in.q.dim(3);
  // Garbage first: every element must be written.
  Whole w{Tensor(out_dtype, {b, tq, hq, d}), Tensor(DType::f32, {b, hq, tq})};
  std::memset(w.o.view().ptr<char>(), 0x7f, w.o.bytes());
  std::memset(w.lse.view().ptr<char>(), 0x7f, w.lse.bytes());
  attention_forward(in.q, in.q_tokens(), in.k, in.v, in.k_tokens(), mask, w.o, w.lse, cfg);
  return w;
}

Mask window_mask() {
  Mask m;
  m.window_left = 40, m.window_right = 7;
  return m;
}

TEST(ForwardWhole, TheBitsOfBlockThenFinalize) {
  int checked = 0;
  for (const DType dtype : {DType::f32, DType::bf16})
    for (const Bf16Tier tier : {Bf16Tier::exact, Bf16Tier::fast})
      for (const Bf16Products products : {Bf16Products::automatic, Bf16Products::fp32})
        for (int shape = 0; shape < 4; ++shape) {
          if (dtype == DType::f32 && (tier == Bf16Tier::fast || products == Bf16Products::fp32))
            continue;  // the tier and the products change nothing with fp32 inputs
          Case c;
          c.dtype = dtype, c.products = products;
          c.threads = 1 + shape % 2;
          c.seed = 7 + shape;
          if (shape == 0) c.tq = 7, c.tk = 7, c.d = 16, c.mask = Mask::causal_mask();
          // Ragged tiles, grouped heads, a batch; keys after the queries: the first rows of a
          // causal mask see nothing (O = 0, LSE = -inf).
          if (shape == 1)
            c.batch = 2, c.tq = 130, c.tk = 200, c.hq = 4, c.hkv = 2, c.d = 72,
            c.mask = Mask::causal_mask(), c.k_offset = 20;
          if (shape == 2) c.tq = 300, c.tk = 513, c.hq = 2, c.d = 128, c.mask = window_mask();
          if (shape == 3) c.tq = 192, c.tk = 640, c.d = 128, c.doc_len = 100;
          const Inputs in = make_inputs(c);
          KernelConfig cfg;
          cfg.threads = c.threads, cfg.bf16_tier = tier, cfg.bf16_products = products;
          for (const DType out_dtype : {DType::f32, dtype}) {
            SCOPED_TRACE(c.name() + " tier " + bf16_tier_name(tier) + " out " +
                         dtype_name(out_dtype));
            const Whole want = by_state(in, c.mask, out_dtype, cfg);
            const Whole got = in_one_call(in, c.mask, out_dtype, cfg);
            EXPECT_TRUE(test::same_bits(got.o, want.o));
            EXPECT_TRUE(test::same_bits(got.lse, want.lse));
            ++checked;
          }
        }
  EXPECT_EQ(checked, 40);
}

// The same rule the block path meets, against fp64 (kernel_support.h), O and LSE.
TEST(ForwardWhole, PassesTheAccuracyRule) {
  for (const DType dtype : {DType::f32, DType::bf16}) {
    Case c;
    c.dtype = dtype, c.tq = 257, c.tk = 400, c.hq = 4, c.hkv = 1, c.d = 64;
    c.mask = Mask::causal_mask(), c.k_offset = 3;
    SCOPED_TRACE(c.name());
    const Inputs in = make_inputs(c);
    const Whole w = in_one_call(in, c.mask, DType::f32, {});
    Outputs out;
    out.o = w.o, out.lse = w.lse;
    EXPECT_EQ(rule_violations(out, references_of(in, c.mask, false), false), "");
  }
}

// Nothing to compute: no keys writes O = 0 and LSE = -inf; bad outputs are refused naming them.
TEST(ForwardWhole, NoKeysAndBadOutputs) {
  Case c;
  c.tq = 5, c.tk = 0;
  const Inputs in = make_inputs(c);
  const Whole w = in_one_call(in, Mask::none(), DType::f32, {});
  for (int64_t i = 0; i < w.o.numel(); ++i) EXPECT_EQ(w.o.view().ptr<float>()[i], 0.0f);
  for (int64_t i = 0; i < w.lse.numel(); ++i)
    EXPECT_EQ(w.lse.view().ptr<float>()[i], -INFINITY) << i;
  Case ok;
  const Inputs good = make_inputs(ok);
  Tensor lse(DType::f32, {1, 2, 7}), small(DType::f32, {1, 6, 2, 16}), bad_lse(DType::f32, {1, 7});
  auto refused = [&](const TensorView& o, const TensorView& l) {
    try {
      attention_forward(good.q, good.q_tokens(), good.k, good.v, good.k_tokens(), Mask::none(), o,
                        l);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(refused(small, lse).find("out: expected q's shape [B, Tq, Hq, D] = [1, 7, 2, 16]"),
            std::string::npos)
      << refused(small, lse);
  EXPECT_NE(refused(Tensor(DType::f32, {1, 7, 2, 16}), bad_lse).find("lse"), std::string::npos)
      << refused(Tensor(DType::f32, {1, 7, 2, 16}), bad_lse);
  // Outputs in the inputs' memory (the tasks write O while others still read q) are refused,
  // naming both; apart, the same call runs.
  const std::string in_q = refused(good.q, lse);
  EXPECT_NE(in_q.find("out: its memory overlaps q's"), std::string::npos) << in_q;
  const TensorView k_as_lse(good.k.view().data(), DType::f32, {1, 2, 7}, {14, 7, 1});
  Tensor o(DType::f32, {1, 7, 2, 16});
  const std::string lse_in_k = refused(o, k_as_lse);
  EXPECT_NE(lse_in_k.find("lse: its memory overlaps k's"), std::string::npos) << lse_in_k;
  EXPECT_EQ(refused(o, lse), "");
}

}  // namespace
}  // namespace ctxpar::test

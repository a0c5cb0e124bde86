// The opt-in fast bf16 tier (KernelConfig::bf16_tier = fast: P and dS rounded to bf16
// before the P V, dV, dQ and dK products, as GPU flash attention does) against fp64, by its own
// rule (docs/kernel.md, "bf16 tiers"):
//   max |fast - ref64| <= 2 max |naive32 - ref64| + kFastTierFloor * max(1, max |ref64|),
//   kFastTierFloor = 2^-7: twice bf16's unit roundoff 2^-8, as the fp32 rule doubles its error
// and the exact tier (the default) strictly more accurate than it on the same data.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "kernel/amx_forced.h"  // AmxForced, DotForced
#include "kernel/kernel_support.h"
#include "kernel/problem.h"

namespace ctxpar::test {
namespace {

constexpr double kFastTierFloor = 2 * 0x1.0p-8;

struct Named {
  const char* what;
  const Tensor& exact;
  const Tensor& fast;
  const std::vector<double>& naive;
  const std::vector<double>& ref;
};

// Each case's fast and exact tiers against fp64 by the rules above, `threads` OpenMP threads,
// the bf16 products `products` asks for.
void check_tiers(const std::vector<Case>& cases, int threads,
                 Bf16Products products = Bf16Products::automatic) {
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name());
    const Inputs in = make_inputs(k);
    const References refs = references_of(in, k.mask, true);
    KernelConfig config;
    config.bf16_products = products;
    config.bf16_tier = Bf16Tier::exact;
    const Outputs exact = run_fast(in, k.mask, threads, true, 1, {}, config);
    config.bf16_tier = Bf16Tier::fast;
    const Outputs fast = run_fast(in, k.mask, threads, true, 1, {}, config);
    const Named outs[] = {{"o", exact.o, fast.o, refs.naive32.o, refs.ref64.o},
                          {"dq", exact.dq, fast.dq, refs.naive32.dq, refs.ref64.dq},
                          {"dk", exact.dk, fast.dk, refs.naive32.dk, refs.ref64.dk},
                          {"dv", exact.dv, fast.dv, refs.naive32.dv, refs.ref64.dv}};
    for (const Named& n : outs) {
      const double naive = max_err(n.naive, n.ref), ref_max = max_abs(n.ref);
      const double e_exact = max_err(n.exact, n.ref), e_fast = max_err(n.fast, n.ref);
      const double tol = reference::accuracy_tolerance(naive, ref_max, kFastTierFloor);
      std::printf("%s: exact %.3g fast %.3g (fast / (2^-8 max(1,|ref|)) = %.3f)\n", n.what, e_exact,
                  e_fast, e_fast / (0x1.0p-8 * std::max(1.0, ref_max)));
      EXPECT_LE(e_fast, tol) << n.what;
      EXPECT_LT(e_exact, e_fast) << n.what << ": the exact tier must be the more accurate";
      EXPECT_LE(e_exact, reference::accuracy_tolerance(naive, ref_max)) << n.what;
    }
    // The LSE does not see the rounding (l sums the fp32 P): both tiers give the same bits.
    EXPECT_EQ(max_err(exact.lse, std::vector<double>(exact.lse.ptr<float>(),
                                                     exact.lse.ptr<float>() + exact.lse.numel())),
              max_err(fast.lse, std::vector<double>(exact.lse.ptr<float>(),
                                                    exact.lse.ptr<float>() + exact.lse.numel())));
  }
}

TEST(Bf16Tier, FastTierWithinItsRuleAndExactTierMoreAccurate) {
  if (kernel::use_scalar_path()) GTEST_SKIP() << "the scalar path has one tier (exact)";
  std::vector<Case> cases;
  Case c;
  c.dtype = DType::bf16, c.tq = c.tk = 200, c.hq = 4, c.hkv = 2, c.d = 80;
  c.mask = Mask::causal_mask();
  cases.push_back(c);
  c.tq = 67, c.tk = 130, c.hq = c.hkv = 1, c.d = 37, c.mask = Mask{}, c.seed = 3;  // odd D, ragged
  cases.push_back(c);
  c.tq = c.tk = 256, c.hq = 8, c.hkv = 2, c.d = 128, c.mask = Mask::causal_mask(), c.seed = 5;
  c.qk_scale = 2;  // sharper softmax rows
  cases.push_back(c);
  check_tiers(cases, 1);
}

// Cases for the pair products of P V, dV, dK and dQ: D not a multiple of 16 or 32 (padding
// columns), ragged lengths (padding rows and key columns), window and document masks, GQA.
std::vector<Case> pair_product_cases() {
  Mask window, docs;
  window.window_left = 40, window.window_right = 7;
  docs.causal = docs.documents = true;
  std::vector<Case> cases;
  int n = 0;
  for (const int64_t d : {37, 80, 96, 128})
    for (const Mask& m : {Mask::causal_mask(), window, docs}) {
      Case c;
      c.dtype = DType::bf16, c.tq = 150 - 7 * (n % 3), c.tk = 150, c.hq = 4, c.hkv = 2, c.d = d;
      c.mask = m, c.doc_len = 45, c.seed = 21 + n++;
      cases.push_back(c);
    }
  return cases;
}

// Both tiers' P V, dV, dK and dQ through AMX tiles (Note [P V, dV, dK, dQ through AMX] in
// amx_bf16.cc: P and dS split in 3 bf16 parts for the exact tier, rounded for the fast one),
// forced, 2 threads. Skips, saying why, where AMX-BF16 is not usable (the ctest entry
// kernel_bf16_amx says the same).
TEST_F(AmxForced, BothTiersThroughAmxWithinTheirRules) {
  if (kernel::use_scalar_path()) GTEST_SKIP() << "the scalar path has one tier (exact)";
  check_tiers(pair_product_cases(), 2, kProducts);
}

// Note [Key steps] (simd_forward.cc): the AMX forward takes several key tiles an online-softmax
// step. Steps of 1 (the one-tile path), 2, 3, 4 and 8 tiles, both tiers, against fp64 by each
// tier's rule (the exact tier by the fp32 one), on the pair-product cases (steps holding key
// tiles that a query tile of the task skips or sees partially: window, causal documents, ragged
// ends), a long sliding window whose tasks skip the early tiles of later steps, and a slice mask
// with a skipped query tile between two computed ones.
TEST_F(AmxForced, KeyStepsWithinTheTiersRules) {
  if (kernel::use_scalar_path()) GTEST_SKIP() << "the scalar path has one tier (exact)";
  std::vector<Case> cases = pair_product_cases();
  Case c;
  c.dtype = DType::bf16, c.tq = c.tk = 700, c.hq = 2, c.hkv = 1, c.d = 64, c.seed = 40;
  c.mask.window_left = 150, c.mask.window_right = 20;
  cases.push_back(c);
  // A gap in a task (Note [Gaps in a task]): key tile 3 shown to query tiles 0 and 2, not 1.
  Case gap = c;
  gap.tq = gap.tk = 256, gap.seed = 41, gap.mask = Mask{};
  gap.mask.set_slices({{0, 256, 0, 192, 0}, {0, 64, 192, 256, 0}, {128, 192, 192, 256, 0}});
  cases.push_back(gap);
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name());
    const Inputs in = make_inputs(k);
    const References refs = references_of(in, k.mask, false);
    const double naive = max_err(refs.naive32.o, refs.ref64.o), ref_max = max_abs(refs.ref64.o);
    for (const Bf16Tier tier : {Bf16Tier::exact, Bf16Tier::fast}) {
      KernelConfig config;
      config.bf16_products = kProducts, config.bf16_tier = tier, config.threads = 2;
      kernel::Problem p = kernel::check_forward_args(in.q, in.q_tokens(), in.k, in.v, in.k_tokens(),
                                                     k.mask, config);
      p.bf16_scores = p.amx = true, p.round_p = tier == Bf16Tier::fast;
      const double tol = tier == Bf16Tier::fast
                             ? reference::accuracy_tolerance(naive, ref_max, kFastTierFloor)
                             : reference::accuracy_tolerance(naive, ref_max);
      for (const int64_t step : {1, 2, 3, 4, 8}) {
        ForwardState state(in.q.dim(0), in.q.dim(1), in.q.dim(2), in.q.dim(3));
        kernel::forward_simd_steps(p, in.q, in.q_tokens(), in.k, in.v, in.k_tokens(), k.mask,
                                   state.view(), step);
        Tensor o(DType::f32, in.q.shape()),
            lse(DType::f32, {in.q.dim(0), in.q.dim(2), in.q.dim(1)});
        attention_forward_finalize(state, o, lse, config);
        EXPECT_LE(max_err(o, refs.ref64.o), tol)
            << (tier == Bf16Tier::fast ? "fast" : "exact") << " tier, " << step << " tiles a step";
        EXPECT_LE(max_err(lse, refs.ref64.lse),
                  reference::accuracy_tolerance(max_err(refs.naive32.lse, refs.ref64.lse),
                                                max_abs(refs.ref64.lse)))
            << step << " tiles a step";
      }
    }
  }
  // A step of no tiles is refused before anything is written (the state stays "nothing seen").
  const Inputs in = make_inputs(cases.front());
  kernel::Problem p = kernel::check_forward_args(in.q, in.q_tokens(), in.k, in.v, in.k_tokens(),
                                                 cases.front().mask, KernelConfig{});
  ForwardState state(in.q.dim(0), in.q.dim(1), in.q.dim(2), in.q.dim(3));
  try {
    kernel::forward_simd_steps(p, in.q, in.q_tokens(), in.k, in.v, in.k_tokens(),
                               cases.front().mask, state.view(), 0);
    ADD_FAILURE() << "a step of 0 tiles was not refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("step_tiles: expected at least 1"), std::string::npos)
        << e.what();
  }
  const float* m = state.m().ptr<float>();
  for (int64_t i = 0; i < state.m().numel(); ++i) ASSERT_EQ(m[i], kernel::kNegInf) << i;
}

// The fast tier's P V, dV, dK and dQ through vdpbf16ps (Note [The fast tier through vdpbf16ps]
// in simd_bf16.cc), the exact tier's fp32 ones beside it, vdpbf16ps forced, 2 threads. Skips,
// saying why, on a CPU without AVX512_BF16.
TEST_F(DotForced, FastTierThroughVdpbf16psWithinItsRule) {
  if (kernel::use_scalar_path()) GTEST_SKIP() << "the scalar path has one tier (exact)";
  check_tiers(pair_product_cases(), 2, kProducts);
}

}  // namespace
}  // namespace ctxpar::test

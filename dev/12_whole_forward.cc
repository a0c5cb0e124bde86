// Lab 12: what the forward state costs a forward of one block (issue 40; src/kernel/
// simd_forward.cc, Note [The whole forward in one call]). A forward of q against the one K/V
// block it sees was reset + attention_forward_block + attention_forward_finalize: the state's
// fp32 acc (as big as an fp32 O) written by reset, read and written by every task, read again by
// the finalize. attention_forward writes O and LSE from the tasks instead. Both, alternating
// within each repetition, for fp32 and both bf16 tiers (the products this CPU's automatic choice
// takes), plain and causal, [1, T, H, D], one thread, GFLOP/s by CPU time, medians; and whether
// O and LSE have the same bits (exit 1 if not).
//   ./build/dev/lab_12_whole_forward [T] [H] [D] [repeats]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ctxpar/kernel.h"
#include "lab_common.h"

int main(int argc, char** argv) {
  using namespace ctxpar;
  lab::ForwardShapeArgs args;
  args.repeats = 5;
  if (!lab::forward_shape_args(argc, argv, "lab_12_whole_forward", 1, args)) return 2;
  const int64_t t = args.t, h = args.h, d = args.d;
  const int repeats = args.repeats;
  std::vector<int64_t> pos(t);
  for (int64_t i = 0; i < t; ++i) pos[i] = i;
  const Tokens tokens{pos, {}};
  int failed = 0;
  for (const DType dtype : {DType::f32, DType::bf16})
    for (const Bf16Tier tier : {Bf16Tier::exact, Bf16Tier::fast}) {
      if (dtype == DType::f32 && tier == Bf16Tier::fast) continue;
      Tensor q(dtype, {1, t, h, d}), k(dtype, {1, t, h, d}), v(dtype, {1, t, h, d});
      fill_normal(q, 1), fill_normal(k, 2), fill_normal(v, 3);
      Tensor o1(dtype, {1, t, h, d}), o2(dtype, {1, t, h, d});
      Tensor lse1(DType::f32, {1, h, t}), lse2(DType::f32, {1, h, t});
      ForwardState state(1, t, h, d);
      KernelConfig cfg;
      cfg.bf16_tier = tier;
      for (const bool causal : {false, true}) {
        const Mask mask = causal ? Mask::causal_mask() : Mask{};
        const double flops = 4.0 * h * t * t * d / (causal ? 2 : 1);
        std::vector<double> by_state, whole;
        // One untimed call of each first: the kernel's per-thread buffers touched.
        for (int r = -1; r < repeats; ++r) {
          double c0 = lab::cpu_seconds();
          state.reset();
          attention_forward_block(q, tokens, k, v, tokens, mask, state, cfg);
          attention_forward_finalize(state, o1, lse1, cfg);
          const double s1 = lab::cpu_seconds() - c0;
          c0 = lab::cpu_seconds();
          attention_forward(q, tokens, k, v, tokens, mask, o2, lse2, cfg);
          const double s2 = lab::cpu_seconds() - c0;
          if (r >= 0) by_state.push_back(flops / s1 / 1e9), whole.push_back(flops / s2 / 1e9);
        }
        std::sort(by_state.begin(), by_state.end()), std::sort(whole.begin(), whole.end());
        const bool same =
            std::memcmp(o1.view().ptr<char>(), o2.view().ptr<char>(), o1.bytes()) == 0 &&
            std::memcmp(lse1.view().ptr<char>(), lse2.view().ptr<char>(), lse1.bytes()) == 0;
        failed |= !same;
        const double a = by_state[repeats / 2], b = whole[repeats / 2];
        std::printf(
            "%-4s %-5s %-6s state + finalize %7.1f  whole %7.1f GFLOP/s (CPU, median of "
            "%d)  whole / state %.3f  bits %s\n",
            dtype_name(dtype), dtype == DType::f32 ? "" : bf16_tier_name(tier),
            causal ? "causal" : "plain", a, b, repeats, b / a, same ? "same" : "DIFFER");
      }
    }
  return failed;
}

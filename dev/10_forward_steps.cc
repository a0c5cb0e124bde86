// Lab 10: how many key tiles should one online-softmax step of the bf16 forward take on the AMX
// path (issue 40; src/kernel/simd_forward.cc, Note [Key steps])? One tile a step runs O += P V
// as a 32-pair tile product, so each 32 x 32 block of O is loaded into AMX tiles and stored back
// for 2 steps of 16 pairs; a step of s tiles keeps it there for 2 s steps and makes one max and
// one rescale a row per s tiles. The library's own forward (kernel::forward_simd_steps) with
// s = 1 (the old path, kept as the reference), 2, 4, 8, 16, both bf16 tiers, plain and causal,
// bf16 inputs [1, T, H, D], one thread, GFLOP/s by CPU time: the runs alternate over s within
// each repetition and the median of the repetitions is printed (a machine shared with other
// builds drifts). max|o - ref64|: the first 64 query rows (all heads) against the fp64
// reference, non-causal; every step size must stay within 2x the one-tile path's error + 1e-5
// (exit 1 otherwise).
//   ./build/dev/lab_10_forward_steps [T] [H] [D] [repeats]
// Exits 0 with a note where AMX-BF16 is not usable.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ctxpar/kernel.h"
#include "ctxpar/reference.h"
#include "kernel/amx_probe.h"
#include "kernel/problem.h"
#include "lab_common.h"

namespace {

using namespace ctxpar;

constexpr int64_t kSteps[] = {1, 2, 4, 8, 16};
constexpr int kNumSteps = sizeof(kSteps) / sizeof(kSteps[0]);

}  // namespace

int main(int argc, char** argv) {
  lab::ForwardShapeArgs args;
  args.repeats = 3;
  if (!lab::forward_shape_args(argc, argv, "lab_10_forward_steps", 64, args)) return 2;
  const int64_t t = args.t, h = args.h, d = args.d;
  const int repeats = args.repeats;
  if (!lab::amx_usable_or_say_why()) return 0;
  Tensor q(DType::bf16, {1, t, h, d}), k(DType::bf16, {1, t, h, d}), v(DType::bf16, {1, t, h, d});
  fill_normal(q, 1), fill_normal(k, 2), fill_normal(v, 3);
  std::vector<int64_t> pos(t);
  for (int64_t i = 0; i < t; ++i) pos[i] = i;
  const Tokens tokens{pos, {}};
  const int64_t rows = 64;
  const std::vector<int64_t> qpos(pos.begin(), pos.begin() + rows);
  const auto ref =
      reference::attention_f64(q.view().slice(1, 0, rows), {qpos, {}}, k, v, tokens, Mask{});
  ForwardState state(1, t, h, d);
  Tensor out(DType::f32, {1, t, h, d}), lse(DType::f32, {1, h, t});
  int failed = 0;
  for (const Bf16Tier tier : {Bf16Tier::exact, Bf16Tier::fast}) {
    KernelConfig cfg;
    cfg.bf16_tier = tier;
    kernel::Problem p = kernel::check_forward_args(q, tokens, k, v, tokens, Mask{}, cfg);
    p.bf16_scores = true, p.amx = true, p.round_p = tier == Bf16Tier::fast;
    for (const bool causal : {false, true}) {
      const Mask mask = causal ? Mask::causal_mask() : Mask{};
      const double flops = 4.0 * h * t * t * d / (causal ? 2 : 1);
      std::vector<std::vector<double>> gflops(kNumSteps);
      double err[kNumSteps] = {};
      for (int r = 0; r < repeats; ++r)
        for (int i = 0; i < kNumSteps; ++i) {
          state.reset();
          const double c0 = lab::cpu_seconds();
          kernel::forward_simd_steps(p, q, tokens, k, v, tokens, mask, state.view(), kSteps[i]);
          gflops[i].push_back(flops / (lab::cpu_seconds() - c0) / 1e9);
          if (r > 0 || causal) continue;
          attention_forward_finalize(state, out, lse, cfg);
          const float* o = out.view().ptr<float>();
          for (size_t x = 0; x < ref.o.size(); ++x)
            err[i] = std::max(err[i], std::fabs(ref.o[x] - o[x]));
        }
      for (int i = 0; i < kNumSteps; ++i) {
        std::sort(gflops[i].begin(), gflops[i].end());
        std::printf("%-5s %-6s step %2lld tiles: %7.1f GFLOP/s (CPU, median of %d)",
                    tier == Bf16Tier::fast ? "fast" : "exact", causal ? "causal" : "plain",
                    static_cast<long long>(kSteps[i]), gflops[i][gflops[i].size() / 2], repeats);
        if (!causal) {
          std::printf("  max|o - ref64| = %.2e", err[i]);
          if (err[i] > 2 * err[0] + 1e-5)
            failed = 1, std::printf("  (above 2x the one-tile step's)");
        }
        std::printf("\n");
      }
    }
  }
  return failed;
}

// `ctxpar bench kernel`: the single-rank kernel's forward and backward throughput against this
// machine's FMA peak for the same thread count, measured in the same run (the machines here
// are shared and noisy, so the ratios are what we quote; each figure is the best of --repeats).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <vector>

#include <nlohmann/json.hpp>

#include "ctxpar/kernel.h"
#include "kernel/peak.h"
#include "options.h"

namespace ctxpar::cli {

namespace {

double best_seconds(int repeats, const std::function<void()>& run) {
  double best = 1e300;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int bench_kernel(int argc, char** argv) {
  Options o("bench kernel",
            "Forward and backward throughput of the single-rank attention kernel on random\n"
            "inputs, against the FMA peak of this machine for the same thread count, measured\n"
            "in the same run. FLOPs: forward 4*B*Hq*T*T*D (halved for causal), backward 2.5x.");
  o.add("seq", "4096", "sequence length T (Tq = Tk)")
      .add("heads", "8", "query heads Hq")
      .add("kv-heads", "0", "key/value heads Hkv (0 = --heads)")
      .add("head-dim", "128", "head dimension D, 16..256")
      .add("batch", "1", "batch size B")
      .add("dtype", "fp32", "storage type of q, k, v, o, do: fp32 | bf16")
      .add("threads", "1", "OpenMP threads")
      .add("repeats", "3", "timed repetitions of each measurement; the fastest counts")
      .flag("no-backward", "skip the backward measurements")
      .flag("json", "print one JSON object instead of text");
  o.example("ctxpar bench kernel --seq 4096 --heads 8 --head-dim 128 --threads 1 --json");
  if (!o.parse(argc, argv)) return 0;
  const int64_t t = o.i64("seq"), hq = o.i64("heads"), d = o.i64("head-dim"), b = o.i64("batch");
  const int64_t hkv = o.i64("kv-heads") > 0 ? o.i64("kv-heads") : hq;
  const int threads = static_cast<int>(o.i64("threads"));
  const int repeats = static_cast<int>(std::max<int64_t>(1, o.i64("repeats")));
  const DType dtype = parse_dtype(o.str("dtype"));
  CTXPAR_CHECK(t >= 1 && hq >= 1 && b >= 1 && threads >= 1, "bench kernel: --seq, --heads, --batch "
               "and --threads must be >= 1");
  const bool backward = !o.on("no-backward");

  const double peak = kernel::measure_fma_peak_gflops(threads);

  Tensor q(dtype, {b, t, hq, d}), k(dtype, {b, t, hkv, d}), v(dtype, {b, t, hkv, d});
  Tensor dout(dtype, {b, t, hq, d});
  fill_normal(q, 1), fill_normal(k, 2), fill_normal(v, 3), fill_normal(dout, 4);
  std::vector<int64_t> pos(t);
  for (int64_t i = 0; i < t; ++i) pos[i] = i;
  const Tokens tokens{pos, {}};
  KernelConfig cfg;
  cfg.threads = threads;
  ForwardState state(b, t, hq, d);
  Tensor out(dtype, {b, t, hq, d}), lse(DType::f32, {b, hq, t}), delta(DType::f32, {b, hq, t});
  Tensor dq(DType::f32, {b, t, hq, d}), dk(DType::f32, {b, t, hkv, d}), dv(DType::f32, {b, t, hkv, d});

  const double full = attention_flops(b, hq, t, t, d);
  auto forward = [&](const Mask& mask) {
    state.reset();
    attention_forward_block(q, tokens, k, v, tokens, mask, state, cfg);
    attention_forward_finalize(state, out, lse, cfg);
  };
  auto run_backward = [&](const Mask& mask) {
    dq.fill_zero(), dk.fill_zero(), dv.fill_zero();
    attention_backward_delta(out, dout, delta, cfg);
    attention_backward_block(q, tokens, k, v, tokens, mask, dout, lse, delta, dq, dk, dv, cfg);
  };
  const Mask none, causal = Mask::causal_mask();
  const double fwd_s = best_seconds(repeats, [&] { forward(none); });
  double bwd_s = 0;
  if (backward) bwd_s = best_seconds(repeats, [&] { run_backward(none); });
  const double cfwd_s = best_seconds(repeats, [&] { forward(causal); });
  double cbwd_s = 0;
  if (backward) cbwd_s = best_seconds(repeats, [&] { run_backward(causal); });

  nlohmann::json j;
  j["seq"] = t, j["heads"] = hq, j["kv_heads"] = hkv, j["head_dim"] = d, j["batch"] = b;
  j["dtype"] = dtype_name(dtype), j["threads"] = threads, j["repeats"] = repeats;
  j["simd_target"] = kernel::simd_target_name(), j["simd_lanes"] = kernel::simd_lanes();
  j["peak_gflops"] = peak;
  j["fwd_seconds"] = fwd_s;
  j["fwd_gflops"] = full / fwd_s / 1e9;
  j["fwd_peak_ratio"] = full / fwd_s / 1e9 / peak;
  j["causal_fwd_seconds"] = cfwd_s;
  j["causal_fwd_gflops"] = full / 2 / cfwd_s / 1e9;
  j["causal_fwd_vs_fwd"] = (full / 2 / cfwd_s) / (full / fwd_s);
  if (backward) {
    j["bwd_seconds"] = bwd_s;
    j["bwd_gflops"] = 2.5 * full / bwd_s / 1e9;
    j["bwd_peak_ratio"] = 2.5 * full / bwd_s / 1e9 / peak;
    j["causal_bwd_gflops"] = 2.5 * full / 2 / cbwd_s / 1e9;
  }
  if (o.on("json")) {
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("kernel T=%lld Hq=%lld Hkv=%lld D=%lld B=%lld %s, %d thread(s), SIMD %s x%d\n",
              (long long)t, (long long)hq, (long long)hkv, (long long)d, (long long)b,
              dtype_name(dtype), threads, kernel::simd_target_name(), kernel::simd_lanes());
  std::printf("  FMA peak          %8.1f GFLOP/s\n", peak);
  std::printf("  forward           %8.1f GFLOP/s  %5.1f%% of peak  (%.3f s)\n", full / fwd_s / 1e9,
              100 * full / fwd_s / 1e9 / peak, fwd_s);
  std::printf("  forward causal    %8.1f GFLOP/s  %5.2fx non-causal (unmasked FLOPs only)\n",
              full / 2 / cfwd_s / 1e9, (full / 2 / cfwd_s) / (full / fwd_s));
  if (backward) {
    std::printf("  backward          %8.1f GFLOP/s  %5.1f%% of peak  (%.3f s)\n",
                2.5 * full / bwd_s / 1e9, 100 * 2.5 * full / bwd_s / 1e9 / peak, bwd_s);
    std::printf("  backward causal   %8.1f GFLOP/s\n", 2.5 * full / 2 / cbwd_s / 1e9);
  }
  return 0;
}

}  // namespace ctxpar::cli

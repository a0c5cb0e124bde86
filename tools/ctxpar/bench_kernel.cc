// `ctxpar bench kernel`: the single-rank kernel's forward and backward throughput against this
// machine's FMA peak for the same thread count, measured in the same run. The machines here
// are shared and noisy, so: each repeat measures the peak and every kernel figure again, the
// best of each over the repeats counts, and every figure is also given by CPU time (process
// CPU seconds / threads), which time stolen by other processes does not inflate. Before
// timing, --warmup untimed forward and backward calls (default 1) touch what the kernel keeps
// between calls (its per-thread packed K / V and scratch, Note [Buffers on cache lines]), as
// every training step after the first finds them, and as bench/torch_sdpa.py warms torch up.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <vector>

#include <nlohmann/json.hpp>

#include "ctxpar/kernel.h"
#include "ctxpar/memory.h"
#include "kernel/peak.h"
#include "options.h"

namespace ctxpar::cli {

namespace {

struct Best {
  double wall = 1e300, cpu = 1e300;  // seconds; cpu = process CPU seconds / threads
};

void time_once(Best& best, int threads, const std::function<void()>& run) {
  const double c0 = kernel::process_cpu_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  run();
  best.wall = std::min(
      best.wall, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  best.cpu = std::min(best.cpu, (kernel::process_cpu_seconds() - c0) / threads);
}

// One FMA peak measurement (0.1 s runs), kept where it beats `best`: every repeat's.
void measure_peak_into(kernel::Peak& best, int threads) {
  const kernel::Peak pk = kernel::measure_fma_peak(threads, 0.1);
  best.gflops = std::max(best.gflops, pk.gflops);
  best.cpu_gflops = std::max(best.cpu_gflops, pk.cpu_gflops);
}

// The measurement `ctxpar bench kernel` makes: the shape, dtype and tier, threads, repeats.
struct KernelBench {
  int64_t t = 0, hq = 0, hkv = 0, d = 0, b = 0;
  int threads = 1, repeats = 1, warmup = 1;
  DType dtype = DType::f32;
  Bf16Tier tier = Bf16Tier::exact;
  Fp32Products fp32_products = Fp32Products::automatic;
  bool backward = true;
  bool heads_major = false;  // --memory bhtd: every [B, T, H, D] tensor a view of [B, H, T, D]
};

Options bench_kernel_options() {
  Options o("bench kernel",
            "Forward and backward throughput of the single-rank attention kernel on random\n"
            "inputs, against the FMA peak of this machine for the same thread count, measured\n"
            "in the same run. FLOPs: forward 4*B*Hq*T*T*D (halved for causal), backward 2.5x.\n"
            "Figures are the best over --repeats; *_cpu figures use CPU time instead of wall.");
  o.add("seq", "4096", "sequence length T (Tq = Tk)")
      .add("heads", "8", "query heads Hq")
      .add("kv-heads", "0", "key/value heads Hkv (0 = --heads)")
      .add("head-dim", "128", "head dimension D, 16..256")
      .add("batch", "1", "batch size B")
      .add("dtype", "fp32", "storage type of q, k, v, o, do: fp32 | bf16")
      .add("bf16-tier", "exact", kBf16TierHelp)
      .add("fp32-products", "automatic",
           "--dtype fp32: fma (fp32 FMAs) | parts (S and the forward's P V through AMX-BF16 "
           "tiles on three bf16 parts of each value: KernelConfig::fp32_products, docs/kernel.md "
           "\"fp32 products\") | automatic (CTXPAR_FP32_PRODUCTS, else fma)")
      .add("threads", "1", "OpenMP threads (not given: OMP_NUM_THREADS when set)")
      .add("repeats", "3", "repetitions of every measurement (peak included); the best counts")
      .add("warmup", "1",
           "untimed forward (+ backward) calls at the same shape before timing (0: none, so "
           "the first timed call also pays the first touch of the kernel's buffers)")
      .add("memory", "bthd",
           "the memory behind q, k, v, dO, O, dQ, dK and dV (the kernel's [B, T, H, D] views "
           "either way): bthd ([B, T, H, D] contiguous, as a model's projections lay them out) "
           "| bhtd ([B, H, T, D] contiguous, the tensors bench/torch_sdpa.py gives torch's "
           "SDPA: a head's rows side by side)")
      .flag("no-backward", "skip the backward measurements")
      .flag("peak-only",
            "measure the FMA peak alone (--threads, best of --repeats) and time no kernel: what "
            "bench/cpu_suite.sh measures right before and after each torch run, so that both "
            "sides of a ratio can be set against the host's speed at their own moment")
      .flag("json", "print one JSON object instead of text");
  o.example("ctxpar bench kernel --seq 4096 --heads 8 --head-dim 128 --threads 1 --json");
  return o;
}

// The options, checked before anything is allocated (a UsageError or ctxpar::Error naming one).
KernelBench kernel_bench_from_options(const Options& o) {
  KernelBench kb;
  const int64_t t = kb.t = o.i64("seq", 1, kMaxTokens), hq = kb.hq = o.i64("heads", 1, kMaxHeads);
  const int64_t d = kb.d = o.i64("head-dim", 16, 256), b = kb.b = o.i64("batch", 1, kMaxBatch);
  const int64_t kv = o.i64("kv-heads", 0, kMaxHeads), hkv = kb.hkv = kv > 0 ? kv : hq;
  const int threads = kb.threads = threads_option(o);
  kb.repeats = o.i32("repeats", 1, kMaxRepeats);
  kb.warmup = o.i32("warmup", 0, kMaxRepeats);
  const DType dtype = kb.dtype = parse_dtype(o.str("dtype"));
  kb.tier = bf16_tier_option(o);
  const std::optional<Fp32Products> fp = parse_fp32_products(o.str("fp32-products"));
  if (!fp)
    throw UsageError("--fp32-products " + o.str("fp32-products") +
                     ": expected fma, parts or automatic");
  kb.fp32_products = *fp;
  CTXPAR_CHECK(t >= 1 && hq >= 1 && b >= 1 && threads >= 1,
               "bench kernel: --seq, --heads, --batch "
               "and --threads must be >= 1");
  kb.backward = !o.on("no-backward");
  const std::string memory = o.str("memory");
  if (memory != "bthd" && memory != "bhtd")
    throw UsageError("--memory " + memory + ": expected bthd or bhtd");
  kb.heads_major = memory == "bhtd";
  // Every option is checked before anything is allocated (--kv-heads 65536 was refused only
  // by the kernel, after a long time filling 1 GiB). A shape whose count overflows int64 is
  // refused by Tensor itself (B*T*H*D = 2^64 of in-range options made a 64-byte tensor).
  if (hq % hkv != 0)
    throw UsageError(detail::concat("--heads ", hq, " must be a multiple of --kv-heads ", hkv,
                                    " (grouped-query attention); e.g. --kv-heads ",
                                    std::gcd(hq, hkv)));
  {
    // Before allocating: q, k, v, dO, O in the dtype; lse, delta in fp32; dQ, dK, dV (fp32).
    const double B = double(b), T = double(t), D = double(d), es = double(dtype_size(dtype));
    const double need =
        B * T * D * ((3.0 * hq + 2.0 * hkv) * es + (1.0 * hq + 2.0 * hkv) * 4) + 2 * B * hq * T * 4;
    const MemoryLimit limit = memory_limit();
    CTXPAR_CHECK(!limit.known() || need <= limit.bytes, "bench kernel: this run ",
                 limit.shortfall(need), ", or lower --seq, --heads, --head-dim or --batch");
  }

  return kb;
}

// Times the forward and backward, unmasked and causal, and the FMA peak: the best of
// `repeats` each. Returns the figures as --json prints them.
nlohmann::json run_kernel_bench(const KernelBench& kb) {
  const int64_t t = kb.t, hq = kb.hq, hkv = kb.hkv, d = kb.d, b = kb.b;
  const int threads = kb.threads, repeats = kb.repeats;
  const DType dtype = kb.dtype;
  const Bf16Tier tier = kb.tier;
  const bool backward = kb.backward;
  // A [B, T, H, D] tensor, contiguous or (--memory bhtd) a view of [B, H, T, D] storage.
  std::vector<Tensor> storage;
  auto tensor = [&](DType dt, int64_t h) {
    if (!kb.heads_major) return TensorView(storage.emplace_back(dt, Shape{b, t, h, d}));
    return TensorView(storage.emplace_back(dt, Shape{b, h, t, d})).transpose(1, 2);
  };
  const TensorView q = tensor(dtype, hq), k = tensor(dtype, hkv), v = tensor(dtype, hkv);
  const TensorView dout = tensor(dtype, hq);
  fill_normal(q, 1), fill_normal(k, 2), fill_normal(v, 3), fill_normal(dout, 4);
  std::vector<int64_t> pos(t);
  for (int64_t i = 0; i < t; ++i) pos[i] = i;
  const Tokens tokens{pos, {}};
  KernelConfig cfg;
  cfg.threads = threads;
  cfg.bf16_tier = tier;
  cfg.fp32_products = kb.fp32_products;
  const TensorView out = tensor(dtype, hq);
  Tensor lse(DType::f32, {b, hq, t}), delta(DType::f32, {b, hq, t});
  const TensorView dq = tensor(DType::f32, hq), dk = tensor(DType::f32, hkv),
                   dv = tensor(DType::f32, hkv);

  const double full = attention_flops(b, hq, t, t, d);
  // The whole forward of one block (attention_forward: the bits of a fresh state's block and
  // finalize, without the state), as torch's SDPA forward is one call.
  auto forward = [&](const Mask& mask) {
    attention_forward(q, tokens, k, v, tokens, mask, out, lse, cfg);
  };
  auto run_backward = [&](const Mask& mask) {
    for (const TensorView* g : {&dq, &dk, &dv})  // each view covers its storage
      std::memset(g->data(), 0, static_cast<size_t>(g->numel()) * dtype_size(g->dtype()));
    attention_backward_delta(out, dout, delta, cfg);
    attention_backward_block(q, tokens, k, v, tokens, mask, dout, lse, delta, dq, dk, dv, cfg);
  };
  const Mask none, causal = Mask::causal_mask();
  kernel::Peak peak;
  Best fwd, bwd, cfwd, cbwd;
  for (int w = 0; w < kb.warmup; ++w) {
    forward(none);
    if (backward) run_backward(none);
  }
  for (int r = 0; r < repeats; ++r) {
    measure_peak_into(peak, threads);
    time_once(fwd, threads, [&] { forward(none); });
    if (backward) time_once(bwd, threads, [&] { run_backward(none); });
    time_once(cfwd, threads, [&] { forward(causal); });
    if (backward) time_once(cbwd, threads, [&] { run_backward(causal); });
  }

  nlohmann::json j;
  j["seq"] = t, j["heads"] = hq, j["kv_heads"] = hkv, j["head_dim"] = d, j["batch"] = b;
  j["dtype"] = dtype_name(dtype), j["bf16_tier"] = bf16_tier_name(tier);
  j["fp32_products"] = fp32_products_name(kb.fp32_products);
  j["threads"] = threads, j["repeats"] = repeats, j["warmup"] = kb.warmup;
  j["memory"] = kb.heads_major ? "bhtd" : "bthd";
  j["simd_target"] = kernel::simd_target_name(), j["simd_lanes"] = kernel::simd_lanes();
  auto put = [&](const char* name, double flops, const Best& s) {
    const std::string n = name;
    j[n + "_seconds"] = s.wall;
    j[n + "_gflops"] = flops / s.wall / 1e9;
    j[n + "_gflops_cpu"] = flops / s.cpu / 1e9;
  };
  j["peak_gflops"] = peak.gflops;
  j["peak_gflops_cpu"] = peak.cpu_gflops;
  put("fwd", full, fwd);
  put("causal_fwd", full / 2, cfwd);
  j["fwd_peak_ratio"] = full / fwd.wall / 1e9 / peak.gflops;
  j["fwd_peak_ratio_cpu"] = full / fwd.cpu / 1e9 / peak.cpu_gflops;
  j["causal_fwd_vs_fwd"] = (full / 2 / cfwd.wall) / (full / fwd.wall);
  j["causal_fwd_vs_fwd_cpu"] = (full / 2 / cfwd.cpu) / (full / fwd.cpu);
  if (backward) {
    put("bwd", 2.5 * full, bwd);
    put("causal_bwd", 2.5 * full / 2, cbwd);
    j["bwd_peak_ratio"] = 2.5 * full / bwd.wall / 1e9 / peak.gflops;
    j["bwd_peak_ratio_cpu"] = 2.5 * full / bwd.cpu / 1e9 / peak.cpu_gflops;
  }
  return j;
}

// The figures of run_kernel_bench as a table.
void print_kernel_bench(const KernelBench& kb, const nlohmann::json& j) {
  const int64_t t = kb.t, hq = kb.hq, hkv = kb.hkv, d = kb.d, b = kb.b;
  const int threads = kb.threads, repeats = kb.repeats;
  const DType dtype = kb.dtype;
  const bool backward = kb.backward;
  kernel::Peak peak;
  peak.gflops = j["peak_gflops"], peak.cpu_gflops = j["peak_gflops_cpu"];
  std::printf(
      "kernel T=%lld Hq=%lld Hkv=%lld D=%lld B=%lld %s on %s memory, %d thread(s), SIMD %s x%d, "
      "best of %d after %d warm-up call(s)\n",
      (long long)t, (long long)hq, (long long)hkv, (long long)d, (long long)b, dtype_name(dtype),
      kb.heads_major ? "[B, H, T, D]" : "[B, T, H, D]", threads, kernel::simd_target_name(),
      kernel::simd_lanes(), repeats, kb.warmup);
  std::printf("                    GFLOP/s (wall)  of peak   GFLOP/s (cpu)  of peak\n");
  auto line = [&](const char* what, const char* key, bool ratio) {
    const double w = j[std::string(key) + "_gflops"], c = j[std::string(key) + "_gflops_cpu"];
    if (ratio)
      std::printf("  %-16s %10.1f %10.1f%% %14.1f %8.1f%%\n", what, w, 100 * w / peak.gflops, c,
                  100 * c / peak.cpu_gflops);
    else
      std::printf("  %-16s %10.1f %11s %14.1f\n", what, w, "", c);
  };
  std::printf("  %-16s %10.1f %11s %14.1f\n", "FMA peak", peak.gflops, "", peak.cpu_gflops);
  line("forward", "fwd", true);
  line("forward causal", "causal_fwd", true);
  if (backward) {
    line("backward", "bwd", true);
    line("backward causal", "causal_bwd", true);
  }
  std::printf("  causal / non-causal forward (unmasked FLOPs): %.2f (wall), %.2f (cpu)\n",
              double(j["causal_fwd_vs_fwd"]), double(j["causal_fwd_vs_fwd_cpu"]));
}

}  // namespace

int bench_kernel(int argc, char** argv) {
  Options o = bench_kernel_options();
  if (!o.parse(argc, argv)) return 0;
  const KernelBench kb = kernel_bench_from_options(o);
  if (o.on("peak-only")) {  // the same measurement as each repeat of run_kernel_bench makes
    kernel::Peak peak;
    for (int r = 0; r < kb.repeats; ++r) measure_peak_into(peak, kb.threads);
    nlohmann::json j;
    j["threads"] = kb.threads, j["repeats"] = kb.repeats;
    j["simd_target"] = kernel::simd_target_name(), j["simd_lanes"] = kernel::simd_lanes();
    j["peak_gflops"] = peak.gflops, j["peak_gflops_cpu"] = peak.cpu_gflops;
    if (o.on("json"))
      std::printf("%s\n", j.dump().c_str());
    else
      std::printf(
          "FMA peak, %d thread(s), SIMD %s x%d, best of %d: %.1f GFLOP/s (wall), %.1f (cpu)\n",
          kb.threads, kernel::simd_target_name(), kernel::simd_lanes(), kb.repeats, peak.gflops,
          peak.cpu_gflops);
    return 0;
  }
  const nlohmann::json j = run_kernel_bench(kb);
  if (o.on("json")) {
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  print_kernel_bench(kb, j);
  return 0;
}

}  // namespace ctxpar::cli

// Whether bf16 products pay on this CPU, by measurement. With bf16 inputs, Q K^T
// and dO V^T are exact as bf16 x bf16 -> fp32 products (vdpbf16ps, AVX512_BF16), which do
// twice the multiply-adds of an fp32 FMA per instruction -- but at what rate depends on the
// core: on the Sapphire Rapids guest here vdpbf16ps gave 0.48x the fp32 FMA FLOP/s (dev lab 05),
// on Zen 5 it is documented to run at full rate. So a short probe (a few milliseconds) times
// both on register-only chains (in thread CPU time), alternating, best of three, the first
// time it is asked, and
// bf16 products are used where they give at least kBf16Pays times the fp32 FLOP/s (the margin
// pays for packing the tiles as bf16 pairs). AMX-BF16 tile products (amx_bf16.cc), where Linux
// grants the tile state, are timed beside them and taken where they give at least kAmxPays
// times the fp32 FLOP/s and beat vdpbf16ps. CTXPAR_BF16_PRODUCTS=on|dot|amx|off|auto overrides it
// (installed with the kernel's environment, beside CTXPAR_SIMD; for tests and comparisons), and
// KernelConfig::bf16_products asks for a level itself. The ranks of a job then agree on it (Note
// [The ranks agree on bf16 products], problem.h).
#include <immintrin.h>

#include <algorithm>
#include <ctime>
#include <cstdio>
#include <cstring>
#include <string>

#include "ctxpar/clock.h"
#include "kernel/amx_probe.h"
#include "kernel/problem.h"

namespace ctxpar::kernel {

namespace {

#if defined(__x86_64__)
#define CTXPAR_PROBE_CHAINS(OP) \
  OP(a0) OP(a1) OP(a2) OP(a3) OP(a4) OP(a5) OP(a6) OP(a7) OP(a8) OP(a9) OP(a10) OP(a11)
#define CTXPAR_PROBE_DECLARE(v) __m512 v = _mm512_set1_ps(seed);
#define CTXPAR_PROBE_KEEP(v) __asm__ volatile("" : "+v"(v));
#define CTXPAR_PROBE_SUM(v) sum = _mm512_add_ps(sum, v);

// 12 chains of vdpbf16ps (kBf16) or of vfmadd231ps, `iterations` steps; the seconds they took.
template <bool kBf16>
__attribute__((target("avx512f,avx512bf16,fma"), noinline)) double chains(long iterations,
                                                                          float seed) {
  CTXPAR_PROBE_CHAINS(CTXPAR_PROBE_DECLARE)
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // bf16 pairs (1, 1)
  const __m512bh y = (__m512bh)_mm512_set1_epi32(0x33d633d6);  // (1e-7, 1e-7)
  const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  const double t0 = thread_cpu_seconds();
  for (long i = 0; i < iterations; ++i) {
#define CTXPAR_PROBE_STEP(v) v = kBf16 ? _mm512_dpbf16_ps(v, x, y) : _mm512_fmadd_ps(v, m, c);
    CTXPAR_PROBE_CHAINS(CTXPAR_PROBE_STEP)
    CTXPAR_PROBE_CHAINS(CTXPAR_PROBE_KEEP)
  }
  const double s = thread_cpu_seconds() - t0;
  __m512 sum = _mm512_setzero_ps();
  CTXPAR_PROBE_CHAINS(CTXPAR_PROBE_SUM)
  volatile float sink = _mm512_cvtss_f32(sum);
  (void)sink;
  return s;
}
#endif

}  // namespace

bool cpu_has_bf16_dot() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

namespace {

// GFLOP/s of fp32 FMAs and of bf16 dot products, one thread.
void probe(double& fma_gflops, double& dot_gflops) {
#if defined(__x86_64__)
  constexpr long kIterations = 200'000;  // x 12 instructions: ~1 ms a run at 3 GHz
  double fma = 1e30, dot = 1e30;
  for (int rep = 0; rep < 3; ++rep) {  // alternating, best of 3
    dot = std::min(dot, chains<true>(kIterations, 1.0f + rep));
    fma = std::min(fma, chains<false>(kIterations, 1.0f + rep));
  }
  const double n = 12.0 * kIterations;
  fma_gflops = n * 32 / fma / 1e9, dot_gflops = n * 64 / dot / 1e9;
#else
  fma_gflops = dot_gflops = 0;
#endif
}

std::string fixed2(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f", x);
  return b;
}

}  // namespace

Bf16Choice decide_bf16_products(const char* env_value, bool cpu_has, double fma_gflops,
                                double dot_gflops, const std::string& amx_why, double amx_gflops) {
  Bf16Choice c;
  const std::string want = env_value != nullptr ? env_value : "";
  if (!want.empty() && want != "auto" && want != "on" && want != "off" && want != "dot" &&
      want != "amx") {
    c.error = "CTXPAR_BF16_PRODUCTS=" + want +
              ": expected on, off or auto (or dot: vdpbf16ps, as on; amx: AMX-BF16 tiles; or "
              "unset it: auto, decided by measurement)";
    return c;
  }
  if (want == "off") {
    c.reason = "fp32 products (CTXPAR_BF16_PRODUCTS=off)";
    return c;
  }
  if (want == "amx") {
    if (!amx_why.empty())
      c.error = "CTXPAR_BF16_PRODUCTS=amx: AMX-BF16 is not usable here (" + amx_why +
                "); use dot, on, off or auto, or unset it";
    c.level = c.error.empty() ? kBf16Amx : kBf16Fp32;
    c.reason = "AMX-BF16 tile products for bf16 inputs (CTXPAR_BF16_PRODUCTS=amx)";
    return c;
  }
  if (!cpu_has) {
    if (want == "on" || want == "dot")
      c.error = "CTXPAR_BF16_PRODUCTS=" + want +
                ": this CPU lacks AVX512_BF16 (vdpbf16ps); use off or auto, or unset it";
    else
      c.reason = "fp32 products (this CPU has no AVX512_BF16 bf16 dot product)";
    return c;
  }
  if (want == "on" || want == "dot") {
    c.level = kBf16Dot;
    c.reason = "bf16 products for bf16 inputs (vdpbf16ps; CTXPAR_BF16_PRODUCTS=" + want + ")";
    return c;
  }
  const double ratio = fma_gflops > 0 ? dot_gflops / fma_gflops : 0;
  const double amx = amx_why.empty() && fma_gflops > 0 ? amx_gflops / fma_gflops : 0;
  c.level = amx >= kAmxPays && amx >= ratio ? kBf16Amx : ratio >= kBf16Pays ? kBf16Dot : kBf16Fp32;
  const char* what[] = {"fp32 products", "bf16 products for bf16 inputs (vdpbf16ps)",
                        "AMX-BF16 tile products for bf16 inputs"};
  c.reason = std::string(what[c.level]) + " (measured: vdpbf16ps " + fixed2(ratio) +
             "x the fp32 FMA FLOP/s; bf16 needs " + fixed2(kBf16Pays) + "x; " +
             (amx_why.empty() ? "AMX-BF16 tile products " + fixed2(amx) + "x, AMX needs " +
                                    fixed2(kAmxPays) + "x"
                              : "AMX-BF16 not usable: " + amx_why) +
             "; CTXPAR_BF16_PRODUCTS=on|off|dot|amx overrides)";
  return c;
}

int bf16_products_level(Bf16Products products) {
  switch (products) {
    case Bf16Products::automatic:
      return bf16_products().level;
    case Bf16Products::fp32:
      return kBf16Fp32;
    case Bf16Products::dot:
      return kBf16Dot;
    case Bf16Products::amx:
      return kBf16Amx;
  }
  return kBf16Fp32;
}

std::string bf16_products_refusal(Bf16Products products, bool cpu_has_dot,
                                  const std::string& amx_why) {
  if (products == Bf16Products::dot && !cpu_has_dot)
    return "KernelConfig::bf16_products = dot: this CPU lacks AVX512_BF16 (vdpbf16ps); use "
           "automatic or fp32";
  if (products == Bf16Products::amx && !amx_why.empty())
    return "KernelConfig::bf16_products = amx: AMX-BF16 is not usable here (" + amx_why +
           "); use automatic, dot or fp32";
  return "";
}

std::string bf16_products_refusal(Bf16Products products) {
  if (products == Bf16Products::automatic || products == Bf16Products::fp32) return "";
  return bf16_products_refusal(products, cpu_has_bf16_dot(),
                               products == Bf16Products::amx ? amx_unusable_why() : "");
}

int bf16_top_level() {
  return amx_unusable_why().empty() ? kBf16Amx : cpu_has_bf16_dot() ? kBf16Dot : kBf16Fp32;
}

const Bf16Choice& bf16_products() {
  static const Bf16Choice c = [] {
    const std::string& want = kernel_environment().bf16_products;  // CTXPAR_BF16_PRODUCTS
    const char* e = want.empty() ? nullptr : want.c_str();
    const bool has = cpu_has_bf16_dot();
    double fma = 0, dot = 0;
    const bool measure = has && (e == nullptr || std::strcmp(e, "auto") == 0);
    if (measure) probe(fma, dot);
    // AMX-BF16 beside it: checked where asked for or measuring, timed where measuring.
    const bool ask_amx = measure || (e != nullptr && std::strcmp(e, "amx") == 0);
    AmxProbe amx;
    if (measure)
      amx = probe_amx();
    else
      amx.why = ask_amx ? amx_unusable_why() : "not measured";
    Bf16Choice d = decide_bf16_products(e, has, fma, dot, amx.why, amx.gflops);
    d.fma_gflops = fma, d.dot_gflops = dot, d.amx_gflops = amx.gflops;
    return d;
  }();
  return c;
}

}  // namespace ctxpar::kernel

namespace ctxpar {

const char* bf16_products_name(Bf16Products products) {
  switch (products) {
    case Bf16Products::automatic:
      return "automatic";
    case Bf16Products::fp32:
      return "fp32";
    case Bf16Products::dot:
      return "dot";
    case Bf16Products::amx:
      return "amx";
  }
  return "?";
}

}  // namespace ctxpar

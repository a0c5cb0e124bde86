// Which SIMD target the fast kernel runs. Highway compiles simd_*.cc once per target in
// HWY_TARGETS (baseline SSSE3, SSE4, AVX2, AVX-512 for the default -march=x86-64-v2) and
// HWY_DYNAMIC_DISPATCH calls the best one the CPU supports. CTXPAR_SIMD=<name> restricts the
// choice to one lower target (for testing every path on one machine, and for comparing them);
// CTXPAR_SIMD=scalar (or CTXPAR_KERNEL=scalar) selects the readable scalar path instead. The
// variables reach the kernel through set_kernel_environment (the edge reads them).
#include <hwy/highway.h>
#include <hwy/targets.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>

#include "kernel/amx_probe.h"
#include "kernel/problem.h"

namespace ctxpar {

namespace kernel {
namespace {

struct Named {
  int64_t target;
  const char* name;
};
// Best first (a lower Highway bit is a better target).
constexpr Named kNames[] = {{HWY_AVX3_DL, "avx512_dl"}, {HWY_AVX3, "avx512"},
                            {HWY_AVX2, "avx2"},         {HWY_SSE4, "sse4"},
                            {HWY_SSSE3, "ssse3"},       {HWY_EMU128, "emu128"},
                            {HWY_SCALAR, "hwy_scalar"}};

std::string names_of(int64_t targets) {
  std::string s;
  for (const Named& n : kNames)
    if (targets & n.target) s += (s.empty() ? "" : ", ") + std::string(n.name);
  return s;
}

// The installed environment, and whether the kernel's choices have been made from it.
struct Installed {
  std::mutex mutex;
  KernelEnvironment env;
  bool fixed = false;
};
Installed& installed() {
  static Installed i;
  return i;
}

// A variable's value, or nullptr where it is unset or empty.
const char* value(const std::string& v) { return v.empty() ? nullptr : v.c_str(); }

struct Choice {
  int64_t runnable = 0;  // compiled targets this CPU supports (before any restriction)
  bool scalar = false;   // the readable scalar path
  int64_t chosen = 0;    // the SIMD target in use (0 when scalar)
  std::string error;     // why CTXPAR_SIMD cannot be honoured
};

Choice decide(const KernelEnvironment& env) {
  Choice c;
  c.runnable = hwy::SupportedTargets() & HWY_TARGETS;
  c.chosen = c.runnable & -c.runnable;  // the best
  c.scalar = env.kernel == "scalar";
  const char* want = value(env.simd);
  if (want == nullptr) return c;
  if (std::strcmp(want, "scalar") == 0) {
    c.scalar = true;
    return c;
  }
  int64_t target = 0;
  for (const Named& n : kNames)
    if (std::strcmp(want, n.name) == 0) target = n.target;
  if (target == 0 || !(target & HWY_TARGETS)) {
    c.error = "CTXPAR_SIMD=" + std::string(want) + ": " +
              (target == 0 ? "unknown SIMD target" : "not compiled into this binary") +
              "; use one of: " + names_of(HWY_TARGETS) + ", scalar (or unset it for the best)";
  } else if (!(target & c.runnable)) {
    c.error = "CTXPAR_SIMD=" + std::string(want) +
              ": this CPU lacks it; it can run: " + names_of(c.runnable) +
              ", scalar (or unset CTXPAR_SIMD for the best)";
  } else {
    c.chosen = target;
  }
  return c;
}

// Decided once per process, before the first dispatch.
const Choice& choice() {
  static const Choice c = [] {
    Choice d = decide(kernel_environment());
    // Restrict Highway's dispatch to the chosen target; the best one needs no restriction.
    if (d.error.empty() && !d.scalar && d.chosen != (d.runnable & -d.runnable))
      hwy::SetSupportedTargetsForTest(d.chosen);
    return d;
  }();
  return c;
}

}  // namespace

const KernelEnvironment& kernel_environment() {
  Installed& i = installed();
  std::lock_guard<std::mutex> lock(i.mutex);
  i.fixed = true;
  return i.env;
}

void select_simd_target() {
  const Choice& c = choice();
  CTXPAR_CHECK(c.error.empty(), c.error);
}

bool use_scalar_path() {
  const Choice& c = choice();
  CTXPAR_CHECK(c.error.empty(), c.error);
  return c.scalar;
}

namespace {
bool avx512_target(const Choice& c) {
  return c.error.empty() && !c.scalar && (c.chosen & (HWY_AVX3 | HWY_AVX3_DL)) != 0;
}
}  // namespace

int bf16_products_on(const KernelConfig& config) {
  const Bf16Choice& b = bf16_products();
  CTXPAR_CHECK(b.error.empty(), b.error);  // e.g. CTXPAR_BF16_PRODUCTS=on on a CPU without it
  const std::string refused = bf16_products_refusal(config.bf16_products);
  CTXPAR_CHECK(refused.empty(), refused);
  return avx512_target(choice()) ? bf16_products_level(config.bf16_products) : kBf16Fp32;
}

Fp32Products fp32_products_of(const KernelConfig& config) {
  if (config.fp32_products != Fp32Products::automatic) return config.fp32_products;
  const std::string& want = kernel_environment().fp32_products;  // CTXPAR_FP32_PRODUCTS
  if (want.empty()) return Fp32Products::fma;
  const std::optional<Fp32Products> p = parse_fp32_products(want);
  CTXPAR_CHECK(p && *p != Fp32Products::automatic, "CTXPAR_FP32_PRODUCTS=", want,
               ": expected fma (fp32 FMAs) or parts (AMX tiles on three bf16 parts of each value, "
               "docs/kernel.md \"fp32 products\"), or unset it");
  return *p;
}

std::string fp32_parts_refusal() {
  const std::string why = amx_unusable_why();
  if (!why.empty())
    return "KernelConfig::fp32_products = parts needs AMX-BF16 tiles, which this machine cannot "
           "use (" +
           why + "); take fma";
  const Choice& c = choice();
  if (!avx512_target(c)) {
    // The chosen target's name from the choice itself: simd_target_name() is made by
    // simd_targets(), which calls this (a static initialised inside its own initialiser hangs).
    std::string name = c.scalar ? "scalar" : "none";
    for (const Named& n : kNames)
      if (n.target == c.chosen && !c.scalar) name = n.name;
    return "KernelConfig::fp32_products = parts needs an avx512 SIMD target, and " + name +
           " is in use (CTXPAR_SIMD); take fma or unset CTXPAR_SIMD";
  }
  return "";
}

int64_t parse_kernel_l1d(const char* text) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text, &end, 10);
  CTXPAR_CHECK(errno == 0 && end != text && *end == '\0' && v >= kMinL1dBytes && v <= kMaxL1dBytes,
               "CTXPAR_KERNEL_L1D=" + std::string(text) +
                   ": expected the L1 data cache size in bytes, a whole number from 1024 to "
                   "1073741824 (e.g. 32768), or unset it to use this CPU's");
  return static_cast<int64_t>(v);
}

int64_t kernel_l1d_bytes() {
  static const int64_t bytes = [] {
    if (const char* e = value(kernel_environment().l1d)) return parse_kernel_l1d(e);
    const long reported = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    return reported >= 1024 ? static_cast<int64_t>(reported) : int64_t{32768};
  }();
  return bytes;
}

int64_t kernel_k_panel(int64_t n, int64_t k, int64_t l1d_bytes) {
  const int64_t budget = (l1d_bytes > 0 ? l1d_bytes : kernel_l1d_bytes()) / 2;
  const int64_t bytes = n * k * static_cast<int64_t>(sizeof(float));
  if (bytes <= budget) return 0;
  // The fewest equal panels that fit (a 128-row K^T tile in two of 64 rows, on 32 and 48 KiB
  // L1s alike), rounded up to 16 rows, and never fewer than 16.
  const int64_t panels = (bytes + budget - 1) / budget;
  const int64_t rows = std::max<int64_t>(16, ((k + panels - 1) / panels + 15) / 16 * 16);
  return rows >= k ? 0 : rows;
}

}  // namespace kernel

SimdTargets simd_targets() {
  const kernel::Choice& c = kernel::choice();
  SimdTargets t;
  for (const kernel::Named& n : kernel::kNames) {
    if (n.target & HWY_TARGETS) t.compiled.push_back(n.name);
    if (n.target & c.runnable) t.runnable.push_back(n.name);
    if (n.target == c.chosen && !c.scalar && c.error.empty()) t.chosen = n.name;
  }
  if (c.scalar) t.chosen = "scalar";
  t.error = c.error;
  const kernel::Bf16Choice& bf16 = kernel::bf16_products();  // CTXPAR_BF16_PRODUCTS
  t.products = bf16.reason;
  if (bf16.level > 0 && !kernel::avx512_target(c))
    t.products += "; not applied: the SIMD target in use (" + t.chosen +
                  ") is not an avx512 one, products stay fp32";
  if (t.error.empty()) t.error = bf16.error;
  // CTXPAR_FP32_PRODUCTS: a bad value, or parts where this machine cannot take them, is an
  // error before any kernel call (the command exits 2 naming it; the kernel tests skip).
  try {
    if (kernel::fp32_products_of({}) == Fp32Products::parts && !c.scalar) {  // scalar: ignored
      const std::string refused = kernel::fp32_parts_refusal();
      if (t.error.empty() && !refused.empty()) t.error = "CTXPAR_FP32_PRODUCTS=parts: " + refused;
      t.products +=
          "; fp32 inputs: S and P V through AMX tiles on three bf16 parts "
          "(CTXPAR_FP32_PRODUCTS=parts)";
    }
  } catch (const Error& e) {
    if (t.error.empty()) t.error = e.what();
  }
  return t;
}

void set_kernel_environment(const KernelEnvironment& env) {
  kernel::Installed& i = kernel::installed();
  std::lock_guard<std::mutex> lock(i.mutex);
  if (i.fixed && !(env == i.env))
    throw Error(
        "set_kernel_environment: the kernel's choices were already made from another "
        "environment (its first call, or simd_targets()); install it before either");
  i.env = env;
}

}  // namespace ctxpar

// The AMX-BF16 probe (amx_probe.h). Compiled for AMX by target attributes only; the tile
// instructions run only after cpuid and the kernel said yes.
#include "kernel/amx_probe.h"

#include <immintrin.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <ctime>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ctxpar/clock.h"
#endif

namespace ctxpar::kernel {

#if defined(__x86_64__) && defined(__linux__)
namespace {

// 4 independent 16 x 16 fp32 accumulators, each += A (16 x 32 bf16) B (32 x 16 bf16 pairs)
// per step: 4 * 16 * 16 * 32 multiply-adds. Returns the seconds `steps` took.
__attribute__((target("amx-tile,amx-bf16"), noinline)) double tile_chains(long steps) {
  load_tile_config(kTiles16x64);
  alignas(64) static uint16_t a[16 * 32], b[16 * 32];
  alignas(64) static float c[16 * 16];
  for (int i = 0; i < 16 * 32; ++i) a[i] = 0x3f80, b[i] = 0x33d6;  // 1 and 1e-7
  _tile_zero(0);  // the tile macros are asm statements: one a statement
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  CTXPAR_TILE_LOAD(4, a, 64);
  CTXPAR_TILE_LOAD(5, b, 64);
  CTXPAR_TILE_LOAD(6, a, 64);
  CTXPAR_TILE_LOAD(7, b, 64);
  const double t0 = thread_cpu_seconds();
  for (long i = 0; i < steps; ++i) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 6, 5);
    _tile_dpbf16ps(3, 6, 7);
  }
  const double s = thread_cpu_seconds() - t0;
  CTXPAR_TILE_STORE(0, c, 64);
  _tile_release();
  volatile float sink = c[0];
  (void)sink;
  return s;
}

}  // namespace

const std::string& amx_unusable_why() {
  static const std::string why = []() -> std::string {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 22)) ||
        !(edx & (1u << 24)))
      return "this CPU has no AMX-BF16";
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
      return std::string("Linux refused the tile state (arch_prctl ARCH_REQ_XCOMP_PERM: ") +
             std::strerror(errno) + ")";
    return "";
  }();
  return why;
}

AmxProbe probe_amx() {
  AmxProbe r;
  r.why = amx_unusable_why();
  if (!r.why.empty()) return r;
  constexpr long kSteps = 50'000;
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) best = std::min(best, tile_chains(kSteps));
  r.usable = true;
  r.gflops = 4.0 * kSteps * 16 * 16 * 32 * 2 / best / 1e9;
  return r;
}
#else
const std::string& amx_unusable_why() {
  static const std::string why = "no AMX outside x86-64 Linux";
  return why;
}

AmxProbe probe_amx() {
  AmxProbe r;
  r.why = amx_unusable_why();
  return r;
}
#endif

}  // namespace ctxpar::kernel

// The AMX-BF16 probe (amx_probe.h). Compiled for AMX by target attributes only; the tile
// instructions run only after cpuid and the kernel said yes.
#include "kernel/amx_probe.h"

#include <immintrin.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ctxpar::kernel {

#if defined(__x86_64__) && defined(__linux__)
namespace {

struct __attribute__((packed)) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// 4 independent 16 x 16 fp32 accumulators, each += A (16 x 32 bf16) B (32 x 16 bf16 pairs)
// per step: 4 * 16 * 16 * 32 multiply-adds. Returns the seconds `steps` took.
__attribute__((target("amx-tile,amx-bf16"), noinline)) double tile_chains(long steps) {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
  _tile_loadconfig(&cfg);
  alignas(64) static uint16_t a[16 * 32], b[16 * 32];
  alignas(64) static float c[16 * 16];
  for (int i = 0; i < 16 * 32; ++i) a[i] = 0x3f80, b[i] = 0x33d6;  // 1 and 1e-7
  _tile_zero(0);  // the tile macros are asm statements: one a statement
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, b, 64);
  _tile_loadd(6, a, 64);
  _tile_loadd(7, b, 64);
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < steps; ++i) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 6, 5);
    _tile_dpbf16ps(3, 6, 7);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  _tile_stored(0, c, 64);
  _tile_release();
  volatile float sink = c[0];
  (void)sink;
  return s;
}

}  // namespace

AmxProbe probe_amx() {
  AmxProbe r;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 22)) ||
      !(edx & (1u << 24))) {
    r.why = "this CPU has no AMX-BF16";
    return r;
  }
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    r.why = std::string("Linux refused the tile state (arch_prctl ARCH_REQ_XCOMP_PERM: ") +
            std::strerror(errno) + ")";
    return r;
  }
  constexpr long kSteps = 50'000;
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) best = std::min(best, tile_chains(kSteps));
  r.usable = true;
  r.gflops = 4.0 * kSteps * 16 * 16 * 32 * 2 / best / 1e9;
  return r;
}
#else
AmxProbe probe_amx() {
  AmxProbe r;
  r.why = "no AMX outside x86-64 Linux";
  return r;
}
#endif

}  // namespace ctxpar::kernel

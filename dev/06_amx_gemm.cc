// Lab 06: how fast do the kernel's AMX tile products run in the shapes the kernel calls them
// with (Note [P V, dV, dK, dQ through AMX] in src/kernel/amx_bf16.cc)? GFLOP/s by CPU
// time, one thread, each call shape repeated on data in L1/L2:
//   - scores_amx(128 rows, 64 pairs): the forward's S = Q K^T for two query tiles;
//   - gemm_amx(64 x 128, 32 pairs), 1 and 3 parts: the backward's dV / dK / dQ per tile pair;
//   - gemm_amx(128 x 128, 32 pairs), 1 and 3 parts: the forward's O += P V;
//   - gemm_amx(64 x 128, 128 pairs): the same product with 4x the depth (what a deeper
//     accumulation would reach: the C tiles loaded and stored once per 4x the work), and 32 /
//     64 / 128 pairs with 1 and 3 parts from A rows 128 pairs apart;
// against the peak of the probe (4 independent tdpbf16ps chains, no loads).
//   ./build/dev/lab_06_amx_gemm [repeats]
// Exits 0 with a note where AMX-BF16 is not usable.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernel/amx_probe.h"
#include "kernel/simd_bf16.h"
#include "lab_common.h"

namespace {

using lab::cpu_seconds;  // one thread: process CPU time is the thread's

template <class F>
double gflops(double flops_per_call, long calls, F&& f) {
  f();  // warm
  const double t0 = cpu_seconds();
  for (long i = 0; i < calls; ++i) f();
  return flops_per_call * static_cast<double>(calls) / (cpu_seconds() - t0) / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  namespace bf16 = ctxpar::kernel::bf16;
  const long repeats = argc > 1 ? std::atol(argv[1]) : 20000;
  if (!lab::amx_usable_or_say_why()) return 0;
  const ctxpar::kernel::AmxProbe probe = ctxpar::kernel::probe_amx();
  std::printf("probe (4 chains, no loads): %.0f GFLOP/s\n", probe.gflops);
  std::vector<uint32_t> a(3 * 128 * 128, 0x3f803f80u), b(128 * 160, 0x3f803f80u);
  std::vector<float> c(128 * 144, 0.0f);
  std::printf("scores_amx 128 x 64, 64 pairs: %.0f GFLOP/s\n",
              gflops(2.0 * 128 * 64 * 128, repeats,
                     [&] { bf16::scores_amx(128, 64, a.data(), 80, b.data(), c.data(), 0.5f); }));
  for (const int m : {64, 128})
    for (const int nsplit : {1, 3})
      std::printf(
          "gemm_amx %d x 128, 32 pairs, %d part(s): %.0f GFLOP/s (of the parts' products)\n", m,
          nsplit, gflops(2.0 * m * 128 * 64 * nsplit, repeats, [&] {
            bf16::gemm_amx(m, 128, 32, a.data(), 32, b.data(), 144, c.data(), 144, true, nsplit,
                           128 * 32);
          }));
  std::printf("gemm_amx 64 x 128, 32 pairs, C zeroed (not loaded): %.0f GFLOP/s\n",
              gflops(2.0 * 64 * 128 * 64, repeats, [&] {
                bf16::gemm_amx(64, 128, 32, a.data(), 32, b.data(), 144, c.data(), 144, false);
              }));
  std::vector<float> cs(8 * 64 * 144, 0.0f);
  long k = 0;
  std::printf("gemm_amx 64 x 128, 32 pairs, C rotating over 8 buffers: %.0f GFLOP/s\n",
              gflops(2.0 * 64 * 128 * 64, repeats, [&] {
                bf16::gemm_amx(64, 128, 32, a.data(), 32, b.data(), 144,
                               cs.data() + (k++ % 8) * 64 * 144, 144, true);
              }));
  // Deeper per C load, 1 and 3 parts: A rows 128 pairs apart (3 parts: 96 KiB, past L1, as
  // several query tiles' P^T parts would be).
  for (const int np : {32, 64, 128})
    for (const int nsplit : {1, 3})
      std::printf("gemm_amx 64 x 128, %d pairs, %d part(s), A 128 pairs a row: %.0f GFLOP/s\n", np,
                  nsplit, gflops(2.0 * 64 * 128 * 2 * np * nsplit, repeats * 32 / np, [&] {
                    bf16::gemm_amx(64, 128, np, a.data(), 128, b.data(), 144, c.data(), 144, true,
                                   nsplit, 64 * 128);
                  }));
  std::printf("gemm_amx 64 x 128, 128 pairs: %.0f GFLOP/s\n",
              gflops(2.0 * 64 * 128 * 256, repeats / 4, [&] {
                bf16::gemm_amx(64, 128, 128, a.data(), 128, b.data(), 144, c.data(), 144, true);
              }));
  // A call's fixed cost: the tile configuration loaded and the tiles released around one
  // 16 x 16 x 16-pair tile product (16384 FLOPs), its C tile loaded and stored.
  const double tiny = gflops(2.0 * 16 * 16 * 32, repeats * 10, [&] {
    bf16::gemm_amx(16, 16, 16, a.data(), 32, b.data(), 144, c.data(), 144, true);
  });
  std::printf(
      "gemm_amx 16 x 16, 16 pairs (one tile product a call): %.1f GFLOP/s = %.0f ns a call\n", tiny,
      2.0 * 16 * 16 * 32 / tiny);
  return 0;
}

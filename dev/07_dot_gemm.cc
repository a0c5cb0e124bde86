// Lab 07: how fast does the fast tier's P V, dV, dK, dQ through vdpbf16ps run (gemm_dot, Note
// [The fast tier through vdpbf16ps] in src/kernel/simd_bf16.cc) in the shapes the kernel calls it
// with, as a fraction of the probe's vdpbf16ps rate on this CPU? That fraction carries to other
// CPUs with AVX512_BF16 (an AMD family-26 CPU runs vdpbf16ps at twice its fp32 FMA FLOP/s, the
// Intel guest of docs/BENCHMARKS.md at half), where the end-to-end speed needs the CPU itself.
// GFLOP/s by CPU time, one thread, each call shape repeated on data in L1/L2:
//   - gemm_dot(64 x 128, 32 pairs): the backward's dV / dK / dQ per (query tile, key tile);
//   - gemm_dot(128 x 128, 32 pairs): the forward's O += P V for two query tiles;
// against the probe's rates (24 independent chains, no loads) of vdpbf16ps and fp32 FMAs.
//   ./build/dev/lab_07_dot_gemm [repeats]
// Exits 0 with a note on CPUs without AVX512_BF16.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "core/environment.h"
#include "kernel/problem.h"
#include "kernel/simd_bf16.h"
#include "lab_common.h"

int main(int argc, char** argv) {
  namespace kernel = ctxpar::kernel;
  const long repeats = argc > 1 ? std::atol(argv[1]) : 4000;
  if (!kernel::cpu_has_bf16_dot()) {
    std::printf("lab_07_dot_gemm: this CPU has no AVX512_BF16 (vdpbf16ps); nothing to measure\n");
    return 0;
  }
  ctxpar::set_kernel_environment(ctxpar::environment::kernel());  // CTXPAR_BF16_PRODUCTS
  const kernel::Bf16Choice& probe = kernel::bf16_products();
  std::printf("probe: vdpbf16ps %.0f GFLOP/s, fp32 FMA %.0f GFLOP/s\n", probe.dot_gflops,
              probe.fma_gflops);
  std::vector<uint32_t> a(128 * 32, 0x3f803f80u), b(32 * 144, 0x3f803f80u);
  std::vector<float> c(128 * 144, 0.0f);
  for (const int m : {64, 128}) {
    const double flops = 2.0 * m * 128 * 64;
    kernel::bf16::gemm_dot(m, 128, 32, a.data(), 32, b.data(), 144, c.data(), 144, true);
    const double t0 = lab::cpu_seconds();
    for (long i = 0; i < repeats; ++i)
      kernel::bf16::gemm_dot(m, 128, 32, a.data(), 32, b.data(), 144, c.data(), 144, true);
    const double gf = flops * static_cast<double>(repeats) / (lab::cpu_seconds() - t0) / 1e9;
    std::printf(
        "gemm_dot %d x 128, 32 pairs: %.0f GFLOP/s = %.2f of vdpbf16ps, %.2f x fp32 FMA "
        "peak\n",
        m, gf, probe.dot_gflops > 0 ? gf / probe.dot_gflops : 0.0,
        probe.fma_gflops > 0 ? gf / probe.fma_gflops : 0.0);
  }
  return 0;
}

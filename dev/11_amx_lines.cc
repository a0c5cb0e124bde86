// Lab 11: where do the AMX products lose their speed inside the kernel (issue 40, round four)?
// The library's bf16::gemm_amx_chunks on the backward's shapes (Note [Deeper tile products] in
// src/kernel/simd_backward_products.h; D = 128, A in 1 or 3 parts):
//   - dV / dK: C 64 x 128 from zero, a block of 4 query tiles (4 chunks of 32 pairs);
//   - dQ: C 64 x 128 accumulated, the pass's 2 key tiles (2 chunks);
// with A, B and C starting on a 64-byte line or 16 bytes past one (where a std::vector's data
// lies: glibc's 16-byte chunk header), by CPU time, one thread, GFLOP/s of the parts'
// products, against the probe's tile rate (chains without loads). Each row of a tile load or
// store is 64 bytes: off a line, every row touches two lines. Checks that the offset changes
// no bit. Random values (bf16 in [1, 2) and [-2, -1)): an all-zero page reads from one line.
//   ./build/dev/lab_11_amx_lines [repeats]
// Exits 0 with a note where AMX-BF16 is not usable.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <vector>

#include "kernel/amx_probe.h"
#include "kernel/simd_bf16.h"
#include "lab_common.h"

namespace {

using lab::cpu_seconds;
constexpr int64_t kM = 64, kN = 128, kHalf = 32, kPart = kM * kHalf;  // words

// Words at a 64-byte line plus `skew` bytes.
struct Block {
  std::vector<uint32_t> raw;
  uint32_t* at;
  Block(size_t words, int skew) : raw(words + 32) {
    const auto base = reinterpret_cast<uintptr_t>(raw.data());
    at = reinterpret_cast<uint32_t*>((base + 63) / 64 * 64 + skew);
  }
};

struct Shape {
  const char* name;
  int64_t chunks;
  bool accumulate;
};

}  // namespace

int main(int argc, char** argv) {
  namespace bf16 = ctxpar::kernel::bf16;
  const long repeats = argc > 1 ? std::atol(argv[1]) : 2000;
  if (!lab::amx_usable_or_say_why()) return 0;
  const int64_t ldv = bf16::vnni_words(kN), ldc = ldv;
  std::mt19937 gen(11);
  auto word = [&] {  // two bf16 of magnitude [1, 2), random signs and mantissas
    const uint32_t r = gen();
    return (0x3f80u | (r & 0x807fu)) | (0x3f80u | (r >> 16 & 0x807fu)) << 16;
  };
  const Shape shapes[] = {{"dV / dK (4 chunks, C from zero)", 4, false},
                          {"dQ (2 chunks, C accumulated)", 2, true}};
  const int skews[] = {0, 16};
  for (int parts : {1, 3}) {
    for (const Shape& s : shapes) {
      const int64_t chunk = parts * kPart;
      std::vector<float> first;
      for (int skew : skews) {
        Block a(s.chunks * chunk, skew), b(s.chunks * kHalf * ldv, skew), c(kM * ldc, skew);
        std::mt19937 reset(11);
        gen = reset;
        for (int64_t i = 0; i < s.chunks * chunk; ++i) a.at[i] = word();
        for (int64_t i = 0; i < s.chunks * kHalf * ldv; ++i) b.at[i] = word();
        const uint32_t* chunks[4];
        for (int64_t i = 0; i < s.chunks; ++i) chunks[i] = b.at + i * kHalf * ldv;
        auto run = [&] {
          bf16::gemm_amx_chunks(kM, kN, s.chunks, kHalf, a.at, kHalf, chunk, chunks, ldv,
                                reinterpret_cast<float*>(c.at), ldc, s.accumulate, parts, kPart);
        };
        std::memset(c.at, 0, kM * ldc * 4);
        run();
        std::vector<float> got(reinterpret_cast<float*>(c.at),
                               reinterpret_cast<float*>(c.at) + kM * ldc);
        if (first.empty()) first = got;
        if (std::memcmp(first.data(), got.data(), got.size() * 4) != 0) {
          std::printf("FAIL: %s, %d parts: the offset changed a bit\n", s.name, parts);
          return 1;
        }
        double best = 1e300;
        for (int r = 0; r < 3; ++r) {
          std::memset(c.at, 0, kM * ldc * 4);
          const double t0 = cpu_seconds();
          for (long i = 0; i < repeats; ++i) run();
          best = std::min(best, cpu_seconds() - t0);
        }
        const double flops = 2.0 * kM * kN * (2 * kHalf * s.chunks) * parts * repeats;
        std::printf("%-34s %d part%s, A B C %2d bytes off a line: %5.0f GFLOP/s\n", s.name, parts,
                    parts > 1 ? "s" : " ", skew, flops / best * 1e-9);
      }
    }
  }
  const ctxpar::kernel::AmxProbe probe = ctxpar::kernel::probe_amx();
  std::printf("probe (4 chains, no loads): %.0f GFLOP/s\n", probe.gflops);
  return 0;
}

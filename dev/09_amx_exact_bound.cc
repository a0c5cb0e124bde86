// Lab 09: what bounds the exact tier's AMX gradient products (issue 40)? One dV-shaped product
// as the backward makes it (Note [Deeper tile products] in src/kernel/simd_backward_products.h):
// C 64 x 128 from zero, 4 chunks of 32 pairs (a block of 4 query tiles), A in 3 parts (P^T
// split exactly into bf16 parts), by CPU time, one thread, in GFLOP/s of the parts' products:
//   - library: bf16::gemm_amx_chunks, 2 x 2 C tiles, per 16-pair step 2 B + 6 A tile loads for
//     12 tdpbf16ps;
//   - same stream, L1 source: the same instructions with every A and B load reading one 1 KiB
//     tile (the data cannot come from L2);
//   - same stream, no loads: the same 12 tdpbf16ps a step on tiles loaded once (the ceiling of
//     this blocking on this core);
//   - chunk outer: the product one chunk at a time (C stored and reloaded between chunks; A's
//     and B's working set of a chunk fits L1); bitwise checked;
//   - 2 x 1 double-buffered: C 32 x 16, A and B tiles alternating so no load waits for a
//     tdpbf16ps still reading its tile (more loads a tdpbf16ps); bitwise checked.
// Both variants also ran end to end inside the library (T = 4096, H = 8, D = 128, alternating):
// slower (docs/kernel.md, "Where the bf16 backward's time goes").
//   ./build/dev/lab_09_amx_exact_bound [repeats]
// Exits 0 with a note where AMX-BF16 is not usable.
#include <immintrin.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernel/amx_probe.h"
#include "kernel/simd_bf16.h"
#include "lab_common.h"

namespace {

using lab::cpu_seconds;
constexpr int64_t kM = 64, kN = 128, kChunks = 4, kHalf = 32, kParts = 3;
constexpr int64_t kPart = kM * kHalf, kChunk = kParts * kPart;  // words

__attribute__((target("amx-tile,amx-bf16"))) void config() {
  ctxpar::kernel::load_tile_config(ctxpar::kernel::kTiles16x64);
}

// The library's 2 x 2 block stream; mode 0: real addresses, 1: every load from `one`, 2: no
// loads in the loop (A and B tiles loaded once).
__attribute__((target("amx-tile,amx-bf16"))) void stream(int mode, const uint32_t* a,
                                                         const uint32_t* const* b, int64_t ldb,
                                                         const uint32_t* one, float* c,
                                                         int64_t ldc) {
  config();
  if (mode == 2) {
    CTXPAR_TILE_LOAD(4, one, 64);  // the tile macros are asm statements: one a statement
    CTXPAR_TILE_LOAD(5, one, 64);
    CTXPAR_TILE_LOAD(6, one, 64);
    CTXPAR_TILE_LOAD(7, one, 64);
  }
  for (int64_t r = 0; r < kM; r += 32)
    for (int64_t col = 0; col < kN; col += 32) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t p = 0; p < kChunks * kHalf; p += 16) {
        const int64_t ch = p / kHalf, pc = p % kHalf;
        const uint32_t* bp = mode == 1 ? one : b[ch] + pc * ldb + col;
        const int64_t sb = mode == 1 ? 64 : ldb * 4;
        if (mode != 2) {
          CTXPAR_TILE_LOAD(6, bp, sb);
          CTXPAR_TILE_LOAD(7, bp + (mode == 1 ? 0 : 16), sb);
        }
        for (int sp = 0; sp < kParts; ++sp) {
          const uint32_t* as = mode == 1 ? one : a + ch * kChunk + sp * kPart + r * kHalf + pc;
          const int64_t sa = mode == 1 ? 64 : kHalf * 4;
          if (mode != 2) {
            CTXPAR_TILE_LOAD(4, as, sa);
            CTXPAR_TILE_LOAD(5, as + (mode == 1 ? 0 : 16 * kHalf), sa);
          }
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      float* cp = c + r * ldc + col;
      CTXPAR_TILE_STORE(0, cp, ldc * 4);
      CTXPAR_TILE_STORE(1, cp + 16, ldc * 4);
      CTXPAR_TILE_STORE(2, cp + 16 * ldc, ldc * 4);
      CTXPAR_TILE_STORE(3, cp + 16 * ldc + 16, ldc * 4);
    }
  _tile_release();
}

// C 32 x 16 (tiles 0, 2); B alternates 6 / 7 by step, A 4, 5 / 1, 3 by part: the same additions
// per C element in the same order (step, then part).
__attribute__((target("amx-tile,amx-bf16"))) void double_buffered(const uint32_t* a,
                                                                  const uint32_t* const* b,
                                                                  int64_t ldb, float* c,
                                                                  int64_t ldc) {
  config();
  for (int64_t r = 0; r < kM; r += 32)
    for (int64_t col = 0; col < kN; col += 16) {
      _tile_zero(0);
      _tile_zero(2);
      int ab = 0;
      for (int64_t p = 0; p < kChunks * kHalf; p += 32)
        for (int half = 0; half < 2; ++half) {
          const int64_t pp = p + 16 * half, ch = pp / kHalf, pc = pp % kHalf;
          const uint32_t* bp = b[ch] + pc * ldb + col;
          if (half == 0) {
            CTXPAR_TILE_LOAD(6, bp, ldb * 4);
          } else {
            CTXPAR_TILE_LOAD(7, bp, ldb * 4);
          }
          for (int sp = 0; sp < kParts; ++sp, ab ^= 1) {
            const uint32_t* as = a + ch * kChunk + sp * kPart + r * kHalf + pc;
            // the macros take tile numbers as literals: a branch per combination
            if (ab == 0) {
              CTXPAR_TILE_LOAD(4, as, kHalf * 4);
              CTXPAR_TILE_LOAD(5, as + 16 * kHalf, kHalf * 4);
              if (half == 0) {
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(2, 5, 6);
              } else {
                _tile_dpbf16ps(0, 4, 7);
                _tile_dpbf16ps(2, 5, 7);
              }
            } else {
              CTXPAR_TILE_LOAD(1, as, kHalf * 4);
              CTXPAR_TILE_LOAD(3, as + 16 * kHalf, kHalf * 4);
              if (half == 0) {
                _tile_dpbf16ps(0, 1, 6);
                _tile_dpbf16ps(2, 3, 6);
              } else {
                _tile_dpbf16ps(0, 1, 7);
                _tile_dpbf16ps(2, 3, 7);
              }
            }
          }
        }
      CTXPAR_TILE_STORE(0, c + r * ldc + col, ldc * 4);
      CTXPAR_TILE_STORE(2, c + (r + 16) * ldc + col, ldc * 4);
    }
  _tile_release();
}

template <class F>
double gflops(long calls, F&& f) {
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    f();
    const double t0 = cpu_seconds();
    for (long i = 0; i < calls; ++i) f();
    best = std::min(best, (cpu_seconds() - t0) / static_cast<double>(calls));
  }
  return 2.0 * kM * kN * 2 * kChunks * kHalf * kParts / best / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  namespace bf16 = ctxpar::kernel::bf16;
  const long repeats = argc > 1 ? std::atol(argv[1]) : 2000;
  if (!lab::amx_usable_or_say_why()) return 0;
  const int64_t ldv = bf16::vnni_words(kN), ldc = ldv;
  std::vector<uint32_t> a(kChunks * kChunk), vnni(kChunks * kHalf * ldv), one(256);
  // Small integers as bf16 pairs (1..8, exact sums), distinct enough that a misplaced one shows.
  auto bf = [](int v) {
    float f = static_cast<float>(v);
    uint32_t w;
    std::memcpy(&w, &f, 4);
    return w >> 16;
  };
  for (size_t i = 0; i < a.size(); ++i) a[i] = bf(1 + i % 7) | bf(1 + i % 5) << 16;
  for (size_t i = 0; i < vnni.size(); ++i) vnni[i] = bf(1 + i % 3) | bf(1 + i % 8) << 16;
  for (uint32_t& w : one) w = 0x3f803f80u;
  const uint32_t* chunks[kChunks];
  for (int i = 0; i < kChunks; ++i) chunks[i] = vnni.data() + i * kHalf * ldv;
  std::vector<float> ref(kM * ldc), got(kM * ldc);
  auto library = [&](float* c) {
    bf16::gemm_amx_chunks(kM, kN, kChunks, kHalf, a.data(), kHalf, kChunk, chunks, ldv, c, ldc,
                          false, kParts, kPart);
  };
  auto chunk_outer = [&](float* c) {
    for (int64_t i = 0; i < kChunks; ++i)
      bf16::gemm_amx_chunks(kM, kN, 1, kHalf, a.data() + i * kChunk, kHalf, 0, chunks + i, ldv, c,
                            ldc, i > 0, kParts, kPart);
  };
  library(ref.data());
  struct Check {
    const char* name;
    bool same;
  };
  stream(0, a.data(), chunks, ldv, one.data(), got.data(), ldc);
  const Check c0{"same stream", std::memcmp(ref.data(), got.data(), ref.size() * 4) == 0};
  chunk_outer(got.data());
  const Check c1{"chunk outer", std::memcmp(ref.data(), got.data(), ref.size() * 4) == 0};
  double_buffered(a.data(), chunks, ldv, got.data(), ldc);
  const Check c2{"2 x 1 double-buffered", std::memcmp(ref.data(), got.data(), ref.size() * 4) == 0};
  for (const Check& c : {c0, c1, c2})
    if (!c.same) return std::printf("%s differs from gemm_amx_chunks\n", c.name), 1;
  const ctxpar::kernel::AmxProbe probe = ctxpar::kernel::probe_amx();
  std::printf("probe (4 chains, no loads): %.0f GFLOP/s\n", probe.gflops);
  std::printf(
      "dV-shaped exact product (64 x 128, 4 x 32 pairs, 3 parts), GFLOP/s of the parts' "
      "products:\n");
  std::printf("  library gemm_amx_chunks      %6.0f\n",
              gflops(repeats, [&] { library(got.data()); }));
  std::printf("  same stream, L1 source       %6.0f\n", gflops(repeats, [&] {
                stream(1, a.data(), chunks, ldv, one.data(), got.data(), ldc);
              }));
  std::printf("  same stream, no loads        %6.0f\n", gflops(repeats, [&] {
                stream(2, a.data(), chunks, ldv, one.data(), got.data(), ldc);
              }));
  std::printf("  chunk outer                  %6.0f\n",
              gflops(repeats, [&] { chunk_outer(got.data()); }));
  std::printf("  2 x 1 double-buffered        %6.0f\n",
              gflops(repeats, [&] { double_buffered(a.data(), chunks, ldv, got.data(), ldc); }));
  return 0;
}

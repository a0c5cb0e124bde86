// Lab 08: where one backward tile pair's time goes on the AMX path (64 query rows x 64 keys,
// D = 128; Note [P V, dV, dK, dQ through AMX] in src/kernel/amx_bf16.cc), exact tier (P and dS
// in 3 bf16 parts) and fast tier (1 part), by CPU time, one thread, each phase repeated:
//   - S and dP: two scores_amx(64 rows, 64 pairs);
//   - the two 64 x 64 transposes (P^T, dS^T): the scalar loop the kernel had, and the library's
//     transpose_tile (simd_tile.h; 16 x 16 register blocks on AVX-512), checked equal;
//   - the three round_to_pairs of P^T, dS^T, dS;
//   - dV, dK, dQ as the kernel called them (issue 40's start): three gemm_amx(64 x 128, 32 pairs),
//     C loaded and stored for every tile pair;
//   - the same products deeper per C load (what the kernel does now, Note [Deeper tile products]
//     in simd_backward_products.h): dV and dK over a block's 4 query tiles (128 pairs, B from
//     4 separate query tiles' pair-rows), dQ over a pass's 2 key tiles (64 pairs);
//   - a candidate for the exact tier (gemm3_1x2 below: A's 3 parts in 3 tiles of their own), checked
//     bitwise equal: 6.25 against 6.85 us here, but no gain end to end (exact backward 138-149
//     GFLOP/s either way, alternating), so not wired.
// Prints microseconds a tile pair per phase and the products' GFLOP/s. The shared build machine
// gives two modes (some runs about 1.7x slower across the board): compare lines of one run.
//   ./build/dev/lab_08_backward_amx [repeats]
// Exits 0 with a note where AMX-BF16 is not usable.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "08_backward_amx.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernel/simd_tile.h"

HWY_BEFORE_NAMESPACE();
namespace lab::HWY_NAMESPACE {
void Transpose(const float* in, float* out) {
  ctxpar::kernel::HWY_NAMESPACE::transpose_tile(in, out);
}
}  // namespace lab::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <immintrin.h>

#include "kernel/amx_probe.h"
#include "kernel/simd_bf16.h"
#include "lab_common.h"

namespace lab {
HWY_EXPORT(Transpose);
}  // namespace lab

namespace {

using lab::cpu_seconds;

// Candidate for the exact tier: C blocks of 16 rows x 32 columns (2 tiles) with A's 3 parts in 3
// tiles of their own, so no A tile is reloaded within a step while a tdpbf16ps may still read it
// (7 of 8 tiles). Same order of additions per C element as gemm_amx (p, then the parts).
__attribute__((target("amx-tile,amx-bf16"))) void gemm3_1x2(int64_t m, int64_t n, int64_t nchunks,
                                                            int64_t chunk_pairs, const uint32_t* a,
                                                            int64_t lda, int64_t a_chunk,
                                                            const uint32_t* const* b, int64_t ldb,
                                                            float* c, int64_t ldc, int64_t split) {
  ctxpar::kernel::load_tile_config(ctxpar::kernel::kTiles16x64);
  const int64_t npairs = nchunks * chunk_pairs;
  for (int64_t r = 0; r < m; r += 16)
    for (int64_t col = 0; col < n; col += 32) {
      float* cp = c + r * ldc + col;
      CTXPAR_TILE_LOAD(0, cp, ldc * 4);
      CTXPAR_TILE_LOAD(1, cp + 16, ldc * 4);
      for (int64_t p = 0; p < npairs; p += 16) {
        const int64_t chunk = p / chunk_pairs, pc = p % chunk_pairs;
        const uint32_t* bp = b[chunk] + pc * ldb + col;
        const uint32_t* ap = a + chunk * a_chunk + r * lda + pc;
        CTXPAR_TILE_LOAD(6, bp, ldb * 4);
        CTXPAR_TILE_LOAD(7, bp + 16, ldb * 4);
        CTXPAR_TILE_LOAD(2, ap, lda * 4);
        CTXPAR_TILE_LOAD(3, ap + split, lda * 4);
        CTXPAR_TILE_LOAD(4, ap + 2 * split, lda * 4);
        _tile_dpbf16ps(0, 2, 6);
        _tile_dpbf16ps(1, 2, 7);
        _tile_dpbf16ps(0, 3, 6);
        _tile_dpbf16ps(1, 3, 7);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
      CTXPAR_TILE_STORE(0, cp, ldc * 4);
      CTXPAR_TILE_STORE(1, cp + 16, ldc * 4);
    }
  _tile_release();
}

// Microseconds a call of f, best of 3 runs of `calls`.
template <class F>
double micros(long calls, F&& f) {
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    f();
    const double t0 = cpu_seconds();
    for (long i = 0; i < calls; ++i) f();
    best = std::min(best, (cpu_seconds() - t0) / static_cast<double>(calls) * 1e6);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  namespace bf16 = ctxpar::kernel::bf16;
  const long repeats = argc > 1 ? std::atol(argv[1]) : 4000;
  if (!lab::amx_usable_or_say_why()) return 0;
  constexpr int64_t kT = 64, kD = 128, kHalf = 32;
  const int64_t ldv = bf16::vnni_words(kD), ldq = bf16::row_words(kD, true);
  const int64_t np = bf16::stored_pairs(kD, true);
  std::vector<uint32_t> q(kT * ldq, 0x3f803f80u), key(np * kT, 0x3f803f80u);
  std::vector<uint32_t> vnni(4 * kHalf * ldv, 0x3f803f80u);  // 4 query tiles' pair-rows
  std::vector<float> s(kT * kT), dp(kT * kT), st(kT * kT), dst(kT * kT);
  for (int64_t i = 0; i < kT * kT; ++i)  // distinct values, so a misplaced one shows
    s[i] = 1.0f / static_cast<float>(i + 1), dp[i] = 0.5f - s[i];
  std::vector<float> dv(kT * ldv, 0.0f), dk(kT * ldv, 0.0f), dq(kT * ldv, 0.0f);
  for (const int nsplit : {3, 1}) {
    std::vector<uint32_t> a(4 * 3 * kT * kHalf, 0x3f803f80u);  // 4 tiles' A, 3 parts each
    const double scores = micros(repeats, [&] {
      bf16::scores(kT, np, q.data(), ldq, key.data(), s.data(), 0.5f, true);
      bf16::scores(kT, np, q.data(), ldq, key.data(), dp.data(), 1.0f, true);
    });
    const double loop = micros(repeats, [&] {
      for (int64_t i = 0; i < kT; ++i)
        for (int64_t j = 0; j < kT; ++j)
          st[j * kT + i] = s[i * kT + j], dst[j * kT + i] = dp[i * kT + j];
    });
    const std::vector<float> st_loop = st;
    const double transposes = micros(repeats, [&] {
      HWY_DYNAMIC_DISPATCH(lab::Transpose)(s.data(), st.data());
      HWY_DYNAMIC_DISPATCH(lab::Transpose)(dp.data(), dst.data());
    });
    if (std::memcmp(st.data(), st_loop.data(), st.size() * sizeof(float)) != 0) {
      std::printf("transpose_tile differs from the loop\n");
      return 1;
    }
    const double rounds = micros(repeats, [&] {
      bf16::round_to_pairs(st.data(), kT, kT, kHalf, a.data(), kHalf, nsplit, kT * kHalf);
      bf16::round_to_pairs(dst.data(), kT, kT, kHalf, a.data() + kT * kHalf * 3, kHalf, 1, 0);
      bf16::round_to_pairs(dp.data(), kT, kT, kHalf, a.data(), kHalf, nsplit, kT * kHalf);
    });
    const double shallow = micros(repeats, [&] {
      for (float* c : {dv.data(), dk.data(), dq.data()})
        bf16::gemm_amx(kT, kD, kHalf, a.data(), kHalf, vnni.data(), ldv, c, ldv, true, nsplit,
                       kT * kHalf);
    });
    // Per tile pair: a quarter of dV's and dK's 128-pair call, half of dQ's 64-pair call.
    const uint32_t* chunks[4];
    for (int i = 0; i < 4; ++i) chunks[i] = vnni.data() + i * kHalf * ldv;
    // A as the kernel lays it out now: each tile's parts one after the other (8 KiB a part).
    const double deep =
        micros(repeats / 4,
               [&] {
                 for (float* c : {dv.data(), dk.data()})
                   bf16::gemm_amx_chunks(kT, kD, 4, kHalf, a.data(), kHalf, nsplit * kT * kHalf,
                                         chunks, ldv, c, ldv, true, nsplit, kT * kHalf);
                 for (int h = 0; h < 2; ++h)
                   bf16::gemm_amx_chunks(kT, kD, 2, kHalf, a.data(), kHalf, nsplit * kT * kHalf,
                                         chunks, ldv, dq.data(), ldv, true, nsplit, kT * kHalf);
               }) /
        4;
    double cand = 0;
    if (nsplit == 3) {
      std::vector<float> ref = dv, got = dv;
      bf16::gemm_amx_chunks(kT, kD, 4, kHalf, a.data(), kHalf, nsplit * kT * kHalf, chunks, ldv,
                            ref.data(), ldv, true, nsplit, kT * kHalf);
      gemm3_1x2(kT, kD, 4, kHalf, a.data(), kHalf, nsplit * kT * kHalf, chunks, ldv, got.data(),
                ldv, kT * kHalf);
      if (std::memcmp(ref.data(), got.data(), ref.size() * sizeof(float)) != 0)
        return std::printf("gemm3_1x2 differs from gemm_amx_chunks\n"), 1;
      cand = micros(repeats / 4,
                    [&] {
                      for (float* c : {dv.data(), dk.data()})
                        gemm3_1x2(kT, kD, 4, kHalf, a.data(), kHalf, nsplit * kT * kHalf, chunks,
                                  ldv, c, ldv, kT * kHalf);
                      for (int h = 0; h < 2; ++h)
                        gemm3_1x2(kT, kD, 2, kHalf, a.data(), kHalf, nsplit * kT * kHalf, chunks,
                                  ldv, dq.data(), ldv, kT * kHalf);
                    }) /
             4;
      std::printf("candidate 1 x 2 blocks, parts in 3 tiles: %.2f us a tile pair\n", cand);
    }
    const double flops = 3.0 * 2 * kT * kD * kT * nsplit;
    std::printf(
        "%s tier (%d part%s), us a tile pair: S + dP %.2f, transposes %.2f (loop %.2f), "
        "round_to_pairs %.2f; dV + dK + dQ %.2f (%.0f GFLOP/s) -> deeper %.2f (%.0f "
        "GFLOP/s)\n",
        nsplit == 3 ? "exact" : "fast", nsplit, nsplit == 1 ? "" : "s", scores, transposes, loop,
        rounds, shallow, flops / shallow / 1e3, deep, flops / deep / 1e3);
  }
  return 0;
}
#endif  // HWY_ONCE

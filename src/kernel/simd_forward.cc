// The fast forward: K/V of the block packed once per call (K transposed, V row-major, fp32,
// zero-padded to 64-key tiles) and shared by every query tile; per (batch, query head, two
// query tiles) task the scores S = Q K^T and the update O += P V run through the
// register-blocked micro-kernel of simd_tile.h, with the online softmax in base 2 in between.
//
// Note [Scores in natural units, exponents in base 2]: Q is packed pre-multiplied by the
// softmax scale, so S and the running max m are in natural units, exactly as the state, the
// LSE and the backward hold them. Only the argument of each exponential, the small difference
// S - m, is converted: P = 2^((S - m) log2(e)). Keeping S itself in natural units matters for
// the backward: it recomputes P = exp(S - LSE) from the forward's fp32 LSE, and the row's max
// score must come out as the same fp32 number there (for a one-hot row LSE == max S, so P = 1
// exactly). Scores converted to log2 units and back differed from LSE by an ulp of |S| -- at
// |S| ~ 5e8 that is 2^(+-64) (issue 9). Rescaling is lazy: a row's acc and l are multiplied by
// alpha = exp(m_old - m_new) only when its max actually grew.
// Compiled once per SIMD target (hwy/foreach_target.h re-includes this file); forward_simd at
// the bottom dispatches to the chosen one.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernel/simd_forward.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <vector>

#include "kernel/problem.h"
#include "kernel/simd_bf16.h"
#include "kernel/simd_tile.h"

HWY_BEFORE_NAMESPACE();
namespace ctxpar::kernel::HWY_NAMESPACE {

KernelStats ForwardSimd(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                         const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                         const Mask& mask, const ForwardStateView& state) {
  // q [B, Tq, Hq, D]; k, v [B, Tk, Hkv, D]; state.acc [B, Tq, Hq, D], state.m/l [B, Hq, Tq].
  const TileRanges qr = tile_ranges(q_tokens, p.tq, kTile, mask.documents);
  const TileRanges kr = tile_ranges(k_tokens, p.tk, kTile, mask.documents);
  const int64_t d = p.d, dp = round_up(d, lanes()), nkt = kr.count(), nqt = qr.count();
  const int64_t ld = padded_ld(dp);  // row stride of V, Q and acc tiles (Note [Padded rows])
  // Packed K^T tiles [B, Hkv, nkt][D][64] and V tiles [B, Hkv, nkt][64][dp].
  float* kpack =
      p.bf16_scores ? nullptr : scratch(Scratch::k_pack, p.batch * p.hkv * nkt * d * kTile);
  // With AMX, O += P V in tiles too (Note [P V, dV, dK, dQ through AMX] in amx_bf16.cc): P split
  // into 3 bf16 parts (the exact tier) or rounded to one (the fast tier), V packed as VNNI
  // pair-rows instead; with vdpbf16ps, the fast tier's the same way (Note [The fast tier through
  // vdpbf16ps] in simd_bf16.cc). Both write columns up to d rounded to 16, which the acc rows
  // must hold (they do on the avx512 targets, the only ones with bf16 products).
  const int64_t n16 = round_up(d, 16), ldv = bf16::vnni_words(d);
  const bool pairs_pv = bf16::pair_products(p.bf16_scores, p.amx, p.round_p) &&
                      v.dtype() == DType::bf16 && n16 <= ld;
  const int nsplit = bf16::amx_parts(p.round_p);
  uint32_t* vvnni =
      pairs_pv ? bf16::buffer(bf16::Buffer::v_vnni, p.batch * p.hkv * nkt * (kTile / 2) * ldv)
             : nullptr;
  float* vpack = pairs_pv ? nullptr : scratch(Scratch::v_pack, p.batch * p.hkv * nkt * kTile * ld);
  // With exact bf16 products (simd_bf16.h) K is packed as tiles of bf16 pairs instead.
  const int64_t np = bf16::stored_pairs(d, p.amx), ldw = bf16::row_words(d, p.amx);
  uint32_t* kpairs =
      p.bf16_scores ? bf16::buffer(bf16::Buffer::k_tiles, p.batch * p.hkv * nkt * np * kTile)
                    : nullptr;
  const int64_t pack_tasks = p.batch * p.hkv * nkt;
#pragma omp parallel num_threads(p.threads)
  {
    std::vector<float> row(d);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < pack_tasks; ++t) {
      const int64_t kt = t % nkt, hk = (t / nkt) % p.hkv, b = t / (nkt * p.hkv);
      const int64_t cols = std::min(p.tk, (kt + 1) * kTile) - kt * kTile;
      if (p.bf16_scores)
        bf16::pack_tile(k, b, hk, kt * kTile, cols, d, kpairs + t * np * kTile, p.amx);
      else
        pack_transposed(k, b, hk, kt * kTile, cols, d, kpack + t * d * kTile, row.data());
      if (pairs_pv)
        bf16::pack_vnni(v, b, hk, kt * kTile, cols, d, ldv, vvnni + t * (kTile / 2) * ldv, kTile);
      else
        pack_rows(v, b, hk, kt * kTile, cols, d, ld, vpack + t * kTile * ld);
    }
  }

  float* acc_state = state.acc().ptr<float>();
  float* m_state = state.m().ptr<float>();
  float* l_state = state.l().ptr<float>();
  // Note [Two query tiles a task]: a task takes kSub = 2 consecutive 64-row query tiles, so
  // every K / V tile it brings into L1 serves 128 query rows instead of 64 (faster forward;
  // the measurement: docs/kernel.md, "Forward tasks"). Which (query tile, key tile)
  // pairs are computed is exactly as with one tile a task: per key tile each query tile is
  // classified on its own, and the rows of a skipped one are left out of the products (with two
  // tiles the computed ones are always adjacent). A row's result never depends on its
  // neighbours, so the bits, the tile counts and tile_progress() calls are those of 64-row tasks.
  constexpr int64_t kSub = 2;
  const int64_t npairs = (nqt + kSub - 1) / kSub;
  const int64_t tasks = p.batch * p.hq * npairs;
  // S = Q K^T streams K^T in L1 panels
  const int64_t k_panel = kernel_k_panel(kTile, d, p.l1d_bytes);
  const DF df;
  const int64_t nl = lanes();
#pragma omp parallel num_threads(p.threads)
  {
    constexpr int64_t kRows = kSub * kTile;
    std::vector<float> qt(kRows * ld), s(kRows * kTile), acc(kRows * ld), m(kRows);
    // Row sums kept as one vector per row (lanes summed once per task, not once per tile).
    std::vector<float> lv(kRows * nl);
    std::vector<uint32_t> qpairs(p.bf16_scores ? kRows * ldw : 0);  // Q as bf16 pairs, unscaled
    const int64_t split_words = kRows * (kTile / 2);
    std::vector<uint32_t> ppairs(pairs_pv ? nsplit * split_words : 0);  // P's parts as pairs
    // Each task owns its rows of the state, so which thread runs it cannot change the result:
    // dynamic scheduling balances causal masks (late query tiles see more keys) for free.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t qp = task % npairs, h = (task / npairs) % p.hq, b = task / (npairs * p.hq);
      const int64_t hk = h / p.group, q0 = qp * kSub, nsub = std::min(kSub, nqt - q0);
      const int64_t i0 = q0 * kTile, rows = std::min(p.tq, i0 + nsub * kTile) - i0;
      if (p.bf16_scores)
        bf16::pack_rows(q, b, h, i0, rows, d, ldw, qpairs.data(), kRows);
      else
        pack_rows(q, b, h, i0, rows, d, ld, qt.data(), p.scale, kRows);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t stat = (b * p.hq + h) * p.tq + i0 + r;
        m[r] = m_state[stat];
        std::fill_n(lv.data() + r * nl, nl, 0.0f);
        lv[r * nl] = l_state[stat];
        std::copy_n(acc_state + ((b * p.tq + i0 + r) * p.hq + h) * d, d, acc.data() + r * ld);
      }
      bool touched = false;
      for (int64_t kt = 0; kt < nkt; ++kt) {
        TileKind kinds[kSub];
        int64_t first = -1, last = -1;  // the computed query tiles of this task: [first, last]
        for (int64_t u = 0; u < nsub; ++u) {
          kinds[u] = classify(mask, qr, q0 + u, kr, kt);
          if (kinds[u] == TileKind::skip) continue;
          if (first < 0) first = u;
          last = u;
        }
        if (first < 0) continue;
        touched = true;
        const int64_t j0 = kt * kTile, cols = std::min(p.tk, j0 + kTile) - j0;
        const int64_t pk = (b * p.hkv + hk) * nkt + kt;
        // Rows [r0, r0 + mrows): the computed tiles' rows; any beyond `rows` are zero padding.
        const int64_t r0 = first * kTile, r1 = std::min(rows, (last + 1) * kTile);
        const int64_t mrows = round_up(r1 - r0, 4);
        if (p.bf16_scores)  // S = scale (Q K^T), the products exact (simd_bf16.h)
          bf16::scores(mrows, np, qpairs.data() + r0 * ldw, ldw, kpairs + pk * np * kTile,
                       s.data() + r0 * kTile, p.scale, p.amx);
        else
          gemm_rows(mrows, kTile, d, qt.data() + r0 * ld, ld, kpack + pk * d * kTile, kTile,
                    s.data() + r0 * kTile, kTile, false, k_panel);
        for (int64_t u = first; u <= last; ++u) {
          const int64_t u0 = u * kTile, urows = std::min(rows, u0 + kTile) - u0;
          if (kinds[u] == TileKind::partial || cols < kTile)
            mask_tile(s.data() + u0 * kTile, urows, cols, kinds[u] == TileKind::partial, mask,
                      q_tokens, i0 + u0, k_tokens, j0);
        }
        for (int64_t r = r0; r < r0 + mrows; ++r) {
          float* sr = s.data() + r * kTile;
          if (r >= rows) {  // padding rows: P = 0 keeps their (unused) acc at 0
            std::fill(sr, sr + kTile, 0.0f);
            continue;
          }
          softmax_row(sr, m[r], lv.data() + r * nl, acc.data() + r * ld, dp);
        }
        // The fast bf16 tier: P rounded for O += P V only (l summed the fp32 P above).
        if (pairs_pv) {  // P's parts, or P rounded (the fast tier), times V as pairs
          // 16-row tiles: rows past mrows are padding rows (r >= rows), their P pairs zero.
          const int64_t m16 = round_up(mrows, 16);
          bf16::round_to_pairs(s.data() + r0 * kTile, kTile, mrows, kTile / 2, ppairs.data(),
                               kTile / 2, nsplit, split_words);
          for (int sp = 0; sp < nsplit; ++sp)
            std::fill(ppairs.data() + sp * split_words + mrows * (kTile / 2),
                      ppairs.data() + sp * split_words + m16 * (kTile / 2), 0u);
          bf16::gemm_pairs(m16, n16, kTile / 2, ppairs.data(), kTile / 2,
                           vvnni + pk * (kTile / 2) * ldv, ldv, acc.data() + r0 * ld, ld, true,
                           p.amx, nsplit, split_words);
        } else {
          if (p.round_p) round_bf16(s.data() + r0 * kTile, mrows * kTile);
          gemm_rows(mrows, dp, cols, s.data() + r0 * kTile, kTile, vpack + pk * kTile * ld, ld,
                    acc.data() + r0 * ld, ld, true);
        }
        // The MPI transport's progress calls, if installed (tile_progress.h): one a tile.
        for (int64_t u = first; u <= last; ++u) tile_progress();
      }
      if (!touched) continue;
      // Rows of a query tile that computed nothing are written back unchanged (same bits).
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t stat = (b * p.hq + h) * p.tq + i0 + r;
        m_state[stat] = m[r];
        l_state[stat] = hn::GetLane(hn::SumOfLanes(df, hn::LoadU(df, lv.data() + r * nl)));
        std::copy_n(acc.data() + r * ld, d, acc_state + ((b * p.tq + i0 + r) * p.hq + h) * d);
      }
    }
  }
  return count_tiles(p, mask, qr, kr, 1.0);
}

// The target's vector exp2 over n values (n any), for its accuracy test.
void Exp2Neg(const float* in, float* out, int64_t n) {
  const DF df;
  const int64_t nl = lanes();
  std::vector<float> a(round_up(n, nl), 0.0f), b(a.size());
  std::copy_n(in, n, a.data());
  for (int64_t i = 0; i < static_cast<int64_t>(a.size()); i += nl)
    hn::StoreU(exp2_neg(df, hn::LoadU(df, a.data() + i)), df, b.data() + i);
  std::copy_n(b.data(), n, out);
}

// Whether the target's MulAdd is one fused operation (AVX2, AVX-512) or a multiply then an
// add (SSE4, SSSE3): the backward's delta must round the same way (api.cc).
bool NativeFma() { return HWY_NATIVE_FMA != 0; }

}  // namespace ctxpar::kernel::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ctxpar::kernel {

HWY_EXPORT(ForwardSimd);
HWY_EXPORT(Exp2Neg);
HWY_EXPORT(NativeFma);

KernelStats forward_simd(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                         const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                         const Mask& mask, const ForwardStateView& state) {
  return HWY_DYNAMIC_DISPATCH(ForwardSimd)(p, q, q_tokens, k, v, k_tokens, mask, state);
}

bool simd_fused_multiply_add() {
  select_simd_target();
  return HWY_DYNAMIC_DISPATCH(NativeFma)();
}

void exp2_neg_simd(const float* in, float* out, int64_t n) {
  select_simd_target();
  HWY_DYNAMIC_DISPATCH(Exp2Neg)(in, out, n);
}

}  // namespace ctxpar::kernel
#endif  // HWY_ONCE

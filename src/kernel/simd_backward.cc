// The fast backward (flash-attention-2 form) on the micro-kernel of simd_tile.h.
//
// Note [Backward tasks]: a task is (batch, kv head, chunk of key tiles; chunk c of n takes key
// tiles c, c + n, c + 2n, ..., which balances causal masks). It owns the dK / dV
// rows of its key tiles (accumulated in a 64-row tile by a two-level sum over query tiles,
// Note [Blocked dK / dV] in simd_tile.h, added to the caller's dk / dv once) and writes the dQ
// of its query-head group into its own partial buffer; partials are summed in a
// fixed chunk order at the end. There is one chunk per (batch, kv head) unless there are fewer
// of those than threads, so the result is bitwise the same for a given thread count and no two
// threads ever write the same element.
//
// Per (query tile, key tile), in natural units as the forward (Note [Scores in natural units,
// exponents in base 2]):
//   S  = Qs K^T            Qs = Q * scale, rounded exactly as the forward rounded it
//   P  = 2^(min(S - lse, 0) log2(e))   masked and fully masked rows give P = 0; P <= 1 always
//   dP = dO V^T
//   dS = P * (dP - delta)
//   dV += P^T dO,  dQ += scale * dS K,  dK += dS^T Qs  (= scale * dS^T Q)
// Note [P at most one]: exp(S - lse) with lse = log sum exp(S) over the row can never exceed 1
// in exact arithmetic; in fp32, S - lse may come out a few ulps of |S| above 0 where S is the
// row's max (lse is rounded), and at |S| ~ 5e8 an ulp is 64: P = 2^64 made dq ~ 4e7 where the
// truth is 0. Clamping the exponent at 0 is exact for the true P and bounds the rounded one.
// Compiled once per SIMD target (hwy/foreach_target.h re-includes this file); backward_simd at
// the bottom dispatches to the chosen one.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernel/simd_backward.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <vector>

#include "kernel/problem.h"
#include "kernel/simd_bf16.h"
#include "kernel/simd_tile.h"

HWY_BEFORE_NAMESPACE();
namespace ctxpar::kernel::HWY_NAMESPACE {

KernelStats BackwardSimd(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                          const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                          const Mask& mask, const TensorView& dout, const TensorView& lse,
                          const TensorView& delta, const TensorView& dq, const TensorView& dk,
                          const TensorView& dv) {
  // q, dout, dq [B, Tq, Hq, D]; k, v, dk, dv [B, Tk, Hkv, D]; lse, delta [B, Hq, Tq].
  const TileRanges qr = tile_ranges(q_tokens, p.tq, kTile, mask.documents);
  const TileRanges kr = tile_ranges(k_tokens, p.tk, kTile, mask.documents);
  const int64_t d = p.d, dp = round_up(d, lanes()), nkt = kr.count(), nqt = qr.count();
  const int64_t ld = padded_ld(dp);  // row stride of the [rows][dp] tiles (Note [Padded rows])
  const int64_t heads = p.batch * p.hkv;
  const int64_t chunks = heads >= p.threads ? 1 : std::min(nkt, (p.threads + heads - 1) / heads);
  const int64_t tasks = heads * chunks;
  const int64_t q_block = p.group * nqt * kTile * ld;  // one task's packed Q (or dO, or dQ)
  float* dq_partial = scratch(Scratch::dq_partial, tasks * q_block);
  // S and dP stream K^T, V^T in L1 panels
  const int64_t k_panel = kernel_k_panel(kTile, d, p.l1d_bytes);
  const DF df;
  const int64_t nl = lanes();
  // With AMX, dV, dK and dQ in tiles too (Note [P V, dV, dK, dQ through AMX] in amx_bf16.cc): P and
  // dS split into 3 bf16 parts (the exact tier) or rounded to one (the fast tier), Q, dO and K as
  // VNNI pair-rows (the fp32 Qs and dO packs are then not needed); with vdpbf16ps, the fast tier's
  // the same way (Note [The fast tier through vdpbf16ps] in simd_bf16.cc). Both write columns up
  // to d rounded to 16, which the accumulators' rows hold. `pairs_pv`: these pair products.
  const int64_t n16 = round_up(d, 16), ldv = bf16::vnni_words(d), hp = kTile / 2;
  const bool pairs_pv =
      bf16::pair_products(p.bf16_scores && p.bf16_dp, p.amx, p.round_p) && n16 <= ld;
  const int nsplit = bf16::amx_parts(p.round_p);
  const int64_t split_words = kTile * hp;            // one part of a 64 x 64 P or dS tile, as pairs
  const int64_t v_block = p.group * nqt * hp * ldv;  // one task's Q (or dO) pair-rows

#pragma omp parallel num_threads(p.threads)
  {
    float* qpack = pairs_pv ? nullptr : scratch(Scratch::q_pack, q_block);
    float* dopack = pairs_pv ? nullptr : scratch(Scratch::do_pack, q_block);
    uint32_t* qvnni = pairs_pv ? bf16::buffer(bf16::Buffer::q_vnni, v_block) : nullptr;
    uint32_t* dovnni = pairs_pv ? bf16::buffer(bf16::Buffer::do_vnni, v_block) : nullptr;
    std::vector<uint32_t> ptp(pairs_pv ? nsplit * split_words : 0), dstp(ptp.size()), dsp(ptp.size());
    // Exact bf16 products (simd_bf16.h): Q (unscaled) and dO also as bf16 pairs.
    const int64_t np = bf16::stored_pairs(d, p.amx), ldw = bf16::row_words(d, p.amx);
    const int64_t w_block = p.group * nqt * kTile * ldw;
    uint32_t* qpairs = p.bf16_scores ? bf16::buffer(bf16::Buffer::q_rows, w_block) : nullptr;
    uint32_t* dopairs = p.bf16_dp ? bf16::buffer(bf16::Buffer::do_rows, w_block) : nullptr;
    std::vector<float> lse_rows(p.group * nqt * kTile), dlt(p.group * nqt * kTile);
    // Note [Two key tiles a pass]: the task walks its key tiles two at a time, and each query
    // tile's packed Q and dO rows serve both before the next query tile is read: half the
    // passes over the group's Q and dO (2.3 MiB each at T = 4096, D = 128: L2 or beyond). Every
    // element's additions keep their order (dK / dV per key tile over query tiles as before; a
    // dQ row gets key tile c, then c + chunks, ...), so the bits are those of one tile a pass.
    struct KeyTile {
      // dk / dv: the block partials (Note [Blocked dK / dV]); *_sum, *_comp: the compensated
      // sum of the blocks; in_block: query tiles in the current block.
      std::vector<float> kt_pack, vt_pack, k_rows, dk, dv, dk_sum, dv_sum, dk_comp, dv_comp;
      std::vector<uint32_t> kt_pairs, vt_pairs;  // bf16 products' key tiles
      std::vector<uint32_t> k_vnni;               // K's pair-rows for dQ through AMX
      int64_t kt = 0, j0 = 0, cols = 0, in_block = 0;
      bool packed = false;
      void flush() {  // the block partial into the compensated sum
        if (in_block == 0) return;
        add_compensated(static_cast<int64_t>(dk.size()), dk.data(), dk_sum.data(), dk_comp.data());
        add_compensated(static_cast<int64_t>(dv.size()), dv.data(), dv_sum.data(), dv_comp.data());
        in_block = 0;
      }
    };
    KeyTile keys[2];
    for (KeyTile& t : keys) {
      t.kt_pack.resize(d * kTile), t.vt_pack.resize(d * kTile);
      t.k_rows.resize(pairs_pv ? 0 : kTile * ld);  // with pair products, dQ reads k_vnni
      t.dk.resize(kTile * ld), t.dv.resize(kTile * ld);
      for (std::vector<float>* x : {&t.dk_sum, &t.dv_sum, &t.dk_comp, &t.dv_comp})
        x->resize(kTile * ld);
      t.kt_pairs.resize(p.bf16_scores ? np * kTile : 0),
          t.vt_pairs.resize(p.bf16_dp ? np * kTile : 0);
      t.k_vnni.resize(pairs_pv ? hp * ldv : 0);
    }
    std::vector<float> row(d);
    std::vector<float> s(kTile * kTile), dpm(kTile * kTile), pt(kTile * kTile), dst(kTile * kTile);
    // A task's result does not depend on the thread that runs it (see the note), so dynamic
    // scheduling is safe for determinism.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t chunk = task % chunks, bh = task / chunks;
      const int64_t b = bh / p.hkv, hk = bh % p.hkv;
      float* dq_acc = dq_partial + task * q_block;
      std::fill(dq_acc, dq_acc + q_block, 0.0f);
      // Pack the group's Q (scaled) and dO tiles, and their row statistics, once per task.
      for (int64_t g = 0; g < p.group; ++g)
        for (int64_t qi = 0; qi < nqt; ++qi) {
          const int64_t h = hk * p.group + g, i0 = qi * kTile;
          const int64_t rows = std::min(p.tq, i0 + kTile) - i0, off = (g * nqt + qi) * kTile;
          if (pairs_pv) {
            bf16::pack_vnni(q, b, h, i0, rows, d, ldv, qvnni + off / 2 * ldv, kTile);
            bf16::pack_vnni(dout, b, h, i0, rows, d, ldv, dovnni + off / 2 * ldv, kTile);
          } else {
            pack_rows(q, b, h, i0, rows, d, ld, qpack + off * ld, p.scale);
            pack_rows(dout, b, h, i0, rows, d, ld, dopack + off * ld);
          }
          if (p.bf16_scores) bf16::pack_rows(q, b, h, i0, rows, d, ldw, qpairs + off * ldw, kTile);
          if (p.bf16_dp) bf16::pack_rows(dout, b, h, i0, rows, d, ldw, dopairs + off * ldw, kTile);
          for (int64_t r = 0; r < kTile; ++r) {
            lse_rows[off + r] = r < rows ? lse.ptr<const float>()[lse.offset(b, h, i0 + r)] : kNegInf;
            dlt[off + r] = r < rows ? delta.ptr<const float>()[delta.offset(b, h, i0 + r)] : 0.0f;
          }
        }
      // Chunks take every chunks-th key tile: under a causal mask early key tiles see more
      // query tiles, so contiguous ranges would give the first chunk most of the work.
      for (int64_t kt0 = chunk; kt0 < nkt; kt0 += 2 * chunks) {
        const int64_t nkeys = kt0 + chunks < nkt ? 2 : 1;
        for (int64_t u = 0; u < nkeys; ++u) {
          KeyTile& t = keys[u];
          t.kt = kt0 + u * chunks, t.j0 = t.kt * kTile, t.cols = std::min(p.tk, t.j0 + kTile) - t.j0;
          t.packed = false, t.in_block = 0;
          std::fill(t.dk_sum.begin(), t.dk_sum.end(), 0.0f);
          std::fill(t.dv_sum.begin(), t.dv_sum.end(), 0.0f);
          std::fill(t.dk_comp.begin(), t.dk_comp.end(), 0.0f);
          std::fill(t.dv_comp.begin(), t.dv_comp.end(), 0.0f);
        }
        for (int64_t g = 0; g < p.group; ++g)
          for (int64_t qi = 0; qi < nqt; ++qi)
            for (int64_t u = 0; u < nkeys; ++u) {
              KeyTile& t = keys[u];
              const int64_t j0 = t.j0, cols = t.cols;
              const TileKind kind = classify(mask, qr, qi, kr, t.kt);
              if (kind == TileKind::skip) continue;
              if (!t.packed) {  // pack this key tile only when some query tile sees it
                if (p.bf16_scores)
                  bf16::pack_tile(k, b, hk, j0, cols, d, t.kt_pairs.data(), p.amx);
                else
                  pack_transposed(k, b, hk, j0, cols, d, t.kt_pack.data(), row.data());
                if (p.bf16_dp)
                  bf16::pack_tile(v, b, hk, j0, cols, d, t.vt_pairs.data(), p.amx);
                else
                  pack_transposed(v, b, hk, j0, cols, d, t.vt_pack.data(), row.data());
                if (pairs_pv)
                  bf16::pack_vnni(k, b, hk, j0, cols, d, ldv, t.k_vnni.data(), kTile);
                else
                  pack_rows(k, b, hk, j0, cols, d, ld, t.k_rows.data());
                t.packed = true;
              }
              const int64_t i0 = qi * kTile, rows = std::min(p.tq, i0 + kTile) - i0;
              const int64_t mrows = round_up(rows, 4), off = (g * nqt + qi) * kTile;
              const float* qs = pairs_pv ? nullptr : qpack + off * ld;
              const float* dot = pairs_pv ? nullptr : dopack + off * ld;
              if (p.bf16_scores)  // S = scale (Q K^T) as the forward's bf16 products
                bf16::scores(mrows, np, qpairs + off * ldw, ldw, t.kt_pairs.data(), s.data(),
                             p.scale, p.amx);
              else
                gemm_rows(mrows, kTile, d, qs, ld, t.kt_pack.data(), kTile, s.data(), kTile,
                          false, k_panel);
              if (p.bf16_dp)
                bf16::scores(mrows, np, dopairs + off * ldw, ldw, t.vt_pairs.data(), dpm.data(), 1.0f, p.amx);
              else
                gemm_rows(mrows, kTile, d, dot, ld, t.vt_pack.data(), kTile, dpm.data(), kTile,
                          false, k_panel);
              if (kind == TileKind::partial || cols < kTile)
                mask_tile(s.data(), rows, cols, kind == TileKind::partial, mask, q_tokens, i0,
                          k_tokens, j0);
              for (int64_t r = 0; r < kTile; ++r) {
                float* sr = s.data() + r * kTile;
                float* dr = dpm.data() + r * kTile;
                if (r >= rows || lse_rows[off + r] == kNegInf) {  // padding or fully masked row
                  std::fill(sr, sr + kTile, 0.0f);
                  std::fill(dr, dr + kTile, 0.0f);
                  continue;
                }
                const VF vl = hn::Set(df, lse_rows[off + r]), vd = hn::Set(df, dlt[off + r]);
                const VF vscale = hn::Set(df, p.scale), vlog2e = hn::Set(df, kLog2e);
                for (int64_t c = 0; c < kTile; c += nl) {
                  // Note [P at most one]: the exponent is clamped at 0.
                  const VF e = hn::Min(hn::Sub(hn::LoadU(df, sr + c), vl), hn::Zero(df));
                  const VF pv = exp2_neg(df, hn::Mul(e, vlog2e));
                  const VF ds = hn::Mul(pv, hn::Sub(hn::LoadU(df, dr + c), vd));
                  hn::StoreU(pv, df, sr + c);                   // s <- P
                  hn::StoreU(hn::Mul(ds, vscale), df, dr + c);  // dpm <- scale * dS
                }
              }
              if (p.round_p && !pairs_pv) {  // the fast bf16 tier: P for dV, scale dS for dQ and dK
                round_bf16(s.data(), kTile * kTile);
                round_bf16(dpm.data(), kTile * kTile);
              }
              transpose_tile(s.data(), pt.data());
              transpose_tile(dpm.data(), dst.data());
              // dV += P^T dO; dK += (scale dS)^T Qs (times 1 / scale at the end), into the
              // block partials, a block's first tile overwriting (Note [Blocked dK / dV]);
              // dQ += scale dS K.
              const bool fresh = t.in_block == 0;
              if (pairs_pv) {  // all 64 rows: those past `rows` are zero in P and dS
                bf16::round_to_pairs(pt.data(), kTile, kTile, hp, ptp.data(), hp, nsplit,
                                     split_words);
                bf16::round_to_pairs(dst.data(), kTile, kTile, hp, dstp.data(), hp, nsplit,
                                     split_words);
                bf16::round_to_pairs(dpm.data(), kTile, kTile, hp, dsp.data(), hp, nsplit,
                                     split_words);
                const int64_t voff = off / 2 * ldv;
                bf16::gemm_pairs(kTile, n16, hp, ptp.data(), hp, dovnni + voff, ldv, t.dv.data(),
                                 ld, !fresh, p.amx, nsplit, split_words);
                bf16::gemm_pairs(kTile, n16, hp, dstp.data(), hp, qvnni + voff, ldv, t.dk.data(),
                                 ld, !fresh, p.amx, nsplit, split_words);
                if (++t.in_block == kDkvBlock) t.flush();
                bf16::gemm_pairs(kTile, n16, hp, dsp.data(), hp, t.k_vnni.data(), ldv,
                                 dq_acc + off * ld, ld, true, p.amx, nsplit, split_words);
              } else {
                gemm_rows(kTile, dp, mrows, pt.data(), kTile, dot, ld, t.dv.data(), ld, !fresh);
                gemm_rows(kTile, dp, mrows, dst.data(), kTile, qs, ld, t.dk.data(), ld, !fresh);
                if (++t.in_block == kDkvBlock) t.flush();
                gemm_rows(mrows, dp, cols, dpm.data(), kTile, t.k_rows.data(), ld,
                          dq_acc + off * ld, ld, true);
              }
              tile_progress();  // the MPI transport's progress calls, if installed
            }
        const float dk_mul = pairs_pv ? 1.0f : 1.0f / p.scale;  // the pairs' dK used the unscaled Q
        for (int64_t u = 0; u < nkeys; ++u) {
          KeyTile& t = keys[u];
          if (!t.packed) continue;
          t.flush();
          for (int64_t j = 0; j < t.cols; ++j) {
            float* dkr = dk.ptr<float>() + dk.offset(b, t.j0 + j, hk);
            float* dvr = dv.ptr<float>() + dv.offset(b, t.j0 + j, hk);
            for (int64_t c = 0; c < d; ++c) {  // sum - comp: the running sum's lost part back
              dkr[c] += dk_mul * (t.dk_sum[j * ld + c] - t.dk_comp[j * ld + c]);
              dvr[c] += t.dv_sum[j * ld + c] - t.dv_comp[j * ld + c];
            }
          }
        }
      }
    }
    // dQ: the partials of each (batch, kv head) summed in chunk order into the caller's dq.
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < heads; ++bh) {
      const int64_t b = bh / p.hkv, hk = bh % p.hkv;
      for (int64_t g = 0; g < p.group; ++g)
        for (int64_t i = 0; i < p.tq; ++i) {
          float* dqr = dq.ptr<float>() + dq.offset(b, i, hk * p.group + g);
          const int64_t off = ((g * nqt) * kTile + i) * ld;
          for (int64_t chunk = 0; chunk < chunks; ++chunk) {
            const float* part = dq_partial + (bh * chunks + chunk) * q_block + off;
            for (int64_t c = 0; c < d; ++c) dqr[c] += part[c];
          }
        }
    }
  }
  return count_tiles(p, mask, qr, kr, 2.5);
}

}  // namespace ctxpar::kernel::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ctxpar::kernel {

HWY_EXPORT(BackwardSimd);

KernelStats backward_simd(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                          const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                          const Mask& mask, const TensorView& dout, const TensorView& lse,
                          const TensorView& delta, const TensorView& dq, const TensorView& dk,
                          const TensorView& dv) {
  return HWY_DYNAMIC_DISPATCH(BackwardSimd)(p, q, q_tokens, k, v, k_tokens, mask, dout, lse,
                                            delta, dq, dk, dv);
}

}  // namespace ctxpar::kernel
#endif  // HWY_ONCE

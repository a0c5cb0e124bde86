// The readable backward path (flash-attention-2 form), one (query row, key row) pair at a
// time. Tasks are (batch, kv head): each owns its dK/dV rows and the dQ rows of its group of
// query heads, so threads never write the same element and the order of additions is fixed.
#include <cmath>
#include <vector>

#include "kernel/problem.h"

namespace ctxpar::kernel {

KernelStats backward_scalar(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                            const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                            const Mask& mask, const TensorView& dout, const TensorView& lse,
                            const TensorView& delta, const TensorView& dq, const TensorView& dk,
                            const TensorView& dv) {
  // q, dout, dq [B, Tq, Hq, D]; k, v, dk, dv [B, Tk, Hkv, D]; lse, delta [B, Hq, Tq].
  const TileRanges qr = tile_ranges(q_tokens, p.tq, kKernelTile, mask.documents);
  const TileRanges kr = tile_ranges(k_tokens, p.tk, kKernelTile, mask.documents);
  const int64_t d = p.d;
  const int64_t tasks = p.batch * p.hkv;

#pragma omp parallel num_threads(p.threads)
  {
    std::vector<float> qrow(d), dorow(d), krow(d), vrow(d);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / p.hkv, hk = task % p.hkv;
      for (int64_t h = hk * p.group; h < (hk + 1) * p.group; ++h)
        for (int64_t qt = 0; qt < qr.count(); ++qt)
          for (int64_t kt = 0; kt < kr.count(); ++kt) {
            const TileKind kind = classify(mask, qr, qt, kr, kt);
            if (kind == TileKind::skip) continue;
            const int64_t i1 = std::min(p.tq, (qt + 1) * kKernelTile);
            const int64_t j1 = std::min(p.tk, (kt + 1) * kKernelTile);
            for (int64_t i = qt * kKernelTile; i < i1; ++i) {
              const float lse_i = lse.ptr<const float>()[lse.offset(b, h, i)];
              if (lse_i == kNegInf) continue;  // row saw no key anywhere: P = 0
              const float delta_i = delta.ptr<const float>()[delta.offset(b, h, i)];
              load_row(q, q.offset(b, i, h), d, qrow.data());
              load_row(dout, dout.offset(b, i, h), d, dorow.data());
              float* dq_i = dq.ptr<float>() + dq.offset(b, i, h);
              for (int64_t j = kt * kKernelTile; j < j1; ++j) {
                if (kind == TileKind::partial && !visible(mask, q_tokens, i, k_tokens, j)) continue;
                load_row(k, k.offset(b, j, hk), d, krow.data());
                load_row(v, v.offset(b, j, hk), d, vrow.data());
                float s = 0, dp = 0;
                for (int64_t c = 0; c < d; ++c) s += qrow[c] * krow[c];
                // Fused, in order: the rounding of the delta (api.cc), so one-hot rows give dS = 0.
                for (int64_t c = 0; c < d; ++c) dp = std::fma(dorow[c], vrow[c], dp);
                // P <= 1 (simd_backward.cc, Note [P at most one]); s * scale is rounded exactly
                // as the forward rounded it (the kernel is built with -ffp-contract=off, so no
                // fused multiply-add skips that rounding here and not there).
                const float pij = std::exp(std::min(s * p.scale - lse_i, 0.0f));
                const float ds = pij * (dp - delta_i) * p.scale;
                float* dk_j = dk.ptr<float>() + dk.offset(b, j, hk);
                float* dv_j = dv.ptr<float>() + dv.offset(b, j, hk);
                for (int64_t c = 0; c < d; ++c) {
                  dv_j[c] += pij * dorow[c];
                  dq_i[c] += ds * krow[c];
                  dk_j[c] += ds * qrow[c];
                }
              }
            }
            tile_progress();  // the MPI transport's progress calls, if installed
          }
    }
  }
  return count_tiles(p, mask, qr, kr, 2.5);
}

}  // namespace ctxpar::kernel

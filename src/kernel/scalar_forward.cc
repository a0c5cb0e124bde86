// The readable forward path: tiles of 64 x 64, one query row at a time, plain loops. It is the
// specification of the fast path in simd_forward.cc (same tiling, same online-softmax update)
// and is selected with CTXPAR_KERNEL=scalar. See docs/kernel.md, "Note [Online softmax]".
#include <cmath>
#include <vector>

#include "kernel/problem.h"

namespace ctxpar::kernel {

KernelStats forward_scalar(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                           const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                           const Mask& mask, const ForwardStateView& state) {
  // q [B, Tq, Hq, D]; k, v [B, Tk, Hkv, D]; state.acc [B, Tq, Hq, D], state.m/l [B, Hq, Tq].
  const TileRanges qr = tile_ranges(q_tokens, p.tq, kKernelTile, mask.documents);
  const TileRanges kr = tile_ranges(k_tokens, p.tk, kKernelTile, mask.documents);
  const int64_t d = p.d;
  float* acc = state.acc().ptr<float>();
  float* m = state.m().ptr<float>();
  float* l = state.l().ptr<float>();
  const int64_t tasks = p.batch * p.hq * qr.count();

#pragma omp parallel num_threads(p.threads)
  {
    std::vector<float> qrow(d), krow(d), vrow(d), s(kKernelTile);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t qt = task % qr.count(), h = (task / qr.count()) % p.hq;
      const int64_t b = task / (qr.count() * p.hq), hk = h / p.group;
      const int64_t i0 = qt * kKernelTile, i1 = std::min(p.tq, i0 + kKernelTile);
      for (int64_t kt = 0; kt < kr.count(); ++kt) {
        const TileKind kind = classify(mask, qr, qt, kr, kt);
        if (kind == TileKind::skip) continue;
        const int64_t j0 = kt * kKernelTile, j1 = std::min(p.tk, j0 + kKernelTile);
        for (int64_t i = i0; i < i1; ++i) {
          load_row(q, q.offset(b, i, h), d, qrow.data());
          float row_max = kNegInf;
          for (int64_t j = j0; j < j1; ++j) {
            float dot = 0;
            load_row(k, k.offset(b, j, hk), d, krow.data());
            for (int64_t c = 0; c < d; ++c) dot += qrow[c] * krow[c];
            const bool seen = kind == TileKind::full || visible(mask, q_tokens, i, k_tokens, j);
            s[j - j0] = seen ? dot * p.scale : kNegInf;
            row_max = std::max(row_max, s[j - j0]);
          }
          float& mi = m[(b * p.hq + h) * p.tq + i];
          float& li = l[(b * p.hq + h) * p.tq + i];
          const float m_new = std::max(mi, row_max);
          if (m_new == kNegInf) continue;  // nothing visible to this row yet
          // mi = -inf gives alpha = exp(-inf) = 0: the (empty) old state is dropped.
          const float alpha = std::exp(mi - m_new);
          float* out = acc + ((b * p.tq + i) * p.hq + h) * d;
          float sum = 0;
          for (int64_t c = 0; c < d; ++c) out[c] *= alpha;
          for (int64_t j = j0; j < j1; ++j) {
            const float pj = std::exp(s[j - j0] - m_new);  // masked: exp(-inf) = 0
            sum += pj;
            if (pj == 0) continue;
            load_row(v, v.offset(b, j, hk), d, vrow.data());
            for (int64_t c = 0; c < d; ++c) out[c] += pj * vrow[c];
          }
          li = li * alpha + sum;
          mi = m_new;
        }
        tile_progress();  // the MPI transport's progress calls, if installed (tile_progress.h)
      }
    }
  }
  return count_tiles(p, mask, qr, kr, 1.0);
}

}  // namespace ctxpar::kernel

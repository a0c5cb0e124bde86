// merge(): combines two partial attention results over disjoint key sets. The strategies do not
// need it (each absorbs every K/V block into one ForwardState), nor does any device operation;
// its handling of -inf rows decides whether merged masked rows stay NaN-free.
#include <cmath>

#include "ctxpar/kernel.h"
#include "kernel/problem.h"

namespace ctxpar {

void merge(const TensorView& o_a, const TensorView& lse_a, const TensorView& o_b,
           const TensorView& lse_b) {
  // o_a, o_b [B, T, H, D] fp32; lse_a, lse_b [B, H, T] fp32. Result in place into (o_a, lse_a).
  kernel::check_activation("o_a", o_a, false);
  kernel::check_activation("o_b", o_b, false);
  CTXPAR_CHECK(o_b.shape() == o_a.shape(), "o_b: expected o_a's shape ", shape_str(o_a.shape()),
               ", got ", shape_str(o_b.shape()));
  const int64_t b = o_a.dim(0), t = o_a.dim(1), h = o_a.dim(2), d = o_a.dim(3);
  kernel::check_rows_f32("lse_a", lse_a, b, h, t);
  kernel::check_rows_f32("lse_b", lse_b, b, h, t);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t hi = 0; hi < h; ++hi)
      for (int64_t ti = 0; ti < t; ++ti) {
        float& la = lse_a.ptr<float>()[lse_a.offset(bi, hi, ti)];
        const float lb = lse_b.ptr<const float>()[lse_b.offset(bi, hi, ti)];
        float* oa = o_a.ptr<float>() + o_a.offset(bi, ti, hi);
        const float* ob = o_b.ptr<const float>() + o_b.offset(bi, ti, hi);
        if (lb == kernel::kNegInf) continue;  // b saw nothing: a is already the answer
        if (la == kernel::kNegInf) {          // a saw nothing: take b as it is
          for (int64_t c = 0; c < d; ++c) oa[c] = ob[c];
          la = lb;
          continue;
        }
        // Both finite. With mx the larger, exp(min - mx) <= 1 cannot overflow, and log1p keeps
        // precision when the smaller side contributes little.
        const float mx = std::max(la, lb), mn = std::min(la, lb);
        const float lse = mx + std::log1p(std::exp(mn - mx));
        const float wa = std::exp(la - lse), wb = std::exp(lb - lse);
        for (int64_t c = 0; c < d; ++c) oa[c] = wa * oa[c] + wb * ob[c];
        la = lse;
      }
}

}  // namespace ctxpar

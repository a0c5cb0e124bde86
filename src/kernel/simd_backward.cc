// Placeholder until the SIMD backward lands: forwards to the scalar path.
#include "kernel/problem.h"

namespace ctxpar::kernel {
KernelStats backward_simd(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                          const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                          const Mask& mask, const TensorView& dout, const TensorView& lse,
                          const TensorView& delta, const TensorView& dq, const TensorView& dk,
                          const TensorView& dv) {
  return backward_scalar(p, q, q_tokens, k, v, k_tokens, mask, dout, lse, delta, dq, dk, dv);
}
}  // namespace ctxpar::kernel

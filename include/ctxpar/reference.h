// Plain fp64 attention, forward and backward, with materialised scores. Deliberately simple;
// every fast path is tested against it, nothing uses it for speed. Also the "naive32"
// baseline: the same materialised computation in fp32, which sets the tolerance rule
// (fast error <= 2 x naive32 error + floor).
#pragma once
#include <vector>

#include "ctxpar/mask.h"
#include "ctxpar/tensor.h"

namespace ctxpar::reference {

// Dense result of a reference computation, in fp64 (or fp32 for naive32), [B, T, H, D] and
// [B, H, T] layouts as in kernel.h.
struct Result {
  std::vector<double> o, lse;       // forward
  std::vector<double> dq, dk, dv;   // backward (empty unless asked for)
};

// Inputs are read as fp32 values (bf16 inputs are widened exactly). `dout` may be empty (then
// no backward). `scale` 0 means 1/sqrt(D). Fully masked rows: O = 0, LSE = -inf, grads 0.
Result attention_f64(const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                     const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                     const TensorView& dout = {}, float scale = 0.0f);
Result attention_naive_f32(const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                           const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                           const TensorView& dout = {}, float scale = 0.0f);

}  // namespace ctxpar::reference

// Plain fp64 attention, forward and backward, with materialised scores. Deliberately simple;
// every fast path is tested against it, nothing uses it for speed. Also the "naive32"
// baseline: the same materialised computation in fp32, which sets the tolerance rule
// (fast error <= 2 x naive32 error + floor).
#pragma once
#include <algorithm>
#include <cmath>
#include <vector>

#include "ctxpar/mask.h"
#include "ctxpar/tensor.h"

namespace ctxpar::reference {

// Dense result of a reference computation, in fp64 (or fp32 for naive32), [B, T, H, D] and
// [B, H, T] layouts as in kernel.h.
struct Result {
  std::vector<double> o, lse;      // forward
  std::vector<double> dq, dk, dv;  // backward (empty unless asked for)
};

// Inputs are read as fp32 values (bf16 inputs are widened exactly). `dout` may be empty (then
// no backward). `scale` 0 means 1/sqrt(D). Fully masked rows: O = 0, LSE = -inf, grads 0.
Result attention_f64(const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                     const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                     const TensorView& dout = {}, float scale = 0.0f);
Result attention_naive_f32(const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                           const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                           const TensorView& dout = {}, float scale = 0.0f);

// The accuracy rule, the one home of it (kernel, strategy and model tests, `ctxpar attention
// --check`, Python's ctxpar.testing through the binding): a result passes when
//   max |result - ref64| <= accuracy_tolerance(max |naive32 - ref64|, max |ref64|)
//                         = 2 * naive_error + floor_rel * max(1, ref_max)
// naive_error that is not finite (a naive32 that overflowed) counts 0: it says nothing about
// what fp32 can reach, and an infinite tolerance would pass anything. ref_max is the largest
// finite |ref64|. floor_rel: kAccuracyFloor for fp32 storage; callers with bf16 storage pass
// a larger one (its rounding of O, attention_check.cc).
constexpr double kAccuracyFloor = 1e-5;
// The floor of the fast bf16 tier (KernelConfig::bf16_tier = fast: P and dS rounded to bf16):
// twice bf16's unit roundoff 2^-8 (docs/kernel.md, "bf16 tiers").
constexpr double kFastBf16TierFloor = 0x1.0p-7;
inline double accuracy_tolerance(double naive_error, double ref_max,
                                 double floor_rel = kAccuracyFloor) {
  return (std::isfinite(naive_error) ? 2.0 * naive_error : 0.0) +
         floor_rel * std::max(1.0, ref_max);
}

}  // namespace ctxpar::reference

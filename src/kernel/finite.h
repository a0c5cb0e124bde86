// The argument checks every layer shares (the kernel's, the strategies', the KV cache's and
// the cuda device's): the one rule for a [B, T, H, D] activation, and where its first NaN / Inf
// is (the strategies name the token by its global position: the kernel only sees the slice it
// was given, a head group, a gathered block).
#pragma once
#include <cstdint>
#include <string>

#include "ctxpar/tensor.h"

namespace ctxpar::kernel {

// The verdict on an activation `name` (q, k, v, out, dout, the gradients; lse with its 3-d
// `want`): "" when it holds, else the message. It holds when t has data (or `want` has no
// elements), has the shape `want` (any 4-d shape when `want` is empty), is fp32 (or bf16 when
// allow_bf16) and, 4-d, has a contiguous last dim. `what` names the expected shape in the
// caller's words ("[B, Tl, Hq, D]", "q's [B, Tq, Hq, D]"). Never throws, so that ranks can
// share a verdict before anyone gives up; check_activation (problem.h) throws it.
std::string activation_verdict(const char* name, const TensorView& t, bool allow_bf16,
                               const Shape& want = {}, const char* what = "[B, T, H, D]");

struct NonFinite {
  int64_t b = -1, t = -1, h = -1, d = -1;  // the element's indices in the tensor
  float value = 0;
  bool found() const { return b >= 0; }
};
// t is 4-d, fp32 or bf16, last dim contiguous (checked by the caller). The finding is the first
// bad element in index order (b, t, h, d). A tensor that is one run in memory (its dimensions in
// any order: a [B, T, H, D] view of [B, H, T, D] storage too) is first tested whole by vectors,
// from kParallelScan elements on by `threads` OpenMP threads in equal chunks, and row by row
// only where that finds something (the same finding).
inline constexpr int64_t kParallelScan = int64_t{1} << 20;
NonFinite find_non_finite(const TensorView& t, int threads = 1);
// Whether any of the n elements of t's data from element `offset` on (fp32 or bf16, one run in
// memory) is a NaN or an Inf: the vector scan (simd_finite.cc) find_non_finite runs first.
bool any_non_finite(const TensorView& t, int64_t offset, int64_t n);

// "non-finite value (nan)": the common start of both layers' messages, and what to do.
extern const char* const kNonFiniteHint;

}  // namespace ctxpar::kernel

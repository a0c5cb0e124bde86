// Where the first NaN / Inf of a [B, T, H, D] activation is. Shared by the kernel's argument
// checks and the strategies', which name the token by its global position (the kernel only
// sees the slice it was given: a head group, a gathered block).
#pragma once
#include <cstdint>

#include "ctxpar/tensor.h"

namespace ctxpar::kernel {

struct NonFinite {
  int64_t b = -1, t = -1, h = -1, d = -1;  // the element's indices in the tensor
  float value = 0;
  bool found() const { return b >= 0; }
};
// t is 4-d, fp32 or bf16, last dim contiguous (checked by the caller). Scans in memory order.
NonFinite find_non_finite(const TensorView& t);

// "non-finite value (nan)": the common start of both layers' messages, and what to do.
extern const char* const kNonFiniteHint;

}  // namespace ctxpar::kernel

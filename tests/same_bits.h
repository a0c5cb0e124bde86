// Whether two tensors hold the same values bit for bit: the same shape, dtype and bytes (views
// of any strides; empty equals only empty). One home for the tests that check determinism
// (threads = MPI = sim, a refused call leaves a cache alone).
#pragma once
#include <cstring>

#include "ctxpar/tensor.h"

namespace ctxpar::test {

inline bool same_bits(const TensorView& a, const TensorView& b) {
  if (a.empty() || b.empty()) return a.empty() && b.empty();
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  if (a.contiguous() && b.contiguous())
    return std::memcmp(a.data(), b.data(), size_t(a.numel()) * dtype_size(a.dtype())) == 0;
  const Tensor x = Tensor::copy_of(a), y = Tensor::copy_of(b);
  return std::memcmp(x.data(), y.data(), x.bytes()) == 0;
}

}  // namespace ctxpar::test

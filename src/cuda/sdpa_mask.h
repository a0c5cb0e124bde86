// A fused call (src/device/fused_calls.h) as cuDNN's SDPA mask attributes. cuDNN masks by
// indices: with the TOP_LEFT diagonal, key j is visible to query i when
//   j - i <= right_bound   and   i - j < left_bound      (each when set)
// and with BOTTOM_RIGHT the diagonal moves by (keys - rows). A Call keeps j' - i' <= upper and
// i' - j' <= lower on call-local indices, so right_bound = upper and left_bound = lower + 1;
// a call with only a lower bound gets right_bound = keys - 1 (every key: cuDNN's bands carry
// a right bound). tests/cuda checks visible() against Call::visible for the decompositions of
// every layout; tests/cuda/cudnn_graphs.cc builds each form in cuDNN's device-less mode.
#pragma once
#include <cstdint>
#include <string>

#include "device/fused_calls.h"

namespace ctxpar::cuda {

struct SdpaMask {
  enum class Alignment { none, top_left, bottom_right };
  Alignment alignment = Alignment::none;  // none: no bounds at all
  bool has_right = false, has_left = false;
  int64_t right = 0, left = 0;

  // The pair (i, j) of a call of `rows` x `keys` under cuDNN's rules above.
  bool visible(int64_t i, int64_t j, int64_t rows, int64_t keys) const {
    if (alignment == Alignment::none) return true;
    const int64_t shift = alignment == Alignment::bottom_right ? keys - rows : 0;
    return (!has_right || j - (i + shift) <= right) && (!has_left || (i + shift) - j < left);
  }
  std::string describe() const {
    if (alignment == Alignment::none) return "no mask";
    std::string s = alignment == Alignment::top_left ? "TOP_LEFT" : "BOTTOM_RIGHT";
    if (has_right) s += " right_bound=" + std::to_string(right);
    if (has_left) s += " left_bound=" + std::to_string(left);
    return s;
  }
};

inline SdpaMask sdpa_mask_of(const fused::Call& c) {
  SdpaMask m;
  if (!c.has_upper && !c.has_lower) return m;
  if (c.has_upper && !c.has_lower && c.upper == c.keys() - c.rows() && c.upper != 0) {
    m.alignment = SdpaMask::Alignment::bottom_right;  // fused_calls' "causal bottom-right"
    m.has_right = true;
    return m;
  }
  m.alignment = SdpaMask::Alignment::top_left;
  m.has_right = true;
  m.right = c.has_upper ? c.upper : c.keys() - 1;
  if (c.has_lower) m.has_left = true, m.left = c.lower + 1;
  return m;
}

}  // namespace ctxpar::cuda

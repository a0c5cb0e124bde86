// The accuracy rule has one home, reference::accuracy_tolerance (ctxpar/reference.h): the
// kernel, strategy and model tests, `ctxpar attention --check` and ctxpar.testing (through
// the binding, tests/python/test_testing.py) all call it.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "ctxpar/reference.h"
#include "kernel/kernel_support.h"

namespace ctxpar::test {
namespace {

TEST(AccuracyRule, TwiceTheNaiveErrorPlusTheFloor) {
  EXPECT_EQ(reference::accuracy_tolerance(1e-6, 3.0), 2 * 1e-6 + 1e-5 * 3.0);
  EXPECT_EQ(reference::accuracy_tolerance(1e-6, 0.25), 2 * 1e-6 + 1e-5);  // max(1, |ref|)
  EXPECT_EQ(reference::accuracy_tolerance(0.0, 2.0, 0x1.0p-8), 0x1.0p-8 * 2.0);
  EXPECT_EQ(reference::kAccuracyFloor, 1e-5);
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(reference::accuracy_tolerance(inf, 2.0), 1e-5 * 2.0);
  EXPECT_EQ(reference::accuracy_tolerance(std::nan(""), 2.0), 1e-5 * 2.0);
}

// A naive32 that overflowed says nothing about what fp32 can reach: the kernel tests' rule
// took its infinite error as an infinite tolerance and passed any finite output (as
// attention_check.cc did not); now both count the floor only.
TEST(AccuracyRule, OverflowedNaiveDoesNotPassAnything) {
  Outputs fast;
  fast.o = Tensor(DType::f32, {1, 1, 1, 2});
  fast.lse = Tensor(DType::f32, {1, 1, 1});
  fast.o.ptr<float>()[0] = 1.0f;  // ref 0: off by 1
  References refs;
  refs.ref64.o = {0.0, 0.5};
  refs.naive32.o = {std::numeric_limits<double>::infinity(), 0.5};
  refs.ref64.lse = refs.naive32.lse = {0.0};
  fast.o.ptr<float>()[1] = 0.5f;
  const std::string v = rule_violations(fast, refs, false);
  EXPECT_NE(v.find("o: max|fast-ref64| = 1"), std::string::npos) << "'" << v << "'";
  // Within the floor it passes.
  fast.o.ptr<float>()[0] = 1e-6f;
  EXPECT_EQ(rule_violations(fast, refs, false), "");
}

}  // namespace
}  // namespace ctxpar::test

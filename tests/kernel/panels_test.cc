// The fast path's memory layout -- K panels sized to the L1 (simd_tile.h, Note [K panels]) and
// padded rows (Note [Padded rows]) -- changes where data sits and in what order the
// micro-kernels walk it, never a bit of a result: every output of forward and backward is
// bitwise the same whatever L1 size the kernel tiles for, from one pass (1 GiB) down to 16-row
// panels (4 KiB), for head dims whose rows are padded (64, 128, 256) or not (80), with GQA,
// a causal mask, ragged tiles and both storage types. Each is also checked against the fp64
// reference by the tolerance rule, so "equal" cannot mean "equally wrong". Runs for every SIMD
// target the ctest entries force (CTXPAR_SIMD).
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "kernel/problem.h"
#include "kernel/kernel_support.h"

namespace ctxpar {
namespace {

using test::Case;
using test::Inputs;
using test::Outputs;
using test::run_fast;

struct L1dOverride {
  explicit L1dOverride(int64_t bytes) { kernel::set_kernel_l1d_for_test(bytes); }
  ~L1dOverride() { kernel::set_kernel_l1d_for_test(0); }
};

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

TEST(Panels, PanelRowsFollowTheL1Size) {
  {
    L1dOverride l1(32768);  // Zen 3: a 128 x 64 K^T tile (32 KiB) in two 16 KiB panels
    EXPECT_EQ(kernel::kernel_k_panel(64, 128), 64);
    EXPECT_EQ(kernel::kernel_k_panel(64, 64), 0);  // 16 KiB fits half of 32 KiB: one pass
    EXPECT_EQ(kernel::kernel_k_panel(64, 256), 64);
  }
  {
    L1dOverride l1(49152);  // Sapphire Rapids: 24 KiB budget, still two even panels
    EXPECT_EQ(kernel::kernel_k_panel(64, 128), 64);
  }
  {
    L1dOverride l1(4096);  // the floor: 16 rows
    EXPECT_EQ(kernel::kernel_k_panel(64, 128), 16);
  }
  {
    L1dOverride l1(1 << 30);
    EXPECT_EQ(kernel::kernel_k_panel(64, 256), 0);
  }
}

TEST(Panels, MalformedL1SizeIsRefusedByName) {
  EXPECT_EQ(kernel::parse_kernel_l1d("32768"), 32768);
  for (const char* bad : {"", "abc", "32k", "512", "0", "-32768", "99999999999", "2147483648"}) {
    try {
      kernel::parse_kernel_l1d(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("CTXPAR_KERNEL_L1D="), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("1024"), std::string::npos) << e.what();
    }
  }
}

TEST(Panels, ResultsDoNotDependOnTheL1Size) {
  if (kernel::use_scalar_path()) GTEST_SKIP() << "the scalar path has no panels";
  for (int64_t d : {64, 80, 128, 256}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      Case c;
      c.tq = 150, c.tk = 200, c.hq = 4, c.hkv = 2, c.d = d, c.dtype = dtype;
      c.mask = Mask::causal_mask(), c.q_offset = 50, c.seed = 7 + d;
      const Inputs in = make_inputs(c);
      Outputs base;
      {
        L1dOverride l1(1 << 30);  // one pass, as before panels existed
        base = run_fast(in, c.mask, 2);
      }
      const std::string violations = rule_violations(base, references_of(in, c.mask, true), true);
      EXPECT_EQ(violations, "") << c.name();
      for (int64_t bytes : {4096, 32768, 49152}) {
        L1dOverride l1(bytes);
        const Outputs f = run_fast(in, c.mask, 2);
        for (auto [x, y, what] : {std::tuple{&f.o, &base.o, "o"}, {&f.lse, &base.lse, "lse"},
                                  {&f.dq, &base.dq, "dq"}, {&f.dk, &base.dk, "dk"},
                                  {&f.dv, &base.dv, "dv"}})
          EXPECT_TRUE(same_bits(*x, *y)) << what << ", L1 " << bytes << " bytes, " << c.name();
      }
    }
  }
}

}  // namespace
}  // namespace ctxpar

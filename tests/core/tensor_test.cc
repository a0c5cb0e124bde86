#include "ctxpar/tensor.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "ctxpar/error.h"

namespace ctxpar {
namespace {

TEST(Bf16, RoundsToNearestEven) {
  // 1 + 2^-8 is halfway between two bf16 values (1 and 1 + 2^-7): ties go to even (1).
  EXPECT_EQ(round_to_bf16(1.0f + 0x1.0p-8f), 1.0f);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even -> 1 + 2^-6.
  EXPECT_EQ(round_to_bf16(1.0f + 3 * 0x1.0p-8f), 1.0f + 0x1.0p-6f);
  EXPECT_EQ(round_to_bf16(1.0f + 0x1.8p-8f), 1.0f + 0x1.0p-7f);  // above half: up
  EXPECT_EQ(round_to_bf16(-2.5f), -2.5f);                        // exact
  EXPECT_TRUE(std::isnan(round_to_bf16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(round_to_bf16(-std::numeric_limits<float>::infinity()),
            -std::numeric_limits<float>::infinity());
}

TEST(Bf16, RelativeErrorBound) {
  // bf16 keeps 8 significant bits: half an ulp is 2^-8 of the leading power of two, so the
  // relative rounding error is at most 2^-8.
  for (float x = 1e-3f; x < 1e3f; x *= 1.37f) {
    EXPECT_LE(std::fabs(round_to_bf16(x) - x), x * 0x1.0p-8f) << x;
  }
}

TEST(Tensor, ZeroFilledAndShaped) {
  Tensor t(DType::f32, {2, 3, 4, 5});
  EXPECT_EQ(t.numel(), 120);
  EXPECT_EQ(t.bytes(), 480u);
  for (int64_t i = 0; i < t.numel(); ++i) EXPECT_EQ(t.ptr<float>()[i], 0.0f);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 64, 0u);
}

// B*T*H*D = 2^40 * 2^16 * 2^8 = 2^64 wrapped numel() to 0: the tensor got 64 bytes and
// fill_normal wrote T*H*D elements past them (`ctxpar bench kernel --seq 1099511627776
// --heads 65536 --head-dim 256`: SIGSEGV). A shape whose element or byte count overflows int64
// is refused naming it; with a zero dimension the others are still bounded (they are strides).
TEST(Tensor, ShapeWhoseCountOverflowsIsRefused) {
  const int64_t big = int64_t{1} << 32;
  const std::vector<std::pair<DType, Shape>> bad = {
      {DType::f32, {1, int64_t{1} << 40, 65536, 256}},  // 2^64 elements
      {DType::f32, {int64_t{1} << 62}},                 // elements fit, bytes do not
      {DType::bf16, {int64_t{1} << 62, 2}},             // 2^63 elements
      {DType::f32, {0, big, big}},                      // zero: the others still bounded
      {DType::i64, {big, 0, big}},
  };
  for (const auto& [dtype, shape] : bad) {
    try {
      Tensor t(dtype, shape);
      ADD_FAILURE() << shape_str(shape) << " was accepted, numel " << t.numel();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(shape_str(shape)), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("overflows int64"), std::string::npos) << e.what();
    }
    int64_t dummy = 0;
    EXPECT_THROW(TensorView(&dummy, dtype, shape), Error) << shape_str(shape);
  }
  // Empty tensors whose other dimensions fit are fine.
  EXPECT_EQ(Tensor(DType::f32, {0, int64_t{1} << 40}).numel(), 0);
  EXPECT_EQ(Tensor(DType::f32, {int64_t{1} << 40, 0, 3}).bytes(), 0u);
}

TEST(Tensor, StridedSliceAndCopyConvert) {
  Tensor t(DType::f32, {2, 6, 3, 4});
  for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = static_cast<float>(i);
  TensorView s = t.view().slice(1, 2, 5);  // tokens 2..4
  EXPECT_EQ(s.shape(), (Shape{2, 3, 3, 4}));
  EXPECT_FALSE(s.contiguous());
  Tensor c = Tensor::copy_of(s, DType::bf16);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < 3; ++i)
      for (int64_t h = 0; h < 3; ++h)
        for (int64_t d = 0; d < 4; ++d) {
          float want = static_cast<float>(((b * 6 + i + 2) * 3 + h) * 4 + d);
          EXPECT_EQ(c.view().get(b, i, h, d), round_to_bf16(want));
        }
  Tensor back = Tensor::copy_of(c.view(), DType::f32);
  EXPECT_EQ(back.view().get(1, 2, 2, 3), c.view().get(1, 2, 2, 3));
}

// transpose swaps two dimensions' sizes and strides over the same elements: the [B, T, H, D]
// view of [B, H, T, D] storage reads element (b, h, t, d) at (b, t, h, d), is not contiguous,
// and transposed back is the storage's own view; a dimension out of range is refused.
TEST(Tensor, TransposeSwapsTwoDimensions) {
  Tensor t(DType::f32, {2, 3, 5, 4});  // [B, H, T, D]
  for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = static_cast<float>(i);
  const TensorView v = t.view().transpose(1, 2);
  EXPECT_EQ(v.shape(), (Shape{2, 5, 3, 4}));
  EXPECT_EQ(v.strides(), (Shape{60, 4, 20, 1}));
  EXPECT_FALSE(v.contiguous());
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 3; ++h)
      for (int64_t i = 0; i < 5; ++i)
        for (int64_t d = 0; d < 4; ++d) EXPECT_EQ(v.get(b, i, h, d), t.view().get(b, h, i, d));
  const TensorView back = v.transpose(2, 1);
  EXPECT_EQ(back.shape(), t.shape());
  EXPECT_TRUE(back.contiguous());
  EXPECT_THROW(t.view().transpose(1, 4), Error);
  EXPECT_THROW(t.view().transpose(-1, 0), Error);
}

TEST(Tensor, DenseInAnyOrderOfDimensions) {
  Tensor t(DType::f32, {2, 3, 5, 4});
  EXPECT_TRUE(t.view().dense());
  EXPECT_TRUE(t.view().transpose(1, 2).dense());  // [B, T, H, D] view of [B, H, T, D] storage
  EXPECT_TRUE(t.view().transpose(0, 3).transpose(1, 2).dense());
  EXPECT_FALSE(t.view().slice(2, 1, 4).dense());  // rows skipped within each run
  EXPECT_FALSE(t.view().slice(1, 0, 2).transpose(1, 2).dense());
  EXPECT_TRUE(t.view().slice(0, 1, 2).dense());  // one batch: a run from its own start
  Tensor one(DType::f32, {1, 6, 1, 4});          // dimensions of size 1 may have any stride
  EXPECT_TRUE(one.view().transpose(0, 2).dense());
  EXPECT_TRUE(one.view().transpose(1, 2).dense());
}

TEST(Tensor, BadSliceAndShapeMismatchThrow) {
  Tensor t(DType::f32, {1, 4, 1, 16});
  EXPECT_THROW(t.view().slice(1, 3, 5), Error);
  Tensor u(DType::f32, {1, 5, 1, 16});
  EXPECT_THROW(copy_into(t.view(), u.view()), Error);
  EXPECT_THROW(parse_dtype("fp8"), Error);
}

TEST(Tensor, FillNormalIsSeededAndStandard) {
  Tensor a(DType::f32, {1, 1000, 2, 16}), b(DType::f32, {1, 1000, 2, 16});
  fill_normal(a.view(), 7);
  fill_normal(b.view(), 7);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.bytes()), 0);
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < a.numel(); ++i)
    sum += a.ptr<float>()[i], sq += a.ptr<float>()[i] * a.ptr<float>()[i];
  double mean = sum / a.numel(), var = sq / a.numel() - mean * mean;
  EXPECT_NEAR(mean, 0.0, 0.03);  // 32000 samples: sd of the mean ~ 0.0056
  EXPECT_NEAR(var, 1.0, 0.05);
  fill_normal(b.view(), 8);
  EXPECT_NE(std::memcmp(a.data(), b.data(), a.bytes()), 0);
}

}  // namespace
}  // namespace ctxpar

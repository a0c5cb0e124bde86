// The NaN / Inf scan of the kernel's inputs (find_non_finite, checks.cc) by vectors: whether any
// element of a run of fp32 or bf16 bit patterns has an all-ones exponent. Every kernel call scans
// its q, k, v (and dout) once; element by element the scan was 3 % of a bf16 forward's samples
// (perf, T 4096, H 8, D 128, one thread), about a twentieth of the attention it guards.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernel/simd_finite.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <cstdint>

#include "kernel/finite.h"
#include "kernel/problem.h"

HWY_BEFORE_NAMESPACE();
namespace ctxpar::kernel::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Any x[i] with (x[i] & exp) == exp, i < n: the lanes' verdicts OR-ed into one vector, tested
// once at the end (no branch per vector).
template <typename T>
HWY_INLINE bool AnyAllOnesExponent(const T* HWY_RESTRICT x, int64_t n, T exp) {
  const hn::ScalableTag<T> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const auto ve = hn::Set(d, exp);
  auto bad = hn::Zero(d);
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes)
    bad = hn::Or(bad, hn::VecFromMask(d, hn::Eq(hn::And(hn::LoadU(d, x + i), ve), ve)));
  bool any = !hn::AllTrue(d, hn::Eq(bad, hn::Zero(d)));
  for (; i < n; ++i) any |= (x[i] & exp) == exp;
  return any;
}

bool AnyNonFinite32(const uint32_t* x, int64_t n) {
  return AnyAllOnesExponent<uint32_t>(x, n, 0x7f800000u);
}
bool AnyNonFinite16(const uint16_t* x, int64_t n) {
  return AnyAllOnesExponent<uint16_t>(x, n, uint16_t{0x7f80u});
}

}  // namespace ctxpar::kernel::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ctxpar::kernel {

HWY_EXPORT(AnyNonFinite32);
HWY_EXPORT(AnyNonFinite16);

bool any_non_finite(const TensorView& t, int64_t offset, int64_t n) {
  select_simd_target();
  if (t.dtype() == DType::bf16)
    return HWY_DYNAMIC_DISPATCH(AnyNonFinite16)(t.ptr<const uint16_t>() + offset, n);
  return HWY_DYNAMIC_DISPATCH(AnyNonFinite32)(
      reinterpret_cast<const uint32_t*>(t.ptr<const float>() + offset), n);
}

}  // namespace ctxpar::kernel
#endif  // HWY_ONCE

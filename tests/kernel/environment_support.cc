// The test programs' edge: the kernel's environment variables (CTXPAR_SIMD, CTXPAR_KERNEL,
// CTXPAR_BF16_PRODUCTS, CTXPAR_FP32_PRODUCTS, CTXPAR_KERNEL_L1D, which ctest entries set) read and installed before
// any test runs, as the command and the Python package install them.
#include "core/environment.h"

namespace {
[[maybe_unused]] const bool kInstalled = [] {
  ctxpar::set_kernel_environment(ctxpar::environment::kernel());
  return true;
}();
}  // namespace

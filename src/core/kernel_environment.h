// The edge where the kernel's environment variables are read: the command (tools/ctxpar),
// the Python package's module and the test programs call it once, before any kernel call, and
// install what it returns (set_kernel_environment, ctxpar/kernel.h); nothing else in the
// library reads them.
#pragma once
#include "ctxpar/kernel.h"

namespace ctxpar {

// CTXPAR_SIMD, CTXPAR_KERNEL, CTXPAR_BF16_PRODUCTS and CTXPAR_KERNEL_L1D as set ("" where unset).
KernelEnvironment read_kernel_environment();

}  // namespace ctxpar

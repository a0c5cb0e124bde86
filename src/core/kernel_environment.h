// The edge where the kernel's environment variables are read: the command (tools/ctxpar),
// the Python package's module and the test programs call it once, before any kernel call, and
// install what it returns (set_kernel_environment, ctxpar/kernel.h); nothing else in the
// library reads them. Same namespace as the rest of the environment's edge
// (core/environment.h), which this one function can join.
#pragma once
#include "ctxpar/kernel.h"

namespace ctxpar::environment {

// CTXPAR_SIMD, CTXPAR_KERNEL, CTXPAR_BF16_PRODUCTS and CTXPAR_KERNEL_L1D as set ("" where unset).
KernelEnvironment kernel();

}  // namespace ctxpar::environment

// The kernel's environment variables, read at the edge (kernel_environment.h).
#include "core/kernel_environment.h"

#include <cstdlib>

namespace ctxpar::environment {

namespace {
std::string variable(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}
}  // namespace

KernelEnvironment kernel() {
  KernelEnvironment env;
  env.simd = variable("CTXPAR_SIMD");
  env.kernel = variable("CTXPAR_KERNEL");
  env.bf16_products = variable("CTXPAR_BF16_PRODUCTS");
  env.l1d = variable("CTXPAR_KERNEL_L1D");
  return env;
}

}  // namespace ctxpar::environment

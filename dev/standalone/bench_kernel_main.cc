// `kernel_bench`: the same code as `ctxpar bench kernel`, linked against the kernel layer only,
// so the kernel can be measured while higher layers are half-built.
#include <cstdio>

#include "core/environment.h"
#include "options.h"

namespace ctxpar::cli {
int bench_kernel(int argc, char** argv);
}

int main(int argc, char** argv) {
  try {
    ctxpar::set_kernel_environment(ctxpar::environment::kernel());  // as `ctxpar` does
    return ctxpar::cli::bench_kernel(argc - 1, argv + 1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kernel_bench: %s\n", e.what());
    return 2;
  }
}

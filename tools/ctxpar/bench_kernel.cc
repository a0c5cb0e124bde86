#include "options.h"

namespace ctxpar::cli {
int bench_kernel(int argc, char** argv) { throw UsageError("not built yet"); }
}  // namespace ctxpar::cli

#include "options.h"

namespace ctxpar::cli {
int bench_cp(int argc, char** argv) { throw UsageError("not built yet"); }
}  // namespace ctxpar::cli

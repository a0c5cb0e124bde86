#include "commands.h"
#include "options.h"

namespace ctxpar::cli {
int cmd_bench(int argc, char** argv) { throw UsageError("'bench' is not built yet"); }
}  // namespace ctxpar::cli

#include "commands.h"
#include "options.h"

namespace ctxpar::cli {
int cmd_plan(int argc, char** argv) { throw UsageError("'plan' is not built yet"); }
}  // namespace ctxpar::cli

#include "commands.h"
#include "options.h"

namespace ctxpar::cli {
int cmd_attention(int argc, char** argv) { throw UsageError("'attention' is not built yet"); }
}  // namespace ctxpar::cli

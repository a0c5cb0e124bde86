#include "commands.h"
#include "options.h"

namespace ctxpar::cli {
int cmd_train(int argc, char** argv) { throw UsageError("'train' is not built yet"); }
}  // namespace ctxpar::cli

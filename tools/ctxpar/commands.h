// The subcommands of `ctxpar`; each lives in its own cmd_<name>.cc. A command returns the
// process exit code: 0 success, 1 a check failed, 2 bad usage or bad input.
#pragma once

namespace ctxpar::cli {
int cmd_attention(int argc, char** argv);
int cmd_bench(int argc, char** argv);
int cmd_train(int argc, char** argv);
int cmd_plan(int argc, char** argv);
int cmd_decode(int argc, char** argv);
}  // namespace ctxpar::cli

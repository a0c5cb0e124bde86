// `ctxpar bench <what>`: kernel (bench_kernel.cc), decode (bench_decode.cc) and cp sweeps
// (bench_cp.cc).
#include <cstdio>
#include <cstring>

#include "commands.h"
#include "options.h"

namespace ctxpar::cli {

int bench_kernel(int argc, char** argv);
int bench_cp(int argc, char** argv);
int bench_decode(int argc, char** argv);

namespace {
const char* const kBenchUsage =
    "usage: ctxpar bench <benchmark> [options]   (ctxpar bench <benchmark> --help for its "
    "options)\n\n"
    "benchmarks:\n"
    "  kernel     the attention kernel against this machine's FMA peak\n"
    "  decode     decode's bytes/s per token against this machine's read bandwidth\n"
    "  cp         sweeps of strategies, layouts, lengths and ranks\n";
}  // namespace

int cmd_bench(int argc, char** argv) {
  if (argc >= 1 && !std::strcmp(argv[0], "kernel")) return bench_kernel(argc - 1, argv + 1);
  if (argc >= 1 && !std::strcmp(argv[0], "cp")) return bench_cp(argc - 1, argv + 1);
  if (argc >= 1 && !std::strcmp(argv[0], "decode")) return bench_decode(argc - 1, argv + 1);
  if (argc >= 1 && (!std::strcmp(argv[0], "--help") || !std::strcmp(argv[0], "-h"))) {
    std::fputs(kBenchUsage, stdout);
    return 0;
  }
  throw UsageError(
      "which benchmark? 'ctxpar bench kernel --help' (the kernel against this machine's FMA "
      "peak), 'ctxpar bench decode --help' (decode against the memory bandwidth) or 'ctxpar "
      "bench cp --help' (sweeps of strategies, layouts, lengths and ranks)");
}

}  // namespace ctxpar::cli

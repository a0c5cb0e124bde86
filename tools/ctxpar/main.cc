// ctxpar: context parallelism for long-sequence attention. See README.md.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "commands.h"
#include "ctxpar/comm.h"
#include "ctxpar/error.h"
#include "ctxpar/kernel.h"
#include "ctxpar/gloo.h"  // gloo_available(), with or without MPI
#ifdef CTXPAR_HAVE_MPI
#include "comm/mpi_env.h"
#endif
#include "core/environment.h"
#include "options.h"

namespace {

struct Command {
  const char* name;
  int (*run)(int, char**);
  const char* summary;
};

const Command kCommands[] = {
    {"attention", ctxpar::cli::cmd_attention,
     "run, check and time one (distributed) attention, forward and backward"},
    {"bench", ctxpar::cli::cmd_bench, "benchmarks: the kernel against the FMA peak; CP sweeps"},
    {"train", ctxpar::cli::cmd_train, "train a transformer with context parallelism"},
    {"plan", ctxpar::cli::cmd_plan, "memory / communication / overlap model for real clusters"},
    {"decode", ctxpar::cli::cmd_decode, "long-context inference: spread KV cache, prefill, decode"},
};

void usage(FILE* out) {
  std::fprintf(out,
               "usage: ctxpar <command> [options]   (ctxpar <command> --help for its options)\n"
               "       ctxpar --version              (version, SIMD targets, CUDA build)\n\n"
               "commands:\n");
  for (const auto& c : kCommands) std::fprintf(out, "  %-10s %s\n", c.name, c.summary);
  std::fprintf(out,
               "\nexamples:\n"
               "  ctxpar attention --seq 65536 --ranks 4 --strategy ring --layout zigzag "
               "--mask causal --backward --check\n"
               "  ctxpar bench kernel --seq 4096 --heads 8 --head-dim 128 --threads 1 --json\n");
}

// Exit status: 2 bad usage or bad input (before any computing), 1 a failure at run time (a
// rank failed, a file could not be written). Under mpirun the other ranks may be waiting for
// this one: end them all at once with the same status.
int end_job(int code) {
  std::fflush(stderr);
  ctxpar::abort_mpi_job(code);
  return code;
}

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

// The version, the kernel's SIMD targets (compiled in, runnable here, chosen: docs/kernel.md)
// and the CUDA build (docs/cuda.md).
int version() {
  const ctxpar::SimdTargets t = ctxpar::simd_targets();
  std::printf("ctxpar %s\nSIMD targets compiled in: %s\nthis CPU can run: %s\n", CTXPAR_VERSION,
              joined(t.compiled).c_str(), joined(t.runnable).c_str());
  std::vector<std::string> transports{"threads"};
#ifdef CTXPAR_HAVE_MPI
  transports.push_back("mpi (mpirun)");
#endif
  if (ctxpar::gloo_available()) transports.push_back("gloo (torchrun)");
  std::printf("transports: %s\n", joined(transports).c_str());
  if (!t.error.empty()) {
    std::fprintf(stderr, "ctxpar: error: %s\n", t.error.c_str());
    return 2;
  }
  std::printf("chosen: %s%s\n", t.chosen.c_str(),
              std::getenv("CTXPAR_SIMD") ? " (CTXPAR_SIMD)"
                                         : " (the best; CTXPAR_SIMD=<name> forces a lower one)");
  std::printf("products: %s\n", t.products.c_str());
  std::printf("%s", ctxpar::cli::cuda_version_lines().c_str());
  return 0;
}

// The CTXPAR_* variables the run will read, checked before anything runs: a bad value is a
// usage error (exit 2) named here, not a rank's failure (exit 1) in the middle of a run.
// (CTXPAR_MEMORY_LIMIT_BYTES is checked by the memory estimate, also before the run.)
void check_environment() {
  const ctxpar::SimdTargets t = ctxpar::simd_targets();  // CTXPAR_SIMD
  if (!t.error.empty()) throw ctxpar::Error(t.error);
  ctxpar::cli::ulysses_groups_from_env();  // CTXPAR_ULYSSES_GROUPS (the library reads none)
#ifdef CTXPAR_HAVE_MPI
  ctxpar::check_mpi_environment();
#endif
}

bool asks_for_help(int argc, char** argv) {
  for (int i = 2; i < argc; ++i)
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) return true;
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  ctxpar::set_kernel_environment(ctxpar::environment::kernel());  // CTXPAR_SIMD, ...
  if (argc >= 2 && !std::strcmp(argv[1], "--version")) return version();
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (const auto& c : kCommands) {
    if (std::strcmp(argv[1], c.name) != 0) continue;
    try {
      if (!asks_for_help(argc, argv)) check_environment();
      return c.run(argc - 2, argv + 2);
    } catch (const ctxpar::cli::UsageError& e) {
      // `bench` has subcommands of its own: point at the one that was asked for.
      std::string full = c.name;
      if (!std::strcmp(c.name, "bench") && argc > 2 && argv[2][0] != '-')
        full += std::string(" ") + argv[2];
      std::fprintf(stderr, "ctxpar %s: %s\n(ctxpar %s --help lists every option)\n", full.c_str(),
                   e.what(), full.c_str());
      return end_job(2);
    } catch (const ctxpar::Error& e) {
      std::fprintf(stderr, "ctxpar %s: error: %s\n", c.name, e.what());
      return end_job(2);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ctxpar %s: failed: %s\n", c.name, e.what());
      return end_job(1);
    }
  }
  std::fprintf(stderr, "ctxpar: unknown command '%s'\n\n", argv[1]);
  usage(stderr);
  return 2;
}

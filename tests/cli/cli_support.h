// Runs the built `ctxpar` command (CTXPAR_BUILD_DIR/ctxpar, set by CTest) and captures its exit
// code, stdout and stderr, so the CLI tests exercise exactly what a user runs.
#pragma once
#include <cstdlib>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace ctxpar::test {

struct CommandResult {
  int exit_code = -1;
  std::string out, err;
};

// `args` is appended to the ctxpar path as shell words (quote them yourself).
CommandResult run_ctxpar(const std::string& args);
// Any shell command line (e.g. /usr/bin/python3 ...).
CommandResult run_shell(const std::string& command);
std::string ctxpar_path();
// The test build of the command (tools/ctxpar/CMakeLists.txt): the same sources with the fault
// hooks CTXPAR_FAULT_RANK and CTXPAR_OUT_FAULT compiled in; the release `ctxpar` has none.
std::string fault_ctxpar_path();
// A fresh empty folder under the test's temporary directory, removed when the test program
// ends (CTXPAR_KEEP_TEMP=1 keeps it).
std::string temp_dir(const std::string& name);
// The whole of a file, as bytes ("" when it cannot be read).
std::string file_bytes(const std::string& path);
// The command line of a small causal attention run; tests append their flags.
inline const std::string kSmallAttention =
    "attention --seq 64 --heads 2 --head-dim 16 --mask causal ";
// Parses stdout as the one JSON object of --json; fails the test (throws) if it is not.
nlohmann::json parse_json(const CommandResult& r);

// mpirun with the flags the suite's MPI tests use (root, 2 cores), bounded by `timeout` so
// that a hang, the bug these tests look for, fails the test instead of stalling the suite.
std::string mpirun(const std::string& args, int seconds = 60);

// A test that runs the command under mpirun: skipped outside the cli_mpi CTest entry, which
// sets CTXPAR_MPIEXEC.
class MpiCommandTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::getenv("CTXPAR_MPIEXEC")) GTEST_SKIP() << "CTXPAR_MPIEXEC not set (ctest -R cli_mpi)";
  }
};

}  // namespace ctxpar::test

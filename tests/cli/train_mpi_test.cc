// `ctxpar train` under mpirun: every process parses its own command line, so the ranks agree
// on every option that changes the trained weights or the schedule before the first step
// (tools/ctxpar/rank_agreement.h): a difference is refused on every rank within seconds,
// exit 2, naming the option and both values, where it used to train diverging copies of the
// model with exit 0 (--lr, --seed, --clip, --layout) or wait 120 s and time out (--steps,
// --layers). Run by the cli_mpi CTest entry (CTXPAR_MPIEXEC).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "cli/cli_support.h"

namespace ctxpar::test {
namespace {

namespace fs = std::filesystem;

class CliMpiTrain : public MpiCommandTest {
 protected:
  // One rank of a tiny training run with `extra` options.
  std::string rank(const std::string& extra) {
    return "-n 1 " + ctxpar_path() +
           " train --seq 64 --layers 1 --dim 32 --heads 2 "
           "--kv-heads 1 --hidden 32 --steps 3 --quiet " +
           extra;
  }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST_F(CliMpiTrain, RanksWithDifferentOptionsAreRefusedNamingTheOption) {
  const std::string dir = temp_dir("train_mpi");
  std::ofstream(dir + "/a.txt") << std::string(4096, 'a');
  std::ofstream(dir + "/b.txt") << std::string(4096, 'b');
  const struct {
    std::string a, b, message;
  } cases[] = {
      {"--lr 0.003", "--lr 0.05", "--lr is 0.003 on rank 0 but 0.05 on rank 1"},
      {"", "--seed 2", "--seed is 1 on rank 0 but 2 on rank 1"},
      {"", "--clip 0", "--clip is 1 on rank 0 but 0 on rank 1"},
      {"", "--layout striped", "--layout is zigzag on rank 0 but striped on rank 1"},
      {"", "--steps 4", "--steps is 3 on rank 0 but 4 on rank 1"},
      {"", "--layers 2", "--layers is 1 on rank 0 but 2 on rank 1"},
      {"--data " + dir + "/a.txt", "", "--data is " + dir + "/a.txt, 4096 bytes"},
      // Same path, other bytes (as on two machines' disks): the fingerprint differs.
      {"--data " + dir + "/a.txt", "--data " + dir + "/b.txt", "--data is " + dir + "/a.txt"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.message);
    const auto t0 = std::chrono::steady_clock::now();
    const CommandResult r = run_shell(mpirun(rank(c.a) + " : " + rank(c.b)));
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("the ranks were started with different options"), std::string::npos);
    EXPECT_LT(seconds_since(t0), 30.0) << "refused only after a timeout";
  }
  // The same options: trains (exit 0). --quiet and the output paths may differ.
  const CommandResult ok =
      run_shell(mpirun(rank("--lr 0.003") + " : " + rank("--lr 3e-3 --log " + dir + "/r.jsonl")));
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  fs::remove_all(dir);
}

// A bad CTXPAR_MPI_INIT_TIMEOUT is refused by name (exit 2) at once, where "abc" fell back
// to 120 s and "inf" failed every job claiming MPI_Init had not returned.
TEST_F(CliMpiTrain, BadInitTimeoutIsRefusedByName) {
  for (const char* value : {"inf", "9e9", "abc", "-1", "0"}) {
    SCOPED_TRACE(value);
    const CommandResult r = run_shell(
        mpirun("-n 1 -x CTXPAR_MPI_INIT_TIMEOUT=" + std::string(value) + " " + ctxpar_path() +
               " attention --seq 64 "
               "--heads 2 --head-dim 16"));
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find("CTXPAR_MPI_INIT_TIMEOUT must be the seconds MPI_Init may wait for the "
                         "other processes of the job, a number in (0, 604800]"),
              std::string::npos)
        << r.err;
    EXPECT_NE(r.err.find("got '" + std::string(value) + "'"), std::string::npos) << r.err;
  }
}

}  // namespace
}  // namespace ctxpar::test

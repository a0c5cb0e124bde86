// `ctxpar attention` under mpirun as a user may get it wrong: MPMD lines whose ranks got
// different options, a rank that fails, a program on the line that never starts MPI; and
// each rank reading only its own rows of the input files. Runs only from the `cli_mpi` test
// (CTXPAR_MPIEXEC set by CMake); skipped elsewhere.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "cli/cli_support.h"
#include "ctxpar/npy.h"

namespace ctxpar::test {
namespace {

namespace fs = std::filesystem;

class CliMpi : public MpiCommandTest {
 protected:
  std::string ctxpar(const std::string& args) { return ctxpar_path() + " attention " + args; }
};

const std::string kSmallShape = "--seq 64 --heads 2 --head-dim 16 --mask causal";

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// An MPMD line whose two programs got different options: refused at once, naming the option
// (it gave an answer off by 2.57 with exit 0, or waited 300 s for a message that never came).
TEST_F(CliMpi, RanksWithDifferentOptionsAreRefusedNamingTheOption) {
  struct Case {
    std::string rank0, rank1, says;
  };
  const std::string dir = temp_dir("mpmd");
  Tensor q(DType::f32, {1, 64, 2, 16});
  write_npy(dir + "/q.npy", q.view());
  const std::string files = " --q " + dir + "/q.npy --k " + dir + "/q.npy --v " + dir + "/q.npy";
  const Case cases[] = {
      {"--layout zigzag", "--layout contiguous",
       "--layout is zigzag on rank 0 but contiguous on rank 1"},
      {"--check", "", "--check is on on rank 0 but off on rank 1"},
      {"--out " + dir + "/out", "", "--out is given on rank 0 but (not given) on rank 1"},
      {"", "--backward", "--backward is off on rank 0 but on on rank 1"},
      {files, "", "--q is "},
      {"--seed 1", "--seed 2", "--seed is 1 on rank 0 but 2 on rank 1"},
      {"--dtype bf16 --bf16-tier fast", "--dtype bf16",
       "--bf16-tier is fast on rank 0 but exact on rank 1"},
  };
  for (const Case& c : cases) {
    const auto t0 = std::chrono::steady_clock::now();
    CommandResult r = run_shell(mpirun("-n 1 " + ctxpar(kSmallShape + " " + c.rank0) + " : -n 1 " +
                                       ctxpar(kSmallShape + " " + c.rank1)));
    EXPECT_EQ(r.exit_code, 2) << c.rank0 << " | " << c.rank1 << "\n" << r.err << r.out;
    EXPECT_NE(r.err.find(c.says), std::string::npos) << c.says << "\n" << r.err;
    EXPECT_LT(seconds_since(t0), 30.0) << "refused, but not at once";
  }
  // CTXPAR_ULYSSES_GROUPS does not change the answer, but the messages Ulysses sends: ranks
  // that differ in it are refused at once, naming it (they mismatched their messages). The
  // command reads the variable into StrategyOptions::ulysses_groups; the library names that.
  {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string uly = kSmallShape + " --strategy ulysses --heads 4";
    CommandResult e = run_shell(
        mpirun("-n 1 -x CTXPAR_ULYSSES_GROUPS=1 " + ctxpar(uly) + " : -n 1 " + ctxpar(uly)));
    EXPECT_NE(e.exit_code, 0) << e.err;
    EXPECT_NE(e.err.find("ulysses_groups is 1 on rank 0 but 0 on rank 1"), std::string::npos)
        << e.err;
    EXPECT_LT(seconds_since(t0), 30.0) << "refused, but not at once";
  }
  // --threads does not change the answer (bitwise): ranks may differ in it.
  CommandResult r = run_shell(mpirun("-n 1 " + ctxpar(kSmallShape + " --threads 2 --check") +
                                     " : -n 1 " + ctxpar(kSmallShape + " --threads 1 --check")));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  fs::remove_all(dir);
}

// Exit status as on the threads transport: 1 a rank failed at run time, 2 bad usage.
TEST_F(CliMpi, FailingRankExits1AndBadUsageExits2) {
  CommandResult r = run_shell(
      mpirun("-n 2 -x CTXPAR_FAULT_RANK=1 " + fault_ctxpar_path() + " attention " + kSmallShape));
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("rank 1 failed: injected fault"), std::string::npos) << r.err;
  r = run_shell(mpirun("-n 2 " + ctxpar(kSmallShape + " --head-dim 8")));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--head-dim must be in [16, 256]"), std::string::npos) << r.err;
}

// Scores beyond fp32 from finite inputs (q . k = 1.6e41 at token 40, head 1): every rank
// fails with the same verdict, naming the global token and head; exit 1, no hang.
TEST_F(CliMpi, OverflowingScoresFailEveryRankNamingTokenAndHead) {
  const std::string dir = temp_dir("mpi_overflow");
  const int64_t T = 64, D = 16;
  Tensor q(DType::f32, {1, T, 2, D}), k(DType::f32, {1, T, 1, D}), v(DType::f32, {1, T, 1, D});
  fill_normal(q.view(), 1), fill_normal(k.view(), 2), fill_normal(v.view(), 3);
  for (int64_t d = 0; d < D; ++d) {
    q.ptr<float>()[q.view().offset(0, 40, 1, d)] = 1e20f;
    k.ptr<float>()[k.view().offset(0, 3, 0, d)] = 1e20f;
  }
  write_npy(dir + "/q.npy", q.view()), write_npy(dir + "/k.npy", k.view());
  write_npy(dir + "/v.npy", v.view());
  for (const char* strategy : {"ring", "ulysses"}) {
    const CommandResult r =
        run_shell(mpirun("-n 2 " + ctxpar("--q " + dir + "/q.npy --k " + dir + "/k.npy --v " + dir +
                                          "/v.npy --mask causal --strategy " + strategy)));
    EXPECT_EQ(r.exit_code, 1) << strategy << ": " << r.err;
    for (const char* rank : {"rank 0 failed: ", "rank 1 failed: "})
      EXPECT_NE(r.err.find(std::string(rank) + strategy + " forward: non-finite output on rank "),
                std::string::npos)
          << rank << r.err;
    EXPECT_NE(r.err.find("lse = inf at token position 40, batch 0, head 1"), std::string::npos)
        << r.err;
  }
  fs::remove_all(dir);
}

// A program on the mpirun line that exits without MPI_Init leaves the others in MPI_Init,
// which OpenMPI does not bound: ctxpar's watchdog does (CTXPAR_MPI_INIT_TIMEOUT).
TEST_F(CliMpi, ProgramThatNeverStartsMpiEndsTheJob) {
  const auto t0 = std::chrono::steady_clock::now();
  CommandResult r = run_shell(
      mpirun("-n 1 -x CTXPAR_MPI_INIT_TIMEOUT=3 " + ctxpar(kSmallShape) + " : -n 1 /bin/true", 60));
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("MPI_Init has not returned after 3 s"), std::string::npos) << r.err;
  EXPECT_LT(seconds_since(t0), 30.0);
}

// Each rank reads its own rows of --q/--k/--v/--do: T/P of each file (plus its header), and
// the answer is bitwise that of one process running the same ranks on threads. T = 62 does
// not divide: the layout pads it to 64, and padding rows are not read.
TEST_F(CliMpi, EachRankReadsItsOwnRowsOfTheInputFiles) {
  for (const int64_t T : {64, 62}) {
    const std::string dir = temp_dir("mpi_rows");
    const int64_t B = 2, H = 2, D = 16;
    uint64_t file_data = 0, headers = 0;
    for (const char* name : {"q", "k", "v", "do"}) {
      Tensor t(DType::f32, {B, H, T, D});  // PyTorch's order, --layout-in bhtd
      fill_normal(t.view(), static_cast<uint64_t>(name[0]));
      write_npy(dir + "/" + name + ".npy", t.view());
      const NpyHeader h = read_npy_header(dir + "/" + name + ".npy");
      file_data += h.data_bytes, headers += h.data_offset;
    }
    const std::string args = "--q " + dir + "/q.npy --k " + dir + "/k.npy --v " + dir +
                             "/v.npy --do " + dir +
                             "/do.npy --layout-in bhtd --mask causal "
                             "--layout zigzag --check --json";
    CommandResult m = run_shell(mpirun("-n 2 " + ctxpar(args + " --out " + dir + "/mpi")));
    ASSERT_EQ(m.exit_code, 0) << m.err << m.out;
    const auto j = parse_json(m);
    EXPECT_EQ(j["transport"], "mpi");
    EXPECT_TRUE(j["check_passed"].get<bool>()) << T;
    uint64_t rows_read = 0;
    for (const auto& rank : j["ranks"]) {
      const auto bytes = rank["input_bytes_read"].get<uint64_t>();
      const auto tokens = rank["tokens"].get<uint64_t>();  // real tokens (padding excluded)
      EXPECT_EQ(bytes, headers + file_data / T * tokens) << T << ": " << rank.dump();
      rows_read += bytes - headers;
    }
    EXPECT_EQ(rows_read, file_data) << "every row read once, by its rank";
    CommandResult t = run_shell(ctxpar(args + " --ranks 2 --out " + dir + "/threads"));
    ASSERT_EQ(t.exit_code, 0) << t.err;
    for (const char* f : {"out.npy", "lse.npy", "dq.npy", "dk.npy", "dv.npy"})
      EXPECT_EQ(file_bytes(dir + "/mpi/" + f), file_bytes(dir + "/threads/" + f)) << T << " " << f;
    fs::remove_all(dir);
  }
}

}  // namespace
}  // namespace ctxpar::test

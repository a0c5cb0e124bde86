// What a hostile user found (docs/faults.md), each case as the user runs it: int64
// document ids, --out replaced as a whole, a FIFO as an input, exit codes of failing ranks,
// launchers that are not mpirun.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "cli/cli_support.h"
#include "ctxpar/npy.h"
#include "held_port.h"
#include "sanitizers.h"

namespace ctxpar::test {
namespace {

namespace fs = std::filesystem;

// ids 0 and 2^32 are two documents; truncated to int32 they were one (and --check agreed,
// reading the same truncated ids).
TEST(CliAttentionFaults, Int64DocumentIdsStayDistinct) {
  const std::string dir = temp_dir("int64_docs");
  auto halves = [](int64_t first, int64_t second) {
    std::vector<int64_t> ids(64, first);
    std::fill(ids.begin() + 32, ids.end(), second);
    return ids;
  };
  write_npy(dir + "/wide.npy", std::span<const int64_t>(halves(0, int64_t(1) << 32)));
  write_npy(dir + "/small.npy", std::span<const int64_t>(halves(0, 1)));
  write_npy(dir + "/one.npy", std::span<const int64_t>(halves(7, 7)));
  for (const char* name : {"wide", "small", "one"}) {
    CommandResult r =
        run_ctxpar(kSmallAttention + "--ranks 2 --layout zigzag --check --json" + " --documents " +
                   dir + "/" + name + ".npy --out " + dir + "/" + name);
    ASSERT_EQ(r.exit_code, 0) << name << ": " << r.err << r.out;
    EXPECT_TRUE(parse_json(r)["check_passed"].get<bool>()) << r.out;
  }
  // The same two documents whatever their ids: bitwise the run with ids {0, 1}.
  EXPECT_EQ(file_bytes(dir + "/wide/out.npy"), file_bytes(dir + "/small/out.npy"));
  // ... and not the one-document answer (the test can tell them apart).
  EXPECT_NE(file_bytes(dir + "/wide/out.npy"), file_bytes(dir + "/one/out.npy"));
  fs::remove_all(dir);
}

// The files of a folder (name -> bytes), the marker included.
std::map<std::string, std::string> folder_files(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::directory_iterator(dir))
    files[e.path().filename().string()] = file_bytes(e.path().string());
  return files;
}

std::set<std::string> names(const std::map<std::string, std::string>& files) {
  std::set<std::string> out;
  for (const auto& [name, bytes] : files) out.insert(name);
  return out;
}

// A forward-only run into the folder of a backward run: the old dq, dk, dv must go too.
TEST(CliAttentionFaults, OutIsReplacedAsAWholeSet) {
  const std::string dir = temp_dir("out_set"), out = dir + "/res";
  ASSERT_EQ(run_ctxpar(kSmallAttention + "--backward --out " + out).exit_code, 0);
  EXPECT_EQ(names(folder_files(out)), (std::set<std::string>{".ctxpar-out", "out.npy", "lse.npy",
                                                             "dq.npy", "dk.npy", "dv.npy"}));
  CommandResult r = run_ctxpar(kSmallAttention + "--seed 3 --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(names(folder_files(out)), (std::set<std::string>{".ctxpar-out", "out.npy", "lse.npy"}));
  // Nothing else beside it: the new set's temporary folder became `res`, the old one is gone.
  EXPECT_EQ(names(folder_files(dir)), (std::set<std::string>{"res"}));
  fs::remove_all(dir);
}

// kill -9 while the set is written (CTXPAR_OUT_FAULT kills at the two moments that matter):
// the folder holds the old set or the new one, each complete, never a mix.
TEST(CliAttentionFaults, OutKilledDuringTheWriteIsTheOldSetOrTheNew) {
  const std::string dir = temp_dir("out_kill"), out = dir + "/res", fresh = dir + "/fresh";
  ASSERT_EQ(run_ctxpar(kSmallAttention + "--backward --out " + out).exit_code, 0);
  const auto old_set = folder_files(out);
  ASSERT_EQ(run_ctxpar(kSmallAttention + "--seed 5 --out " + fresh).exit_code, 0);
  const auto new_set = folder_files(fresh);

  CommandResult r = run_shell("CTXPAR_OUT_FAULT=before-swap " + fault_ctxpar_path() + " " +
                              kSmallAttention + "--seed 5 --out " + out);
  EXPECT_EQ(r.exit_code, 128 + 9) << r.err;  // killed
  EXPECT_EQ(folder_files(out), old_set);

  r = run_shell("CTXPAR_OUT_FAULT=after-swap " + fault_ctxpar_path() + " " + kSmallAttention +
                "--seed 5 --out " + out);
  EXPECT_EQ(r.exit_code, 128 + 9) << r.err;
  EXPECT_EQ(folder_files(out), new_set);
  // The next run replaces the set again, killed or not before.
  ASSERT_EQ(run_ctxpar(kSmallAttention + "--backward --out " + out).exit_code, 0);
  EXPECT_EQ(folder_files(out), old_set);
  fs::remove_all(dir);
}

TEST(CliAttentionFaults, OutThatCannotBeWrittenFailsBeforeComputing) {
  // CTXPAR_FAULT_RANK=0 would fail the run itself (exit 1, "injected fault"): exit 2 naming
  // --out shows the folder was refused before any computing.
  CommandResult r = run_shell("CTXPAR_FAULT_RANK=0 " + fault_ctxpar_path() + " " + kSmallAttention +
                              "--out /proc/ctxpar_out");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--out /proc/ctxpar_out: cannot write in /proc"), std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("injected fault"), std::string::npos) << r.err;

  // A folder of the user's own files is not replaced (that would delete them).
  const std::string dir = temp_dir("out_foreign");
  std::ofstream(dir + "/notes.txt") << "mine";
  r = run_shell("CTXPAR_FAULT_RANK=0 " + fault_ctxpar_path() + " " + kSmallAttention + "--out " +
                dir);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("holds files that ctxpar did not write"), std::string::npos) << r.err;
  EXPECT_EQ(file_bytes(dir + "/notes.txt"), "mine");
  fs::remove_all(dir);
}

TEST(CliAttentionFaults, FifoAsInputIsRefusedAtOnce) {
  const std::string dir = temp_dir("fifo");
  ASSERT_EQ(mkfifo((dir + "/q.npy").c_str(), 0600), 0);
  // `timeout` ends the run if it blocks (as it did: open() of a FIFO waits for a writer).
  const auto t0 = std::chrono::steady_clock::now();
  CommandResult r = run_shell("timeout 20 " + ctxpar_path() + " attention --q " + dir +
                              "/q.npy --k " + dir + "/q.npy --v " + dir + "/q.npy");
  // At once: well inside the 20 s a blocking open() would wait (a process start under ASan is
  // slow, so its bound is 8 s).
  EXPECT_LT(std::chrono::steady_clock::now() - t0,
            std::chrono::seconds(CTXPAR_UNDER_SANITIZER ? 8 : 2));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find(dir + "/q.npy: not a regular file (a FIFO)"), std::string::npos) << r.err;
  fs::remove_all(dir);
}

// Exit status: 2 for bad usage or input (before any computing), 1 for a failure at run time,
// as under MPI (tests in attention_mpi_test.cc).
TEST(CliAttentionFaults, FailingRankExits1AndBadUsageExits2) {
  CommandResult r =
      run_shell("CTXPAR_FAULT_RANK=1 " + fault_ctxpar_path() + " " + kSmallAttention + "--ranks 2");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("rank 1 failed: injected fault"), std::string::npos) << r.err;
  r = run_ctxpar(kSmallAttention + "--head-dim 8");
  EXPECT_EQ(r.exit_code, 2) << r.err;
}

// srun without MPI starts P copies, each of which would run the whole job alone; torchrun's
// copies run over gloo, but only with its whole environment (tests/cli/torchrun_test.sh).
TEST(CliAttentionFaults, LauncherWithoutMpiIsRefusedWithHowToLaunch) {
  CommandResult tr = run_shell(std::string("env WORLD_SIZE=2 RANK=1 LOCAL_RANK=1 ") +
                               ctxpar_path() + " " + kSmallAttention);
  EXPECT_EQ(tr.exit_code, 2) << tr.err;
  EXPECT_NE(tr.err.find("MASTER_ADDR is not set"), std::string::npos) << tr.err;
  EXPECT_NE(tr.err.find("torchrun --nproc-per-node N"), std::string::npos) << tr.err;
  for (const char* env :
       {"SLURM_PROCID=1 SLURM_STEP_NUM_TASKS=2", "SLURM_PROCID=0 SLURM_NTASKS=2 SLURM_STEP_ID=0"}) {
    CommandResult r =
        run_shell(std::string("env ") + env + " " + ctxpar_path() + " " + kSmallAttention);
    EXPECT_EQ(r.exit_code, 2) << env << ": " << r.err;
    EXPECT_NE(r.err.find("mpirun -n 2 ctxpar attention"), std::string::npos)
        << env << ": " << r.err;
    EXPECT_NE(r.err.find("--ranks 2"), std::string::npos) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
  // bench cp sweeps P itself, in one process.
  CommandResult b =
      run_shell("env WORLD_SIZE=2 RANK=0 " + ctxpar_path() + " bench cp --seq 64 --dry-run");
  EXPECT_EQ(b.exit_code, 2) << b.err;
  EXPECT_NE(b.err.find("run it once, without a launcher"), std::string::npos) << b.err;
  // train: the same (it runs over gloo under torchrun, given torchrun's whole environment),
  // and under srun the refusal, before any work.
  CommandResult t = run_shell("env WORLD_SIZE=4 RANK=0 LOCAL_RANK=0 " + ctxpar_path() +
                              " train --seq 64 --steps 1");
  EXPECT_EQ(t.exit_code, 2) << t.err;
  EXPECT_NE(t.err.find("MASTER_ADDR is not set"), std::string::npos) << t.err;
  EXPECT_TRUE(t.out.empty()) << t.out;
  t = run_shell("env SLURM_PROCID=0 SLURM_STEP_NUM_TASKS=4 " + ctxpar_path() +
                " train --seq 64 --steps 1");
  EXPECT_EQ(t.exit_code, 2) << t.err;
  EXPECT_NE(t.err.find("mpirun -n 4 ctxpar train"), std::string::npos) << t.err;
  EXPECT_TRUE(t.out.empty()) << t.out;
  // One process: a batch script (SLURM_NTASKS without a step), a torchrun of one.
  for (const char* env : {"SLURM_PROCID=0 SLURM_NTASKS=4", "WORLD_SIZE=1 RANK=0"}) {
    CommandResult r =
        run_shell(std::string("env ") + env + " " + ctxpar_path() + " " + kSmallAttention);
    EXPECT_EQ(r.exit_code, 0) << env << ": " << r.err;
  }
}

// The library reads no environment: the command reads CTXPAR_GLOO_IFNAME / CTXPAR_GLOO_HOST and
// passes them to the gloo transport (GlooOptions::hostname_or_interface). A torchrun job of one
// rank told to listen on a host that does not resolve is refused, naming it, by each command.
TEST(CliAttentionFaults, GlooAddressVariablesReachTheTransport) {
  for (const std::string& command : {kSmallAttention, std::string("train --seq 64 --steps 1"),
                                     std::string("decode --context 64 --tokens 1")}) {
    const std::string env = "env RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                            std::to_string(ctxpar::test::free_port()) +
                            " CTXPAR_GLOO_IFNAME= CTXPAR_GLOO_HOST=no-such-host.invalid ";
    const CommandResult r = run_shell(env + ctxpar_path() + " " + command);
    EXPECT_EQ(r.exit_code, 2) << command << ": " << r.err;
    EXPECT_NE(r.err.find("cannot listen on host 'no-such-host.invalid'"), std::string::npos)
        << command << ": " << r.err;
  }
  // torch's GLOO_SOCKET_IFNAME (after ctxpar's own): an interface this host lacks is refused
  // naming the variable (issue 38: it was ignored).
  const CommandResult r = run_shell(
      "env -u CTXPAR_GLOO_IFNAME -u CTXPAR_GLOO_HOST GLOO_SOCKET_IFNAME=ctxpar-no-if0 RANK=0 "
      "WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
      std::to_string(ctxpar::test::free_port()) + " " + ctxpar_path() + " " + kSmallAttention);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("GLOO_SOCKET_IFNAME=ctxpar-no-if0: this host has no network interface"),
            std::string::npos)
      << r.err;
}

TEST(CliAttentionFaults, ThreadsDefaultToOmpNumThreads) {
  auto threads = [](const std::string& env, const std::string& args) {
    CommandResult r =
        run_shell("env " + env + " " + ctxpar_path() + " " + kSmallAttention + "--json " + args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r.exit_code == 0 ? parse_json(r)["threads"].get<int>() : -1;
  };
  EXPECT_EQ(threads("OMP_NUM_THREADS=3", ""), 3);
  EXPECT_EQ(threads("OMP_NUM_THREADS=2,1", ""), 2);
  EXPECT_EQ(threads("OMP_NUM_THREADS=3", "--threads 2"), 2);
  EXPECT_EQ(threads("-u OMP_NUM_THREADS", ""), 1);
  CommandResult r = run_shell("env OMP_NUM_THREADS=many " + ctxpar_path() + " " + kSmallAttention);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("OMP_NUM_THREADS='many'"), std::string::npos) << r.err;
  // bench kernel reads the same default (bench cp and train too: threads_option).
  CommandResult k = run_shell("env OMP_NUM_THREADS=2 " + ctxpar_path() +
                              " bench kernel --seq 64 --heads 1 --head-dim 16 --repeats 1 "
                              "--no-backward --json");
  ASSERT_EQ(k.exit_code, 0) << k.err;
  EXPECT_EQ(parse_json(k)["threads"].get<int>(), 2);
  CommandResult t =
      run_shell("env OMP_NUM_THREADS=0 " + ctxpar_path() + " train --seq 64 --steps 1");
  EXPECT_EQ(t.exit_code, 2) << t.err;
  EXPECT_NE(t.err.find("OMP_NUM_THREADS='0'"), std::string::npos) << t.err;
}

}  // namespace
}  // namespace ctxpar::test

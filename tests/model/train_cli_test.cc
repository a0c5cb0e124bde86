// `ctxpar train` driven as a hostile user would: the built binary in a child process (its
// arguments an argument vector, never a shell line, so the test itself cannot inject), its
// working folder a fresh one, its address space capped at 8 GiB so that a run that grows
// without bound fails here instead of waking the OOM killer, and killed after 60 s.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "model/train_support.h"
#include "model/training.h"

namespace ctxpar {
namespace {

namespace fs = std::filesystem;

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

size_t lines_in(const fs::path& p) {
  const std::string text = slurp(p);
  return size_t(std::count(text.begin(), text.end(), '\n'));
}

bool have_matplotlib() {
  static const bool ok =
      std::system("/usr/bin/python3 -c 'import matplotlib' >/dev/null 2>&1") == 0;
  return ok;
}

struct Result {
  int exit_code = -1;  // 1000 + signal when killed
  std::string out, err;
  double seconds = 0;
};

class TrainCli : public test::TempDirTest {
 protected:
  // Runs `ctxpar train` with a tiny model, then `args`, in dir_.
  Result train(const std::vector<std::string>& args) { return wait(start(args)); }

  pid_t start(const std::vector<std::string>& args) {
    const char* build = std::getenv("CTXPAR_BUILD_DIR");
    std::vector<std::string> full = {std::string(build ? build : ".") + "/ctxpar", "train",
                                     "--seq", "64", "--ranks", "1", "--layers", "1", "--dim",
                                     "32", "--heads", "2", "--kv-heads", "1", "--hidden", "32",
                                     "--steps", "2", "--quiet"};
    full.insert(full.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : full) argv.push_back(a.data());
    argv.push_back(nullptr);
    const std::string out = path(".stdout"), err = path(".stderr");
    t0_ = std::chrono::steady_clock::now();
    const pid_t pid = ::fork();
    if (pid == 0) {
      if (::chdir(dir_.c_str()) != 0) _exit(126);
      const int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(o, 1);
      ::dup2(e, 2);
      const rlimit cap = {8ull << 30, 8ull << 30};
      ::setrlimit(RLIMIT_AS, &cap);
      ::execv(argv[0], argv.data());
      _exit(127);
    }
    return pid;
  }

  Result wait(pid_t pid) {
    const std::string out = path(".stdout"), err = path(".stderr");
    Result r;
    int status = 0;
    for (int i = 0; ::waitpid(pid, &status, WNOHANG) == 0; ++i) {
      if (i == 6000) ::kill(pid, SIGKILL);  // 60 s: it hangs
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 1000 + WTERMSIG(status);
    r.out = slurp(out);
    r.err = slurp(err);
    fs::remove(out);
    fs::remove(err);
    return r;
  }

  std::chrono::steady_clock::time_point t0_;
};

// The two payloads of the fault matrix: each once ran `touch PWNED` through the shell that
// the plot command was pasted into.
TEST_F(TrainCli, LogAndPlotPathsNeverReachAShell) {
  Result r = train({"--log", "run.jsonl", "--plot", "x.png'; touch PWNED; echo '"});
  EXPECT_FALSE(fs::exists(dir_ / "PWNED")) << "--plot ran a shell command";
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const std::string weird_log = "a'$(touch PWNED)'.jsonl";
  r = train({"--log", weird_log});
  EXPECT_FALSE(fs::exists(dir_ / "PWNED")) << "--log ran a shell command";
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(lines_in(dir_ / weird_log), 2u) << "the log goes to the file of that very name";
  if (have_matplotlib()) {
    EXPECT_TRUE(fs::exists(dir_ / "x.png'; touch PWNED; echo '")) << r.err;
    EXPECT_TRUE(fs::exists(dir_ / "a'$(touch PWNED)'.png")) << r.err;
  }
}

TEST_F(TrainCli, WeirdLegalFileNamesGetTheirLogAndPlot) {
  const std::string log = "it's \"quoted\" $HOME `id` & 50% a b.jsonl";
  const std::string png = "-plot; $(id) \\ 'x'.png";  // a leading '-' is not an option to python
  const Result r = train({"--log", log, "--plot", png});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(lines_in(dir_ / log), 2u);
  if (!have_matplotlib()) GTEST_SKIP() << "no matplotlib under /usr/bin/python3: plot not checked";
  EXPECT_TRUE(fs::exists(dir_ / png)) << r.out << r.err;
  EXPECT_NE(r.out.find("loss curve: " + png), std::string::npos) << r.out;
}

// A full disk: the run fails naming the file and the system error, not exit 0 behind an
// empty log.
TEST_F(TrainCli, FullDiskDuringLogFailsNamingTheFile) {
  const Result r = train({"--log", "/dev/full"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--log /dev/full failed: No space left on device"), std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("matplotlib"), std::string::npos) << "it must not go on to plot: " << r.err;
}

// Resuming a checkpoint already at --steps: said plainly, exit 0, no loss that was not
// computed, the log left as it was.
TEST_F(TrainCli, ResumePastStepsSaysNothingWasTrained) {
  ASSERT_EQ(train({"--save", "ck.safetensors", "--log", "run.jsonl"}).exit_code, 0);
  for (const char* steps : {"2", "1"}) {
    const Result r = train({"--resume", "ck.safetensors", "--steps", steps, "--log", "run.jsonl"});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("is already at step 2 >= --steps " + std::string(steps) +
                         ": nothing to train"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("loss"), std::string::npos) << r.out;
  }
  const Result loud = train({"--resume", "ck.safetensors", "--steps", "2", "--log", "run.jsonl"});
  EXPECT_EQ(loud.out.find("final loss"), std::string::npos) << loud.out;
  EXPECT_EQ(lines_in(dir_ / "run.jsonl"), 2u);
}

// kill -9 while checkpointing every step: the file at --save is always a whole checkpoint
// (the previous or the new one), and the run resumes from it.
TEST_F(TrainCli, KillDuringCheckpointingLeavesAWholeCheckpoint) {
  const std::string ck = path("ck.safetensors");
  const pid_t pid = start({"--steps", "100000", "--save", ck, "--save-every", "1"});
  for (int i = 0; i < 3000 && !fs::exists(ck); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // mid-run, mid-save likely
  ::kill(pid, SIGKILL);
  EXPECT_EQ(wait(pid).exit_code, 1000 + SIGKILL);
  ASSERT_TRUE(fs::exists(ck));
  const model::SafetensorsFile f = model::read_safetensors(ck);  // ranges and checksum
  EXPECT_TRUE(f.checksummed);
  const int64_t step = std::stoll(f.metadata.at("step"));
  const Result r = train({"--steps", std::to_string(step + 2), "--resume", ck, "--log", "r.jsonl"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(lines_in(dir_ / "r.jsonl"), 2u) << "steps " << step + 1 << " and " << step + 2;
}

// Refused at once with the figure and what to lower; once allocated until the OOM killer
// (here: until the 8 GiB cap).
TEST_F(TrainCli, ModelTooBigForThisMachineIsRefusedBeforeAllocating) {
  const Result r = train({"--layers", "60000", "--dim", "1024"});  // in range, not in memory
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("this run needs about"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("is available (MemAvailable)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("lower --layers"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 20.0) << "took " << r.seconds << " s: it allocated before refusing";
}

// /dev/zero never ends and a FIFO blocks: both refused before a byte is read.
TEST_F(TrainCli, DataThatIsNotARegularFileIsRefused) {
  const std::string fifo = path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& data : {std::string("/dev/zero"), fifo, dir_.string()}) {
    const Result r = train({"--data", data});
    EXPECT_EQ(r.exit_code, 2) << data << ": " << r.err;
    EXPECT_NE(r.err.find("--data " + data + " is not a regular file"), std::string::npos)
        << r.err;
    EXPECT_LT(r.seconds, 20.0) << data << " took " << r.seconds << " s";
  }
}

// A 200 kB header of 100000 nested brackets was a SIGSEGV (exit 139): the stack overflowed
// printing it in an error message. Now a usage error naming the file, the depth and the limit.
TEST_F(TrainCli, DeeplyNestedCheckpointHeaderIsRefusedNotASignal) {
  std::string text = "{\"x\":" + std::string(100000, '[') + std::string(100000, ']') + "}";
  text.append((8 - text.size() % 8) % 8, ' ');
  {
    std::ofstream out(path("deep.safetensors"), std::ios::binary);
    for (int i = 0; i < 8; ++i) out.put(char(uint64_t(text.size()) >> (8 * i)));
    out << text;
  }
  const Result r = train({"--resume", "deep.safetensors"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("checkpoint deep.safetensors has a header nested 100001 levels deep, "
                       "over the limit of 64"),
            std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace ctxpar

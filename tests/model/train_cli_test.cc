// `ctxpar train` driven as a hostile user would: the built binary in a child process (its
// arguments an argument vector, never a shell line, so the test itself cannot inject), its
// working folder a fresh one, its memory 2 GiB as the command sees it (CTXPAR_MEMORY_LIMIT_BYTES,
// which sanitizer builds honour too) and, outside sanitizers, its address space capped at
// 16 GiB so that a run that grows without bound fails here instead of waking the OOM killer;
// killed after 60 s. One test lowers RLIMIT_AS (ulimit -v) itself, and skips under sanitizers.
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

#include "ctxpar/memory.h"
#include "model/train_support.h"
#include "model/training.h"
#include "sanitizers.h"

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
    std::vector<std::string> full = {std::string(build ? build : ".") + "/ctxpar",
                                     "train",
                                     "--seq",
                                     "64",
                                     "--ranks",
                                     "1",
                                     "--layers",
                                     "1",
                                     "--dim",
                                     "32",
                                     "--heads",
                                     "2",
                                     "--kv-heads",
                                     "1",
                                     "--hidden",
                                     "32",
                                     "--steps",
                                     "2",
                                     "--quiet"};
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
      if (address_space_ > 0) {  // the real limit alone
        ::unsetenv(kMemoryLimitEnv);
        const rlimit cap = {address_space_, address_space_};
        ::setrlimit(RLIMIT_AS, &cap);
      } else {
        ::setenv(kMemoryLimitEnv, memory_override_.c_str(), 1);
        if (!CTXPAR_UNDER_SANITIZER) {
          const rlimit cap = {16ull << 30, 16ull << 30};
          ::setrlimit(RLIMIT_AS, &cap);
        }
      }
      if (file_size_cap_ > 0) {  // a disk that fills up: writes past it fail with EFBIG
        ::signal(SIGXFSZ, SIG_IGN);
        const rlimit fsize = {file_size_cap_, file_size_cap_};
        ::setrlimit(RLIMIT_FSIZE, &fsize);
      }
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
  rlim_t address_space_ = 0;  // > 0: RLIMIT_AS of the child instead of the override
  std::string memory_override_ = "2147483648";  // CTXPAR_MEMORY_LIMIT_BYTES: 2 GiB
  rlim_t file_size_cap_ = 0;                    // bytes any file of the run may hold (0: no cap)
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

// A device as --log (/dev/full, /dev/null) is not a file ctxpar may replace: refused by name
// before the run (it used to be written through; a full disk during a run still fails naming
// the file, LogFile in src/model/trainer.cc).
TEST_F(TrainCli, DeviceAsLogIsRefusedBeforeTheRun) {
  const Result r = train({"--log", "/dev/full"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--log /dev/full exists and is not a regular file"), std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("matplotlib"), std::string::npos) << "it must not go on to plot: " << r.err;
}

// A disk that fills up during the run (every file capped at 1000 bytes, RLIMIT_FSIZE): the
// run fails naming the log and the system error, not exit 0 behind a cut log.
TEST_F(TrainCli, FullDiskDuringLogFailsNamingTheFile) {
  file_size_cap_ = 1000;  // a log line is ~240 bytes: the fifth does not fit
  const Result r = train({"--log", "r.jsonl", "--steps", "20"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--log r.jsonl failed: File too large"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("matplotlib"), std::string::npos) << "it must not go on to plot: " << r.err;
}

// A link planted at the --log or --plot name made the run overwrite the link's
// target. Refused by name before the run; the target keeps its bytes.
TEST_F(TrainCli, LogAndPlotNeverWriteThroughALink) {
  std::ofstream(dir_ / "victim") << "x\n";
  fs::create_symlink("victim", dir_ / "run.jsonl");
  fs::create_symlink("victim", dir_ / "p.png");
  Result r = train({"--log", "run.jsonl", "--no-plot"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--log run.jsonl is a symbolic link"), std::string::npos) << r.err;
  r = train({"--log", "r.jsonl", "--plot", "p.png"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--plot p.png is a symbolic link"), std::string::npos) << r.err;
  r = train({"--save", "run.jsonl"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--save run.jsonl is a symbolic link"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(dir_ / "victim"), "x\n");
  EXPECT_FALSE(fs::exists(dir_ / "r.jsonl")) << "refused after the run, not before";
}

// --plot /dev/null is refused by name (a device is not a file to replace); --no-plot is the
// way to have no loss curve.
TEST_F(TrainCli, PlotToADeviceIsRefusedNoPlotSkipsIt) {
  Result r = train({"--log", "r.jsonl", "--plot", "/dev/null"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--plot /dev/null exists and is not a regular file"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("--no-plot"), std::string::npos) << r.err;
  r = train({"--log", "r.jsonl", "--no-plot"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(lines_in(dir_ / "r.jsonl"), 2u);
  EXPECT_FALSE(fs::exists(dir_ / "r.png"));
}

// Every output path is checked before the first step, exit 2 naming the option (a missing
// folder for --save was found only when the checkpoint was written, after the whole run).
TEST_F(TrainCli, OutputPathsAreCheckedBeforeTheFirstStep) {
  fs::create_directories(dir_ / "folder");
  const struct {
    std::vector<std::string> args;
    std::string message;
  } cases[] = {
      {{"--save", "missing/ck.safetensors"},
       "--save missing/ck.safetensors cannot be written: its folder missing does not exist"},
      {{"--save", "folder"}, "--save folder is a folder"},
      {{"--dump-grads", "missing/g.safetensors"}, "--dump-grads missing/g.safetensors cannot"},
      {{"--log", "missing/r.jsonl"}, "--log missing/r.jsonl cannot be written"},
      {{"--plot", "missing/r.png"}, "--plot missing/r.png cannot be written"},
      {{"--save", "/proc/ck.safetensors"},
       "--save /proc/ck.safetensors cannot be written: no "
       "file can be created in /proc"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.message);
    std::vector<std::string> args = c.args;
    for (const char* a : {"--steps", "60", "--log", "first.jsonl"})
      if (c.args[0] != "--log") args.push_back(a);
    if (c.args[0] == "--log") args.insert(args.end(), {"--steps", "60"});
    const Result r = train(args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(dir_ / "first.jsonl")) << "a step ran before the refusal";
  }
}

// The plotter runs isolated (python3 -I): a json.py in the working folder is not imported.
TEST_F(TrainCli, PlotterIgnoresAJsonPyInTheWorkingFolder) {
  std::ofstream(dir_ / "json.py") << "open('PWNED', 'w')\n";
  const Result r = train({"--log", "r.jsonl"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "PWNED")) << "the plotter imported ./json.py";
}

// Resuming a checkpoint already at --steps: said plainly, exit 0, no loss that was not
// computed, the log left as it was.
TEST_F(TrainCli, ResumePastStepsSaysNothingWasTrained) {
  ASSERT_EQ(train({"--save", "ck.safetensors", "--log", "run.jsonl"}).exit_code, 0);
  for (const char* steps : {"2", "1"}) {
    const Result r = train({"--resume", "ck.safetensors", "--steps", steps, "--log", "run.jsonl"});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(
        r.out.find("is already at step 2 >= --steps " + std::string(steps) + ": nothing to train"),
        std::string::npos)
        << r.out;
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

// Refused at once with the figure, the limit that binds and what to lower; once allocated
// until the OOM killer. `ctxpar train` ignored CTXPAR_MEMORY_LIMIT_BYTES and read MemAvailable
// only.
TEST_F(TrainCli, ModelTooBigForThisMachineIsRefusedBeforeAllocating) {
  const Result r = train({"--layers", "60000", "--dim", "1024"});  // in range, not in memory
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("this run needs about"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("but CTXPAR_MEMORY_LIMIT_BYTES leaves 2.0 GiB; raise or unset "
                       "CTXPAR_MEMORY_LIMIT_BYTES"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("lower --layers"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 20.0) << "took " << r.seconds << " s: it allocated before refusing";
  // A model that fits the machine but not the override is refused too.
  const Result mid = train({"--layers", "8", "--dim", "1024", "--hidden", "8192"});  // 3.3 GB
  EXPECT_EQ(mid.exit_code, 2) << mid.err;
  EXPECT_NE(mid.err.find("CTXPAR_MEMORY_LIMIT_BYTES leaves"), std::string::npos) << mid.err;
}

// The real address-space limit (ulimit -v) counts, named as such: the run is refused before
// allocating instead of failing with "out of memory" once it has filled what it may.
TEST_F(TrainCli, AddressSpaceLimitIsNamedWhenItBinds) {
  CTXPAR_SKIP_UNDER_SANITIZER();
  address_space_ = 3ull << 30;
  const Result r = train({"--layers", "8", "--dim", "1024", "--hidden", "8192"});  // 3.3 GB
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("but the address-space limit (ulimit -v) leaves"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("raise it (ulimit -v)"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 20.0);
}

// A bad override is a usage error naming the variable.
TEST_F(TrainCli, BadMemoryOverrideIsRefusedNamingTheVariable) {
  memory_override_ = "lots";
  const Result r = train({});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("CTXPAR_MEMORY_LIMIT_BYTES must be a positive number of bytes, got 'lots'"),
            std::string::npos)
      << r.err;
}

// /dev/zero never ends and a FIFO blocks: both refused before a byte is read.
TEST_F(TrainCli, DataThatIsNotARegularFileIsRefused) {
  const std::string fifo = path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& data : {std::string("/dev/zero"), fifo, dir_.string()}) {
    const Result r = train({"--data", data});
    EXPECT_EQ(r.exit_code, 2) << data << ": " << r.err;
    EXPECT_NE(r.err.find("--data " + data + " is not a regular file"), std::string::npos) << r.err;
    EXPECT_LT(r.seconds, 20.0) << data << " took " << r.seconds << " s";
  }
}

// --data with --separator: packed documents train on 2 ranks with the balanced layout (what
// --layout auto picks then: the same bits as --layout balanced); bad separators and the
// balanced layout without documents are refused before a step, naming the flag (exit 2).
TEST_F(TrainCli, PackedDocumentsTrainBalancedAndBadSeparatorsAreRefused) {
  {
    std::ofstream docs(dir_ / "docs.txt", std::ios::binary);
    for (int d = 0; d < 40; ++d)
      docs << std::string(size_t(1 + d * 7 % 23), char('a' + d % 26)) << '\n';
  }
  const std::vector<std::string> packed = {"--data", "docs.txt", "--separator",
                                           "10",     "--ranks",  "2"};
  auto with = [&](std::vector<std::string> args, const std::vector<std::string>& more) {
    args.insert(args.end(), more.begin(), more.end());
    return args;
  };
  Result r = train(with(packed, {"--log", "auto.jsonl", "--no-plot"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = train(with(packed, {"--layout", "balanced", "--log", "balanced.jsonl", "--no-plot"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(lines_in(dir_ / "auto.jsonl"), 2u);
  auto losses = [&](const char* log) {  // the losses, as JSON prints them (shortest exact text)
    std::string out;
    const std::string text = slurp(dir_ / log);
    for (size_t at = text.find("\"loss\":"); at != std::string::npos;
         at = text.find("\"loss\":", at + 1))
      out += text.substr(at, text.find(',', at) - at) + " ";
    return out;
  };
  const std::string auto_losses = losses("auto.jsonl");
  EXPECT_EQ(std::count(auto_losses.begin(), auto_losses.end(), ' '), 2) << auto_losses;
  EXPECT_EQ(auto_losses, losses("balanced.jsonl"));
  const struct {
    std::vector<std::string> args;
    std::string message;
  } cases[] = {
      {with(packed, {"--separator", "256"}),
       "--separator 256 is not a token id: the vocabulary is 0..255"},
      {with(packed, {"--separator", "-1"}), "--separator must be"},
      {{"--separator", "10"}, "--separator needs --data"},
      {with(packed, {"--batch", "2"}), "--separator needs --batch 1, got 2"},
      {{"--layout", "balanced"},
       "--layout balanced balances the work of packed documents and "
       "needs --separator"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.message);
    r = train(with(c.args, {"--log", "refused.jsonl", "--no-plot"}));
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(dir_ / "refused.jsonl")) << "a step ran before the refusal";
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

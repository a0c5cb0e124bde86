// memory_limit(): the smallest of MemAvailable, RLIMIT_AS / RLIMIT_DATA less what the process
// already maps, the cgroup's limit less its usage, and CTXPAR_MEMORY_LIMIT_BYTES; fake /proc
// and cgroup files in a temporary folder, and real rlimits in a child process.
#include "ctxpar/memory.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "ctxpar/error.h"
#include "sanitizers.h"

namespace ctxpar {
namespace {

namespace fs = std::filesystem;

class MemoryLimitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "ctxpar_memory_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    src_.meminfo = (dir_ / "meminfo").string();
    src_.self_status = (dir_ / "status").string();
    src_.self_cgroup = (dir_ / "cgroup").string();
    src_.cgroup_root = (dir_ / "sys").string();
    src_.rlimits = false;
    write("meminfo",
          "MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:    8000000 kB\n");
  }
  void TearDown() override { fs::remove_all(dir_); }
  void write(const std::string& rel, const std::string& text) {
    fs::create_directories((dir_ / rel).parent_path());
    std::ofstream(dir_ / rel) << text;
  }
  fs::path dir_;
  MemoryLimitSources src_;
};

TEST_F(MemoryLimitTest, MemAvailableAloneIsTheLimit) {
  const MemoryLimit m = memory_limit(src_);
  EXPECT_EQ(m.bytes, 8000000.0 * 1024);
  EXPECT_EQ(m.source, MemorySource::meminfo);
  EXPECT_NE(m.source_text().find("MemAvailable"), std::string::npos);
  fs::remove(dir_ / "meminfo");
  EXPECT_FALSE(memory_limit(src_).known()) << "nothing readable: no limit, no check";
}

TEST_F(MemoryLimitTest, OverrideCountsWhenSmallestAndIsValidated) {
  src_.override_value = "1e6";
  MemoryLimit m = memory_limit(src_);
  EXPECT_EQ(m.bytes, 1e6);
  EXPECT_EQ(m.source, MemorySource::env_override);
  EXPECT_EQ(m.shortfall(3e6),
            "needs 2.9 MiB, CTXPAR_MEMORY_LIMIT_BYTES leaves 976.6 KiB; raise or "
            "unset CTXPAR_MEMORY_LIMIT_BYTES");
  src_.override_value = "1e15";  // larger than MemAvailable: MemAvailable binds
  EXPECT_EQ(memory_limit(src_).source, MemorySource::meminfo);
  for (const char* bad : {"", "lots", "0", "-5", "1e400", "inf", "nan", "12 GB"}) {
    src_.override_value = bad;
    try {
      memory_limit(src_);
      ADD_FAILURE() << "'" << bad << "' accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("CTXPAR_MEMORY_LIMIT_BYTES must be a positive number "
                                           "of bytes, got '" +
                                           std::string(bad) + "'"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST_F(MemoryLimitTest, CgroupV2LimitLessUsageOfTheOwnCgroupAndItsAncestors) {
  write("cgroup", "0::/user.slice/job\n");
  write("sys/user.slice/job/memory.max", "max\n");
  write("sys/user.slice/job/memory.current", "1000\n");
  EXPECT_EQ(memory_limit(src_).source, MemorySource::meminfo) << "max: unlimited";
  write("sys/user.slice/job/memory.max", "5000000\n");
  MemoryLimit m = memory_limit(src_);
  EXPECT_EQ(m.bytes, 5000000.0 - 1000);
  EXPECT_EQ(m.source, MemorySource::cgroup);
  EXPECT_EQ(m.where, src_.cgroup_root + "/user.slice/job/memory.max");
  EXPECT_NE(m.source_text().find("cgroup"), std::string::npos);
  // A parent's tighter limit binds the child too.
  write("sys/user.slice/memory.max", "3000000\n");
  write("sys/user.slice/memory.current", "2900000\n");
  m = memory_limit(src_);
  EXPECT_EQ(m.bytes, 100000.0);
  EXPECT_EQ(m.where, src_.cgroup_root + "/user.slice/memory.max");
  // Usage above the limit: nothing left, not a negative figure.
  write("sys/user.slice/memory.current", "3500000\n");
  EXPECT_EQ(memory_limit(src_).bytes, 0.0);
}

TEST_F(MemoryLimitTest, CgroupV1LimitInBytes) {
  write("cgroup", "12:cpu,cpuacct:/x\n5:memory:/docker/abc\n0::/\n");
  write("sys/memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n");  // no limit
  write("sys/memory/docker/abc/memory.usage_in_bytes", "1000\n");
  EXPECT_EQ(memory_limit(src_).source, MemorySource::meminfo);
  write("sys/memory/docker/abc/memory.limit_in_bytes", "2000000\n");
  const MemoryLimit m = memory_limit(src_);
  EXPECT_EQ(m.bytes, 2000000.0 - 1000);
  EXPECT_EQ(m.source, MemorySource::cgroup);
  EXPECT_EQ(m.where, src_.cgroup_root + "/memory/docker/abc/memory.limit_in_bytes");
}

// A real RLIMIT_AS / RLIMIT_DATA in a child process: the limit less VmSize / VmData binds
// (MemAvailable and the cgroup faked larger). The child reports through its exit code.
TEST_F(MemoryLimitTest, RlimitLessWhatTheProcessUsesBinds) {
  CTXPAR_SKIP_UNDER_SANITIZER();
  write("meminfo", "MemAvailable: 1000000000 kB\n");  // ~1 TB
  src_.rlimits = true;
  src_.self_status = "/proc/self/status";
  for (int resource : {RLIMIT_AS, RLIMIT_DATA}) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      const rlim_t cap = rlim_t(6) << 30;
      const rlimit r = {cap, cap};
      if (::setrlimit(resource, &r) != 0) _exit(10);
      const MemoryLimit m = memory_limit(src_);
      const MemorySource want =
          resource == RLIMIT_AS ? MemorySource::rlimit_as : MemorySource::rlimit_data;
      if (m.source != want) _exit(11);
      // The cap less what is mapped already (VmSize / VmData, read again here: a few pages may
      // come and go between the two reads).
      std::ifstream status("/proc/self/status");
      const std::string field = resource == RLIMIT_AS ? "VmSize:" : "VmData:";
      double used = -1;
      for (std::string key; status >> key;)
        if (key == field) status >> used;
      if (!(used > 0 && m.bytes < double(cap) &&
            std::fabs(m.bytes - (double(cap) - used * 1024)) < (16 << 20))) {
        std::fprintf(stderr, "limit %.0f, left %.0f, %s %.0f kB\n", double(cap), m.bytes,
                     field.c_str(), used);
        _exit(12);
      }
      const std::string text = m.shortfall(1e12);
      const char* ulimit = resource == RLIMIT_AS ? "(ulimit -v) leaves" : "(ulimit -d) leaves";
      if (text.find(ulimit) == std::string::npos) _exit(13);
      _exit(0);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0)
        << "resource " << resource << " (10 setrlimit, 11 source, 12 bytes, 13 text)";
  }
}

}  // namespace
}  // namespace ctxpar

// What a hostile user found (issue 9, fault matrix), each case as the user runs it: int64
// document ids, --out replaced as a whole, a FIFO as an input, exit codes of failing ranks,
// launchers that are not mpirun.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cli/cli_support.h"
#include "ctxpar/npy.h"

namespace ctxpar::test {
namespace {

namespace fs = std::filesystem;

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const char* kSmall = "attention --seq 64 --heads 2 --head-dim 16 --mask causal ";

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
    CommandResult r = run_ctxpar(std::string(kSmall) + "--ranks 2 --layout zigzag --check --json" +
                                 " --documents " + dir + "/" + name + ".npy --out " + dir + "/" +
                                 name);
    ASSERT_EQ(r.exit_code, 0) << name << ": " << r.err << r.out;
    EXPECT_TRUE(parse_json(r)["check_passed"].get<bool>()) << r.out;
  }
  // The same two documents whatever their ids: bitwise the run with ids {0, 1}.
  EXPECT_EQ(file_bytes(dir + "/wide/out.npy"), file_bytes(dir + "/small/out.npy"));
  // ... and not the one-document answer (the test can tell them apart).
  EXPECT_NE(file_bytes(dir + "/wide/out.npy"), file_bytes(dir + "/one/out.npy"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace ctxpar::test

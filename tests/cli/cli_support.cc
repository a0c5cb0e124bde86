#include "cli/cli_support.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <vector>

namespace ctxpar::test {
namespace fs = std::filesystem;

std::string ctxpar_path() {
  const char* dir = std::getenv("CTXPAR_BUILD_DIR");
  if (!dir) throw std::runtime_error("CTXPAR_BUILD_DIR is not set (run the test through ctest)");
  return std::string(dir) + "/ctxpar";
}

std::string fault_ctxpar_path() {
  const char* dir = std::getenv("CTXPAR_BUILD_DIR");
  if (!dir) throw std::runtime_error("CTXPAR_BUILD_DIR is not set (run the test through ctest)");
  return std::string(dir) + "/ctxpar-faults";
}

namespace {
// The folders temp_dir made, removed when the test program that made them ends (a child it
// forked leaves them alone); CTXPAR_KEEP_TEMP=1 keeps them to look at.
struct TempDirs {
  pid_t owner = ::getpid();
  std::vector<fs::path> made;
  ~TempDirs() {
    if (::getpid() != owner || std::getenv("CTXPAR_KEEP_TEMP")) return;
    std::error_code ec;
    for (const fs::path& p : made) fs::remove_all(p, ec);
  }
};
TempDirs& temp_dirs() {
  static TempDirs dirs;
  return dirs;
}
}  // namespace

std::string temp_dir(const std::string& name) {
  fs::path p =
      fs::temp_directory_path() / ("ctxpar_cli_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  temp_dirs().made.push_back(p);
  return p.string();
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

CommandResult run_shell(const std::string& command) {
  static int counter = 0;
  const fs::path base =
      fs::temp_directory_path() /
      ("ctxpar_cli_run_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
  const std::string out = base.string() + ".out", err = base.string() + ".err";
  const std::string line = "(" + command + ") >" + out + " 2>" + err;
  const int status = std::system(line.c_str());
  CommandResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = file_bytes(out);
  r.err = file_bytes(err);
  fs::remove(out);
  fs::remove(err);
  return r;
}

CommandResult run_ctxpar(const std::string& args) { return run_shell(ctxpar_path() + " " + args); }

nlohmann::json parse_json(const CommandResult& r) {
  try {
    return nlohmann::json::parse(r.out);
  } catch (const std::exception& e) {
    throw std::runtime_error("stdout is not one JSON object (" + std::string(e.what()) +
                             "); exit " + std::to_string(r.exit_code) + ", stderr: " + r.err +
                             "\nstdout: " + r.out.substr(0, 2000));
  }
}

std::string mpirun(const std::string& args, int seconds) {
  return "timeout " + std::to_string(seconds) + " " + std::getenv("CTXPAR_MPIEXEC") +
         " --oversubscribe --mca btl_vader_single_copy_mechanism none " + args;
}

}  // namespace ctxpar::test

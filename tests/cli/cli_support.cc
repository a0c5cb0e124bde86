#include "cli/cli_support.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

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

std::string temp_dir(const std::string& name) {
  fs::path p =
      fs::temp_directory_path() / ("ctxpar_cli_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

namespace {
std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
}  // namespace

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
  r.out = slurp(out);
  r.err = slurp(err);
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

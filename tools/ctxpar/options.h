// A small command-line parser shared by the subcommands: every option is declared with its
// default and help, so `--help` lists them all and an unknown option is an error that names
// the closest valid one.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ctxpar/error.h"

namespace ctxpar::cli {

// A usage mistake: the command prints it with a pointer to --help and exits 2.
class UsageError : public Error {
 public:
  explicit UsageError(const std::string& what) : Error(what) {}
};

// Refuses a launcher (torchrun, srun) that started copies of `ctxpar <command>` without MPI:
// each copy would run the whole job alone.
void refuse_foreign_launcher(const char* command);

class Options {
 public:
  Options(std::string command, std::string summary);
  // --name VALUE (default shown in --help; "" means no default).
  Options& add(const std::string& name, const std::string& default_value, const std::string& help);
  // --name (boolean, off by default).
  Options& flag(const std::string& name, const std::string& help);
  Options& example(const std::string& line);
  // Returns false when --help was given (help already printed to stdout).
  bool parse(int argc, char** argv);

  bool given(const std::string& name) const;
  bool on(const std::string& name) const;
  std::string str(const std::string& name) const;
  int64_t i64(const std::string& name) const;
  double num(const std::string& name) const;
  std::vector<std::string> list(const std::string& name) const;  // comma-separated
  std::vector<int64_t> list_i64(const std::string& name) const;
  std::string help() const;
  const std::string& command() const { return command_; }

 private:
  struct Spec {
    std::string default_value, help;
    bool is_flag = false;
  };
  const Spec& spec(const std::string& name) const;
  std::string command_, summary_;
  std::vector<std::string> order_;
  std::map<std::string, Spec> specs_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> examples_;
};

}  // namespace ctxpar::cli

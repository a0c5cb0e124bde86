#include "options.h"

#include "ctxpar/comm.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace ctxpar::cli {

void refuse_foreign_launcher(const char* command) {
  const ForeignLauncher l = foreign_launcher();
  if (l.ranks == 0) return;
  throw UsageError(detail::concat(
      "started by ", l.name, " as ", l.ranks, " separate processes without MPI: each would run "
      "the whole job alone. Launch it with mpirun -n ", l.ranks, " ctxpar ", command,
      " ... (or srun --mpi=pmix with an MPI build), or as one process with --ranks ", l.ranks));
}

Options::Options(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {}

Options& Options::add(const std::string& name, const std::string& default_value,
                      const std::string& help) {
  order_.push_back(name);
  specs_[name] = Spec{default_value, help, false};
  return *this;
}

Options& Options::flag(const std::string& name, const std::string& help) {
  order_.push_back(name);
  specs_[name] = Spec{"", help, true};
  return *this;
}

Options& Options::example(const std::string& line) {
  examples_.push_back(line);
  return *this;
}

namespace {
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}
}  // namespace

bool Options::parse(int argc, char** argv) {
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(help().c_str(), stdout);
      return false;
    }
    if (arg.rfind("--", 0) != 0)
      throw UsageError("unexpected argument '" + arg + "' (options start with --)");
    std::string name = arg.substr(2), value;
    size_t eq = name.find('=');
    bool has_value = eq != std::string::npos;
    if (has_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    auto it = specs_.find(name);
    if (it == specs_.end()) {
      std::string best;
      size_t best_d = 1000;
      for (const auto& n : order_) {
        size_t d = edit_distance(name, n);
        if (d < best_d) best_d = d, best = n;
      }
      std::string hint = best_d <= 3 ? "; did you mean --" + best + "?" : "";
      throw UsageError("unknown option --" + name + hint);
    }
    if (it->second.is_flag) {
      if (has_value && value != "1" && value != "true")
        throw UsageError("--" + name + " is a flag and takes no value");
      values_[name] = "1";
      continue;
    }
    if (!has_value) {
      if (i + 1 >= argc) throw UsageError("--" + name + " needs a value (" + it->second.help + ")");
      value = argv[++i];
    }
    values_[name] = value;
  }
  return true;
}

const Options::Spec& Options::spec(const std::string& name) const {
  auto it = specs_.find(name);
  CTXPAR_ASSERT(it != specs_.end(), "option --", name, " was never declared");
  return it->second;
}

bool Options::given(const std::string& name) const {
  spec(name);
  return values_.count(name) > 0;
}

bool Options::on(const std::string& name) const { return given(name) && values_.at(name) == "1"; }

std::string Options::str(const std::string& name) const {
  auto it = values_.find(name);
  return it != values_.end() ? it->second : spec(name).default_value;
}

int64_t Options::i64(const std::string& name) const {
  std::string s = str(name);
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  // Accept 64K / 1M suffixes: sequence lengths are often written that way.
  if (end && (*end == 'K' || *end == 'k') && end[1] == '\0') v *= 1024, ++end;
  else if (end && (*end == 'M' || *end == 'm') && end[1] == '\0') v *= 1024 * 1024, ++end;
  if (s.empty() || !end || *end != '\0')
    throw UsageError("--" + name + " expects a whole number, got '" + s + "'");
  return v;
}

double Options::num(const std::string& name) const {
  std::string s = str(name);
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (s.empty() || !end || *end != '\0')
    throw UsageError("--" + name + " expects a number, got '" + s + "'");
  return v;
}

std::vector<std::string> Options::list(const std::string& name) const {
  std::vector<std::string> out;
  std::stringstream ss(str(name));
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

std::vector<int64_t> Options::list_i64(const std::string& name) const {
  std::vector<int64_t> out;
  for (const auto& item : list(name)) {
    char* end = nullptr;
    long long v = std::strtoll(item.c_str(), &end, 10);
    if (end && (*end == 'K' || *end == 'k') && end[1] == '\0') v *= 1024, ++end;
    else if (end && (*end == 'M' || *end == 'm') && end[1] == '\0') v *= 1024 * 1024, ++end;
    if (!end || *end != '\0')
      throw UsageError("--" + name + " expects comma-separated whole numbers, got '" + item + "'");
    out.push_back(v);
  }
  return out;
}

std::string Options::help() const {
  std::ostringstream out;
  out << "usage: ctxpar " << command_ << " [options]\n\n" << summary_ << "\n\noptions:\n";
  for (const auto& n : order_) {
    const Spec& s = specs_.at(n);
    std::string left = "  --" + n + (s.is_flag ? "" : " VALUE");
    out << left;
    if (left.size() < 28) out << std::string(28 - left.size(), ' ');
    else out << "\n" << std::string(28, ' ');
    out << s.help;
    if (!s.is_flag && !s.default_value.empty()) out << " (default: " << s.default_value << ")";
    out << "\n";
  }
  out << "  --help                    this text\n";
  if (!examples_.empty()) {
    out << "\nexamples:\n";
    for (const auto& e : examples_) out << "  " << e << "\n";
  }
  return out.str();
}

}  // namespace ctxpar::cli

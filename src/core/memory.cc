#include "ctxpar/memory.h"

#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "core/environment.h"
#include "ctxpar/error.h"

namespace ctxpar {
namespace {

// The value after `key` in a "Key:   123 kB" file (/proc/meminfo, /proc/self/status), in
// bytes; < 0 when absent.
double kib_field(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, key.size(), key) != 0) continue;
    std::istringstream rest(line.substr(key.size()));
    double kib = 0;
    if (rest >> kib) return kib * 1024.0;
  }
  return -1;
}

// A cgroup file holding one number ("max" or absent: < 0).
double number_file(const std::string& path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word) || word == "max") return -1;
  char* end = nullptr;
  const double v = std::strtod(word.c_str(), &end);
  return *end == '\0' && std::isfinite(v) && v >= 0 ? v : -1;
}

struct Candidate {
  double bytes;
  MemorySource source;
  std::string where;
};

void take(MemoryLimit& best, const Candidate& c) {
  if (c.bytes < 0) return;
  if (!best.known() || c.bytes < best.bytes) {
    best.bytes = c.bytes;
    best.source = c.source;
    best.where = c.where;
  }
}

// cgroup v2 ("0::/path") and v1 ("N:...memory...:/path"): the smallest limit - usage over the
// process's cgroup and its ancestors (a parent's limit binds the child too).
void cgroup_limits(const MemoryLimitSources& s, MemoryLimit& best) {
  std::ifstream in(s.self_cgroup);
  std::string line;
  while (std::getline(in, line)) {
    const size_t a = line.find(':'), b = line.find(':', a == std::string::npos ? a : a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    std::string path = line.substr(b + 1);
    bool v2 = controllers.empty();
    bool v1 = false;
    std::istringstream list(controllers);
    for (std::string c; std::getline(list, c, ',');) v1 = v1 || c == "memory";
    if (!v2 && !v1) continue;
    const std::string base = s.cgroup_root + (v1 ? "/memory" : "");
    const char* limit_name = v1 ? "/memory.limit_in_bytes" : "/memory.max";
    const char* usage_name = v1 ? "/memory.usage_in_bytes" : "/memory.current";
    while (true) {
      const std::string dir = base + (path == "/" ? "" : path);
      const double limit = number_file(dir + limit_name);
      // v1 writes "no limit" as a huge page-rounded number.
      if (limit >= 0 && limit < 0x1p62) {
        const double used = std::max(0.0, number_file(dir + usage_name));
        take(best, {std::max(0.0, limit - used), MemorySource::cgroup, dir + limit_name});
      }
      if (path.empty() || path == "/") break;
      const size_t slash = path.rfind('/');
      path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
    }
  }
}

void rlimit_limits(const MemoryLimitSources& s, MemoryLimit& best) {
  const struct {
    int resource;
    const char* field;
    MemorySource source;
  } limits[] = {{RLIMIT_AS, "VmSize:", MemorySource::rlimit_as},
                {RLIMIT_DATA, "VmData:", MemorySource::rlimit_data}};
  for (const auto& l : limits) {
    rlimit r{};
    if (::getrlimit(l.resource, &r) != 0 || r.rlim_cur == RLIM_INFINITY) continue;
    const double used = std::max(0.0, kib_field(s.self_status, l.field));
    take(best, {std::max(0.0, double(r.rlim_cur) - used), l.source, ""});
  }
}

}  // namespace

MemoryLimitSources MemoryLimitSources::system() {
  MemoryLimitSources s;
  s.override_value = environment::memory_limit_override();
  return s;
}

MemoryLimit memory_limit(const MemoryLimitSources& s) {
  MemoryLimit best;
  if (s.override_value) {
    const std::string& text = *s.override_value;
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(text.c_str(), &end);
    CTXPAR_CHECK(!text.empty() && *end == '\0' && errno != ERANGE && std::isfinite(v) && v > 0,
                 kMemoryLimitEnv, " must be a positive number of bytes, got '", text,
                 "'; set it to e.g. 8e9 or unset it");
    take(best, {v, MemorySource::env_override, ""});
  }
  take(best, {kib_field(s.meminfo, "MemAvailable:"), MemorySource::meminfo, ""});
  if (s.rlimits) rlimit_limits(s, best);
  cgroup_limits(s, best);
  return best;
}

MemoryLimit memory_limit() { return memory_limit(MemoryLimitSources::system()); }

std::string MemoryLimit::source_text() const {
  switch (source) {
    case MemorySource::meminfo:
      return "the machine's available memory (MemAvailable in /proc/meminfo)";
    case MemorySource::rlimit_as:
      return "the address-space limit (ulimit -v)";
    case MemorySource::rlimit_data:
      return "the data-segment limit (ulimit -d)";
    case MemorySource::cgroup:
      return "the cgroup's memory limit (" + where + ")";
    case MemorySource::env_override:
      return kMemoryLimitEnv;
    case MemorySource::unknown:
      break;
  }
  return "no known limit";
}

std::string MemoryLimit::raise_text() const {
  switch (source) {
    case MemorySource::meminfo:
      return "free memory on this machine";
    case MemorySource::rlimit_as:
      return "raise it (ulimit -v)";
    case MemorySource::rlimit_data:
      return "raise it (ulimit -d)";
    case MemorySource::cgroup:
      return "raise the container's or cgroup's memory limit";
    case MemorySource::env_override:
      return std::string("raise or unset ") + kMemoryLimitEnv;
    case MemorySource::unknown:
      break;
  }
  return "";
}

std::string MemoryLimit::shortfall(double needed_bytes) const {
  return detail::concat("needs ", bytes_text(needed_bytes), ", ", source_text(), " leaves ",
                        bytes_text(bytes), "; ", raise_text());
}

}  // namespace ctxpar

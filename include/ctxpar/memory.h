// How much memory this process may still take, from every limit that can bind it: the machine
// (MemAvailable), the address-space and data limits (ulimit -v, ulimit -d), the cgroup's
// memory limit, and an override of the user's own (CTXPAR_MEMORY_LIMIT_BYTES). The smallest
// counts, and which one it was, so a refusal can say what to raise. Every command and the
// Python package check a job's estimate against this before allocating.
#pragma once
#include <optional>
#include <string>

namespace ctxpar {

enum class MemorySource {
  unknown,       // no source could be read: bytes < 0, no check
  meminfo,       // MemAvailable of /proc/meminfo
  rlimit_as,     // RLIMIT_AS (ulimit -v) minus VmSize
  rlimit_data,   // RLIMIT_DATA (ulimit -d) minus VmData
  cgroup,        // cgroup v2 memory.max - memory.current (or v1 memory.limit_in_bytes - usage)
  env_override,  // CTXPAR_MEMORY_LIMIT_BYTES
};

struct MemoryLimit {
  double bytes = -1;  // bytes this process may still allocate; < 0 when nothing is known
  MemorySource source = MemorySource::unknown;
  std::string where;  // the cgroup file, for source == cgroup

  bool known() const { return bytes >= 0; }
  // "the address-space limit (ulimit -v)", "MemAvailable in /proc/meminfo", ...
  std::string source_text() const;
  // What to do about it: "raise it (ulimit -v) or ...".
  std::string raise_text() const;
  // "needs 3.4 GiB, the address-space limit (ulimit -v) leaves 1.2 GiB; raise it (ulimit -v)"
  std::string shortfall(double needed_bytes) const;
};

// Where memory_limit() reads from; tests point it at fake files and a fake environment.
struct MemoryLimitSources {
  std::string meminfo = "/proc/meminfo";
  std::string self_status = "/proc/self/status";  // VmSize, VmData
  std::string self_cgroup = "/proc/self/cgroup";
  std::string cgroup_root = "/sys/fs/cgroup";  // v2 unified root; v1 controllers below it
  bool rlimits = true;                         // read getrlimit (false: ignore them)
  // The override's text; nullopt: not set. Default: the environment variable.
  std::optional<std::string> override_value;
  static MemoryLimitSources system();  // the real files, rlimits and environment
};

// The name of the override variable.
inline constexpr const char* kMemoryLimitEnv = "CTXPAR_MEMORY_LIMIT_BYTES";

// The smallest of every limit readable from `sources`. Throws ctxpar::Error naming
// CTXPAR_MEMORY_LIMIT_BYTES when the override is not a positive number of bytes (the commands
// exit 2 on it).
MemoryLimit memory_limit(const MemoryLimitSources& sources);
MemoryLimit memory_limit();  // memory_limit(MemoryLimitSources::system())

}  // namespace ctxpar

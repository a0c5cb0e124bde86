// Shared by the fuzz targets: the input as a file (an in-memory memfd, no disk), and the
// rule that a parser's error is a ctxpar::Error that says what is wrong.
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace fuzz {

[[noreturn]] inline void fail(const char* target, const char* what, const std::string& detail) {
  std::fprintf(stderr, "%s: %s: %s\n", target, what, detail.c_str());
  std::abort();
}

// "/proc/self/fd/N" holding exactly `size` bytes of `data` (one memfd, reused), or "" when
// the memfd could not be made.
inline std::string as_file(const uint8_t* data, size_t size) {
  static const int fd = memfd_create("fuzz_input", 0);
  if (fd < 0 || ftruncate(fd, 0) != 0) return "";
  if (size > 0 && pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) return "";
  return "/proc/self/fd/" + std::to_string(fd);
}

// An error message must say something, and name `must_name` (the file) when that is given.
inline void check_message(const char* target, const std::string& msg,
                          const std::string& must_name = "") {
  // CTXPAR_FUZZ_VERBOSE=1: print every refusal (to see why a seed stops where it does).
  static const bool verbose = std::getenv("CTXPAR_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "%s: refused: %s\n", target, msg.c_str());
  if (msg.empty()) fail(target, "empty error message", "");
  if (!must_name.empty() && msg.find(must_name) == std::string::npos)
    fail(target, "error message does not name the file", msg);
}

}  // namespace fuzz

// Errors. A user mistake throws ctxpar::Error with a message the user can act on; a broken
// internal invariant aborts with file:line (CTXPAR_ASSERT), because continuing would give a
// silently wrong answer.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace ctxpar {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

[[noreturn]] void assert_fail(const char* expr, const char* file, int line, const std::string& msg);

// A byte count for messages and reports, in binary units: "512 B", "1.5 MiB", "3.0 GiB"
// (the one formatter of the library and the command).
std::string bytes_text(double bytes);

// A short, printable, single-line rendering of untrusted text (a file's header, a value from
// the network) for error messages: other bytes as \xNN, past max_len cut with "...".
std::string printable(std::string_view s, size_t max_len = 40);

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
}  // namespace detail

}  // namespace ctxpar

// Throws ctxpar::Error when `cond` is false; the rest of the arguments are streamed into the
// message: CTXPAR_CHECK(d % 2 == 0, "q: head dim must be even, got ", d).
#define CTXPAR_CHECK(cond, ...)                                                \
  do {                                                                         \
    if (!(cond)) throw ::ctxpar::Error(::ctxpar::detail::concat(__VA_ARGS__)); \
  } while (0)

#define CTXPAR_ASSERT(cond, ...)                                          \
  do {                                                                    \
    if (!(cond))                                                          \
      ::ctxpar::assert_fail(#cond, __FILE__, __LINE__,                    \
                            ::ctxpar::detail::concat("", ##__VA_ARGS__)); \
  } while (0)

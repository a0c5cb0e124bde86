#include "ctxpar/error.h"

#include <cstdio>
#include <cstdlib>

namespace ctxpar {

void assert_fail(const char* expr, const char* file, int line, const std::string& msg) {
  std::fprintf(stderr, "ctxpar: internal error at %s:%d: assertion `%s` failed%s%s\n", file, line,
               expr, msg.empty() ? "" : ": ", msg.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace ctxpar

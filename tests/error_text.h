// The message of the ctxpar::Error a call throws ("no error" when it returns), for tests that
// check what an error says.
#pragma once
#include <functional>
#include <string>

#include "ctxpar/error.h"

namespace ctxpar::test {

inline std::string error_text(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace ctxpar::test

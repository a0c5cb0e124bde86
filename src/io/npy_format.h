// Private to the io layer: what the .npy reader (npy.cc) and writer (npy_write.cc) share.
#pragma once
#include <cstddef>
#include <string>

#include "ctxpar/error.h"

namespace ctxpar::npy_format {

inline constexpr char kMagic[] = "\x93NUMPY";
inline constexpr size_t kMagicLen = 6;

// Every problem with a file is reported as "<file>: <problem>".
[[noreturn]] inline void fail(const std::string& name, const std::string& problem) {
  throw Error(name + ": " + problem);
}

}  // namespace ctxpar::npy_format

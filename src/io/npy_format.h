// Private to the io layer: what the .npy header parser (npy_header.cc), readers (npy.cc) and
// writer (npy_write.cc) share.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "ctxpar/error.h"
#include "ctxpar/npy.h"

namespace ctxpar::npy_format {

inline constexpr char kMagic[] = "\x93NUMPY";
inline constexpr size_t kMagicLen = 6;

// Every problem with a file is reported as "<file>: <problem>".
[[noreturn]] inline void fail(const std::string& name, const std::string& problem) {
  throw Error(name + ": " + problem);
}

// Bytes one stored element of type t takes.
inline size_t element_size(NpyType t) {
  switch (t) {
    case NpyType::f16:
      return 2;
    case NpyType::f32:
      return 4;
    case NpyType::i32:
      return 4;
    case NpyType::i64:
      return 8;
  }
  return 0;
}

// The length of magic + version + length field + header from the file's first bytes (the
// first 12, or the whole file if shorter), checked against the file's size; the major version
// in *version (npy_header.cc). Throws naming the file.
uint64_t header_end(std::span<const uint8_t> head, uint64_t file_size, const std::string& name,
                    int* version);

}  // namespace ctxpar::npy_format

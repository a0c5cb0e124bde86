// FNV-1a, 64 bit: the one hash of the project (checkpoint checksums, the fingerprints MPI ranks
// compare, the strategies' argument agreement). Not cryptographic: it catches corruption and
// disagreement, not an adversary.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ctxpar {

constexpr uint64_t kFnv1a64Offset = 0xcbf29ce484222325ull;

// Continues the hash `h` over `bytes` bytes (start from kFnv1a64Offset; chain calls to hash
// several pieces as one).
inline uint64_t fnv1a64(const void* data, size_t bytes, uint64_t h = kFnv1a64Offset) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

}  // namespace ctxpar

// Note [Buffers on cache lines]: the kernel's own buffers start on a 64-byte line. A
// std::vector's data is 16-byte aligned (a large one is an mmap'd chunk plus glibc's 16-byte
// header), so every 64-byte row of an AMX tile load or store, and every 512-bit vector load,
// straddled two lines. dev/11_amx_lines.cc (the library's gemm_amx_chunks on the backward's
// dV and dQ shapes, random values, one thread, an AMX-BF16 guest): 570-640 GFLOP/s one part
// and 840-960 three parts off a line, 1660-2090 and 1590-2290 on lines. End to end (docs/
// kernel.md, "Round four"): bf16 +40-60 %, fp32 +5-7 %. Alignment moves no value: every
// result keeps its bits (scripts/bitwise_grid.sh). From 2 MiB a buffer starts on a huge page
// and asks for huge pages (Note [Huge pages for large buffers], core/pages.h).
#pragma once
#include <cstddef>
#include <vector>

#include "core/pages.h"

namespace ctxpar::kernel {

template <class T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <class U>
  LineAllocator(const LineAllocator<U>&) noexcept {}  // NOLINT: rebinding, as std::allocator
  T* allocate(std::size_t n) { return static_cast<T*>(allocate_buffer(n * sizeof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { free_buffer(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const LineAllocator<U>&) const noexcept {
    return true;
  }
};

// A std::vector whose data starts on a cache line (on a huge page from 2 MiB).
template <class T>
using LineVector = std::vector<T, LineAllocator<T>>;

}  // namespace ctxpar::kernel

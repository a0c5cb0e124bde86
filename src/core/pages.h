// Note [Huge pages for large buffers]: large buffers (the kernel's packed rows and partials,
// tensors) start on a 2 MiB boundary and ask the kernel for transparent huge pages over their
// whole 2 MiB spans (madvise MADV_HUGEPAGE: Linux's default THP mode, "madvise", gives huge
// pages only where asked). A backward task streams its packed Q, dO and dQ partial (7 MiB at
// T = 4096, D = 128) past K and V tiles: on 4 KiB pages that is more pages than the second-level
// TLB holds, and a guest's page walk is two-dimensional. On the Intel guest of docs/kernel.md
// ("Round ten"): fp32 +2-4 %, the bf16 forward +6-7 %. Only the spans inside the buffer are
// advised, so no page is backed that it does not use. Smaller buffers keep a 64-byte line
// (Note [Buffers on cache lines] in kernel/lines.h). Only where memory sits moves: no value.
#pragma once
#include <cstddef>
#include <cstdint>
#include <new>
#ifdef __linux__
#include <sys/mman.h>
#endif

namespace ctxpar {

inline constexpr std::size_t kLineBytes = 64;
inline constexpr std::size_t kHugePage = std::size_t{2} << 20;

// The alignment a buffer of `bytes` gets (allocate_buffer, free_buffer agree on it).
inline std::size_t buffer_alignment(std::size_t bytes) {
  return bytes >= kHugePage ? kHugePage : kLineBytes;
}
// `bytes` of uninitialised memory on a line, or on a huge page with huge pages asked for its
// whole 2 MiB spans; throws std::bad_alloc as operator new does. Free with free_buffer.
inline void* allocate_buffer(std::size_t bytes) {
  const std::size_t align = buffer_alignment(bytes);
  void* p = ::operator new (bytes, std::align_val_t{align});
#ifdef MADV_HUGEPAGE
  if (align == kHugePage) madvise(p, bytes / kHugePage * kHugePage, MADV_HUGEPAGE);  // advice only
#endif
  return p;
}
inline void free_buffer(void* p, std::size_t bytes) noexcept {
  ::operator delete (p, std::align_val_t{buffer_alignment(bytes)});
}

}  // namespace ctxpar

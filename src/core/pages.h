// Note [Huge pages for large buffers]: the kernel's large buffers (LineAllocator from 2 MiB:
// the per-thread scratch of packed rows and dQ partials, which lives as long as its thread)
// start on a 2 MiB boundary and ask for transparent huge pages over their whole 2 MiB spans
// (madvise MADV_HUGEPAGE; Linux's default THP mode, "madvise", gives huge pages only where
// asked). A backward task streams its packed Q, dO and dQ partial (7 MiB at T = 4096, D = 128)
// past the K and V tiles: on 4 KiB pages that is more pages than the second-level TLB holds,
// and a guest's page walk is two-dimensional. On the Intel guest of docs/kernel.md ("Round
// ten"): the fp32 backward +3 %. Only the spans inside the buffer are advised, so no page is
// backed that it does not use. Tensors (ctxpar::Tensor) do not ask: there a fresh huge page
// cost about 7 ms a MiB to touch first (160 MiB: 1.0-1.3 s, against 0.1 s on 4 KiB pages,
// after 3 s idle), and tensors are allocated a call (threads_run.cc's outputs; the device
// layer's buffers are comm/buffer.cc's), so a training step that frees and allocates them
// would pay it again; the scratch pays it once a thread. Smaller buffers keep a 64-byte line
// (Note [Buffers on cache lines] in kernel/lines.h). No value moves.
#pragma once
#include <cstddef>
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

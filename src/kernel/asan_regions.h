// Note [Hot loops under AddressSanitizer]: the micro-kernels load and store whole SIMD vectors
// (32 or 64 bytes). AddressSanitizer checks such an access through an out-of-line call, one per
// vector load, which made the kernel many times slower under the sanitizer build, most of CI's
// sanitizer stage. A function marked CTXPAR_REGION_CHECKED is compiled without the per-access
// checks and instead checks, once per call, every byte its loops will touch (check_rows below)
// against the same shadow memory: an access outside a live allocation is still reported, with
// ASan's own report, before the loop runs (tests/kernel/asan_regions_test.cc). UBSan's checks
// are left out of those loops too (they took much of the time left): what they would check there
// is index arithmetic on int64 values bounded by the tile (rows, columns <= kTile, strides of a
// packed tile), which cannot overflow; every function that computes those bounds, and the
// packing that reads the user's tensors, stays instrumented. Outside a sanitizer build both are
// nothing.
#pragma once
#include <cstdint>

#if defined(__SANITIZE_ADDRESS__)
#define CTXPAR_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CTXPAR_ASAN 1
#endif
#endif

#ifdef CTXPAR_ASAN
#include <sanitizer/asan_interface.h>
#define CTXPAR_REGION_CHECKED __attribute__((no_sanitize_address, no_sanitize_undefined))
#else
#define CTXPAR_REGION_CHECKED
#endif

namespace ctxpar::kernel {

// `rows` rows of `row_bytes` bytes each, `stride_bytes` apart from p: reported (ASan aborts)
// when any byte of them is not addressable.
inline void check_rows(const void* p, int64_t rows, int64_t row_bytes, int64_t stride_bytes,
                       bool write) {
#ifdef CTXPAR_ASAN
  if (rows <= 0 || row_bytes <= 0) return;
  for (int64_t r = 0; r < rows; ++r) {
    char* row = const_cast<char*>(static_cast<const char*>(p)) + r * stride_bytes;
    if (void* bad = __asan_region_is_poisoned(row, static_cast<size_t>(row_bytes)))
      __asan_report_error(__builtin_return_address(0), __builtin_frame_address(0),
                          __builtin_frame_address(0), bad, write ? 1 : 0, 1);
  }
#else
  (void)p, (void)rows, (void)row_bytes, (void)stride_bytes, (void)write;
#endif
}

}  // namespace ctxpar::kernel

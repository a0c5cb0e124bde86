// Note [Huge pages for large buffers] (src/core/pages.h): where large buffers sit and what the
// kernel is asked for them, read back from /proc/self/smaps (the VMA's "hg" flag is
// MADV_HUGEPAGE's advice, whatever the system's THP mode).
#include "core/pages.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "ctxpar/tensor.h"

namespace ctxpar {
namespace {

// The VmFlags of the mapping that holds address p ("" if none is found).
std::string vm_flags(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-' && line.find(':') > line.find(' ')) {
      inside = a >= lo && a < hi;
      continue;
    }
    if (inside && line.rfind("VmFlags:", 0) == 0) return line.substr(8) + " ";
  }
  return "";
}

TEST(Pages, SmallBuffersOnALineLargeOnesOnAHugePage) {
  for (size_t bytes : {size_t{1}, size_t{100}, size_t{64 << 10}, kHugePage - 1}) {
    void* p = allocate_buffer(bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % kLineBytes, 0u) << bytes;
    free_buffer(p, bytes);
  }
  for (size_t bytes : {kHugePage, kHugePage + 4096, 3 * kHugePage}) {
    void* p = allocate_buffer(bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % kHugePage, 0u) << bytes;
    std::memset(p, 1, bytes);  // every byte is the caller's
    free_buffer(p, bytes);
  }
}

TEST(Pages, LargeBuffersAskForHugePages) {
#ifndef __linux__
  GTEST_SKIP() << "madvise(MADV_HUGEPAGE) is Linux's";
#endif
  if (!std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled"))
    GTEST_SKIP() << "this kernel has no transparent huge pages to ask for";
  const size_t bytes = 2 * kHugePage + 12345;
  void* p = allocate_buffer(bytes);
  std::memset(p, 0, bytes);
  const std::string flags = vm_flags(p);
  ASSERT_FALSE(flags.empty()) << "no mapping in /proc/self/smaps holds the buffer";
  EXPECT_NE(flags.find(" hg "), std::string::npos) << "VmFlags:" << flags;
  free_buffer(p, bytes);
}

TEST(Pages, TensorsDoNotAsk) {
  // A tensor's storage stays on 4 KiB pages: a fresh huge page costs far more to touch first
  // on a guest, and the strategies allocate tensors a call (the Note).
  Tensor t(DType::f32, {1, 1024, 8, 128});  // 4 MiB
  const std::string flags = vm_flags(t.data());
  ASSERT_FALSE(flags.empty());
  EXPECT_EQ(flags.find(" hg "), std::string::npos) << "VmFlags:" << flags;
}

}  // namespace
}  // namespace ctxpar

// HostDevice: the cpu device runs a kernel operation without a heap allocation of its own (its
// execute() takes the bound work by reference; only sim copies it into a std::function).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "ctxpar/device.h"
#include "device/host_device.h"

namespace {
std::atomic<long> allocations{0};
}

void* operator new(size_t n) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace ctxpar {
namespace {

// The same operations through the device and called directly: the same allocations (host_add's
// shape check makes some; a std::function per operation would add one each).
TEST(HostDevice, CpuEnqueuesAnOperationWithoutAHeapAllocation) {
  auto dev = make_device({}, 0);
  Tensor x(DType::f32, {1, 64, 2, 16}), y(DType::f32, {1, 64, 2, 16});
  const TensorView xv = x, yv = y;
  dev->add(kComputeStream, xv, yv);  // warm up anything done once
  auto count = [&](auto&& ops) {
    const long before = allocations.load();
    for (int i = 0; i < 100; ++i) ops();
    return allocations.load() - before;
  };
  const long direct = count([&] {
    device::host_fill_zero(xv);
    device::host_add(xv, yv);
  });
  const long enqueued = count([&] {
    dev->fill_zero(kComputeStream, xv);
    dev->add(kComputeStream, xv, yv);
  });
  EXPECT_EQ(enqueued, direct);
}

}  // namespace
}  // namespace ctxpar

// A sent buffer stays readable by its sender whatever the receiver does with what it got
// (device.h: "`buffer` stays readable by the sender"). On the cpu device with the threads
// transport the receiver gets the sender's memory itself (no copy), and it used to own it
// alone: a receiver that freed it (a ring rank unwinding from a failed peer, ~RingComm) freed
// it under a sender still computing on it (heap-use-after-free under ASan, SIGSEGV
// without). Now both hold it and the last to let go frees it.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "ctxpar/comm.h"
#include "ctxpar/device.h"

namespace ctxpar {
namespace {

constexpr size_t kBytes = 4096;

// Rank 0 sends a buffer to rank 1 and keeps reading it after rank 1 has received it, freed
// it and allocated (and filled) fresh buffers of the same size, which reuse freed memory
// first. Returns the bytes rank 0 found changed (ASan reports the read itself before the fix).
int changed_bytes_after_receiver_frees(DeviceKind kind) {
  std::atomic<int> changed{0};
  run_threads(2, [&](Communicator& comm) {
    DeviceOptions o;
    o.kind = kind;
    o.sim_max_delay_us = 0;
    auto dev = make_device(o, comm.rank());
    if (comm.rank() == 0) {
      DeviceBuffer block = dev->alloc(kBytes);
      std::memset(block.data(), 0x5A, kBytes);
      dev->send(kCommStream, comm, block, 1, 7);
      dev->synchronize();
      comm.barrier();  // rank 1 has received the block, freed it and reused the memory
      const std::byte* p = block.data();
      int n = 0;
      for (size_t i = 0; i < kBytes; ++i) n += p[i] != std::byte{0x5A};
      changed = n;
      comm.barrier();
    } else {
      DeviceBuffer got = dev->recv(kCommStream, comm, kBytes, 0, 7);
      dev->synchronize();
      EXPECT_EQ(got.data()[kBytes - 1], std::byte{0x5A});
      got.reset();
      dev->synchronize();
      std::vector<Buffer> reuse;
      for (int i = 0; i < 16; ++i) {
        reuse.push_back(Buffer::uninitialized(kBytes));
        std::memset(reuse.back().data(), 0xA5, kBytes);
      }
      comm.barrier();
      comm.barrier();  // keep `reuse` until rank 0 has looked
    }
  });
  return changed;
}

TEST(LentBuffers, SentBufferOutlivesTheReceiversCopy) {
  for (DeviceKind kind : {DeviceKind::cpu, DeviceKind::sim})
    EXPECT_EQ(changed_bytes_after_receiver_frees(kind), 0) << device_name(kind);
}

// Buffer::share: a second handle to the same bytes, which stay when the first handle goes.
TEST(LentBuffers, SharedBufferLivesUntilItsLastHandle) {
  Buffer a = Buffer::uninitialized(kBytes);
  std::memset(a.data(), 0x11, kBytes);
  Buffer b = a.share();
  EXPECT_EQ(b.data(), a.data());
  EXPECT_EQ(b.size(), kBytes);
  a = Buffer();
  EXPECT_TRUE(a.empty());
  for (size_t i = 0; i < kBytes; ++i) ASSERT_EQ(b.data()[i], std::byte{0x11}) << i;
}

}  // namespace
}  // namespace ctxpar

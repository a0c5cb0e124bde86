// The race checker on its own (src/device/race_checker.h): accesses and events given by hand,
// so each rule is checked without a device, threads or timing.
#include "device/race_checker.h"

#include <gtest/gtest.h>

#include <string>

namespace ctxpar::device {
namespace {

constexpr int kCompute = 0, kComm = 1;

// Two tracked allocations a and b; c is memory the checker was never told of.
class RaceCheckerTest : public ::testing::Test {
 protected:
  RaceCheckerTest() {
    r.add(a, sizeof a);
    r.add(b, sizeof b);
  }
  // Operation `seq` of stream s, `op`, reads or writes `at`: what the checker says.
  std::string read(int s, uint64_t seq, const char* op, const void* at) {
    return r.refusal(s, seq, op, at, false);
  }
  std::string write(int s, uint64_t seq, const char* op, const void* at) {
    return r.refusal(s, seq, op, at, true);
  }
  // Stream s waits for an event recorded on stream t when t had `seq` operations.
  bool order(int s, int t, uint64_t seq) {
    r.record(t, seq);
    return r.wait(s, Event{t, seq});
  }

  alignas(8) char a[64] = {}, b[64] = {}, c[64] = {};
  RaceChecker r;
};

TEST_F(RaceCheckerTest, ReadOfAnotherStreamsWriteWithoutAWaitIsARace) {
  EXPECT_EQ(write(kCompute, 1, "fill_zero", a), "");
  EXPECT_EQ(read(kComm, 1, "copy", a + 16),  // anywhere inside the allocation
            "sim: 'copy' on the comm stream reads a buffer that 'fill_zero' on the compute "
            "stream writes, with no wait in between (a missing Device::wait(comm, "
            "record(compute)))");
}

TEST_F(RaceCheckerTest, AWaitForAnEventAfterTheWriteOrdersTheRead) {
  EXPECT_EQ(write(kCompute, 1, "fill_zero", a), "");
  EXPECT_TRUE(order(kComm, kCompute, 1));
  EXPECT_EQ(read(kComm, 1, "copy", a), "");
}

TEST_F(RaceCheckerTest, AnEventRecordedBeforeTheWriteDoesNotOrderIt) {
  r.record(kCompute, 0);
  EXPECT_EQ(write(kCompute, 1, "fill_zero", a), "");
  EXPECT_TRUE(r.wait(kComm, Event{kCompute, 0}));
  EXPECT_NE(read(kComm, 1, "copy", a), "");
}

TEST_F(RaceCheckerTest, ReusingWhatAnotherStreamReadsIsARaceTwoReadsAreNot) {
  EXPECT_EQ(read(kComm, 1, "send", a), "");
  EXPECT_EQ(read(kCompute, 1, "forward_block", a), "");
  const std::string refusal = write(kCompute, 2, "pack_kv", a);
  EXPECT_NE(refusal.find("'pack_kv' on the compute stream writes a buffer that 'send' on the "
                         "comm stream reads"),
            std::string::npos)
      << refusal;
}

// compute -> comm -> compute: the second wait carries the first one's order with it.
TEST_F(RaceCheckerTest, WaitsOrderTransitively) {
  EXPECT_EQ(write(kCompute, 1, "fill_zero", a), "");
  EXPECT_TRUE(order(kComm, kCompute, 1));
  EXPECT_EQ(write(kComm, 1, "copy", b), "");
  EXPECT_TRUE(order(kCompute, kComm, 1));
  EXPECT_EQ(write(kCompute, 2, "add", b), "");
}

TEST_F(RaceCheckerTest, SynchronizeOrdersEverythingBeforeIt) {
  EXPECT_EQ(write(kCompute, 1, "fill_zero", a), "");
  r.record(kCompute, 1);
  r.synchronized({1, 0});
  EXPECT_FALSE(r.wait(kComm, Event{kCompute, 1}));  // done: no wait needed
  EXPECT_EQ(read(kComm, 1, "copy", a), "");
}

TEST_F(RaceCheckerTest, FreedMemoryIsRefusedUntrackedMemoryIsNotChecked) {
  r.freed(a);
  EXPECT_EQ(read(kCompute, 1, "copy", a),
            "sim: 'copy' on the compute stream uses a buffer that was already freed (a view "
            "kept past its DeviceBuffer)");
  r.forget(a);  // out of quarantine: no longer the device's memory
  EXPECT_EQ(read(kCompute, 2, "copy", a), "");
  EXPECT_EQ(write(kCompute, 3, "copy", c), "");
  EXPECT_EQ(write(kComm, 1, "copy", c), "");
  EXPECT_EQ(write(kComm, 2, "copy", nullptr), "");
}

}  // namespace
}  // namespace ctxpar::device

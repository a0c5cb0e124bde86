// One call's record, the one home for what a collective call reports of itself: the
// strategies' forward / backward (StrategyStats, src/strategy/frame.cc) and inference's
// prefill / decode (InferenceStats, src/inference/). Shared by the two layers.
#pragma once
#include <cstdint>
#include <vector>

#include "ctxpar/clock.h"
#include "ctxpar/comm.h"
#include "ctxpar/device.h"

namespace ctxpar::strategy {

using ctxpar::now_seconds;
using ctxpar::thread_cpu_seconds;

// What one rank did between a CallRecord's construction and its finish().
struct CallMeasure {
  uint64_t bytes_sent = 0, bytes_received = 0;  // over the counted communicators
  DeviceCounters device;                        // the device's counters: flops, busy, wait
  size_t peak_bytes = 0;  // most device bytes held at once, above those held at the start
  double wall_seconds = 0;
  double cpu_seconds = 0;  // of the calling thread (the cpu device runs inline)
};

// Made once every rank has agreed on the call's arguments (the agreement's small all-gather
// is then not counted): snapshots the byte counters of `counted`, the device's counters and
// the bytes it holds, and resets its memory peak. finish() waits for the device and measures.
// A call that throws still waits, here in the destructor, for its queued work before its
// buffers and the caller's tensors go.
class CallRecord {
 public:
  CallRecord(Device& device, std::vector<Communicator*> counted);
  ~CallRecord();
  CallRecord(const CallRecord&) = delete;
  CallRecord& operator=(const CallRecord&) = delete;
  CallMeasure finish();

 private:
  Device& device_;
  std::vector<Communicator*> counted_;
  uint64_t sent0_ = 0, received0_ = 0;
  DeviceCounters device0_;
  size_t held0_ = 0;
  double t0_ = 0, cpu0_ = 0;
  bool finished_ = false;
};

}  // namespace ctxpar::strategy

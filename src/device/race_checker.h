// Private: the sim device's race checker. It follows the order the code states, not the timing
// of one run: every operation says, when it is enqueued, which allocations it reads and writes;
// one that reads an allocation another stream writes, or writes one another stream uses, with
// no wait in between, is a race. "In between" is a vector clock per stream: stream s has seen
// operation n of stream t once s waited for an event recorded on t after n was enqueued
// (directly, or through a chain of waits). So a missing wait is reported on every run.
//
// Not thread-safe: the device calls it under its own lock.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ctxpar/device.h"

namespace ctxpar::device {

class RaceChecker {
 public:
  RaceChecker();

  // Memory: an allocation [start, start + bytes) is tracked from add() until forget(); once
  // freed(), any use of it is refused.
  void add(const void* start, size_t bytes);
  void freed(const void* start);
  void forget(const void* start);

  // Order. `seq` is the stream's count of enqueued operations.
  // An event of stream s recorded when s had `seq` operations enqueued.
  void record(int s, uint64_t seq);
  // Stream s waits for event e. False when e was recorded before the last synchronized() (it is
  // done: no wait is needed).
  bool wait(int s, const Event& e);
  // Every stream's work is done (`enqueued` operations each): nothing enqueued so far can race
  // with what comes.
  void synchronized(const uint64_t (&enqueued)[kStreams]);

  // Operation number `seq` of stream s, named `op`, reads (or writes) memory at `at`. Returns ""
  // and remembers the access, or the refusal to report (naming both operations). Memory outside
  // every tracked allocation is not checked.
  std::string check(int s, uint64_t seq, const std::string& op, const void* at, bool write);

 private:
  struct Access {
    int stream;
    uint64_t seq;
    bool write;
    std::string op;
  };
  struct Allocation {
    size_t bytes = 0;
    bool freed = false;
    std::vector<Access> accesses;  // since the last synchronized()
  };
  Allocation* allocation_of(const void* at);

  std::map<uintptr_t, Allocation> allocations_;
  // clocks_[s][t]: the last operation of stream t that stream s is ordered after.
  std::vector<std::vector<uint64_t>> clocks_;
  std::map<std::pair<int, uint64_t>, std::vector<uint64_t>> event_clocks_;
};

}  // namespace ctxpar::device

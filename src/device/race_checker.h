// Private: the race checker of the asynchronous devices' tests -- the sim device's, and the
// recording CUDA API's log (src/cuda/api_recording.h). It follows the order the code states, not
// the timing of one run: every operation says, when it is enqueued, which allocations it reads
// and writes; one that reads an allocation another stream writes, or writes one another stream
// uses, with no wait in between, is a race. "In between" is a vector clock per stream: stream s
// has seen operation n of stream t once s waited for an event recorded on t after n was
// enqueued (directly, or through a chain of waits), or once the host waited for it (what the
// host has seen, every later operation has). So a missing wait is reported on every run.
//
// The checker says what it found (a Verdict); each user words it its own way. Operation numbers
// are the caller's: `seq` counts the operations enqueued on a stream, from 1.
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
  using Clock = std::vector<uint64_t>;  // per stream: the last operation ordered before

  explicit RaceChecker(int streams = kStreams);
  int add_stream();  // a new stream (its index), ordered after what the host has seen

  // ---- order --------------------------------------------------------------------------------
  // The clock of an event recorded on s after its operation `seq`.
  Clock event_clock(int s, uint64_t seq) const;
  void wait(int s, const Clock& event);  // s's later operations come after the event
  void host_wait(const Clock& event);    // the host, and so every later operation, after it
  // Events named by (stream, seq), kept until synchronized(): record one; wait for one (false
  // when it is unknown: recorded before the last synchronized(), so done, no wait needed).
  void record(int s, uint64_t seq);
  bool wait(int s, const Event& e);
  // Every stream's work is done (`enqueued` operations each): nothing enqueued so far can race
  // with what comes.
  void synchronized(const Clock& enqueued);

  // ---- memory -------------------------------------------------------------------------------
  struct Access {
    int stream;
    uint64_t seq;
    bool write;
    std::string op;
  };
  struct Allocation {
    size_t bytes = 0;
    int stream = -1;  // allocated on this stream after its operation `seq`; -1: before all
    uint64_t seq = 0;
    bool adopted = false;  // the caller's memory, used in place (never freed by a device)
    bool freed = false;
    std::vector<Access> accesses;  // since the host last saw them
  };
  // An allocation [start, start + max(bytes, 1)), tracked from add() until forget(); once
  // freed(), any use of it is a verdict of its own.
  void add(const void* start, size_t bytes, int stream = -1, uint64_t seq = 0,
           bool adopted = false);
  void freed(const void* start);
  void forget(const void* start);
  // The allocation holding p (live or freed), and its start; null for untracked memory.
  const Allocation* find(const void* p, uintptr_t* start = nullptr) const;
  const std::map<uintptr_t, Allocation>& allocations() const { return allocations_; }
  // Per stream, the last access to the allocation at `start` the host has not seen (0: none).
  Clock unseen_by_host(const void* start) const;

  // ---- accesses -----------------------------------------------------------------------------
  // Earlier accesses of another stream that an access is not ordered after, and that conflict
  // with it (one of the two writes): per stream, its writes, then (for a write) its reads.
  struct Race {
    int stream;
    bool write;     // the earlier accesses write (else they read)
    Access first;   // the first of them, in the order they were noted
    uint64_t last;  // the operation number of the last of them
  };
  struct Verdict {
    const Allocation* allocation = nullptr;  // null: untracked memory, nothing to say
    uintptr_t start = 0;
    bool freed = false;      // a use of freed memory (nothing else is checked)
    bool unordered = false;  // its allocation (on another stream) is not ordered before it
    std::vector<Race> races;
    bool ok() const { return !freed && !unordered && races.empty(); }
  };
  // What an operation of stream s reading (or writing) memory at `at` would meet.
  Verdict check(int s, const void* at, bool write) const;
  // Remembers that access (after check(); a use of freed memory is not remembered).
  void note(int s, uint64_t seq, const std::string& op, const void* at, bool write);
  // The sim device's question: "" (and the access noted), or the refusal to report in its words
  // ("sim: ..."), naming both operations.
  std::string refusal(int s, uint64_t seq, const std::string& op, const void* at, bool write);

 private:
  Allocation* find_mutable(const void* p);
  uint64_t covered(int s, int t) const;

  std::map<uintptr_t, Allocation> allocations_;
  std::vector<Clock> clocks_;  // clocks_[s][t]: the last operation of t that s is ordered after
  Clock host_;                 // what the host has seen
  std::map<std::pair<int, uint64_t>, Clock> events_;
};

}  // namespace ctxpar::device

// The sim device's race checker (see race_checker.h).
#include "device/race_checker.h"

#include <algorithm>

namespace ctxpar::device {

RaceChecker::RaceChecker() : clocks_(kStreams, std::vector<uint64_t>(kStreams, 0)) {}

void RaceChecker::add(const void* start, size_t bytes) {
  Allocation a;
  a.bytes = bytes;
  allocations_[reinterpret_cast<uintptr_t>(start)] = std::move(a);
}

void RaceChecker::freed(const void* start) {
  auto it = allocations_.find(reinterpret_cast<uintptr_t>(start));
  if (it != allocations_.end()) it->second.freed = true;
}

void RaceChecker::forget(const void* start) {
  allocations_.erase(reinterpret_cast<uintptr_t>(start));
}

void RaceChecker::record(int s, uint64_t seq) { event_clocks_[{s, seq}] = clocks_[s]; }

bool RaceChecker::wait(int s, const Event& e) {
  auto ec = event_clocks_.find({e.stream, e.seq});
  if (ec == event_clocks_.end()) return false;
  std::vector<uint64_t>& clock = clocks_[s];
  for (int t = 0; t < kStreams; ++t) clock[t] = std::max(clock[t], ec->second[t]);
  clock[e.stream] = std::max(clock[e.stream], e.seq);
  return true;
}

void RaceChecker::synchronized(const uint64_t (&enqueued)[kStreams]) {
  for (auto& [start, a] : allocations_) a.accesses.clear();
  for (std::vector<uint64_t>& clock : clocks_)
    for (int t = 0; t < kStreams; ++t) clock[t] = enqueued[t];
  event_clocks_.clear();
}

RaceChecker::Allocation* RaceChecker::allocation_of(const void* at) {
  if (!at || allocations_.empty()) return nullptr;
  const auto p = reinterpret_cast<uintptr_t>(at);
  auto it = allocations_.upper_bound(p);
  if (it == allocations_.begin()) return nullptr;
  --it;
  return p < it->first + it->second.bytes ? &it->second : nullptr;
}

std::string RaceChecker::check(int s, uint64_t seq, const std::string& op, const void* at,
                               bool write) {
  Allocation* a = allocation_of(at);
  if (!a) return {};
  if (a->freed)
    return detail::concat("sim: '", op, "' on the ", stream_name(Stream{s}),
                          " stream uses a buffer that was already freed (a view kept past its "
                          "DeviceBuffer)");
  const std::vector<uint64_t>& clock = clocks_[s];
  for (const Access& x : a->accesses)
    if (x.stream != s && x.seq > clock[x.stream] && (write || x.write))
      return detail::concat(
          "sim: '", op, "' on the ", stream_name(Stream{s}), " stream ",
          write ? "writes" : "reads", " a buffer that '", x.op, "' on the ",
          stream_name(Stream{x.stream}), " stream ", x.write ? "writes" : "reads",
          ", with no wait in between (a missing Device::wait(", stream_name(Stream{s}),
          ", record(", stream_name(Stream{x.stream}), ")))");
  a->accesses.push_back({s, seq, write, op});
  return {};
}

}  // namespace ctxpar::device

// The race checker of the asynchronous devices' tests (see race_checker.h).
#include "device/race_checker.h"

#include <algorithm>

namespace ctxpar::device {
namespace {

void merge(RaceChecker::Clock& into, const RaceChecker::Clock& from) {
  if (into.size() < from.size()) into.resize(from.size(), 0);
  for (size_t i = 0; i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
}

}  // namespace

RaceChecker::RaceChecker(int streams) {
  for (int s = 0; s < streams; ++s) add_stream();
}

int RaceChecker::add_stream() {
  clocks_.push_back(host_);
  for (Clock& c : clocks_) c.resize(clocks_.size(), 0);
  host_.resize(clocks_.size(), 0);
  return int(clocks_.size()) - 1;
}

uint64_t RaceChecker::covered(int s, int t) const {
  const Clock& c = clocks_[size_t(s)];
  return size_t(t) < c.size() ? c[size_t(t)] : 0;
}

RaceChecker::Clock RaceChecker::event_clock(int s, uint64_t seq) const {
  Clock c = clocks_[size_t(s)];
  c[size_t(s)] = std::max(c[size_t(s)], seq);
  return c;
}

void RaceChecker::wait(int s, const Clock& event) { merge(clocks_[size_t(s)], event); }

void RaceChecker::host_wait(const Clock& event) {
  merge(host_, event);
  for (Clock& c : clocks_) merge(c, host_);
}

void RaceChecker::record(int s, uint64_t seq) { events_[{s, seq}] = event_clock(s, seq); }

bool RaceChecker::wait(int s, const Event& e) {
  auto it = events_.find({e.stream, e.seq});
  if (it == events_.end()) return false;
  wait(s, it->second);
  return true;
}

void RaceChecker::synchronized(const Clock& enqueued) {
  host_wait(enqueued);
  for (auto& [start, a] : allocations_) a.accesses.clear();
  events_.clear();
}

void RaceChecker::add(const void* start, size_t bytes, int stream, uint64_t seq, bool adopted) {
  Allocation a;
  a.bytes = bytes;
  a.stream = stream;
  a.seq = seq;
  a.adopted = adopted;
  allocations_[reinterpret_cast<uintptr_t>(start)] = std::move(a);
}

void RaceChecker::freed(const void* start) {
  auto it = allocations_.find(reinterpret_cast<uintptr_t>(start));
  if (it != allocations_.end()) it->second.freed = true;
}

void RaceChecker::forget(const void* start) {
  allocations_.erase(reinterpret_cast<uintptr_t>(start));
}

const RaceChecker::Allocation* RaceChecker::find(const void* p, uintptr_t* start) const {
  if (!p || allocations_.empty()) return nullptr;
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = allocations_.upper_bound(a);
  if (it == allocations_.begin()) return nullptr;
  --it;
  if (a >= it->first + std::max<size_t>(it->second.bytes, 1)) return nullptr;
  if (start) *start = it->first;
  return &it->second;
}

RaceChecker::Allocation* RaceChecker::find_mutable(const void* p) {
  return const_cast<Allocation*>(find(p));
}

RaceChecker::Clock RaceChecker::unseen_by_host(const void* start) const {
  Clock last(clocks_.size(), 0);
  auto it = allocations_.find(reinterpret_cast<uintptr_t>(start));
  if (it == allocations_.end()) return last;
  for (const Access& x : it->second.accesses) {
    const uint64_t seen = size_t(x.stream) < host_.size() ? host_[size_t(x.stream)] : 0;
    if (x.seq > seen) last[size_t(x.stream)] = std::max(last[size_t(x.stream)], x.seq);
  }
  return last;
}

RaceChecker::Verdict RaceChecker::check(int s, const void* at, bool write) const {
  Verdict v;
  v.allocation = find(at, &v.start);
  if (!v.allocation) return v;
  const Allocation& a = *v.allocation;
  if (a.freed) {
    v.freed = true;
    return v;
  }
  v.unordered = a.stream >= 0 && a.stream != s && covered(s, a.stream) < a.seq;
  for (int t = 0; t < int(clocks_.size()); ++t) {
    if (t == s) continue;
    for (bool writes : {true, false}) {
      if (!writes && !write) continue;  // two reads never race
      Race r{t, writes, {}, 0};
      for (const Access& x : a.accesses) {
        if (x.stream != t || x.write != writes || x.seq <= covered(s, t)) continue;
        if (r.last == 0) r.first = x;
        r.last = std::max(r.last, x.seq);
      }
      if (r.last) v.races.push_back(std::move(r));
    }
  }
  return v;
}

void RaceChecker::note(int s, uint64_t seq, const std::string& op, const void* at, bool write) {
  Allocation* a = find_mutable(at);
  if (!a || a->freed) return;
  // What the host has seen can race with nothing that comes: forgotten.
  std::erase_if(a->accesses, [&](const Access& x) { return x.seq <= host_[size_t(x.stream)]; });
  a->accesses.push_back({s, seq, write, op});
}

std::string RaceChecker::refusal(int s, uint64_t seq, const std::string& op, const void* at,
                                 bool write) {
  const Verdict v = check(s, at, write);
  if (v.freed)
    return detail::concat("sim: '", op, "' on the ", stream_name(Stream{s}),
                          " stream uses a buffer that was already freed (a view kept past its "
                          "DeviceBuffer)");
  const Race* x = nullptr;  // the earliest conflicting access
  for (const Race& r : v.races)
    if (!x || r.first.seq < x->first.seq) x = &r;
  if (x)
    return detail::concat(
        "sim: '", op, "' on the ", stream_name(Stream{s}), " stream ", write ? "writes" : "reads",
        " a buffer that '", x->first.op, "' on the ", stream_name(Stream{x->stream}), " stream ",
        x->write ? "writes" : "reads", ", with no wait in between (a missing Device::wait(",
        stream_name(Stream{s}), ", record(", stream_name(Stream{x->stream}), ")))");
  note(s, seq, op, at, write);
  return {};
}

}  // namespace ctxpar::device

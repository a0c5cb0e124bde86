// RecordingCudaApi (api_recording.h): the CUDA runtime and the fallback kernel on the host,
// with a log and vector-clock checks of the ordering rules.
#include "cuda/api_recording.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "ctxpar/error.h"
#include "device/race_checker.h"

namespace ctxpar::cuda {

struct StreamTag {
  int id = 0;
  bool destroyed = false;
};
struct EventTag {
  int id = 0;
  bool destroyed = false;
  std::chrono::steady_clock::time_point at;  // host time of the last record (work ran by then)
  bool recorded = false;
  int stream = -1;
  uint64_t seq = 0;
  device::RaceChecker::Clock clock;
};

namespace {

struct Use {
  const void* p;
  bool write;
};

}  // namespace

struct RecordingCudaApi::Impl {
  mutable std::mutex mu;
  std::vector<std::unique_ptr<StreamTag>> streams;
  std::vector<uint64_t> seqs;  // per stream: operations so far
  std::vector<std::unique_ptr<EventTag>> events;
  device::RaceChecker races{0};  // allocations, by start; freed ones stay
  std::vector<void*> memory;     // every block, released at destruction
  size_t host_live = 0;
  std::vector<Entry> log;
  std::vector<std::string> violations;
  std::map<std::string, std::pair<int, std::string>> faults;  // op -> calls left, message

  // fail_at's fault, when this call of `name` is the one.
  void maybe_fail(const std::string& name) {
    auto it = faults.find(name);
    if (it == faults.end() || --it->second.first > 0) return;
    const std::string message = it->second.second;
    faults.erase(it);
    throw Error(message);
  }
  // A use of a destroyed handle (a late destroy, seen from the use).
  void check_live(const char* what, const EventTag* e) {
    if (e->destroyed)
      violations.push_back(std::string("'") + what + "' of event " + std::to_string(e->id) +
                           " after its destroy");
  }
  void check_live(const char* what, const StreamTag* s) {
    if (s->destroyed)
      violations.push_back(std::string("'") + what + "' on stream " + std::to_string(s->id) +
                           " after its destroy");
  }
  // The checker's verdict on one use of operation `name` on stream s, as violations.
  void report(const char* name, int s, bool write, const device::RaceChecker::Verdict& v) {
    char where[64];
    std::snprintf(where, sizeof where, "allocation %#lx", (unsigned long)v.start);
    const std::string on = std::string("'") + name + "' on stream " + std::to_string(s);
    if (v.freed) {
      violations.push_back(on + " uses freed memory (" + where + ")");
      return;
    }
    if (v.unordered)
      violations.push_back(on + " uses " + where + " before its allocation on stream " +
                           std::to_string(v.allocation->stream) + " is ordered before it");
    for (const device::RaceChecker::Race& r : v.races)
      violations.push_back(
          r.write ? on + (write ? " writes " : " reads ") + where + " that stream " +
                        std::to_string(r.stream) + " writes (op " + std::to_string(r.last) +
                        ") with no wait in between"
                  : on + " writes " + where + " that stream " + std::to_string(r.stream) +
                        " still reads (op " + std::to_string(r.last) + ")");
  }
  // Enqueues operation `op` on stream s: checks its uses against the clocks and notes them.
  static bool kernel(const char* name) {
    return std::strcmp(name, "forward") == 0 || std::strcmp(name, "backward") == 0 ||
           std::strcmp(name, "tile_ranges") == 0;
  }
  void op(const char* name, StreamHandle sh, std::initializer_list<Use> uses,
          const void* ptr = nullptr, size_t bytes = 0) {
    maybe_fail(name);
    check_live(name, sh);
    const int s = sh->id;
    const uint64_t seq = ++seqs[size_t(s)];
    for (const Use& u : uses) {
      if (!u.p) continue;
      const device::RaceChecker::Verdict v = races.check(s, u.p, u.write);
      if (!v.allocation) {
        // Host memory: the host's own business for copies, but a kernel cannot read it (a
        // pointer into a host structure, e.g. a mask's slice list, would fault on a GPU).
        if (kernel(name))
          violations.push_back(std::string("kernel '") + name + "' on stream " + std::to_string(s) +
                               " reads memory that is not a device allocation");
        continue;
      }
      report(name, s, u.write, v);
      races.note(s, seq, name, u.p, u.write);
    }
    log.push_back(Entry{name, s, seq, -1, -1, 0, ptr, bytes});
  }
};

RecordingCudaApi::RecordingCudaApi() : impl_(std::make_unique<Impl>()) {}
RecordingCudaApi::~RecordingCudaApi() {
  if (on_destroy) on_destroy(*this);
  for (void* p : impl_->memory) std::free(p);
}

StreamHandle RecordingCudaApi::stream_create() {
  std::lock_guard<std::mutex> l(impl_->mu);
  auto s = std::make_unique<StreamTag>();
  s->id = impl_->races.add_stream();
  impl_->streams.push_back(std::move(s));
  impl_->seqs.push_back(0);
  return impl_->streams.back().get();
}
void RecordingCudaApi::stream_destroy(StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  if (s->destroyed)
    impl_->violations.push_back("stream " + std::to_string(s->id) + " destroyed twice");
  s->destroyed = true;
  impl_->log.push_back(Entry{"stream_destroy", s->id});
}
void RecordingCudaApi::stream_synchronize(StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->maybe_fail("stream_synchronize");
  impl_->check_live("stream_synchronize", s);
  device::RaceChecker::Clock seen(impl_->seqs.size(), 0);
  seen[size_t(s->id)] = impl_->seqs[size_t(s->id)];
  impl_->races.host_wait(seen);
  impl_->log.push_back(Entry{"stream_synchronize", s->id, impl_->seqs[size_t(s->id)]});
}
EventHandle RecordingCudaApi::event_create(bool) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->maybe_fail("event_create");
  auto e = std::make_unique<EventTag>();
  e->id = int(impl_->events.size());
  impl_->events.push_back(std::move(e));
  return impl_->events.back().get();
}
void RecordingCudaApi::event_destroy(EventHandle e) {
  std::lock_guard<std::mutex> l(impl_->mu);
  if (e->destroyed)
    impl_->violations.push_back("event " + std::to_string(e->id) + " destroyed twice");
  e->destroyed = true;
  impl_->log.push_back(Entry{"event_destroy", -1, 0, e->id, e->stream, e->seq});
}
void RecordingCudaApi::event_record(EventHandle e, StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->maybe_fail("record");
  impl_->check_live("record", e);
  impl_->check_live("record", s);
  e->recorded = true;
  e->at = std::chrono::steady_clock::now();
  e->stream = s->id;
  e->seq = impl_->seqs[size_t(s->id)];
  e->clock = impl_->races.event_clock(s->id, e->seq);
  impl_->log.push_back(Entry{"record", s->id, e->seq, e->id, s->id, e->seq});
}
void RecordingCudaApi::stream_wait_event(StreamHandle s, EventHandle e) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->maybe_fail("wait");
  impl_->check_live("wait", e);
  impl_->check_live("wait", s);
  if (e->recorded) impl_->races.wait(s->id, e->clock);
  impl_->log.push_back(Entry{"wait", s->id, impl_->seqs[size_t(s->id)], e->id, e->stream, e->seq});
}
bool RecordingCudaApi::event_query(EventHandle e) {  // everything ran at once
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->check_live("query", e);
  return true;
}
void RecordingCudaApi::event_synchronize(EventHandle e) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->check_live("event_synchronize", e);
  if (e->recorded) impl_->races.host_wait(e->clock);
  impl_->log.push_back(Entry{"event_synchronize", -1, 0, e->id, e->stream, e->seq});
}
// Work runs at once, so the host time between two records is the time of what ran between.
float RecordingCudaApi::event_elapsed_ms(EventHandle a, EventHandle b) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->maybe_fail("elapsed");
  for (const EventTag* e : {a, b}) {
    impl_->check_live("elapsed", e);
    if (!e->recorded)
      impl_->violations.push_back("'elapsed' of event " + std::to_string(e->id) +
                                  ", never recorded");
  }
  return std::chrono::duration<float, std::milli>(b->at - a->at).count();
}

void* RecordingCudaApi::malloc_async(size_t bytes, StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  void* p = std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256);
  impl_->memory.push_back(p);
  std::memset(p, 0xff, std::max<size_t>(bytes, 1));  // uninitialised: NaN
  impl_->op("malloc", s, {}, p, bytes);
  impl_->races.add(p, bytes, s->id, impl_->seqs[size_t(s->id)]);
  return p;
}
void RecordingCudaApi::free_async(void* p, StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  uintptr_t start = 0;
  const device::RaceChecker::Allocation* a = impl_->races.find(p, &start);
  if (!a || a->freed) {
    impl_->violations.push_back("free of memory that is not a live allocation");
    return;
  }
  if (a->adopted) {
    impl_->violations.push_back("free of the caller's memory (adopted, never the device's)");
    return;
  }
  const size_t bytes = a->bytes;
  impl_->op("free", s, {{p, true}}, p, bytes);  // a free is the last write
  impl_->races.freed(reinterpret_cast<void*>(start));
  std::memset(p, 0xff, bytes);
}
void RecordingCudaApi::adopt(void* p, size_t bytes) {
  std::lock_guard<std::mutex> l(impl_->mu);
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const auto& allocations = impl_->races.allocations();
  auto next = allocations.lower_bound(a);
  if (impl_->races.find(p) || (next != allocations.end() && next->first < a + bytes)) {
    impl_->violations.push_back("adopt of memory that overlaps an allocation or adopted range");
    return;
  }
  // Allocated on no stream: ordered before every stream's first operation.
  impl_->races.add(p, bytes, -1, 0, /*adopted=*/true);
  impl_->log.push_back(Entry{"adopt", -1, 0, -1, -1, 0, p, bytes});
}
void RecordingCudaApi::release(void* p) {
  std::lock_guard<std::mutex> l(impl_->mu);
  const auto& allocations = impl_->races.allocations();
  auto it = allocations.find(reinterpret_cast<uintptr_t>(p));
  if (it == allocations.end() || !it->second.adopted) {
    impl_->violations.push_back("release of memory that was not adopted");
    return;
  }
  const device::RaceChecker::Clock unseen = impl_->races.unseen_by_host(p);
  for (size_t t = 0; t < unseen.size(); ++t)
    if (unseen[t])
      impl_->violations.push_back("the caller's memory is handed back while stream " +
                                  std::to_string(t) + " still uses it (op " +
                                  std::to_string(unseen[t]) +
                                  ") with no synchronisation in between");
  impl_->log.push_back(Entry{"release", -1, 0, -1, -1, 0, p, it->second.bytes});
  impl_->races.forget(p);
}
void* RecordingCudaApi::host_alloc(size_t bytes) {
  std::lock_guard<std::mutex> l(impl_->mu);
  ++impl_->host_live;
  impl_->log.push_back(Entry{"host_alloc", -1, 0, -1, -1, 0, nullptr, bytes});
  return std::malloc(std::max<size_t>(bytes, 1));
}
void RecordingCudaApi::host_free(void* p) {
  std::lock_guard<std::mutex> l(impl_->mu);
  --impl_->host_live;
  std::free(p);
}
void RecordingCudaApi::memcpy_async(void* dst, const void* src, size_t bytes, CopyKind kind,
                                    StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  const char* name = kind == CopyKind::host_to_device   ? "memcpy h2d"
                     : kind == CopyKind::device_to_host ? "memcpy d2h"
                                                        : "memcpy d2d";
  impl_->op(name, s, {{src, false}, {dst, true}}, dst, bytes);
  // The caller's device memory taken for host memory (staged instead of used in place): on a
  // GPU the runtime would refuse the copy, or the host would read a device address.
  const device::RaceChecker::Allocation* from = impl_->races.find(src);
  const device::RaceChecker::Allocation* to = impl_->races.find(dst);
  if ((kind == CopyKind::host_to_device && from && from->adopted) ||
      (kind == CopyKind::device_to_host && to && to->adopted))
    impl_->violations.push_back(std::string("'") + name + "' on stream " + std::to_string(s->id) +
                                " treats the caller's device memory (adopted) as host memory");
  if (bytes) std::memmove(dst, src, bytes);
}
void RecordingCudaApi::memset_async(void* p, int value, size_t bytes, StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->op("memset", s, {{p, true}}, p, bytes);
  if (bytes) std::memset(p, value, bytes);
}

void RecordingCudaApi::tile_ranges(const int64_t* pos, const int32_t* doc, int64_t n,
                                   bool documents, TileRange* out, StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->op("tile_ranges", s, {{pos, false}, {documents ? doc : nullptr, false}, {out, true}});
  for (int64_t t = 0; t * kTile < n; ++t)  // tile_ranges_kernel: a thread per tile
    out[t] = tile_range_of(pos, doc, t * kTile, std::min(n, t * kTile + kTile), documents);
}

template <class T>
void RecordingCudaApi::forward_t(const Problem<T>& p, const DeviceState& st, StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->op("forward", s,
            {{p.q.ptr, false},
             {p.k.ptr, false},
             {p.v.ptr, false},
             {p.q_pos, false},
             {p.k_pos, false},
             {p.q_tiles, false},
             {p.k_tiles, false},
             {p.mask.documents ? p.q_doc : nullptr, false},
             {p.mask.documents ? p.k_doc : nullptr, false},
             {p.mask.sliced ? p.mask.slices : nullptr, false},
             {st.acc, true}});
  if (p.tk == 0) return;
  float qrow[kMaxHeadDim];
  for (int64_t b = 0; b < p.batch; ++b)  // forward_kernel: a thread per (b, h, i)
    for (int64_t h = 0; h < p.hq; ++h)
      for (int64_t i = 0; i < p.tq; ++i) {
        const int64_t row = (b * p.hq + h) * p.tq + i;
        forward_row(p, b, h, i,
                    StateRow{st.acc + ((b * p.tq + i) * p.hq + h) * p.d, st.m + row, st.l + row},
                    qrow);
      }
}
void RecordingCudaApi::forward(const Problem<float>& p, const DeviceState& st, StreamHandle s) {
  forward_t(p, st, s);
}
void RecordingCudaApi::forward(const Problem<Bf16>& p, const DeviceState& st, StreamHandle s) {
  forward_t(p, st, s);
}

void RecordingCudaApi::finalize(const DeviceState& st, int64_t batch, int64_t tq, int64_t hq,
                                int64_t d, void* out, bool bf16, float* lse, StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->op("finalize", s, {{st.acc, false}, {out, true}, {lse, true}});
  for (int64_t r = 0; r < batch * tq * hq; ++r) {  // finalize_kernel: a thread per row
    const int64_t h = r % hq, t = (r / hq) % tq, b = r / (hq * tq);
    const int64_t stat = (b * hq + h) * tq + t;
    if (bf16)
      finalize_row(st.acc + r * d, st.m[stat], st.l[stat], d, static_cast<Bf16*>(out) + r * d,
                   lse + stat);
    else
      finalize_row(st.acc + r * d, st.m[stat], st.l[stat], d, static_cast<float*>(out) + r * d,
                   lse + stat);
  }
}

void RecordingCudaApi::delta(const void* out, const void* dout, bool bf16, int64_t batch,
                             int64_t tq, int64_t hq, int64_t d, float* delta, StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->op("delta", s, {{out, false}, {dout, false}, {delta, true}});
  for (int64_t r = 0; r < batch * tq * hq; ++r) {  // delta_kernel
    const int64_t h = r % hq, t = (r / hq) % tq, b = r / (hq * tq);
    delta[(b * hq + h) * tq + t] = bf16 ? delta_row(static_cast<const Bf16*>(out) + r * d,
                                                    static_cast<const Bf16*>(dout) + r * d, d)
                                        : delta_row(static_cast<const float*>(out) + r * d,
                                                    static_cast<const float*>(dout) + r * d, d);
  }
}

template <class T>
void RecordingCudaApi::backward_t(const Problem<T>& p, const BackwardRows& r, StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->op("backward", s,
            {{p.q.ptr, false},
             {p.k.ptr, false},
             {p.v.ptr, false},
             {p.dout.ptr, false},
             {p.q_pos, false},
             {p.k_pos, false},
             {p.q_tiles, false},
             {p.k_tiles, false},
             {p.mask.documents ? p.q_doc : nullptr, false},
             {p.mask.documents ? p.k_doc : nullptr, false},
             {p.mask.sliced ? p.mask.slices : nullptr, false},
             {r.lse.ptr, false},
             {r.delta.ptr, false},
             {r.dq.ptr, true},
             {r.dk.ptr, true},
             {r.dv.ptr, true}});
  if (p.tq == 0 || p.tk == 0) return;
  float a[kMaxHeadDim], g[kMaxHeadDim];
  for (int64_t b = 0; b < p.batch; ++b)  // backward_kernel<T, false>: a thread per query row
    for (int64_t h = 0; h < p.hq; ++h)
      for (int64_t i = 0; i < p.tq; ++i) backward_dq_row(p, r, b, h, i, a, g);
  for (int64_t b = 0; b < p.batch; ++b)  // backward_kernel<T, true>: a thread per key row
    for (int64_t hk = 0; hk < p.hkv; ++hk)
      for (int64_t j = 0; j < p.tk; ++j) backward_dkdv_row(p, r, b, hk, j, a, g);
}
void RecordingCudaApi::backward(const Problem<float>& p, const BackwardRows& r, StreamHandle s) {
  backward_t(p, r, s);
}
void RecordingCudaApi::backward(const Problem<Bf16>& p, const BackwardRows& r, StreamHandle s) {
  backward_t(p, r, s);
}

void RecordingCudaApi::merge(float* o_a, float* lse_a, const float* o_b, const float* lse_b,
                             int64_t batch, int64_t t, int64_t h, int64_t d, StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->op("merge", s, {{o_b, false}, {lse_b, false}, {o_a, true}, {lse_a, true}});
  for (int64_t r = 0; r < batch * t * h; ++r) {  // merge_kernel
    const int64_t hh = r % h, tt = (r / h) % t, b = r / (h * t);
    const int64_t stat = (b * h + hh) * t + tt;
    merge_row(o_a + r * d, lse_a + stat, o_b + r * d, lse_b[stat], d);
  }
}

void RecordingCudaApi::permute(const std::byte* src, std::byte* dst, int64_t outer,
                               int64_t src_tokens, int64_t dst_tokens, int64_t row,
                               const int64_t* index, bool scatter, StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->op("permute", s, {{src, false}, {index, false}, {dst, true}});
  const int64_t n = outer * (scatter ? src_tokens : dst_tokens) * row;
  for (int64_t e = 0; e < n; ++e) {
    const BytePair at = permute_rows_byte(e, src_tokens, dst_tokens, row, index, scatter);
    dst[at.dst] = src[at.src];
  }
}

void RecordingCudaApi::copy(const Strided4& src, const Strided4& dst, StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->op("copy", s, {{src.ptr, false}, {dst.ptr, true}});
  for (int64_t e = 0; e < src.count(); ++e) copy_strided_element(src, dst, e);
}
void RecordingCudaApi::add(const Strided4& x, const Strided4& y, StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->op("add", s, {{x.ptr, false}, {y.ptr, true}});
  for (int64_t e = 0; e < x.count(); ++e) add_strided_element(x, y, e);
}
void RecordingCudaApi::zero(const Strided4& t, StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->op("zero", s, {{t.ptr, true}});
  for (int64_t e = 0; e < t.count(); ++e) zero_strided_element(t, e);
}
void RecordingCudaApi::fill_f32(float* p, int64_t n, float value, StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->op("fill_f32", s, {{p, true}});
  for (int64_t i = 0; i < n; ++i) p[i] = value;
}
void RecordingCudaApi::absorb_partial(const DeviceState& st, int64_t batch, int64_t tq, int64_t hq,
                                      int64_t d, int64_t row0, int64_t rows, const float* o,
                                      const float* lse, StreamHandle s) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->op("absorb_partial", s, {{o, false}, {lse, false}, {st.acc, true}});
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t row = (b * hq + h) * tq + row0 + i;
        absorb_partial_row(
            StateRow{st.acc + ((b * tq + row0 + i) * hq + h) * d, st.m + row, st.l + row},
            o + ((b * rows + i) * hq + h) * d, lse[(b * hq + h) * rows + i], d);
      }
}

std::vector<RecordingCudaApi::Entry> RecordingCudaApi::log() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  return impl_->log;
}
std::vector<std::string> RecordingCudaApi::violations() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  return impl_->violations;
}
void RecordingCudaApi::fail_at(const std::string& op, int nth, const std::string& message) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->faults[op] = {nth, message};
}
size_t RecordingCudaApi::live_events() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  size_t n = 0;
  for (const auto& e : impl_->events) n += !e->destroyed;
  return n;
}
size_t RecordingCudaApi::live_streams() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  size_t n = 0;
  for (const auto& s : impl_->streams) n += !s->destroyed;
  return n;
}
size_t RecordingCudaApi::live_allocations() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  size_t n = 0;
  for (const auto& [p, a] : impl_->races.allocations()) n += !a.freed && !a.adopted;
  return n;
}
size_t RecordingCudaApi::adopted() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  size_t n = 0;
  for (const auto& [p, a] : impl_->races.allocations()) n += a.adopted;
  return n;
}
size_t RecordingCudaApi::live_host_allocations() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  return impl_->host_live;
}
bool RecordingCudaApi::is_device_memory(const void* p) const {
  std::lock_guard<std::mutex> l(impl_->mu);
  return impl_->races.find(p) != nullptr;
}

}  // namespace ctxpar::cuda

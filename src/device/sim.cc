// The sim device: an asynchronous device simulated on the host, so that CI exercises the
// stream / event ordering of the strategies without a GPU. See docs/device.md.
//
//   - Each stream is a FIFO queue run by its own worker thread; an event is a stream's count of
//     completed operations. A transfer is posted when its turn comes and completes later (the
//     worker keeps polling it), as ncclSend / ncclRecv do on a GPU stream.
//   - Every operation first sleeps a seeded random time (DeviceOptions::sim_seed), so that the
//     interleaving of the streams (and of the ranks) changes from seed to seed.
//   - Memory: fresh and freed buffers are filled with NaN (0xFF bytes: NaN as fp32 and bf16);
//     freed memory is kept in quarantine for a while, so a dangling view reads NaN instead of
//     someone else's data, and an operation enqueued on it is refused.
//   - Races: every operation says which buffers it reads and writes; at enqueue time an
//     operation that reads a buffer another stream writes, or writes one another stream uses,
//     with no wait in between (vector clocks over record / wait), is refused with an Error
//     naming both operations. The check follows the order the code states, not the timing of
//     one run, so a missing wait is reported on every run, whatever the delays.
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include <utility>

#include "device/devices.h"

namespace ctxpar::device {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kQuarantineBytes = size_t(256) << 20;

struct SimStorage final : DeviceBuffer::Storage {
  std::byte* ptr = nullptr;
  std::byte* data() override { return ptr; }
};

struct Access {
  int stream;
  uint64_t seq;
  bool write;
  std::string op;
};

struct Allocation {
  Buffer memory;
  bool freed = false;
  std::vector<Access> accesses;  // since the last synchronize()
};

// A posted transfer: done when its request is; a receive then copies into its buffer.
struct Inflight {
  uint64_t seq = 0;
  Request request;
  std::byte* into = nullptr;  // receives only
  size_t bytes = 0;
  std::string what;
  Clock::time_point deadline;
};

struct Op {
  enum Kind { run, post, wait } kind = run;
  std::string name;
  uint64_t seq = 0;
  int delay_us = 0;
  std::function<void()> fn;
  std::function<Inflight()> post_fn;
  Event wait_for;
};

// Something freed or released on the host, let go once every stream passed `after`.
struct Deferred {
  uint64_t after[kStreams] = {};  // set by defer(); zero, not indeterminate, when moved there
  std::byte* freed = nullptr;        // a buffer to fill with NaN and quarantine
  std::shared_ptr<void> keep_alive;  // or host memory queued operations use
};

class SimDevice final : public Device {
 public:
  SimDevice(const DeviceOptions& options, int rank)
      : rng_(options.sim_seed * 0x9E3779B97F4A7C15ull + uint64_t(rank) + 1),
        max_delay_us_(options.sim_max_delay_us) {
    for (int s = 0; s < kStreams; ++s) workers_[s] = std::thread([this, s] { work(s); });
  }
  ~SimDevice() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& w : workers_) w.join();
  }

  std::string name() const override { return "sim"; }

  DeviceBuffer alloc(size_t bytes) override {
    auto s = std::make_unique<SimStorage>();
    s->size = bytes;
    Allocation a;
    a.memory = Buffer::uninitialized(bytes ? bytes : 1);
    std::memset(a.memory.data(), 0xFF, a.memory.size());  // NaN: reads of unwritten memory show
    s->ptr = a.memory.data();
    std::lock_guard lock(mu_);
    allocations_.emplace(reinterpret_cast<uintptr_t>(s->ptr), std::move(a));
    return DeviceBuffer(this, std::move(s));
  }

  Event record(Stream s) override {
    std::lock_guard lock(mu_);
    const Event e{s.index, streams_[s.index].enqueued};
    event_clocks_[{e.stream, e.seq}] = streams_[s.index].clock;
    return e;
  }

  void wait(Stream s, const Event& e) override {
    if (e.stream < 0 || e.stream == s.index) return;  // a stream is ordered with itself
    Op op;
    op.kind = Op::wait;
    op.name = "wait";
    op.wait_for = e;
    std::lock_guard lock(mu_);
    StreamState& st = streams_[s.index];
    auto ec = event_clocks_.find({e.stream, e.seq});
    if (ec == event_clocks_.end()) return;  // recorded before the last synchronize(): done
    for (int t = 0; t < kStreams; ++t) st.clock[t] = std::max(st.clock[t], ec->second[t]);
    st.clock[e.stream] = std::max(st.clock[e.stream], e.seq);
    push(s, std::move(op));
  }

  void synchronize() override {
    const double t0 = now_seconds();
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] {
      if (failed_) return true;
      for (const StreamState& st : streams_)
        if (st.completed < st.enqueued) return false;
      return true;
    });
    if (!failed_) {
      release_deferred();
      for (auto& [start, a] : allocations_) a.accesses.clear();
      for (StreamState& st : streams_)
        for (int t = 0; t < kStreams; ++t) st.clock[t] = streams_[t].enqueued;
      event_clocks_.clear();
    }
    counters_.wait_seconds += now_seconds() - t0;
    if (failed_) throw Error(error_);
  }

  void send(Stream s, Communicator& comm, DeviceBuffer& buffer, int peer, int tag) override {
    post_send(s, "send", comm, buffer.data(), buffer.size(), peer, tag);
  }

  DeviceBuffer recv(Stream s, Communicator& comm, size_t bytes, int peer, int tag) override {
    DeviceBuffer b = alloc(bytes);
    post_recv(s, "recv", comm, b.data(), bytes, peer, tag);
    return b;
  }

  // As on cpu: P-1 posted receives and sends (each its own operation of the stream, so the
  // stream's later work waits for all of them), and the own chunk copied in order.
  void alltoall(Stream s, Communicator& comm, const DeviceBuffer& send, const DeviceBuffer& recv,
                size_t chunk, int tag) override {
    const int p = comm.size(), r = comm.rank();
    std::byte *from = send.data(), *to = recv.data();
    for (int k = 1; k < p && chunk; ++k) {
      const int j = (r - k + p) % p;
      post_recv(s, "alltoall recv", comm, to + size_t(j) * chunk, chunk, j, tag);
    }
    for (int k = 1; k < p && chunk; ++k) {
      const int j = (r + k) % p;
      post_send(s, "alltoall send", comm, from + size_t(j) * chunk, chunk, j, tag);
    }
    from += size_t(r) * chunk;
    to += size_t(r) * chunk;
    enqueue(s, "alltoall own chunk", {bytes_view(from, chunk)}, {bytes_view(to, chunk)},
            [=] { std::memcpy(to, from, chunk); });
  }
  void barrier(Stream s, Communicator& comm) override {
    Communicator* c = &comm;
    enqueue(s, "barrier", {}, {}, [=] { c->barrier(); });
  }
  bool lends_sent_buffers(const Communicator&) const override { return false; }

  void forward_block(Stream s, const TensorView& q, const Tokens& qt, const TensorView& k,
                     const TensorView& v, const Tokens& kt, const Mask& mask, ForwardState& state,
                     const KernelConfig& config) override {
    ForwardState* st = &state;
    enqueue(s, "forward_block", {q, k, v}, {}, [=, this] {
      busy([&] { return attention_forward_block(q, qt, k, v, kt, mask, *st, config); });
    });
  }
  void forward_finalize(Stream s, ForwardState& state, const TensorView& out, const TensorView& lse,
                        const KernelConfig& config) override {
    ForwardState* st = &state;
    enqueue(s, "forward_finalize", {}, {out, lse}, [=, this] {
      busy([&] {
        attention_forward_finalize(*st, out, lse, config);
        return KernelStats{};
      });
    });
  }
  void backward_delta(Stream s, const TensorView& out, const TensorView& dout,
                      const TensorView& delta, const KernelConfig& config) override {
    enqueue(s, "backward_delta", {out, dout}, {delta}, [=, this] {
      busy([&] {
        attention_backward_delta(out, dout, delta, config);
        return KernelStats{};
      });
    });
  }
  void backward_block(Stream s, const TensorView& q, const Tokens& qt, const TensorView& k,
                      const TensorView& v, const Tokens& kt, const Mask& mask,
                      const TensorView& dout, const TensorView& lse, const TensorView& delta,
                      const TensorView& dq, const TensorView& dk, const TensorView& dv,
                      const KernelConfig& config) override {
    enqueue(s, "backward_block", {q, k, v, dout, lse, delta}, {dq, dk, dv}, [=, this] {
      busy([&] {
        return attention_backward_block(q, qt, k, v, kt, mask, dout, lse, delta, dq, dk, dv,
                                        config);
      });
    });
  }
  void merge(Stream s, const TensorView& o_a, const TensorView& lse_a, const TensorView& o_b,
             const TensorView& lse_b) override {
    enqueue(s, "merge", {o_b, lse_b}, {o_a, lse_a}, [=, this] {
      busy([&] {
        ctxpar::merge(o_a, lse_a, o_b, lse_b);
        return KernelStats{};
      });
    });
  }
  void add(Stream s, const TensorView& x, const TensorView& y) override {
    enqueue(s, "add", {x}, {y}, [=] { host_add(x, y); });
  }
  void copy(Stream s, const TensorView& src, const TensorView& dst) override {
    enqueue(s, "copy", {src}, {dst}, [=] { copy_into(src, dst); });
  }
  void fill_zero(Stream s, const TensorView& t) override {
    enqueue(s, "fill_zero", {}, {t}, [=] { host_fill_zero(t); });
  }
  void pack_kv(Stream s, const TensorView& k, const TensorView& v, const Tokens& tokens,
               bool documents, const TensorView& bk, const TensorView& bv,
               std::byte* bt) override {
    const size_t tb = size_t(k.dim(1)) * (8 + (documents ? 4 : 0));
    enqueue(s, "pack_kv", {k, v}, {bk, bv, bytes_view(bt, tb)},
            [=] { host_pack_kv(k, v, tokens, documents, bk, bv, bt); });
  }
  void scatter_tokens(Stream s, const TensorView& src, const TensorView& dst,
                      const TensorView& index) override {
    enqueue(s, "scatter_tokens", {src, index}, {dst},
            [=] { host_scatter_tokens(src, dst, index); });
  }
  void gather_tokens(Stream s, const TensorView& src, const TensorView& dst,
                     const TensorView& index) override {
    enqueue(s, "gather_tokens", {src, index}, {dst},
            [=] { host_gather_tokens(src, dst, index); });
  }

 protected:
  void free(std::unique_ptr<DeviceBuffer::Storage> storage) override {
    Deferred d;
    d.freed = static_cast<SimStorage*>(storage.get())->ptr;
    defer(std::move(d));
  }
  void release_later(std::shared_ptr<void> owner) override {
    Deferred d;
    d.keep_alive = std::move(owner);
    defer(std::move(d));
  }

 private:
  struct StreamState {
    std::deque<Op> queue;
    uint64_t enqueued = 0, completed = 0;
    std::vector<uint64_t> clock = std::vector<uint64_t>(kStreams, 0);
  };

  // A send of a copy of [from, from + bytes) (the wire, not a loan) when its turn comes.
  void post_send(Stream s, const char* name, Communicator& comm, std::byte* from, size_t bytes,
                 int peer, int tag) {
    Communicator* c = &comm;
    const Clock::duration timeout = comm.timeout();
    enqueue_post(s, name, {bytes_view(from, bytes)}, {}, [=] {
      Buffer out = Buffer::uninitialized(bytes);
      std::memcpy(out.data(), from, bytes);
      Inflight f;
      f.request = c->isend(std::move(out), peer, tag);
      f.what = detail::concat(name, " to rank ", peer, " (tag ", tag, ")");
      f.deadline = Clock::now() + timeout;
      return f;
    });
  }
  // A receive into [into, into + bytes), copied there when the message is in.
  void post_recv(Stream s, const char* name, Communicator& comm, std::byte* into, size_t bytes,
                 int peer, int tag) {
    Communicator* c = &comm;
    const Clock::duration timeout = comm.timeout();
    enqueue_post(s, name, {}, {bytes_view(into, bytes)}, [=] {
      Inflight f;
      f.request = c->irecv(bytes, peer, tag);
      f.into = into;
      f.bytes = bytes;
      f.what = detail::concat(name, " from rank ", peer, " (tag ", tag, ")");
      f.deadline = Clock::now() + timeout;
      return f;
    });
  }

  static TensorView bytes_view(std::byte* p, size_t n) {
    return TensorView(p, DType::i32, {int64_t(n / 4 > 0 ? n / 4 : 1)});
  }

  template <typename F>
  void busy(F&& f) {
    count_busy(counters_, std::forward<F>(f));
  }

  // The allocation a view lies in (nullptr: memory the device does not own). Caller holds mu_.
  Allocation* allocation_of(const TensorView& t) {
    if (t.empty() || allocations_.empty()) return nullptr;
    const auto at = reinterpret_cast<uintptr_t>(t.data());
    auto it = allocations_.upper_bound(at);
    if (it == allocations_.begin()) return nullptr;
    --it;
    return at < it->first + it->second.memory.size() ? &it->second : nullptr;
  }

  // Refuses an access that races an earlier one of another stream; records it. Holds mu_.
  // A refusal also fails the device (its queued work is dropped), so that the rank leaves the
  // call at once and its peers fail with it instead of waiting for its messages.
  void check(int s, uint64_t seq, const std::string& op, const TensorView& t, bool write) {
    Allocation* a = allocation_of(t);
    if (!a) return;
    if (a->freed)
      refuse(detail::concat("sim: '", op, "' on the ", stream_name(Stream{s}),
                            " stream uses a buffer that was already freed (a view kept "
                            "past its DeviceBuffer)"));
    const std::vector<uint64_t>& clock = streams_[s].clock;
    for (const Access& x : a->accesses)
      if (x.stream != s && x.seq > clock[x.stream] && (write || x.write))
        refuse(detail::concat(
            "sim: '", op, "' on the ", stream_name(Stream{s}), " stream ",
            write ? "writes" : "reads", " a buffer that '", x.op, "' on the ",
            stream_name(Stream{x.stream}), " stream ", x.write ? "writes" : "reads",
            ", with no wait in between (a missing Device::wait(", stream_name(Stream{s}),
            ", record(", stream_name(Stream{x.stream}), ")))"));
    a->accesses.push_back({s, seq, write, op});
  }

  [[noreturn]] void refuse(const std::string& what) {  // caller holds mu_
    fail(what);
    throw Error(what);
  }

  void check_all(int s, uint64_t seq, const std::string& name,
                 std::initializer_list<TensorView> reads,
                 std::initializer_list<TensorView> writes) {
    for (const TensorView& t : reads) check(s, seq, name, t, false);
    for (const TensorView& t : writes) check(s, seq, name, t, true);
  }

  void enqueue(Stream s, const char* name, std::initializer_list<TensorView> reads,
               std::initializer_list<TensorView> writes, std::function<void()> fn) {
    Op op;
    op.name = name;
    op.fn = std::move(fn);
    std::lock_guard lock(mu_);
    check_all(s.index, streams_[s.index].enqueued + 1, name, reads, writes);
    push(s, std::move(op));
  }
  void enqueue_post(Stream s, const char* name, std::initializer_list<TensorView> reads,
                    std::initializer_list<TensorView> writes, std::function<Inflight()> fn) {
    Op op;
    op.kind = Op::post;
    op.name = name;
    op.post_fn = std::move(fn);
    std::lock_guard lock(mu_);
    check_all(s.index, streams_[s.index].enqueued + 1, name, reads, writes);
    push(s, std::move(op));
  }

  void fail(const std::string& what) {  // caller holds mu_
    if (!failed_) error_ = what;
    failed_ = true;
    cv_.notify_all();
  }

  // Caller holds mu_.
  void push(Stream s, Op op) {
    StreamState& st = streams_[s.index];
    op.seq = ++st.enqueued;
    op.delay_us = max_delay_us_ > 0 && (rng_() & 1) ? int(rng_() % uint64_t(max_delay_us_ + 1)) : 0;
    st.queue.push_back(std::move(op));
    cv_.notify_all();
  }

  void defer(Deferred d) {
    std::lock_guard lock(mu_);
    for (int t = 0; t < kStreams; ++t) d.after[t] = streams_[t].enqueued;
    deferred_.push_back(std::move(d));
    release_deferred();
  }

  // Lets go of what every stream has passed. Caller holds mu_.
  void release_deferred() {
    for (auto it = deferred_.begin(); it != deferred_.end();) {
      bool passed = true;
      for (int t = 0; t < kStreams; ++t) passed = passed && streams_[t].completed >= it->after[t];
      if (!passed) {
        ++it;
        continue;
      }
      if (it->freed) {
        auto a = allocations_.find(reinterpret_cast<uintptr_t>(it->freed));
        if (a != allocations_.end()) {
          std::memset(a->second.memory.data(), 0xFF, a->second.memory.size());
          a->second.freed = true;
          quarantine_.push_back(a->first);
          quarantined_ += a->second.memory.size();
          while (quarantined_ > kQuarantineBytes && quarantine_.size() > 1) {
            auto old = allocations_.find(quarantine_.front());
            quarantined_ -= old->second.memory.size();
            allocations_.erase(old);
            quarantine_.pop_front();
          }
        }
      }
      it = deferred_.erase(it);
    }
  }

  // ---- workers --------------------------------------------------------------------------

  // Completes the transfers that are done (never blocks). Caller holds mu_; it is released
  // while the communicator is asked.
  void poll(int s, std::deque<Inflight>& inflight, std::unique_lock<std::mutex>& lock,
            uint64_t executed) {
    lock.unlock();
    std::string error;
    try {
      for (auto it = inflight.begin(); it != inflight.end();) {
        if (it->request.test()) {
          if (it->into) {
            Buffer b = it->request.take();
            std::memcpy(it->into, b.data(), it->bytes);
          }
          it = inflight.erase(it);
        } else if (Clock::now() > it->deadline) {
          throw Error("sim: timed out waiting for the " + it->what);
        } else {
          ++it;
        }
      }
    } catch (const std::exception& e) {
      error = e.what();
      inflight.clear();
    }
    lock.lock();
    if (!error.empty()) fail(error);
    StreamState& st = streams_[s];
    const uint64_t done = inflight.empty() ? executed : inflight.front().seq - 1;
    if (done != st.completed) {
      st.completed = done;
      release_deferred();
      cv_.notify_all();
    }
  }

  void work(int s) {
    StreamState& st = streams_[s];
    std::deque<Inflight> inflight;
    uint64_t executed = 0;
    std::unique_lock lock(mu_);
    for (;;) {
      if (!inflight.empty()) poll(s, inflight, lock, executed);
      if (failed_) inflight.clear();
      if (st.queue.empty()) {
        if (stop_) return;
        if (inflight.empty())
          cv_.wait(lock, [&] { return stop_ || !st.queue.empty(); });
        else
          cv_.wait_for(lock, std::chrono::microseconds(50));
        continue;
      }
      Op op = std::move(st.queue.front());
      st.queue.pop_front();
      if (op.delay_us > 0 && !failed_) {
        lock.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(op.delay_us));
        lock.lock();
      }
      if (op.kind == Op::wait) {
        const StreamState& other = streams_[op.wait_for.stream];
        while (!failed_ && !stop_ && other.completed < op.wait_for.seq) {
          if (!inflight.empty()) poll(s, inflight, lock, executed);
          cv_.wait_for(lock, std::chrono::microseconds(50));
        }
      } else if (!failed_) {
        lock.unlock();
        std::string error;
        try {
          if (op.kind == Op::run) {
            op.fn();
          } else {
            Inflight f = op.post_fn();
            f.seq = op.seq;
            inflight.push_back(std::move(f));
          }
        } catch (const std::exception& e) {
          error = detail::concat("sim: '", op.name, "' on the ", stream_name(Stream{s}),
                                 " stream failed: ", e.what());
        }
        lock.lock();
        if (!error.empty()) fail(error);
      }
      executed = op.seq;
      if (failed_) inflight.clear();
      if (inflight.empty()) {
        st.completed = executed;
        release_deferred();
        cv_.notify_all();
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  StreamState streams_[kStreams];
  std::thread workers_[kStreams];
  std::map<uintptr_t, Allocation> allocations_;
  std::deque<uintptr_t> quarantine_;
  size_t quarantined_ = 0;
  std::map<std::pair<int, uint64_t>, std::vector<uint64_t>> event_clocks_;
  std::vector<Deferred> deferred_;
  std::mt19937_64 rng_;
  int max_delay_us_;
  bool stop_ = false, failed_ = false;
  std::string error_;
};

}  // namespace

std::unique_ptr<Device> make_sim(const DeviceOptions& options, int rank) {
  return std::make_unique<SimDevice>(options, rank);
}

}  // namespace ctxpar::device

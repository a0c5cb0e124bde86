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
//     with no wait in between (vector clocks over record / wait: race_checker.h), is refused
//     with an Error naming both operations. The check follows the order the code states, not
//     the timing of one run, so a missing wait is reported on every run, whatever the delays.
//   - The kernel operations are HostDevice's (host_device.h); run() queues each one.
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
#include "device/host_device.h"
#include "device/race_checker.h"

namespace ctxpar::device {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kQuarantineBytes = size_t(256) << 20;

struct SimStorage final : DeviceBuffer::Storage {
  std::byte* ptr = nullptr;
  std::byte* data() override { return ptr; }
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

struct Queued {
  enum Kind { run, post, wait } kind = run;
  std::string name;
  uint64_t seq = 0;
  int delay_us = 0;
  std::function<void()> fn;
  std::function<Inflight()> post_fn;
  Event wait_for;
};

// A freed buffer, filled with NaN and quarantined once every stream passed `after`.
struct Deferred {
  uint64_t after[kStreams] = {};  // set by defer(); zero, not indeterminate, when moved there
  std::byte* freed = nullptr;
};

class SimDevice final : public HostDevice {
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
    Buffer memory = Buffer::uninitialized(bytes ? bytes : 1);
    std::memset(memory.data(), 0xFF, memory.size());  // NaN: reads of unwritten memory show
    s->ptr = memory.data();
    std::lock_guard lock(mu_);
    races_.add(s->ptr, memory.size());
    allocations_.emplace(reinterpret_cast<uintptr_t>(s->ptr), std::move(memory));
    return DeviceBuffer(this, std::move(s));
  }

  Event record(Stream s) override {
    std::lock_guard lock(mu_);
    const Event e{s.index, streams_[s.index].enqueued};
    races_.record(e.stream, e.seq);
    return e;
  }

  void wait(Stream s, const Event& e) override {
    if (e.stream < 0 || e.stream == s.index) return;  // a stream is ordered with itself
    Queued op;
    op.kind = Queued::wait;
    op.name = "wait";
    op.wait_for = e;
    std::lock_guard lock(mu_);
    if (!races_.wait(s.index, e)) return;  // recorded before the last synchronize(): done
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
      RaceChecker::Clock enqueued(kStreams);
      for (int t = 0; t < kStreams; ++t) enqueued[size_t(t)] = streams_[t].enqueued;
      races_.synchronized(enqueued);
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

 protected:
  void free(std::unique_ptr<DeviceBuffer::Storage> storage) override {
    Deferred d;
    d.freed = static_cast<SimStorage*>(storage.get())->ptr;
    defer(std::move(d));
  }
  // A kernel operation: checked for races now, run by the stream's worker later.
  void execute(Stream s, const char* op, Views reads, Views writes, const Work& work) override {
    enqueue(s, op, reads, writes, work.keep());
  }

 private:
  struct StreamState {
    std::deque<Queued> queue;
    uint64_t enqueued = 0, completed = 0;
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

  // Refuses an access that races an earlier one of another stream (RaceChecker); records it.
  // Holds mu_. A refusal also fails the device (its queued work is dropped), so that the rank
  // leaves the call at once and its peers fail with it instead of waiting for its messages.
  void check(int s, uint64_t seq, const std::string& op, const TensorView& t, bool write) {
    const std::string refusal = races_.refusal(s, seq, op, t.data(), write);
    if (!refusal.empty()) refuse(refusal);
  }

  [[noreturn]] void refuse(const std::string& what) {  // caller holds mu_
    fail(what);
    throw Error(what);
  }

  void check_all(int s, uint64_t seq, const std::string& name, Views reads, Views writes) {
    for (const TensorView& t : reads) check(s, seq, name, t, false);
    for (const TensorView& t : writes) check(s, seq, name, t, true);
  }

  void enqueue(Stream s, const char* name, Views reads, Views writes, std::function<void()> fn) {
    Queued op;
    op.name = name;
    op.fn = std::move(fn);
    std::lock_guard lock(mu_);
    check_all(s.index, streams_[s.index].enqueued + 1, name, reads, writes);
    push(s, std::move(op));
  }
  void enqueue_post(Stream s, const char* name, Views reads, Views writes,
                    std::function<Inflight()> fn) {
    Queued op;
    op.kind = Queued::post;
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
  void push(Stream s, Queued op) {
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
      auto a = allocations_.find(reinterpret_cast<uintptr_t>(it->freed));
      if (a != allocations_.end()) {
        std::memset(a->second.data(), 0xFF, a->second.size());
        races_.freed(a->second.data());
        quarantine_.push_back(a->first);
        quarantined_ += a->second.size();
        while (quarantined_ > kQuarantineBytes && quarantine_.size() > 1) {
          auto old = allocations_.find(quarantine_.front());
          quarantined_ -= old->second.size();
          races_.forget(old->second.data());
          allocations_.erase(old);
          quarantine_.pop_front();
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
      Queued op = std::move(st.queue.front());
      st.queue.pop_front();
      if (op.delay_us > 0 && !failed_) {
        lock.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(op.delay_us));
        lock.lock();
      }
      if (op.kind == Queued::wait) {
        const StreamState& other = streams_[op.wait_for.stream];
        while (!failed_ && !stop_ && other.completed < op.wait_for.seq) {
          if (!inflight.empty()) poll(s, inflight, lock, executed);
          cv_.wait_for(lock, std::chrono::microseconds(50));
        }
      } else if (!failed_) {
        lock.unlock();
        std::string error;
        try {
          if (op.kind == Queued::run) {
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
  std::map<uintptr_t, Buffer> allocations_;  // live and quarantined memory, by address
  std::deque<uintptr_t> quarantine_;
  size_t quarantined_ = 0;
  RaceChecker races_;
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

// Gloo transport: one rank per process, point-to-point over Gloo's TCP pairs and unbound
// buffers; the collectives are the shared ones (point_to_point.cc), so every sum is bitwise
// the threads and MPI transports'. See gloo_world.h for the slots and docs/comm.md ("Gloo
// transport").
//
//   isend(buf, peer, tag): header {size} -> header slot, payload -> data slot (size-specific)
//   irecv(n, peer, tag):   header recv + data recv of n bytes, posted at once, so Gloo's I/O
//                          thread moves the payload while the rank computes
//   wait():                the header first (a size mismatch is reported, never read), then
//                          the payload; blocks in Gloo's waitRecv/waitSend, which an abort
//                          message from another rank interrupts
#include <gloo/common/error.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/tcp/loop.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstring>

#include "comm/gloo_world.h"
#include "core/environment.h"
#include "ctxpar/gloo.h"

namespace ctxpar {
namespace comm_detail {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// How long a lost connection waits for the peer's abort message (GlooWorld::await_failure).
constexpr milliseconds kAbortGrace{500};

// A Gloo failure on the pair to at.peer (its process exited, or the connection broke): this
// rank tells the others that at.peer failed, and throws naming it.
[[noreturn]] void throw_lost(GlooWorld& w, const Where& at, const char* doing,
                             const std::string& gloo_message) {
  w.await_failure(at.me, kAbortGrace);
  const std::string why =
      detail::concat("its connection to rank ", at.me, " closed (", gloo_message, ")");
  w.fail(at.peer, why);
  w.broadcast_abort(at.peer, why);
  throw Error(detail::concat("rank ", at.me, ": lost the connection to rank ", at.peer, " while ",
                             doing, " rank ", at.peer, " (", describe_tag(at.ch, at.tag),
                             "): rank ", at.peer, " exited or failed (", gloo_message, ")"));
}

// Blocks until buf's send (or recv) is complete. False: interrupted without a failure (the
// request is being dropped). Throws on timeout, a lost peer, or another rank's failure.
bool wait_buffer(GlooWorld& w, gloo::transport::UnboundBuffer* buf, bool recv, const Where& at,
                 Clock::time_point deadline) {
  {
    std::lock_guard lock(w.mu);
    w.check_failed_locked(at.me);
    (recv ? w.waiting_recv : w.waiting_send).insert(buf);
  }
  bool ok = false;
  std::string io_error;
  try {
    const auto left =
        std::max(milliseconds(1), std::chrono::ceil<milliseconds>(deadline - Clock::now()));
    ok = recv ? buf->waitRecv(nullptr, left) : buf->waitSend(nullptr, left);
  } catch (const std::exception& e) {
    io_error = e.what();
    if (io_error.empty()) io_error = "I/O error";
  }
  {
    std::lock_guard lock(w.mu);
    (recv ? w.waiting_recv : w.waiting_send).erase(buf);
    if (!ok) w.check_failed_locked(at.me);
  }
  const char* doing = recv ? "waiting for recv from" : "waiting for send to";
  if (!io_error.empty()) {
    if (Clock::now() >= deadline) throw_timeout(at, recv ? "recv from" : "send to");
    throw_lost(w, at, doing, io_error);
  }
  return ok;
}

// Posting on a pair that has already failed throws from Gloo.
template <typename Post>
void post_or_throw(GlooWorld& w, const Where& at, const char* doing, Post&& post) {
  try {
    post();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw_lost(w, at, doing, e.what());
  }
}

// The part of a request that Gloo may still touch after the Request is gone.
struct Transfer {
  std::array<uint64_t, 2> header{};  // {payload bytes, 0}
  Buffer payload;
  std::unique_ptr<gloo::transport::UnboundBuffer> header_buffer, data_buffer;
};

// One isend or irecv. A send posts the header and the payload; a receive posts the header
// receive and the payload receive (of the expected size) at once.
class GlooRequest final : public Request::Impl {
 public:
  GlooRequest(std::shared_ptr<GlooWorld> w, Where at, uint64_t slot, bool recv, Buffer&& buf,
              size_t bytes)
      : world_(std::move(w)),
        at_(at),
        recv_(recv),
        expected_(bytes),
        t_(std::make_shared<Transfer>()) {
    Transfer& t = *t_;
    t.payload = recv ? Buffer::uninitialized(bytes) : std::move(buf);
    t.header[0] = recv ? 0 : t.payload.size();
    auto& ctx = *world_->context;
    t.header_buffer = ctx.createUnboundBuffer(t.header.data(), sizeof(t.header));
    if (!t.payload.empty())
      t.data_buffer = ctx.createUnboundBuffer(t.payload.data(), t.payload.size());
    const uint64_t data = data_slot(slot, t.payload.size());
    post_or_throw(*world_, at_, recv ? "receiving from" : "sending to", [&] {
      if (recv) {
        t.header_buffer->recv(at_.peer, slot);
        if (t.data_buffer) t.data_buffer->recv(at_.peer, data);
      } else {
        t.header_buffer->send(at_.peer, slot);
        if (t.data_buffer) t.data_buffer->send(at_.peer, data);
      }
    });
  }
  ~GlooRequest() override {
    if (helper_.joinable()) {
      // Interrupts the helper's wait (it returns false, and ends).
      if (t_->header_buffer) abort_wait(t_->header_buffer.get());
      if (t_->data_buffer) abort_wait(t_->data_buffer.get());
      helper_.join();
    }
    if (!done_) {
      std::lock_guard lock(world_->mu);
      world_->detached.push_back(t_);
    }
  }
  // Never blocks: the first call starts a thread that waits; later calls read its verdict.
  bool test() override {
    if (done_) return true;
    std::unique_lock lock(m_);
    if (!helper_.joinable())
      helper_ = std::thread([this] {
        std::exception_ptr error;
        try {
          complete();
        } catch (...) {
          error = std::current_exception();
        }
        std::lock_guard l(m_);
        helper_error_ = error;
        helper_done_ = true;
        cv_.notify_all();
      });
    if (!helper_done_) return false;
    finish_helper(lock);
    return true;
  }
  void wait() override {
    if (done_) return;
    std::unique_lock lock(m_);
    if (!helper_.joinable()) {
      lock.unlock();
      complete();
      return;
    }
    cv_.wait(lock, [this] { return helper_done_; });
    finish_helper(lock);
  }
  Buffer take() override { return std::move(t_->payload); }

 private:
  // Blocks until the transfer is complete (sets done_), or throws; the timeout counts from
  // here, as on the other transports. A receive reads the header first: a payload of another
  // size is reported, and its data slot never matched.
  void complete() {
    const Clock::time_point deadline = Clock::now() + at_.timeout;
    if (!wait_buffer(*world_, t_->header_buffer.get(), recv_, at_, deadline)) return;
    if (recv_) check_message_size(at_, expected_, t_->header[0]);
    if (t_->data_buffer && !wait_buffer(*world_, t_->data_buffer.get(), recv_, at_, deadline))
      return;
    done_ = true;
  }
  void abort_wait(gloo::transport::UnboundBuffer* b) {
    if (recv_)
      b->abortWaitRecv();
    else
      b->abortWaitSend();
  }
  void finish_helper(std::unique_lock<std::mutex>& lock) {
    lock.unlock();
    helper_.join();
    if (helper_error_) std::rethrow_exception(std::exchange(helper_error_, nullptr));
  }

  std::shared_ptr<GlooWorld> world_;
  Where at_;
  bool recv_;
  size_t expected_;
  std::shared_ptr<Transfer> t_;
  std::atomic<bool> done_{false};
  std::mutex m_;
  std::condition_variable cv_;
  std::thread helper_;
  bool helper_done_ = false;
  std::exception_ptr helper_error_;
};

// A message to oneself: moved through the world's self mailbox, no Gloo.
class SelfRecvRequest final : public Request::Impl {
 public:
  SelfRecvRequest(std::shared_ptr<GlooWorld> w, Where at, size_t bytes,
                  std::shared_ptr<SelfMessage> m)
      : world_(std::move(w)), at_(at), expected_(bytes), m_(std::move(m)) {}
  bool test() override {
    std::lock_guard lock(world_->mu);
    return ready_locked();
  }
  void wait() override {
    std::unique_lock lock(world_->mu);
    if (!world_->cv.wait_for(lock, at_.timeout, [&] {
          world_->check_failed_locked(at_.me);
          return ready_locked();
        }))
      throw_timeout(at_, "recv from");
  }
  Buffer take() override { return std::move(m_->payload); }

 private:
  bool ready_locked() const {
    if (!m_->arrived) return false;
    check_message_size(at_, expected_, m_->payload.size());
    return true;
  }
  std::shared_ptr<GlooWorld> world_;
  Where at_;
  size_t expected_;
  std::shared_ptr<SelfMessage> m_;
};

class DoneRequest final : public Request::Impl {
 public:
  bool test() override { return true; }
  void wait() override {}
};

class GlooCommunicator final : public PointToPointCommunicator {
 public:
  GlooCommunicator(std::shared_ptr<GlooWorld> w, uint32_t group, std::vector<int> world_of,
                   int rank)
      : world_(std::move(w)), group_(group), world_of_(std::move(world_of)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(world_of_.size()); }
  TransportKind transport() const override { return TransportKind::gloo; }
  int world_rank() const override { return world_of_[rank_]; }
  int world_rank_of(int peer) const override { return world_of_[peer]; }
  GlooWorld& world() { return *world_; }

 protected:
  int max_user_tag() const override { return INT_MAX; }

  Request post_send(Buffer&& buf, int peer, int tag, Channel ch) override {
    const Where at = where(peer, tag, ch);
    const uint64_t slot = header_slot(group_, ch, tag);
    check_not_failed(at);
    if (at.peer == world_->rank) {
      std::lock_guard lock(world_->mu);
      auto& box = world_->self[slot];
      if (!box.posted.empty()) {
        box.posted.front()->payload = std::move(buf);
        box.posted.front()->arrived = true;
        box.posted.pop_front();
      } else {
        box.unexpected.push_back(std::move(buf));
      }
      world_->cv.notify_all();
      return Request(std::make_unique<DoneRequest>());
    }
    return Request(std::make_unique<GlooRequest>(world_, at, slot, false, std::move(buf), 0));
  }

  Request post_recv(size_t bytes, int peer, int tag, Channel ch) override {
    const Where at = where(peer, tag, ch);
    const uint64_t slot = header_slot(group_, ch, tag);
    check_not_failed(at);
    if (at.peer == world_->rank) {
      auto m = std::make_shared<SelfMessage>();
      std::lock_guard lock(world_->mu);
      auto& box = world_->self[slot];
      if (!box.unexpected.empty()) {
        m->payload = std::move(box.unexpected.front());
        m->arrived = true;
        box.unexpected.pop_front();
      } else {
        box.posted.push_back(m);
      }
      return Request(std::make_unique<SelfRecvRequest>(world_, at, bytes, std::move(m)));
    }
    return Request(std::make_unique<GlooRequest>(world_, at, slot, true, Buffer(), bytes));
  }

  // The members agree on the new group's number without talking: a hash of the parent's,
  // the split's number and the color.
  std::unique_ptr<Communicator> make_split(int color, int key, const std::vector<int>& members,
                                           uint32_t split_number) override {
    uint32_t group = static_cast<uint32_t>(
        mix(mix(group_) ^ (uint64_t(split_number) << 32 | uint32_t(color))) & 0x7fffffffu);
    if (group == kAbortGroup || group == 0) group = 1;
    std::vector<int> world_of;
    for (int m : members) world_of.push_back(world_of_[m]);
    const int new_rank =
        static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    return std::make_unique<GlooCommunicator>(world_, group, std::move(world_of), new_rank);
  }

 private:
  void check_not_failed(const Where& at) {
    std::lock_guard lock(world_->mu);
    world_->check_failed_locked(at.me);
  }

  std::shared_ptr<GlooWorld> world_;
  uint32_t group_;
  std::vector<int> world_of_;
  int rank_;
};

}  // namespace

uint64_t header_slot(uint32_t group, Channel ch, int tag) {
  return (uint64_t(1) << 63) | (uint64_t(group & 0x7fffffffu) << 32) |
         (uint64_t(ch == Channel::collective) << 31) | uint64_t(uint32_t(tag) & 0x7fffffffu);
}

uint64_t data_slot(uint64_t header, uint64_t bytes) {
  return mix(header ^ mix(bytes)) & ~(uint64_t(1) << 63);
}

// Note [Gloo's teardown waits a tick per pair]
// Gloo's TCP loop polls with a 10 ms timeout, and each pair, as it is destroyed, waits for the
// loop's next turn (Loop::unregisterDescriptor): 10 ms a pair, one after the other, so a failed
// bootstrap of 1024 ranks (a rendezvous that timed out) held its process 10 s after the error,
// whatever the timeout. While the pairs of a bootstrap that never connected go, a pipe that
// stays readable keeps the loop turning at once. A connected world keeps Gloo's pace: a rank
// that returns from connect() and goes away at once could close a pair before its peer's side
// of the handshake had finished (seen with the fast teardown for every world, under parallel
// load: Gloo.IsAvailableAndNamesItself's connect failed with "Connection closed by peer").
GlooWorld::~GlooWorld() {
  if (abort_thread.joinable()) {
    {
      std::lock_guard lock(mu);
      stopping = true;
    }
    abort_buffer->abortWaitRecv();
    abort_thread.join();
  }
  struct Ignore : gloo::transport::tcp::Handler {
    void handleEvents(int) override {}
  };
  static Ignore ignore;  // static: never dangling, whatever happens below
  auto* tcp = dynamic_cast<gloo::transport::tcp::Device*>(device.get());
  const int* tick = teardown_tick;
  if (tcp && tick[0] >= 0 && !connected) {  // else Gloo's pace
    const char byte = 0;
    (void)!::write(tick[1], &byte, 1);  // never read: readable until closed
    try {  // Gloo throws where epoll_ctl fails: never out of a destructor
      tcp->registerDescriptor(tick[0], EPOLLIN, &ignore);
      detached.clear();
      self.clear();
      abort_buffer.reset();
      context.reset();  // the pairs go here (unless a request still holds them)
      tcp->unregisterDescriptor(tick[0], &ignore);
    } catch (const std::exception&) {}
  }
  for (int fd : teardown_tick)
    if (fd >= 0) ::close(fd);  // (closing also takes it out of the loop's epoll set)
}

void GlooWorld::check_failed_locked(int me) const {
  if (failed_rank >= 0 && failed_rank != me) throw_stopped(me, failed_rank, failure);
  if (failed_rank == me) throw Error(detail::concat("rank ", me, ": failed earlier: ", failure));
}

void GlooWorld::await_failure(int me, milliseconds grace) {
  std::unique_lock lock(mu);
  cv.wait_for(lock, grace, [&] { return failed_rank >= 0; });
  check_failed_locked(me);
}

void GlooWorld::fail(int who, const std::string& message) {
  std::lock_guard lock(mu);
  if (failed_rank < 0) {
    failed_rank = who;
    failure = message;
  }
  for (auto* b : waiting_recv) b->abortWaitRecv();
  for (auto* b : waiting_send) b->abortWaitSend();
  cv.notify_all();
}

// An abort message: "<failed rank>\n<message>", zero-padded to kAbortBytes.
void GlooWorld::start_abort_listener() {
  if (size < 2) return;
  abort_buffer = context->createUnboundBuffer(abort_in.data(), abort_in.size());
  std::vector<int> others;
  for (int j = 0; j < size; ++j)
    if (j != rank) others.push_back(j);
  abort_buffer->recv(others, header_slot(kAbortGroup, Channel::collective, 0));
  abort_thread = std::thread([this] {
    bool got = false;
    try {
      got = abort_buffer->waitRecv(nullptr, std::chrono::hours(24 * 365));
    } catch (...) {
      return;  // the context closed (this rank failed or timed out): nothing more to hear
    }
    if (!got) return;
    abort_in.back() = '\0';
    const char* text = abort_in.data();
    const int who = std::atoi(text);
    const char* nl = std::strchr(text, '\n');
    fail(who, nl ? nl + 1 : "(no message)");
  });
}

void GlooWorld::broadcast_abort(int failed, const std::string& message) {
  if (size < 2) return;
  auto text = std::make_shared<std::array<char, kAbortBytes>>();
  text->fill('\0');
  const std::string s = detail::concat(failed, "\n", message);
  std::memcpy(text->data(), s.data(), std::min(s.size(), kAbortBytes - 1));
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> sends;
  const uint64_t slot = header_slot(kAbortGroup, Channel::collective, 0);
  for (int j = 0; j < size; ++j) {
    if (j == rank) continue;
    try {
      auto b = context->createUnboundBuffer(text->data(), text->size());
      b->send(j, slot);
      sends.push_back(std::move(b));
    } catch (...) {
      // that pair is closed: its rank will hear of the failure by its own closed pair
    }
  }
  const auto deadline = Clock::now() + std::chrono::seconds(2);
  for (auto& b : sends) {
    try {
      b->waitSend(nullptr, std::max(milliseconds(1),
                                    std::chrono::ceil<milliseconds>(deadline - Clock::now())));
    } catch (...) {}
  }
  // Gloo may still hold the sends that did not complete: their memory stays.
  std::lock_guard lock(mu);
  detached.push_back(text);
  for (auto& b : sends) detached.push_back(std::shared_ptr<void>(std::move(b)));
}

std::unique_ptr<Communicator> make_gloo_communicator(std::shared_ptr<GlooWorld> w) {
  std::vector<int> all(w->size);
  for (int j = 0; j < w->size; ++j) all[j] = j;
  const int r = w->rank;
  auto comm = std::make_unique<GlooCommunicator>(std::move(w), 0, std::move(all), r);
  return comm;
}

}  // namespace comm_detail

namespace {
std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char u[8];
      std::snprintf(u, sizeof(u), "\\u%04x", static_cast<unsigned>(c));
      out += u;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// Note [The error file names the rank that failed first] (python/ctxpar/_distributed.py): the
// failing rank writes torchrun's error file in torch's @record format; a rank stopped by
// another's failure waits under the agent, so that the agent sees the first failure alone.
constexpr std::chrono::seconds kStoppedRankGrace{5};

void report_to_torchrun(const std::string& error, int first_failed) {
  const environment::Torchrun t = environment::torchrun();
  if (!t.error_file.empty()) {
    const std::string json =
        detail::concat("{\"message\": {\"message\": ", json_string("ctxpar::Error: " + error),
                       ", \"extraInfo\": {\"py_callstack\": \"\", \"timestamp\": \"",
                       std::chrono::duration_cast<std::chrono::seconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count(),
                       "\", \"first_failed_rank\": \"", first_failed, "\"}}}\n");
    if (std::FILE* f = std::fopen(t.error_file.c_str(), "w")) {
      std::fputs(json.c_str(), f);
      std::fclose(f);
    } else {
      std::fprintf(stderr, "ctxpar: could not write the error file %s (TORCHELASTIC_ERROR_FILE)\n",
                   t.error_file.c_str());
    }
  }
}
}  // namespace

int gloo_failed_rank(const Communicator& comm) {
  auto* g = dynamic_cast<const comm_detail::GlooCommunicator*>(&comm);
  if (g == nullptr) return -1;
  comm_detail::GlooWorld& w = const_cast<comm_detail::GlooCommunicator*>(g)->world();
  std::lock_guard lock(w.mu);
  return w.failed_rank;
}

void run_gloo(Communicator& comm, const std::function<void(Communicator&)>& fn) {
  std::string error;
  try {
    fn(comm);
    return;
  } catch (const std::exception& e) {
    error = e.what();
  } catch (...) {
    error = "unknown exception (not derived from std::exception)";
  }
  if (error.empty()) error = "exception without a message";
  int me = comm.rank(), first_failed = me;
  if (auto* g = dynamic_cast<comm_detail::GlooCommunicator*>(&comm)) {
    comm_detail::GlooWorld& w = g->world();
    me = first_failed = g->world_rank();
    bool first = false;
    {
      std::lock_guard lock(w.mu);
      first = w.failed_rank < 0;
      if (!first) first_failed = w.failed_rank;
    }
    // A rank stopped by another's failure does not repeat it: the others heard it already.
    if (first) {
      w.fail(me, error);
      w.broadcast_abort(me, error);
    }
  }
  std::fprintf(stderr, "ctxpar: rank %d failed: %s\n", me, error.c_str());
  std::fflush(nullptr);
  report_to_torchrun(error, first_failed);
  if (first_failed != me && !environment::torchrun().run_id.empty())
    std::this_thread::sleep_for(kStoppedRankGrace);
  std::_Exit(1);
}

}  // namespace ctxpar

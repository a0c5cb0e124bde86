// Threads transport: P ranks as threads of one process.
//
// A send moves the Buffer into the receiver's mailbox (no copy): it either fills the first
// matching receive already posted there, or waits in the mailbox's "unexpected" queue until a
// receive asks for it. Matching is by (source, tag, channel) and first-come first-served, as
// in MPI, so two messages with the same tag never overtake each other. One mutex and one
// condition variable per run_threads call guard every group of it (P is small; the critical
// sections only move pointers). The optional SimulatedLink stamps each message with its
// delivery time; waits sleep until then. See docs/comm.md.
#include <algorithm>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <numeric>
#include <system_error>
#include <thread>
#include <tuple>

#include "comm/point_to_point.h"

namespace ctxpar {
namespace comm_detail {
namespace {

using Clock = std::chrono::steady_clock;

// A posted receive (expected > its payload until a message arrives), or a sent message that
// no receive has asked for yet.
struct Message {
  int src = 0;
  int tag = 0;
  Channel ch = Channel::user;
  size_t expected = 0;
  bool arrived = false;
  Buffer payload;
  Clock::time_point deliver_at{};
};
using Queue = std::deque<std::shared_ptr<Message>>;

struct Group {
  uint64_t id = 0;
  std::vector<int> world;         // local rank -> world rank
  std::vector<Queue> posted;      // per local rank: its receives still waiting, in post order
  std::vector<Queue> unexpected;  // per local rank: messages to it nobody asked for yet
};

struct World {
  World(int ranks, SimulatedLink l) : link(l), link_free(ranks), finished(ranks, false) {}

  std::mutex mu;
  std::condition_variable cv;
  const SimulatedLink link;
  std::vector<Clock::time_point> link_free;  // per world rank: when its outgoing link is idle
  std::vector<bool> finished;                // per world rank: fn has returned or thrown
  int failed_rank = -1;                      // the first rank that threw
  std::string failure;
  uint64_t next_group_id = 0;
  struct PendingSplit {
    std::shared_ptr<Group> group;
    size_t remaining;  // members that have not picked it up yet
  };
  std::map<std::tuple<uint64_t, uint32_t, int>, PendingSplit> splits;

  bool link_modelled() const { return link.gbytes_per_second > 0 || link.latency_us > 0; }

  // Caller holds mu (or no other thread exists yet).
  std::shared_ptr<Group> make_group(std::vector<int> world_ranks) {
    auto g = std::make_shared<Group>();
    g->id = next_group_id++;
    g->posted.resize(world_ranks.size());
    g->unexpected.resize(world_ranks.size());
    g->world = std::move(world_ranks);
    return g;
  }
};

// Caller holds w.mu.
void check_group(const World& w, const Where& at) {
  if (w.failed_rank >= 0 && w.failed_rank != at.me) throw_stopped(at.me, w.failed_rank, w.failure);
}

class SendRequest final : public Request::Impl {
 public:
  SendRequest(std::shared_ptr<World> w, Where at, Clock::time_point done)
      : world_(std::move(w)), at_(at), done_(done) {}
  bool test() override {
    if (Clock::now() >= done_) return true;
    std::lock_guard lock(world_->mu);
    check_group(*world_, at_);
    return false;
  }
  // A send is complete when its last byte has left this rank's (simulated) link.
  void wait() override {
    if (Clock::now() >= done_) return;
    std::unique_lock lock(world_->mu);
    const auto deadline = Clock::now() + at_.timeout;
    for (;;) {
      check_group(*world_, at_);
      const auto now = Clock::now();
      if (now >= done_) return;
      if (now >= deadline) throw_timeout(at_, "send to");
      world_->cv.wait_until(lock, std::min(done_, deadline));
    }
  }

 private:
  std::shared_ptr<World> world_;
  Where at_;
  Clock::time_point done_;
};

class RecvRequest final : public Request::Impl {
 public:
  RecvRequest(std::shared_ptr<World> w, std::shared_ptr<Group> g, int local_rank, Where at,
              std::shared_ptr<Message> m)
      : world_(std::move(w)),
        group_(std::move(g)),
        local_rank_(local_rank),
        at_(at),
        m_(std::move(m)) {}
  ~RecvRequest() override {
    // A receive dropped before its message came must not swallow a later message.
    std::lock_guard lock(world_->mu);
    if (m_->arrived) return;
    auto& q = group_->posted[local_rank_];
    q.erase(std::remove(q.begin(), q.end(), m_), q.end());
  }
  bool test() override {
    std::lock_guard lock(world_->mu);
    if (ready(Clock::now())) return true;
    check_group(*world_, at_);
    return false;
  }
  void wait() override {
    std::unique_lock lock(world_->mu);
    const auto deadline = Clock::now() + at_.timeout;
    for (;;) {
      const auto now = Clock::now();
      if (ready(now)) return;
      check_group(*world_, at_);
      if (!m_->arrived && world_->finished[at_.peer])
        throw Error(detail::concat("rank ", at_.me, ": waiting for recv from rank ", at_.peer, " (",
                                   describe_tag(at_.ch, at_.tag), "), but rank ", at_.peer,
                                   " has returned without sending it"));
      if (!m_->arrived && at_.ch == Channel::collective) check_same_collective();
      if (now >= deadline) throw_timeout(at_, "recv from");
      world_->cv.wait_until(lock, m_->arrived ? std::min(m_->deliver_at, deadline) : deadline);
    }
  }
  Buffer take() override { return std::move(m_->payload); }

 private:
  // Caller holds the lock. Throws on a size mismatch once the message is there.
  bool ready(Clock::time_point now) const {
    if (!m_->arrived || now < m_->deliver_at) return false;
    check_message_size(at_, m_->expected, m_->payload.size());
    return true;
  }

  // Caller holds the lock. A message of the same collective call number but another kind
  // means a rank called a different collective: no message this rank waits for will come.
  void check_same_collective() const {
    for (const auto& u : group_->unexpected[local_rank_])
      if (u->ch == Channel::collective)
        comm_detail::check_same_collective(at_, u->tag, group_->world[u->src]);
  }

  std::shared_ptr<World> world_;
  std::shared_ptr<Group> group_;
  int local_rank_;
  Where at_;
  std::shared_ptr<Message> m_;
};

bool matches(const Message& m, int src, int tag, Channel ch) {
  return m.src == src && m.tag == tag && m.ch == ch;
}

class ThreadsCommunicator final : public PointToPointCommunicator {
 public:
  ThreadsCommunicator(std::shared_ptr<World> w, std::shared_ptr<Group> g, int rank)
      : world_(std::move(w)), group_(std::move(g)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(group_->world.size()); }
  TransportKind transport() const override { return TransportKind::threads; }
  bool shares_send_buffers() const override { return true; }
  int world_rank() const override { return group_->world[rank_]; }
  int world_rank_of(int peer) const override { return group_->world[peer]; }

 protected:
  int max_user_tag() const override { return INT_MAX; }

  Request post_send(Buffer&& buf, int peer, int tag, Channel ch) override {
    World& w = *world_;
    const Where at = where(peer, tag, ch);
    std::lock_guard lock(w.mu);
    check_group(w, at);
    const auto now = Clock::now();
    auto done = now, deliver = now;
    if (w.link_modelled() && peer != rank_) {
      // One message at a time on this rank's outgoing link: start when it is idle.
      const auto start = std::max(now, w.link_free[at.me]);
      const double wire = w.link.gbytes_per_second > 0
                              ? static_cast<double>(buf.size()) / (w.link.gbytes_per_second * 1e9)
                              : 0.0;
      // In double seconds first: a delay past the timeout (or past what a clock duration
      // holds) must fail here, not wrap into a time in the past that reads as "no link".
      const double queued = std::chrono::duration<double>(start - now).count();
      const double delay = queued + wire + w.link.latency_us * 1e-6;
      const double limit = std::chrono::duration<double>(at.timeout).count();
      if (!(delay <= limit))
        throw Error(detail::concat(
            "rank ", at.me, ": the simulated link (", w.link.gbytes_per_second, " GB/s, ",
            w.link.latency_us, " us latency) would deliver this ", buf.size(),
            "-byte message to rank ", at.peer, " after ", delay, " s, past the ", limit,
            " s timeout; raise the link's "
            "bandwidth, lower its latency, or raise the timeout"));
      done =
          start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(wire));
      w.link_free[at.me] = done;
      deliver = done + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double, std::micro>(w.link.latency_us));
    }
    auto& posted = group_->posted[peer];
    auto it = std::find_if(posted.begin(), posted.end(),
                           [&](const auto& m) { return matches(*m, rank_, tag, ch); });
    if (it != posted.end()) {
      (*it)->payload = std::move(buf);
      (*it)->deliver_at = deliver;
      (*it)->arrived = true;
      posted.erase(it);
    } else {
      auto m = std::make_shared<Message>();
      m->src = rank_;
      m->tag = tag;
      m->ch = ch;
      m->payload = std::move(buf);
      m->deliver_at = deliver;
      m->arrived = true;
      group_->unexpected[peer].push_back(std::move(m));
    }
    w.cv.notify_all();
    return Request(std::make_unique<SendRequest>(world_, at, done));
  }

  Request post_recv(size_t bytes, int peer, int tag, Channel ch) override {
    World& w = *world_;
    const Where at = where(peer, tag, ch);
    std::lock_guard lock(w.mu);
    check_group(w, at);
    auto m = std::make_shared<Message>();
    m->src = peer;
    m->tag = tag;
    m->ch = ch;
    m->expected = bytes;
    auto& unexpected = group_->unexpected[rank_];
    auto it = std::find_if(unexpected.begin(), unexpected.end(),
                           [&](const auto& u) { return matches(*u, peer, tag, ch); });
    if (it != unexpected.end()) {
      m->payload = std::move((*it)->payload);
      m->deliver_at = (*it)->deliver_at;
      m->arrived = true;
      unexpected.erase(it);
    } else {
      group_->posted[rank_].push_back(m);
    }
    return Request(std::make_unique<RecvRequest>(world_, group_, rank_, at, std::move(m)));
  }

  // The first member to arrive creates the group; the others find it under the same key.
  std::unique_ptr<Communicator> make_split(int color, int key, const std::vector<int>& members,
                                           uint32_t split_number) override {
    World& w = *world_;
    std::lock_guard lock(w.mu);
    const auto id = std::make_tuple(group_->id, split_number, color);
    auto it = w.splits.find(id);
    if (it == w.splits.end()) {
      std::vector<int> world_ranks;
      for (int m : members) world_ranks.push_back(group_->world[m]);
      it = w.splits.emplace(id, World::PendingSplit{w.make_group(world_ranks), members.size()})
               .first;
    }
    auto g = it->second.group;
    if (--it->second.remaining == 0) w.splits.erase(it);
    const int new_rank =
        static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    return std::make_unique<ThreadsCommunicator>(world_, std::move(g), new_rank);
  }

 private:
  std::shared_ptr<World> world_;
  std::shared_ptr<Group> group_;
  int rank_;
};

}  // namespace
}  // namespace comm_detail

void run_threads(int ranks, const std::function<void(Communicator&)>& fn,
                 const ThreadsOptions& options) {
  using namespace comm_detail;
  CTXPAR_CHECK(ranks >= 1, "run_threads: ranks must be >= 1, got ", ranks);
  CTXPAR_CHECK(ranks <= kMaxThreadsRanks, "run_threads: ", ranks,
               " ranks is more than the "
               "threads transport's ",
               kMaxThreadsRanks,
               " (every rank is a thread of this "
               "process and per-pair state grows as ranks^2); use MPI for more ranks");
  CTXPAR_CHECK(
      options.link.gbytes_per_second >= 0 && std::isfinite(options.link.gbytes_per_second),
      "run_threads: link.gbytes_per_second must be finite and >= 0 (0 = no link model), got ",
      options.link.gbytes_per_second);
  CTXPAR_CHECK(options.link.latency_us >= 0 && std::isfinite(options.link.latency_us),
               "run_threads: link.latency_us must be finite and >= 0, got ",
               options.link.latency_us);
  CTXPAR_CHECK(options.timeout.count() > 0, "run_threads: timeout must be positive, got ",
               options.timeout.count(), " ms");
  auto world = std::make_shared<World>(ranks, options.link);
  std::vector<int> all(ranks);
  std::iota(all.begin(), all.end(), 0);
  auto group = world->make_group(all);

  auto body = [&](int r) {
    std::string error;
    {
      ThreadsCommunicator comm(world, group, r);
      comm.set_timeout(options.timeout);
      try {
        fn(comm);
      } catch (const std::exception& e) {
        error = e.what();
        if (error.empty()) error = "exception without a message";
      } catch (...) {
        error = "unknown exception (not derived from std::exception)";
      }
    }
    std::lock_guard lock(world->mu);
    if (!error.empty() && world->failed_rank < 0) {
      world->failed_rank = r;
      world->failure = error;
    }
    world->finished[r] = true;
    world->cv.notify_all();
  };
  std::vector<std::thread> threads;
  threads.reserve(ranks);
  std::string refused;  // why the system would not start a thread (empty: all started)
  for (int r = 0; r < ranks && refused.empty(); ++r) {
    try {
      threads.emplace_back(body, r);
    } catch (const std::system_error& e) {
      refused = e.what();
      // The ranks that never start count as finished and failed, so every started rank's
      // pending or next communication throws instead of waiting for them.
      std::lock_guard lock(world->mu);
      for (int q = r; q < ranks; ++q) world->finished[q] = true;
      if (world->failed_rank < 0) {
        world->failed_rank = r;
        world->failure = "its thread could not be started";
      }
      world->cv.notify_all();
    }
  }
  for (auto& t : threads) t.join();
  if (!refused.empty())
    throw Error(detail::concat("run_threads: the system refused thread ", threads.size() + 1,
                               " of ", ranks, " (", refused, "); the ", threads.size(),
                               " ranks already started were stopped. Use fewer ranks, or raise "
                               "the limit on threads / memory (ulimit -u, ulimit -v)"));
  if (world->failed_rank >= 0)
    throw Error(detail::concat("rank ", world->failed_rank, " failed: ", world->failure));
}

}  // namespace ctxpar

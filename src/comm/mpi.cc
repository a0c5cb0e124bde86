// MPI transport: one rank per process, started by mpirun (OpenMPI 4.1 here).
//
// Point-to-point messages are MPI_Isend / MPI_Irecv of bytes on a duplicate of the parent
// communicator; collective traffic goes over a second duplicate, so user tags can never match
// it. The collectives themselves are the shared ones over point-to-point
// (point_to_point.cc): same algorithms, same summation order as the threads transport, so
// both give bitwise identical answers. Waits poll MPI_Test against the communicator's
// timeout; meanwhile progress calls keep pending transfers moving while the rank computes,
// made by the CPU kernel between its tiles (the default) or by a progress thread
// (mpi_progress.cc, Note [MPI progress]), and every MPI call holds mpi_mutex(). Errors:
// MPI_ERRORS_RETURN on every communicator, each code checked and turned into ctxpar::Error;
// run_mpi turns any exception into a message and MPI_Abort, so no rank waits forever for a
// dead one. See docs/comm.md.
#include <mpi.h>

#include <cerrno>
#include <cmath>
#include <climits>
#include <condition_variable>
#include <mutex>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <utility>
#include <vector>

#include "comm/mpi_env.h"
#include "comm/mpi_progress.h"
#include "comm/point_to_point.h"
#include "core/environment.h"

namespace ctxpar {
namespace comm_detail {
namespace {

using Clock = std::chrono::steady_clock;

int world_rank_now() {
  MpiLock lock(mpi_mutex());
  int initialized = 0, finalized = 0, r = -1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

bool mpi_finalized() {
  int f = 0;
  MPI_Finalized(&f);
  return f != 0;
}

std::string mpi_error_string(int code) {
  MpiLock lock(mpi_mutex());
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return detail::concat("MPI error ", code);
  return std::string(text, len);
}

void mpi_check(int code, const char* call) {
  if (code != MPI_SUCCESS)
    throw Error(
        detail::concat("rank ", world_rank_now(), ": ", call, " failed: ", mpi_error_string(code)));
}

// Polls by yielding: a large message over shared memory moves one fragment per progress
// call on each side, so sleeping between polls would cut bandwidth to fragment / sleep.
// Yielding still lets an oversubscribed rank (mpirun --oversubscribe) run. Only a wait that
// has lasted a second (a stuck peer, or a huge message) sleeps between polls.
class Backoff {
 public:
  bool spinning() const { return Clock::now() - start_ < std::chrono::seconds(1); }
  void pause() {
    if (spinning())
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }

 private:
  Clock::time_point start_ = Clock::now();
};

// Sends dropped before completion: MPI still reads their buffers, so they are kept here
// until MPI_Test says they are done (checked on every new send).
struct DetachedSend {
  MPI_Request request;
  Buffer buffer;
  Pending pending;  // pending: the progress calls (tile hook or thread) keep moving it
};
std::vector<DetachedSend>& detached_sends() {
  // Never destroyed: finalize_at_exit (an atexit handler) reads it after static destructors
  // registered later have run.
  static auto* list = new std::vector<DetachedSend>;
  return *list;
}
void reap_detached_sends() {
  MpiLock lock(mpi_mutex());
  auto& list = detached_sends();
  for (size_t i = 0; i < list.size();) {
    int done = 0;
    MPI_Test(&list[i].request, &done, MPI_STATUS_IGNORE);
    if (done) {
      list[i] = std::move(list.back());
      list.pop_back();
    } else {
      ++i;
    }
  }
}

// `stalled` runs every 10 ms while the wait lasts (it may throw).
template <typename Poll, typename Stalled>
void wait_until_done(const Where& at, const char* waiting_for, Poll&& done, Stalled&& stalled) {
  if (done()) return;
  const auto deadline = Clock::now() + at.timeout;
  auto next_check = Clock::now() + std::chrono::milliseconds(10);
  Backoff backoff;
  while (!done()) {
    const auto now = Clock::now();
    if (now >= deadline) throw_timeout(at, waiting_for);
    if (now >= next_check) {
      stalled();
      next_check = now + std::chrono::milliseconds(10);
    }
    backoff.pause();
  }
}

class MpiSendRequest final : public Request::Impl {
 public:
  MpiSendRequest(Buffer&& buf, Where at) : buf_(std::move(buf)), at_(at) {}
  ~MpiSendRequest() override {
    if (!done_ && !mpi_finalized())
      detached_sends().push_back({request_, std::move(buf_), std::move(pending_)});
  }
  MPI_Request* request() { return &request_; }
  const Buffer& buffer() const { return buf_; }
  bool test() override {
    if (done_) return true;
    int flag = 0, rc = 0;
    {
      MpiLock lock(mpi_mutex());
      rc = MPI_Test(&request_, &flag, MPI_STATUS_IGNORE);
    }
    mpi_check(rc, "MPI_Test (send)");
    done_ = flag != 0;
    if (done_) pending_.done();
    return done_;
  }
  void wait() override {
    wait_until_done(
        at_, "send to", [this] { return test(); }, [] {});
  }

 private:
  Buffer buf_;
  Where at_;
  MPI_Request request_ = MPI_REQUEST_NULL;
  bool done_ = false;
  Pending pending_;
};

class MpiRecvRequest final : public Request::Impl {
 public:
  // `world_ranks`: of the communicator's members, to name a rank in errors.
  MpiRecvRequest(size_t bytes, Where at, MPI_Comm comm, const std::vector<int>* world_ranks)
      : buf_(Buffer::uninitialized(bytes)), at_(at), comm_(comm), world_ranks_(world_ranks) {}
  ~MpiRecvRequest() override {
    if (done_ || request_ == MPI_REQUEST_NULL || mpi_finalized()) return;
    // Cancel, then wait: the cancel completes at once unless the message already matched.
    MpiLock lock(mpi_mutex());
    MPI_Cancel(&request_);
    MPI_Wait(&request_, MPI_STATUS_IGNORE);
  }
  MPI_Request* request() { return &request_; }
  Buffer& buffer() { return buf_; }
  bool test() override {
    if (done_) return true;
    int flag = 0;
    MPI_Status status;
    int rc = 0;
    {
      MpiLock lock(mpi_mutex());
      rc = MPI_Test(&request_, &flag, &status);
    }
    if (rc != MPI_SUCCESS) {
      int cls = rc;
      MPI_Error_class(rc, &cls);
      CTXPAR_CHECK(cls != MPI_ERR_TRUNCATE, "rank ", at_.me, ": recv from rank ", at_.peer, " (",
                   describe_tag(at_.ch, at_.tag), ") expected ", buf_.size(),
                   " bytes, but the message has more than ", buf_.size(), " bytes");
      mpi_check(rc, "MPI_Test (recv)");
    }
    if (!flag) return false;
    pending_.done();
    int got = 0;
    MPI_Get_count(&status, MPI_BYTE, &got);
    check_message_size(at_, buf_.size(), size_t(got));
    done_ = true;
    return true;
  }
  void wait() override {
    wait_until_done(
        at_, "recv from", [this] { return test(); },
        [this] {
          if (at_.ch == Channel::collective) check_same_collective();
        });
  }
  Buffer take() override { return std::move(buf_); }

 private:
  // A pending message of the same collective call number but another kind means a rank
  // called a different collective: what this rank waits for will never come. (Best effort:
  // a probe sees the first pending message of each source.)
  void check_same_collective() const {
    MpiLock lock(mpi_mutex());
    for (int src = 0; src < static_cast<int>(world_ranks_->size()); ++src) {
      int flag = 0;
      MPI_Status status;
      mpi_check(MPI_Iprobe(src, MPI_ANY_TAG, comm_, &flag, &status), "MPI_Iprobe");
      if (flag) comm_detail::check_same_collective(at_, status.MPI_TAG, (*world_ranks_)[src]);
    }
  }

  Buffer buf_;
  Where at_;
  MPI_Comm comm_;
  const std::vector<int>* world_ranks_;
  MPI_Request request_ = MPI_REQUEST_NULL;
  bool done_ = false;
  Pending pending_;
};

class MpiCommunicator final : public PointToPointCommunicator {
 public:
  // Takes ownership of `user` (a communicator this transport created).
  explicit MpiCommunicator(MPI_Comm user) : user_(user) {
    MpiLock lock(mpi_mutex());
    mpi_check(MPI_Comm_set_errhandler(user_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    mpi_check(MPI_Comm_dup(user_, &collective_), "MPI_Comm_dup");
    mpi_check(MPI_Comm_rank(user_, &rank_), "MPI_Comm_rank");
    mpi_check(MPI_Comm_size(user_, &size_), "MPI_Comm_size");
    // World ranks of this group's members, for error messages.
    MPI_Group mine, world;
    MPI_Comm_group(user_, &mine);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    std::vector<int> local(size_);
    for (int i = 0; i < size_; ++i) local[i] = i;
    world_ranks_.resize(size_);
    MPI_Group_translate_ranks(mine, size_, local.data(), world, world_ranks_.data());
    MPI_Group_free(&mine);
    MPI_Group_free(&world);
    void* ub = nullptr;
    int found = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &found);
    tag_ub_ = found ? *static_cast<int*>(ub) : 32767;
    // collective_tag uses 20 bits.
    CTXPAR_CHECK(tag_ub_ >= (1 << 20) - 1, "MPI: this MPI's tag upper bound (", tag_ub_,
                 ") is below 2^20 - 1, which ctxpar's collectives need");
  }
  ~MpiCommunicator() override {
    if (mpi_finalized()) return;
    MpiLock lock(mpi_mutex());
    MPI_Comm_free(&collective_);
    MPI_Comm_free(&user_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  TransportKind transport() const override { return TransportKind::mpi; }
  int world_rank() const override { return world_ranks_[rank_]; }
  int world_rank_of(int peer) const override { return world_ranks_[peer]; }

 protected:
  int max_user_tag() const override { return tag_ub_; }

  Request post_send(Buffer&& buf, int peer, int tag, Channel ch) override {
    mpi_progress().start_once();
    reap_detached_sends();
    CTXPAR_CHECK(buf.size() <= size_t(INT_MAX), "isend: messages over ", INT_MAX,
                 " bytes are not supported on MPI, got ", buf.size());
    auto req = std::make_unique<MpiSendRequest>(std::move(buf), where(peer, tag, ch));
    const Buffer& b = req->buffer();
    int rc = 0;
    {
      MpiLock lock(mpi_mutex());
      rc = MPI_Isend(b.data(), static_cast<int>(b.size()), MPI_BYTE, peer, tag, comm(ch),
                     req->request());
    }
    mpi_check(rc, "MPI_Isend");
    return Request(std::move(req));
  }

  Request post_recv(size_t bytes, int peer, int tag, Channel ch) override {
    mpi_progress().start_once();
    CTXPAR_CHECK(bytes <= size_t(INT_MAX), "irecv: messages over ", INT_MAX,
                 " bytes are not supported on MPI, got ", bytes);
    auto req =
        std::make_unique<MpiRecvRequest>(bytes, where(peer, tag, ch), comm(ch), &world_ranks_);
    Buffer& b = req->buffer();
    int rc = 0;
    {
      MpiLock lock(mpi_mutex());
      rc = MPI_Irecv(b.data(), static_cast<int>(bytes), MPI_BYTE, peer, tag, comm(ch),
                     req->request());
    }
    mpi_check(rc, "MPI_Irecv");
    return Request(std::move(req));
  }

  std::unique_ptr<Communicator> make_split(int color, int key, const std::vector<int>& members,
                                           uint32_t) override {
    MPI_Comm sub = MPI_COMM_NULL;
    // MPI orders by key, then by parent rank: the same order as `members`.
    int rc = 0;
    {
      MpiLock lock(mpi_mutex());
      rc = MPI_Comm_split(user_, color, key, &sub);
    }
    mpi_check(rc, "MPI_Comm_split");
    auto out = std::make_unique<MpiCommunicator>(sub);
    CTXPAR_ASSERT(out->size() == static_cast<int>(members.size()) && members[out->rank()] == rank_);
    return out;
  }

 private:
  MPI_Comm comm(Channel ch) const { return ch == Channel::user ? user_ : collective_; }

  MPI_Comm user_ = MPI_COMM_NULL;
  MPI_Comm collective_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, tag_ub_ = 32767;
  std::vector<int> world_ranks_;
};

MpiCommunicator* g_world = nullptr;

// MPI_Init waits for every process of the job to start MPI; one that exited without it (an
// MPMD line whose other program is not an MPI one, a crash before main) leaves it waiting
// forever, and OpenMPI 4.1 has no setting that bounds that wait (pmix_base_exchange_timeout
// does not; mpirun --timeout bounds the whole job). So MPI_Init runs under a watchdog.
double init_timeout_from_env() {
  double limit = 120;
  if (const std::optional<std::string> text = environment::mpi().init_timeout) {
    const char* env = text->c_str();
    // A bad value is refused (exit 2), not replaced by the default or waited on forever:
    // "inf", 9e9 (beyond what a timed wait can hold), "abc", 0 or a negative number.
    constexpr double kMaxInitTimeout = 7 * 24 * 3600;
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(env, &end);
    CTXPAR_CHECK(*env != '\0' && end != env && *end == '\0' && errno != ERANGE &&
                     std::isfinite(v) && v > 0 && v <= kMaxInitTimeout,
                 "CTXPAR_MPI_INIT_TIMEOUT must be the seconds MPI_Init may wait for the other "
                 "processes of the job, a number in (0, ",
                 kMaxInitTimeout,
                 "] (default 120), "
                 "got '",
                 env, "'");
    limit = v;
  }
  return limit;
}

void init_mpi_with_watchdog() {
  const double limit = init_timeout_from_env();
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::thread watchdog([&] {
    std::unique_lock lock(mu);
    if (cv.wait_for(lock, std::chrono::duration<double>(limit), [&] { return done; })) return;
    std::fprintf(stderr,
                 "ctxpar: MPI_Init has not returned after %g s: a process of this mpirun job "
                 "exited or hangs without initialising MPI (every program on the mpirun line "
                 "must be ctxpar, started with the same options); CTXPAR_MPI_INIT_TIMEOUT=s "
                 "waits longer\n",
                 limit);
    std::fflush(stderr);
    std::_Exit(1);
  });
  int provided = 0;
  // MULTIPLE: the progress calls come from other threads than the rank's (the kernel's
  // threads between tiles, or the progress thread), one call at a time with the rank's, under
  // mpi_mutex(); Note [MPI progress]. An MPI that gives less still works, with progress off.
  const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  {
    std::lock_guard lock(mu);
    done = true;
  }
  cv.notify_all();
  watchdog.join();
  if (rc != MPI_SUCCESS) throw Error("mpi_world: MPI_Init_thread failed: " + mpi_error_string(rc));
  CTXPAR_CHECK(provided >= MPI_THREAD_FUNNELED,
               "mpi_world: this MPI does not provide MPI_THREAD_FUNNELED");
}

void finalize_at_exit() {
  if (mpi_finalized()) return;
  mpi_progress().stop();  // nothing may be inside MPI when it ends
  // Sends nobody received: let MPI forget them; their buffers are deliberately leaked, as
  // MPI may still read them.
  reap_detached_sends();
  for (auto& d : detached_sends()) {
    MPI_Request_free(&d.request);
    new Buffer(std::move(d.buffer));
  }
  detached_sends().clear();
  delete g_world;
  g_world = nullptr;
  MPI_Finalize();
}

}  // namespace
}  // namespace comm_detail

Communicator& mpi_world() {
  using namespace comm_detail;
  if (g_world) return *g_world;
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    init_mpi_with_watchdog();
    std::atexit(finalize_at_exit);
  }
  MpiLock lock(mpi_mutex());  // an mpi_wrap communicator may have started progress
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm dup = MPI_COMM_NULL;
  mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &dup), "MPI_Comm_dup");
  g_world = new MpiCommunicator(dup);
  return *g_world;
}

std::unique_ptr<Communicator> mpi_wrap(const void* mpi_comm) {
  using namespace comm_detail;
  CTXPAR_CHECK(mpi_comm != nullptr, "mpi_wrap: null MPI_Comm pointer");
  int initialized = 0;
  MPI_Initialized(&initialized);
  CTXPAR_CHECK(initialized && !mpi_finalized(),
               "mpi_wrap: MPI is not initialised (or already finalised); initialise it first "
               "(e.g. `from mpi4py import MPI`)");
  MPI_Comm dup = MPI_COMM_NULL;
  MpiLock lock(mpi_mutex());
  mpi_check(MPI_Comm_dup(*static_cast<const MPI_Comm*>(mpi_comm), &dup), "MPI_Comm_dup");
  return std::make_unique<MpiCommunicator>(dup);
}

void run_mpi(const std::function<void(Communicator&)>& fn) {
  std::string error;
  try {
    fn(mpi_world());
    return;
  } catch (const std::exception& e) {
    error = e.what();
  } catch (...) {
    error = "unknown exception (not derived from std::exception)";
  }
  std::fprintf(stderr, "ctxpar: rank %d failed: %s\n", comm_detail::world_rank_now(),
               error.c_str());
  std::fflush(stderr);
  abort_mpi_job(1);
  std::exit(1);
}

void check_mpi_environment() {
  comm_detail::init_timeout_from_env();
  comm_detail::progress_settings_from_env();
}

void abort_mpi_job(int code) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized && !comm_detail::mpi_finalized()) MPI_Abort(MPI_COMM_WORLD, code);
}

}  // namespace ctxpar

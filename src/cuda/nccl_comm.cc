// The `nccl` transport (nccl_comm.h; docs/cuda.md, "Transports"): host work delegated to the
// host communicator, device memory by ncclSend / ncclRecv in groups, a watchdog per
// communicator. Every NCCL call goes through the NcclApi table.
#include "cuda/nccl_comm.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>

namespace ctxpar::cuda {

using Clock = std::chrono::steady_clock;

namespace {

std::chrono::milliseconds resolved_timeout(const NcclOptions& o, const Communicator& host) {
  return o.timeout.count() >= 0 ? o.timeout : host.timeout();
}

double seconds(std::chrono::milliseconds t) { return t.count() / 1000.0; }

}  // namespace

NcclCommunicator::NcclCommunicator(Communicator& host, std::shared_ptr<const NcclApi> api,
                                   const NcclOptions& options)
    : HostDelegatingComm(host), api_(std::move(api)), options_(options) {
  CTXPAR_CHECK(api_ != nullptr, "nccl transport: no NCCL functions (load_nccl())");
  set_timeout(resolved_timeout(options_, host));
  init();
}

NcclCommunicator::NcclCommunicator(std::unique_ptr<Communicator> host,
                                   std::shared_ptr<const NcclApi> api, const NcclOptions& options)
    : HostDelegatingComm(std::move(host)), api_(std::move(api)), options_(options) {
  CTXPAR_CHECK(api_ != nullptr, "nccl transport: no NCCL functions (load_nccl())");
  set_timeout(resolved_timeout(options_, host_comm()));
  init();
}

// Rank 0 makes the unique id; every rank learns it (and whether rank 0 could make it) through
// the host communicator, then joins the NCCL communicator, non-blocking.
void NcclCommunicator::init() {
  if (options_.cuda_device >= 0) api_->set_device(options_.cuda_device);
  struct Offer {
    int32_t ok = 0;
    char text[124] = {};  // why not, when !ok
    ncclUniqueId id{};
  };
  Offer mine;
  if (rank() == 0) {
    const ncclResult_t r = api_->get_unique_id(&mine.id);
    mine.ok = r == ncclSuccess;
    if (!mine.ok)
      std::snprintf(mine.text, sizeof mine.text, "ncclGetUniqueId failed: %s",
                    api_->get_error_string(r));
  }
  std::vector<Offer> all(size());
  host_comm().set_timeout(timeout());
  host_comm().allgather(&mine, all.data(), sizeof(Offer));
  CTXPAR_CHECK(all[0].ok, "rank ", rank(),
               ": nccl transport: rank 0 could not make the NCCL "
               "unique id (",
               std::string(all[0].text), "); check NCCL_DEBUG=INFO on rank 0");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns; the watchdog can abort
  const ncclResult_t r = api_->comm_init_rank_config(&comm_, size(), all[0].id, rank(), &config);
  nccl_check(r, "ncclCommInitRankConfig", {});
  settle({}, "ncclCommInitRankConfig");
  watchdog_ = std::thread([this] { watchdog(); });
}

NcclCommunicator::~NcclCommunicator() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  for (Pending& p : pending_)
    for (void* m : p.marks) api_->mark_free(m);
  if (!comm_ || aborted_) return;
  // Finalize flushes what is left; a peer that never finishes would hold it: abort instead.
  bool clean = pending_.empty();
  if (clean) {
    const ncclResult_t r = api_->comm_finalize(comm_);
    clean = r == ncclSuccess || r == ncclInProgress;
  }
  const Clock::time_point deadline = Clock::now() + timeout();
  ncclResult_t state = ncclInProgress;
  while (clean) {
    if (api_->comm_get_async_error(comm_, &state) != ncclSuccess) state = ncclSystemError;
    if (state != ncclInProgress || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(options_.poll);
  }
  if (clean && state == ncclSuccess)
    api_->comm_destroy(comm_);
  else
    api_->comm_abort(comm_);
}

// ---- host memory: the host communicator's -------------------------------------------------

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key) {
  std::unique_ptr<Communicator> sub;
  delegate([&](Communicator& h) { sub = h.split(color, key); });
  if (!sub) return nullptr;
  NcclOptions o = options_;
  o.timeout = timeout();
  o.cuda_device = -1;  // already selected
  return std::make_unique<NcclCommunicator>(std::move(sub), api_, o);
}

// ---- device memory ----------------------------------------------------------------------

void NcclCommunicator::check_peer(int peer, int tag, const char* what) const {
  CTXPAR_CHECK(peer >= 0 && peer < size(), "rank ", rank(), ": nccl transport: ", what, " rank ",
               peer, " (tag ", tag, ") is not a rank of this communicator (0..", size() - 1, ")");
}

void NcclCommunicator::send(const void* data, size_t bytes, int peer, int tag,
                            cudaStream_t stream) {
  check();
  check_peer(peer, tag, "send to");
  count(CommKind::send, bytes, 0);
  enqueue(Op{true, peer, tag, bytes}, stream,
          [&] { return api_->send(data, bytes, ncclUint8, peer, comm_, stream); });
}

void NcclCommunicator::recv(void* data, size_t bytes, int peer, int tag, cudaStream_t stream) {
  check();
  check_peer(peer, tag, "recv from");
  count(CommKind::recv, 0, bytes);
  enqueue(Op{false, peer, tag, bytes}, stream,
          [&] { return api_->recv(data, bytes, ncclUint8, peer, comm_, stream); });
}

void NcclCommunicator::enqueue(const Op& op, cudaStream_t stream,
                               const std::function<ncclResult_t()>& call) {
  const bool alone = group_depth_ == 0;  // a group of one
  if (alone) group_start();
  try {
    nccl_check(locked(call), op.is_send ? "ncclSend" : "ncclRecv", {op});
  } catch (const Error&) {
    if (alone) {  // close the group: NCCL's group state is per thread, other communicators share it
      group_depth_ = 0;
      api_->group_end();
    }
    throw;
  }
  group_ops_.push_back(op);
  if (std::find(group_streams_.begin(), group_streams_.end(), stream) == group_streams_.end())
    group_streams_.push_back(stream);
  if (alone) group_end();
}

void NcclCommunicator::group_start() {
  check();
  if (group_depth_++ == 0) {
    group_ops_.clear();
    group_streams_.clear();
    nccl_check(locked(api_->group_start), "ncclGroupStart", {});
  }
}

void NcclCommunicator::group_end() {
  CTXPAR_CHECK(group_depth_ > 0, "rank ", rank(),
               ": nccl transport: group_end() without a group_start()");
  if (--group_depth_ == 0) flush_group();
}

void NcclCommunicator::flush_group() {
  std::vector<Op> ops = std::move(group_ops_);
  std::vector<cudaStream_t> streams = std::move(group_streams_);
  group_ops_.clear();
  group_streams_.clear();
  nccl_check(locked(api_->group_end), "ncclGroupEnd", ops);
  if (ops.empty()) return;
  Pending p;
  p.ops = std::move(ops);
  for (cudaStream_t s : streams) p.marks.push_back(api_->mark(s));
  p.start = Clock::now();
  p.timeout = timeout();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_.empty()) {  // the watchdog aborted meanwhile
      for (void* m : p.marks) api_->mark_free(m);
      throw_if_failed_locked();
    }
    pending_.push_back(std::move(p));
  }
  cv_.notify_all();
}

// NCCL calls of the calling thread hold mutex_, so that the watchdog's ncclCommAbort never
// runs in the middle of one, and no call reaches an aborted communicator.
ncclResult_t NcclCommunicator::locked(const std::function<ncclResult_t()>& call) {
  std::lock_guard<std::mutex> lock(mutex_);
  throw_if_failed_locked();
  return call();
}

void NcclCommunicator::nccl_check(ncclResult_t r, const char* call, const std::vector<Op>& ops) {
  if (r == ncclSuccess) return;
  if (r == ncclInProgress) {  // non-blocking: done when the communicator leaves ncclInProgress
    settle(ops, call);
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  fail_locked(detail::concat(call, " failed: ", api_->get_error_string(r)), ops);
  throw_if_failed_locked();
}

void NcclCommunicator::settle(const std::vector<Op>& ops, const char* during) {
  const Clock::time_point deadline = Clock::now() + timeout();
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = comm_ ? api_->comm_get_async_error(comm_, &state) : ncclSuccess;
    if (r != ncclSuccess) state = r;
    if (state == ncclSuccess) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (state != ncclInProgress)
        fail_locked(detail::concat("asynchronous NCCL error in ", during, ": ",
                                   api_->get_error_string(state)),
                    ops);
      else if (Clock::now() >= deadline)
        fail_locked(detail::concat("timed out after ", seconds(timeout()), " s in ", during,
                                   " (--timeout)"),
                    ops);
      throw_if_failed_locked();
    }
    std::this_thread::sleep_for(options_.poll);
  }
}

std::string NcclCommunicator::describe(const std::vector<Op>& ops) const {
  std::string s;
  for (const Op& op : ops)
    s += detail::concat(s.empty() ? "" : ", ", op.is_send ? "send to rank " : "recv from rank ",
                        op.peer, " (tag ", op.tag, ", ", bytes_text(double(op.bytes)), ")");
  return s;
}

void NcclCommunicator::fail_locked(const std::string& why, const std::vector<Op>& ops) {
  if (!error_.empty()) return;
  std::string last;
  if (comm_ && api_->get_last_error) {
    const char* t = api_->get_last_error(comm_);
    if (t && *t) last = detail::concat(" (NCCL: ", t, ")");
  }
  error_ = detail::concat("rank ", rank(), ": nccl transport: ", why, last,
                          ops.empty() ? "" : ": " + describe(ops),
                          comm_ ? "; the NCCL communicator was aborted (ncclCommAbort)" : "");
  if (comm_ && !aborted_) api_->comm_abort(comm_);
  aborted_ = true;
  for (Pending& p : pending_)
    for (void* m : p.marks) api_->mark_free(m);
  pending_.clear();
  cv_.notify_all();
}

void NcclCommunicator::throw_if_failed_locked() const {
  if (!error_.empty()) throw Error(error_);
}

void NcclCommunicator::check() {
  std::lock_guard<std::mutex> lock(mutex_);
  throw_if_failed_locked();
}

void NcclCommunicator::wait_all() {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return pending_.empty() || !error_.empty(); });
  throw_if_failed_locked();
}

size_t NcclCommunicator::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pending_.size();
}

// Pops the groups whose marks are done (in order: a stream runs them in order); for the oldest
// one left, an asynchronous error or its time running out aborts. A group's clock starts when
// it reaches the front, so that the transfers queued behind it are not charged for its time.
void NcclCommunicator::watchdog() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    if (pending_.empty() || !error_.empty()) {
      cv_.wait(lock, [&] { return stop_ || (!pending_.empty() && error_.empty()); });
      continue;
    }
    bool popped = false;
    while (!pending_.empty()) {
      Pending& p = pending_.front();
      int state = 1;
      for (void* m : p.marks) state = std::min(state, api_->mark_done(m));
      if (state < 0) {
        fail_locked("the stream of a transfer failed (cudaEventQuery)", p.ops);
        break;
      }
      if (state == 0) break;
      for (void* m : p.marks) api_->mark_free(m);
      pending_.pop_front();
      popped = true;
      if (!pending_.empty())
        pending_.front().start = std::max(pending_.front().start, Clock::now());
    }
    if (popped) cv_.notify_all();
    if (pending_.empty() || !error_.empty()) continue;
    const Pending& front = pending_.front();
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = api_->comm_get_async_error(comm_, &state);
    if (r != ncclSuccess) state = r;
    if (state != ncclSuccess && state != ncclInProgress)
      fail_locked(detail::concat("asynchronous NCCL error: ", api_->get_error_string(state)),
                  front.ops);
    else if (Clock::now() - front.start >= front.timeout)
      fail_locked(detail::concat("timed out after ", seconds(front.timeout),
                                 " s: a peer died, hangs, or posted no matching transfer "
                                 "(--timeout)"),
                  front.ops);
    else
      cv_.wait_for(lock, options_.poll);
  }
}

}  // namespace ctxpar::cuda

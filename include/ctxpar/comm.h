// Communicators: P ranks that exchange messages. One interface, one file per transport
// (src/comm/threads.cc, mpi.cc, gloo.cc; the cuda device's nccl and loopback in src/cuda), and
// one way to start a job's ranks on any of them (launch, ctxpar/launch.h). See docs/comm.md.
//
// Point-to-point messages are owned byte buffers that move: on the threads transport a send
// hands the buffer itself to the receiver (no copy); on MPI it is the send buffer. Collectives
// take raw buffers. Every call is counted (bytes and calls per kind) so tests can assert the
// communication volume of each strategy.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ctxpar/error.h"

namespace ctxpar {

// A movable, 64-byte-aligned byte buffer: the unit of point-to-point transfer. Its memory is
// reference-counted: share() makes a second handle to the same bytes, and the memory is freed
// when the last handle goes (a sender that lends its buffer keeps one, so that a receiver
// unwinding from a failure cannot free it while the sender still reads it).
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t bytes);  // zero-filled
  // Like Buffer(bytes), but the contents are left undefined: for a buffer about to be filled.
  static Buffer uninitialized(size_t bytes);
  // A moved-from Buffer is empty (size 0, no data).
  Buffer(Buffer&& other) noexcept
      : data_(std::move(other.data_)), size_(std::exchange(other.size_, 0)) {}
  Buffer& operator=(Buffer&& other) noexcept {
    data_ = std::move(other.data_);
    size_ = std::exchange(other.size_, 0);
    return *this;
  }
  size_t size() const { return size_; }
  std::byte* data() const { return data_.get(); }
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(data_.get());
  }
  bool empty() const { return size_ == 0; }
  // Another handle to the same memory (no copy); writes through one are seen through the other.
  Buffer share() const {
    Buffer b;
    b.data_ = data_;
    b.size_ = size_;
    return b;
  }

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  std::shared_ptr<std::byte> data_;
  size_t size_ = 0;
};

enum class CommKind { send, recv, allgather, reduce_scatter, alltoall, allreduce, barrier, count_ };
const char* comm_kind_name(CommKind k);

struct CommCounters {
  uint64_t bytes_sent = 0;      // payload bytes this rank sent, all kinds together
  uint64_t bytes_received = 0;  // payload bytes this rank received
  uint64_t calls[static_cast<int>(CommKind::count_)] = {};
  uint64_t bytes_sent_by[static_cast<int>(CommKind::count_)] = {};
  uint64_t calls_of(CommKind k) const { return calls[static_cast<int>(k)]; }
  uint64_t sent_by(CommKind k) const { return bytes_sent_by[static_cast<int>(k)]; }
};

class Communicator;

// The transports (--transport, Communicator::transport()). threads, mpi and gloo carry a whole
// job (launch); nccl and loopback move the cuda device's memory, over one of those for the
// rest (src/cuda/nccl_comm.h: the launcher's mpi or gloo; src/cuda/loopback.h: threads).
enum class TransportKind { threads, mpi, gloo, nccl, loopback };

// What a transport is and needs: one row per transport (transport_traits), the one place a
// command or the Python package asks it, instead of comparing names.
struct TransportTraits {
  const char* name;           // "threads", "mpi", ...: --transport's word for it
  bool one_rank_per_process;  // each process is one rank (else P ranks are threads of one)
  bool needs_launcher;        // its processes are started by mpirun or torchrun
  bool needs_gpu;             // it moves device memory: --device cuda, on a GPU
};
const TransportTraits& transport_traits(TransportKind kind);
inline const char* transport_name(TransportKind kind) { return transport_traits(kind).name; }
TransportKind parse_transport(const std::string& name);  // throws listing the valid names

// A pending send or receive. wait() blocks until done (or the communicator's timeout passes:
// then it throws ctxpar::Error naming rank, peer and tag). A receive's buffer is taken with
// take() after wait().
//
// Note [A failed request fails at once after]: once test(), wait() or take() has thrown
// (timeout, group failure, wrong size), every later call rethrows that error at once. A call
// that throws still waits for its queued transfers as it unwinds (the devices' synchronize),
// and that wait met the same lost message again: a lost message took twice the timeout to
// report (2 s for 1 s; 240 s for the default 120 s). A timeout is final, on every transport.
class Request {
  // Defined before its uses: a deduced return type must be seen first.
  template <typename F>
  auto remembering_failure(F&& f) {
    if (failed_) std::rethrow_exception(failed_);
    try {
      return f();
    } catch (...) {
      failed_ = std::current_exception();
      throw;
    }
  }

 public:
  struct Impl {
    virtual ~Impl() = default;
    virtual bool test() = 0;  // true when complete (never blocks)
    virtual void wait() = 0;  // blocks; throws on timeout / group failure
    virtual Buffer take() { return {}; }
  };
  Request() = default;
  explicit Request(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
  bool valid() const { return impl_ != nullptr; }
  bool test() {
    return !impl_ || remembering_failure([&] { return impl_->test(); });
  }
  void wait() {
    if (impl_) remembering_failure([&] { impl_->wait(); });
  }
  // An empty Buffer for an empty Request (or one already taken).
  Buffer take() {
    if (!impl_) return {};
    wait();
    Buffer b = remembering_failure([&] { return impl_->take(); });
    impl_.reset();
    return b;
  }

 private:
  std::unique_ptr<Impl> impl_;
  std::exception_ptr failed_;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual TransportKind transport() const = 0;
  // True when isend hands the Buffer's memory itself to the receiver (threads transport): a
  // sender that goes on reading it must keep a handle of its own (Buffer::share()).
  virtual bool shares_send_buffers() const { return false; }

  // Non-blocking point-to-point. `tag` should identify the step so a timeout can name it.
  // recv must be told the exact byte count it expects (a mismatch is an error).
  virtual Request isend(Buffer&& buf, int peer, int tag) = 0;
  virtual Request irecv(size_t bytes, int peer, int tag) = 0;

  // Collectives (blocking, every rank of this communicator must call them in the same order).
  // Sums add the ranks' contributions in rank order 0..P-1 (deterministic, and bitwise equal
  // on every transport). Counted per rank (P = size(), r = rank(); docs/comm.md):
  //   kind            bytes_sent                           bytes_received
  //   allgather       (P-1) * bytes                        (P-1) * bytes
  //   reduce_scatter  (P-1) * count * 4                    (P-1) * count * 4
  //   alltoall        (P-1) * bytes                        (P-1) * bytes
  //   allreduce       (2n - len(r) - len(r+1 mod P)) * s   (n + (P-2) * len(r)) * s
  //                   with s = sizeof(T), len(j) = floor((j+1)n/P) - floor(jn/P);
  //                   2 (P-1) n/P * s both ways when P divides n; 0 when P = 1
  //   barrier         0                                    0
  //   send / recv     the Buffer's size (isend)            `bytes` (irecv)
  // Each call adds 1 to calls[kind]; split is not counted.
  //
  // allgather: send `bytes` from each rank; recv holds size()*bytes in rank order.
  virtual void allgather(const void* send, void* recv, size_t bytes) = 0;
  // reduce_scatter (sum, fp32): send holds size()*count floats; rank r receives the sum of
  // every rank's r-th chunk of `count` floats.
  virtual void reduce_scatter(const float* send, float* recv, size_t count) = 0;
  // alltoall: send holds size() chunks of `bytes`; chunk j goes to rank j; recv chunk i came
  // from rank i.
  virtual void alltoall(const void* send, void* recv, size_t bytes) = 0;
  // allreduce (sum) in place.
  virtual void allreduce(float* buf, size_t count) = 0;
  virtual void allreduce(double* buf, size_t count) = 0;
  virtual void barrier() = 0;

  // Sub-groups: ranks with the same color (>= 0) form a new communicator, ordered by key (ties:
  // parent rank order). It inherits the timeout; its counters start at zero.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  const CommCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }
  // How long one wait may block (a request keeps the timeout set when it was posted).
  // A Communicator and its requests are used by one thread at a time.
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }
  std::chrono::milliseconds timeout() const { return timeout_; }

 protected:
  void count(CommKind k, uint64_t sent, uint64_t received) {
    counters_.calls[static_cast<int>(k)] += 1;
    counters_.bytes_sent_by[static_cast<int>(k)] += sent;
    counters_.bytes_sent += sent;
    counters_.bytes_received += received;
  }
  CommCounters counters_;
  std::chrono::milliseconds timeout_{std::chrono::seconds(120)};
};

// ---- threads transport ------------------------------------------------------------------

// Optional simulated link on the threads transport: each message is delivered
// latency + bytes / bandwidth after it is sent, and a rank's outgoing link carries one message
// at a time (so back-to-back sends queue), as on a real wire.
struct SimulatedLink {
  double gbytes_per_second = 0;  // 0: no link model (instant hand-over)
  double latency_us = 0;
};

struct ThreadsOptions {
  SimulatedLink link;
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
};

// The most ranks run_threads takes. Every rank is a thread of this one process, and what a
// rank holds about all others adds up to P x P in one address space (each strategy call
// agrees on its arguments by an allgather of a small verdict, agreement.h: at thousands of ranks
// a verdict of a few hundred bytes takes gigabytes, and a ring's P steps wake all P threads
// per message). Beyond it, use MPI.
constexpr int kMaxThreadsRanks = 1024;

// Runs fn(comm) on P threads, one rank each, and returns when all have returned. If any rank
// throws, every other rank's pending or next communication fails promptly (no deadlock), and
// run_threads rethrows a ctxpar::Error naming the first failing rank and its message. If the
// system refuses a thread, the ranks already started are stopped the same way and the Error
// says how many started. A simulated link message that could not arrive within the timeout
// fails its send with an Error naming the link (it is never silently delivered at once).
void run_threads(int ranks, const std::function<void(Communicator&)>& fn,
                 const ThreadsOptions& options = {});

// ---- MPI transport ------------------------------------------------------------------------

// True when this process was started by mpirun / mpiexec (reads the launcher's environment).
bool launched_by_mpi();
// A launcher that started several copies of this program without MPI (torchrun: RANK /
// WORLD_SIZE; srun without an MPI plugin: SLURM_PROCID / SLURM_STEP_NUM_TASKS): each copy
// would run the whole job alone. `ranks` is 0 when there is none (or MPI started us).
struct ForeignLauncher {
  std::string name;  // "torchrun (WORLD_SIZE=4)", "srun (SLURM_STEP_NUM_TASKS=4)"
  int ranks = 0;
};
ForeignLauncher foreign_launcher();
// Initialises MPI (MPI_Init_thread, MPI_THREAD_MULTIPLE asked for) once and returns the world
// communicator; finalised at exit. Throws if ctxpar was built without MPI. MPI_Init waits for
// every process of the job; if it has not returned after CTXPAR_MPI_INIT_TIMEOUT seconds
// (default 120) — a process of the mpirun line exited or hangs without initialising MPI —
// the process prints why and exits 1, which ends the job. Pending transfers move while the
// rank computes: the CPU kernel drives MPI between tiles (the default), or with
// CTXPAR_MPI_PROGRESS=thread a progress thread (docs/comm.md, "Progress"; =off turns both off). The communicator is
// still used by one thread.
Communicator& mpi_world();
// Wraps a communicator MPI was already initialised with (mpi4py's MPI.COMM_WORLD, ...):
// `mpi_comm` points to an MPI_Comm handle (mpi4py: MPI._addressof(comm)). The handle is
// duplicated, so the caller's communicator sees none of ctxpar's traffic. Throws if MPI is not
// initialised, or if ctxpar was built without MPI.
std::unique_ptr<Communicator> mpi_wrap(const void* mpi_comm);
// Runs fn on this process's rank of MPI_COMM_WORLD; an exception prints
// "ctxpar: rank R failed: ..." to stderr and aborts the whole job (MPI_Abort), so no rank
// waits forever.
void run_mpi(const std::function<void(Communicator&)>& fn);
// When MPI is initialised (and not finalised): ends every process of the job at once with
// exit status `code` (MPI_Abort), so that no other rank waits for this one. Otherwise returns.
void abort_mpi_job(int code);

}  // namespace ctxpar

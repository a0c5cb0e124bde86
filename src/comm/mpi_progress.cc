// Note [MPI progress]
// ~~~~~~~~~~~~~~~~~~
// Ring attention posts the next K/V transfer and then computes for as long as the transfer
// should take. Over Open MPI (ob1, TCP or shared memory) a message larger than the eager limit
// is a rendezvous: the receiver must see the header and answer, and the sender then writes a
// few 128 KB fragments at a time, each next batch only when a progress call notices the last
// one has left. Progress calls happen inside MPI_Test / MPI_Wait / MPI_Iprobe, which a rank
// computing a block does not make, so without help the whole transfer waits for the wait
// after the compute (measured: docs/comm.md, "Progress").
//
// Two ways out, both built (CTXPAR_MPI_PROGRESS picks; docs/comm.md, "Progress"):
//
//   rank's thread                                progress thread (mode thread, while
//   ─────────────                                requests pend)
//   isend / irecv  ─ lock, MPI_Isend/Irecv ─┐     every `interval`:
//   compute (no MPI)                        │       lock, MPI_Iprobe(private comm), unlock
//   wait: lock, MPI_Test, unlock, yield ... ┘       (drives the whole progress engine)
//
//   mode tiles: no thread; the CPU kernel calls tile_progress() (ctxpar/tile_progress.h) after
//   each (query tile x key tile) unit, and while requests pend that hook does the same probe,
//   at most once per `interval` over all kernel threads (steady_clock), under try_lock only.
//
// * The thread serves every strategy, collective and device alike, whatever computes; it
//   costs a core's share (a wake-up per interval) and a context switch onto the rank's core.
//   The tile hook costs no thread, but progresses only while the CPU kernel runs (not while a
//   rank packs, merges, sleeps or runs the model's matmuls), and its calls are spaced by tile
//   times (tens of us at D = 64..128) as well as the interval. Both ends of a transfer need
//   progress calls (the receiver answers the rendezvous and drains the fragments): with tiles,
//   a receiver that does not run the kernel moves the transfer only in its own tests and
//   waits. `both` runs the two. Measured with the ranks' compute filling the cores, the
//   thread's wake-ups cost the ranks' kernels many times what the tile hook costs, and both hid
//   a shaped TCP link's transfers equally: tiles is the default (the figures: docs/comm.md,
//   "Progress").
// * Neither ever tests the rank's requests: completing one there would take the status the
//   receive needs for its size check. They probe a private duplicate of MPI_COMM_SELF on
//   which nothing is ever sent, so the probe never matches; its only effect is the progress
//   call every MPI implementation makes inside an unmatched probe.
// * All MPI calls of the transport hold one lock, so the thread, the kernel's threads and the
//   rank never enter MPI together. Both need MPI_THREAD_MULTIPLE: MPI_Abort, or a program's
//   own MPI calls, do not take the lock. A poke holds it for microseconds; the rank's thread
//   holds it only inside its own short, non-blocking calls (and inside the blocking
//   collectives of split / construction, where MPI progresses itself). A kernel thread only
//   try_locks: when MPI is busy it skips the poke rather than stall the compute.
// * The interval (100 us): ob1 keeps ~3 fragments of 128 KB in flight, so a poke every 100 us
//   sustains several GB/s, while the thread costs ~1 % of a core. With nothing pending the
//   thread sleeps on a condition variable and the tile hook is not installed (a kernel tile
//   then pays one relaxed atomic load).
#include "comm/mpi_progress.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "core/environment.h"
#include "ctxpar/error.h"
#include "ctxpar/tile_progress.h"

namespace ctxpar::comm_detail {

std::recursive_mutex& mpi_mutex() {
  static auto* m = new std::recursive_mutex;  // never destroyed: used by the exit handler
  return *m;
}

MpiProgress& mpi_progress() {
  static auto* t = new MpiProgress;
  return *t;
}

ProgressSettings progress_settings_from_env() {
  ProgressSettings s;
  const environment::Mpi env = environment::mpi();
  if (env.progress && !env.progress->empty()) {
    const std::string& m = *env.progress;
    CTXPAR_CHECK(m == "thread" || m == "tiles" || m == "both" || m == "off",
                 "CTXPAR_MPI_PROGRESS must be 'thread' (a progress thread moves MPI transfers "
                 "while the rank computes), 'tiles' (the CPU kernel makes the progress calls "
                 "between tiles; the default), 'both' or 'off', got '",
                 m, "'");
    s.thread = m == "thread" || m == "both";
    s.tiles = m == "tiles" || m == "both";
  }
  if (env.progress_us) {
    const char* us = env.progress_us->c_str();
    char* end = nullptr;
    const long v = std::strtol(us, &end, 10);
    CTXPAR_CHECK(end != us && *end == '\0' && v >= 1 && v <= 100000,
                 "CTXPAR_MPI_PROGRESS_US must be the progress calls' interval in microseconds "
                 "(the thread's poll, the tile hook's least spacing), 1..100000 (default 100), "
                 "got '",
                 us, "'");
    s.interval = std::chrono::microseconds(v);
  }
  return s;
}

namespace {
void tile_hook() { mpi_progress().poke_from_tile(); }

std::string mode_name(const ProgressSettings& s) {
  return s.thread && s.tiles ? "thread and tiles" : s.thread ? "thread" : "tiles";
}
}  // namespace

void MpiProgress::start_once() {
  std::lock_guard<std::mutex> lock(m_);
  if (started_) return;
  started_ = true;
  settings_ = progress_settings_from_env();
  if (!settings_.thread && !settings_.tiles) {
    description_ = "off (CTXPAR_MPI_PROGRESS=off)";
    return;
  }
  MpiLock mpi(mpi_mutex());
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  // MULTIPLE, not just SERIALIZED: a program that initialised MPI itself may make its own MPI
  // calls, which do not take mpi_mutex().
  if (provided < MPI_THREAD_MULTIPLE) {
    description_ = "off (MPI was initialised without MPI_THREAD_MULTIPLE)";
    return;
  }
  if (MPI_Comm_dup(MPI_COMM_SELF, &probe_comm_) != MPI_SUCCESS) {
    description_ = "off (MPI_Comm_dup of MPI_COMM_SELF failed)";
    return;
  }
  // MPI_Finalize deletes MPI_COMM_SELF's attributes first, with MPI still whole: the hook that
  // stops the thread (and removes the tile hook) when the program finalises MPI itself
  // (mpi_wrap: mpi4py at exit), not finalize_at_exit.
  int keyval = MPI_KEYVAL_INVALID;
  if (MPI_Comm_create_keyval(
          MPI_COMM_NULL_COPY_FN,
          [](MPI_Comm, int, void*, void*) {
            mpi_progress().stop();
            return MPI_SUCCESS;
          },
          &keyval, nullptr) != MPI_SUCCESS ||
      MPI_Comm_set_attr(MPI_COMM_SELF, keyval, nullptr) != MPI_SUCCESS) {
    description_ = "off (no MPI_Finalize hook on MPI_COMM_SELF)";
    return;
  }
  const std::string every = settings_.thread ? ", every " : ", at most every ";
  description_ = mode_name(settings_) + every + std::to_string(settings_.interval.count()) + " us";
  if (settings_.tiles) {
    interval_ticks_.store(
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(settings_.interval).count(),
        std::memory_order_relaxed);
    tiles_ = true;
    if (pending_ > 0) set_tile_progress_hook(&tile_hook);
  }
  if (settings_.thread) thread_ = std::thread([this] { loop(); });
}

void MpiProgress::stop() {
  {
    std::lock_guard<std::mutex> lock(m_);
    stopping_ = true;
    started_ = true;  // no start after a stop (MPI is about to end)
    if (tiles_) set_tile_progress_hook(nullptr);
    tiles_ = false;
  }
  stopped_.store(true, std::memory_order_relaxed);
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // A kernel thread that read the hook just before it was removed may still poke once: it
  // sees stopped_, or MPI_Finalized under the lock. probe_comm_ is left to MPI_Finalize /
  // MPI_Abort: freeing it here could race neither, but it is not worth a call on the exit path.
}

void MpiProgress::add_pending() {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(m_);
    wake = pending_++ == 0;
    if (wake && tiles_) set_tile_progress_hook(&tile_hook);
  }
  if (wake) cv_.notify_one();
}

void MpiProgress::remove_pending() {
  std::lock_guard<std::mutex> lock(m_);
  if (--pending_ == 0 && tiles_) set_tile_progress_hook(nullptr);
}

bool MpiProgress::probe_locked() {
  // Should MPI end without the finalize hook having run (it always runs, per the standard), no
  // MPI call is allowed after it: MPI_Finalized is, at any time.
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return false;
  int flag = 0;
  MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, probe_comm_, &flag, MPI_STATUS_IGNORE);
  return true;
}

void MpiProgress::poke_from_tile() {
  // Called after every tile of every kernel thread: everything before the try_lock is a clock
  // read and two relaxed loads, and a busy lock means the rank (or the thread, in `both`) is
  // inside MPI already, which progresses it.
  const int64_t now = std::chrono::steady_clock::now().time_since_epoch().count();
  const int64_t interval = interval_ticks_.load(std::memory_order_relaxed);
  if (now - last_tile_poke_.load(std::memory_order_relaxed) < interval) return;
  std::unique_lock<std::recursive_mutex> mpi(mpi_mutex(), std::try_to_lock);
  if (!mpi.owns_lock() || stopped_.load(std::memory_order_relaxed)) return;
  // Another kernel thread may have poked between the check and the lock.
  if (now - last_tile_poke_.load(std::memory_order_relaxed) < interval) return;
  last_tile_poke_.store(now, std::memory_order_relaxed);
  probe_locked();
}

void MpiProgress::loop() {
  std::unique_lock<std::mutex> lock(m_);
  for (;;) {
    cv_.wait(lock, [this] { return stopping_ || pending_ > 0; });
    if (stopping_) return;
    lock.unlock();
    {
      MpiLock mpi(mpi_mutex());
      if (!probe_locked()) return;
    }
    std::this_thread::sleep_for(settings_.interval);
    lock.lock();
  }
}

}  // namespace ctxpar::comm_detail

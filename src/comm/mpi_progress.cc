// Note [MPI progress]
// ~~~~~~~~~~~~~~~~~~
// Ring attention posts the next K/V transfer and then computes for as long as the transfer
// should take. Over Open MPI (ob1, TCP or shared memory) a message larger than the eager limit
// is a rendezvous: the receiver must see the header and answer, and the sender then writes a
// few 128 KB fragments at a time, each next batch only when a progress call notices the last
// one has left. Progress calls happen inside MPI_Test / MPI_Wait / MPI_Iprobe, which a rank
// computing a block does not make, so without help the whole transfer waits for the wait
// after the compute (issue 15: 1.3-1.6 s exposed of a 1.34 s transfer, over a 400 Mbit/s link).
//
// Two ways out: progress calls between kernel tiles, or a thread that makes them. Calls
// between tiles need every strategy and kernel to know about MPI, and their spacing is set by
// tile sizes, not by what the link needs; the thread needs neither and serves every strategy
// and collective alike. So:
//
//   rank's thread                                progress thread (while requests pend)
//   ─────────────                                ──────────────────────────────────────
//   isend / irecv  ─ lock, MPI_Isend/Irecv ─┐     every `interval`:
//   compute (no MPI)                        │       lock, MPI_Iprobe(private comm), unlock
//   wait: lock, MPI_Test, unlock, yield ... ┘       (drives the whole progress engine)
//
// * The thread never tests the rank's requests: completing one there would take the status
//   the receive needs for its size check. It probes a private duplicate of MPI_COMM_SELF on
//   which nothing is ever sent, so the probe never matches; its only effect is the progress
//   call every MPI implementation makes inside an unmatched probe.
// * All MPI calls of the transport hold one lock, so the thread and the rank never enter MPI
//   together. The thread still needs MPI_THREAD_MULTIPLE: MPI_Abort, or a program's own MPI
//   calls, do not take the lock. A poke holds it for microseconds; the rank's thread holds it
//   only inside its own short, non-blocking calls (and inside the blocking collectives of
//   split / construction, where MPI progresses itself).
// * It sleeps `interval` (100 us) between pokes: ob1 keeps ~3 fragments of 128 KB in flight,
//   so a poke every 100 us sustains several GB/s, while the thread costs ~1 % of a core. With
//   nothing pending it sleeps on a condition variable and costs nothing.
#include "comm/mpi_progress.h"

#include <cstdlib>
#include <cstring>

#include "ctxpar/error.h"

namespace ctxpar::comm_detail {

std::recursive_mutex& mpi_mutex() {
  static auto* m = new std::recursive_mutex;  // never destroyed: used by the exit handler
  return *m;
}

ProgressThread& progress_thread() {
  static auto* t = new ProgressThread;
  return *t;
}

ProgressSettings progress_settings_from_env() {
  ProgressSettings s;
  if (const char* mode = std::getenv("CTXPAR_MPI_PROGRESS")) {
    if (std::strcmp(mode, "off") == 0)
      s.enabled = false;
    else
      CTXPAR_CHECK(std::strcmp(mode, "thread") == 0 || mode[0] == '\0',
                   "CTXPAR_MPI_PROGRESS must be 'thread' (a progress thread moves MPI transfers "
                   "while the rank computes; the default) or 'off', got '", mode, "'");
  }
  if (const char* us = std::getenv("CTXPAR_MPI_PROGRESS_US")) {
    char* end = nullptr;
    const long v = std::strtol(us, &end, 10);
    CTXPAR_CHECK(end != us && *end == '\0' && v >= 1 && v <= 100000,
                 "CTXPAR_MPI_PROGRESS_US must be the progress thread's poll interval in "
                 "microseconds, 1..100000 (default 100), got '", us, "'");
    s.interval = std::chrono::microseconds(v);
  }
  return s;
}

void ProgressThread::start_once() {
  std::lock_guard<std::mutex> lock(m_);
  if (started_) return;
  started_ = true;
  settings_ = progress_settings_from_env();
  if (!settings_.enabled) {
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
  // stops the thread when the program finalises MPI itself (mpi_wrap: mpi4py at exit), not
  // finalize_at_exit.
  int keyval = MPI_KEYVAL_INVALID;
  if (MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN,
                             [](MPI_Comm, int, void*, void*) {
                               progress_thread().stop();
                               return MPI_SUCCESS;
                             },
                             &keyval, nullptr) != MPI_SUCCESS ||
      MPI_Comm_set_attr(MPI_COMM_SELF, keyval, nullptr) != MPI_SUCCESS) {
    description_ = "off (no MPI_Finalize hook on MPI_COMM_SELF)";
    return;
  }
  description_ = "thread, every " + std::to_string(settings_.interval.count()) + " us";
  thread_ = std::thread([this] { loop(); });
}

void ProgressThread::stop() {
  {
    std::lock_guard<std::mutex> lock(m_);
    stopping_ = true;
    started_ = true;  // no start after a stop (MPI is about to end)
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // probe_comm_ is left to MPI_Finalize / MPI_Abort: freeing it here could race neither, but
  // it is not worth a collective-free call on the exit path.
}

void ProgressThread::add_pending() {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(m_);
    wake = pending_++ == 0;
  }
  if (wake) cv_.notify_one();
}

void ProgressThread::remove_pending() {
  std::lock_guard<std::mutex> lock(m_);
  --pending_;
}

void ProgressThread::loop() {
  std::unique_lock<std::mutex> lock(m_);
  for (;;) {
    cv_.wait(lock, [this] { return stopping_ || pending_ > 0; });
    if (stopping_) return;
    lock.unlock();
    {
      MpiLock mpi(mpi_mutex());
      // Should MPI end without the hook having run (it always runs, per the standard), no MPI
      // call is allowed after it: MPI_Finalized is, at any time.
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (finalized) return;
      int flag = 0;
      MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, probe_comm_, &flag, MPI_STATUS_IGNORE);
    }
    std::this_thread::sleep_for(settings_.interval);
    lock.lock();
  }
}

}  // namespace ctxpar::comm_detail

// Progress for the MPI transport: a thread that keeps MPI transfers moving while the rank
// computes. See docs/comm.md ("Progress") and Note [MPI progress] in mpi_progress.cc.
//
// Most MPI libraries (Open MPI's ob1 over TCP or shared memory among them) move a large
// message only while some thread is inside an MPI call: a rendezvous is answered, and the
// next fragments are written to the socket, from MPI_Test / MPI_Wait / MPI_Iprobe. A strategy
// that posts a transfer and then computes for a second would find it hardly started. The
// progress thread enters MPI every `interval` while any request of this transport is pending,
// so every strategy built on isend / irecv (and the collectives, which are built on them)
// overlaps without calling anything between kernel tiles.
#pragma once
#include <mpi.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace ctxpar::comm_detail {

// Every MPI call of this transport holds this lock (recursive: an error path inside a locked
// call asks MPI for the rank and the error text), so the progress thread and the rank's
// thread never enter MPI together.
std::recursive_mutex& mpi_mutex();
using MpiLock = std::lock_guard<std::recursive_mutex>;

struct ProgressSettings {
  bool enabled = true;                            // CTXPAR_MPI_PROGRESS=thread (default) | off
  std::chrono::microseconds interval{100};        // CTXPAR_MPI_PROGRESS_US (1 .. 100000)
};
// Reads the two variables; a bad value throws ctxpar::Error naming the variable and what it
// accepts.
ProgressSettings progress_settings_from_env();

class ProgressThread {
 public:
  // Starts the thread on first use (from the rank's thread, MPI initialised), unless the
  // settings say off or MPI was not initialised with MPI_THREAD_MULTIPLE; then transfers move
  // only inside the rank's own waits, as before. Idempotent.
  void start_once();
  // Joins the thread (before MPI_Finalize or MPI_Abort). start_once does not restart it.
  void stop();
  bool running() const { return thread_.joinable(); }
  // "thread, every 100 us" | "off (CTXPAR_MPI_PROGRESS=off)" | ... : for docs and errors.
  const std::string& describe() const { return description_; }

  // Pending requests: the thread sleeps on a condition variable while there are none.
  void add_pending();
  void remove_pending();

 private:
  void loop();

  std::mutex m_;
  std::condition_variable cv_;
  int pending_ = 0;
  bool stopping_ = false, started_ = false;
  ProgressSettings settings_;
  std::string description_ = "not started";
  MPI_Comm probe_comm_ = MPI_COMM_NULL;  // a private duplicate of MPI_COMM_SELF: never matches
  std::thread thread_;
};

// The process's one progress thread (never destroyed: finalize_at_exit runs at exit).
ProgressThread& progress_thread();

// One pending MPI request: counted while it lives and until done() is called, so the progress
// thread runs exactly while there is something to move. Movable (a dropped send that MPI still
// reads keeps its count in the detached list).
class Pending {
 public:
  Pending() { progress_thread().add_pending(); }
  Pending(Pending&& other) noexcept : live_(std::exchange(other.live_, false)) {}
  Pending& operator=(Pending&& other) noexcept {
    if (this != &other) {
      done();
      live_ = std::exchange(other.live_, false);
    }
    return *this;
  }
  Pending(const Pending&) = delete;
  Pending& operator=(const Pending&) = delete;
  ~Pending() { done(); }
  void done() {
    if (live_) progress_thread().remove_pending();
    live_ = false;
  }

 private:
  bool live_ = true;
};

}  // namespace ctxpar::comm_detail

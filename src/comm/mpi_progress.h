// Progress for the MPI transport: keeps MPI transfers moving while the rank computes, from a
// thread, from the CPU kernel between tiles, or both. See docs/comm.md ("Progress") and Note
// [MPI progress] in mpi_progress.cc.
//
// Most MPI libraries (Open MPI's ob1 over TCP or shared memory among them) move a large
// message only while some thread is inside an MPI call: a rendezvous is answered, and the
// next fragments are written to the socket, from MPI_Test / MPI_Wait / MPI_Iprobe. A strategy
// that posts a transfer and then computes for a second would find it hardly started. While
// any request of this transport is pending, the progress thread enters MPI every `interval`,
// and / or the kernel's tile hook (ctxpar/tile_progress.h) does at most every `interval`, so
// every strategy built on isend / irecv (and the collectives, which are built on them)
// overlaps without knowing about MPI.
#pragma once
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace ctxpar::comm_detail {

// Every MPI call of this transport holds this lock (recursive: an error path inside a locked
// call asks MPI for the rank and the error text), so no two of the rank's thread, the kernel's
// threads in the tile hook and the progress thread enter MPI together.
std::recursive_mutex& mpi_mutex();
using MpiLock = std::lock_guard<std::recursive_mutex>;

struct ProgressSettings {
  // CTXPAR_MPI_PROGRESS: tiles (the default) | thread | both | off. Tiles by default: with
  // every core computing, the thread's wake-ups every interval preempt the ranks and cost them
  // compute, the tile hook almost none (the figures: docs/comm.md, "Progress").
  bool thread = false;  // a progress thread pokes MPI every `interval`
  bool tiles = true;    // the CPU kernel pokes MPI between tiles, at most every `interval`
  std::chrono::microseconds interval{100};  // CTXPAR_MPI_PROGRESS_US (1 .. 100000)
};
// Reads the two variables; a bad value throws ctxpar::Error naming the variable and what it
// accepts.
ProgressSettings progress_settings_from_env();

class MpiProgress {
 public:
  // Sets progress up on first use (from the rank's thread, MPI initialised) as the settings
  // say: starts the thread and / or arms the tile hook. Neither when the settings say off or
  // MPI was not initialised with MPI_THREAD_MULTIPLE; then transfers move only inside the
  // rank's own waits. Idempotent.
  void start_once();
  // Joins the thread and removes the tile hook (before MPI_Finalize or MPI_Abort). start_once
  // does not restart them.
  void stop();
  bool thread_running() const { return thread_.joinable(); }
  bool tiles_armed() const { return tiles_; }
  // "thread, every 100 us" | "tiles, at most every 100 us" | "off (CTXPAR_MPI_PROGRESS=off)"
  // | ... : for docs and errors.
  const std::string& describe() const { return description_; }

  // Pending requests: the thread sleeps on a condition variable and the tile hook is removed
  // while there are none.
  void add_pending();
  void remove_pending();

  // The tile hook's work (a kernel thread, between tiles): one probe if `interval` has passed
  // since the last one and MPI is not busy; otherwise returns at once.
  void poke_from_tile();

 private:
  void loop();
  // One progress call (the caller holds mpi_mutex()); false once MPI has been finalised.
  bool probe_locked();

  std::mutex m_;
  std::condition_variable cv_;
  int pending_ = 0;
  bool stopping_ = false, started_ = false;
  bool tiles_ = false;  // the tile hook is armed: installed whenever pending_ > 0
  ProgressSettings settings_;
  std::string description_ = "not started";
  MPI_Comm probe_comm_ = MPI_COMM_NULL;  // a private duplicate of MPI_COMM_SELF: never matches
  std::thread thread_;
  // For the tile hook, read by kernel threads without m_: steady_clock ticks.
  std::atomic<int64_t> interval_ticks_{0}, last_tile_poke_{0};
  std::atomic<bool> stopped_{false};
};

// The process's one progress engine (never destroyed: finalize_at_exit runs at exit).
MpiProgress& mpi_progress();

// One pending MPI request: counted while it lives and until done() is called, so the progress
// thread and the tile hook run exactly while there is something to move. Movable (a dropped
// send that MPI still reads keeps its count in the detached list).
class Pending {
 public:
  Pending() { mpi_progress().add_pending(); }
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
    if (live_) mpi_progress().remove_pending();
    live_ = false;
  }

 private:
  bool live_ = true;
};

}  // namespace ctxpar::comm_detail

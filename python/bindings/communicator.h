// ctxpar.Communicator: a Python handle on a ctxpar::Communicator. Ways to get one:
// ctxpar.init() (MPI_COMM_WORLD under mpirun, gloo under torchrun), Communicator.from_mpi4py,
// Communicator.from_torch / from_mesh (gloo over a torch ProcessGroup, python/bindings/gloo.cc),
// ctxpar.run_threads(P, fn) (P ranks as threads of this process; fn(comm) runs on each), and
// comm.split(color, key).
#pragma once
#include <atomic>
#include <memory>

#include "arrays.h"
#include "ctxpar/comm.h"

namespace ctxpar::python {

class PyCommunicator {
 public:
  // Borrowed: `comm` outlives every use (the MPI world) or `alive` says when it stops (a
  // run_threads rank, which ends with its block).
  PyCommunicator(Communicator* comm, std::shared_ptr<std::atomic<bool>> alive)
      : comm_(comm), alive_(std::move(alive)) {}
  // Owned (mpi4py's duplicate, a gloo communicator, a split); a split of a run_threads rank
  // shares its parent's `alive`.
  explicit PyCommunicator(std::shared_ptr<Communicator> owned,
                          std::shared_ptr<std::atomic<bool>> alive = nullptr)
      : comm_(owned.get()), owned_(std::move(owned)), alive_(std::move(alive)) {}
  const std::shared_ptr<std::atomic<bool>>& alive() const { return alive_; }
  // Raises ValueError when used after its run_threads block ended, or after close().
  Communicator& get() const;
  // Lets go of an owned communicator now (its transport's threads joined, its sockets closed,
  // unless a split still shares them): ctxpar's exit hook closes the communicators it made
  // before the interpreter finalises (Note [Closing at exit], python/ctxpar/_distributed.py).
  void close();
  bool closed() const { return closed_; }

 private:
  Communicator* comm_;
  std::shared_ptr<Communicator> owned_;
  std::shared_ptr<std::atomic<bool>> alive_;
  bool closed_ = false;
};

void bind_communicator(nb::module_& m);

}  // namespace ctxpar::python

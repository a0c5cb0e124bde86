// ctxpar.Communicator: a Python handle on a ctxpar::Communicator. Three ways to get one:
// ctxpar.init() (MPI_COMM_WORLD under mpirun), Communicator.from_mpi4py(comm), and
// ctxpar.run_threads(P, fn) (P ranks as threads of this process; fn(comm) runs on each).
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
  explicit PyCommunicator(std::shared_ptr<Communicator> owned)
      : comm_(owned.get()), owned_(std::move(owned)) {}
  // Raises ValueError when used after its run_threads block ended.
  Communicator& get() const;

 private:
  Communicator* comm_;
  std::shared_ptr<Communicator> owned_;
  std::shared_ptr<std::atomic<bool>> alive_;
};

void bind_communicator(nb::module_& m);

}  // namespace ctxpar::python

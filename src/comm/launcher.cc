// Launcher detection (always built) and the MPI entry points of a build without MPI.
#include <cstdlib>

#include "ctxpar/comm.h"

namespace ctxpar {

bool launched_by_mpi() {
  // OpenMPI's mpirun sets OMPI_COMM_WORLD_SIZE; MPICH / Hydra and Slurm's PMI set PMI_SIZE.
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(name) != nullptr) return true;
  return false;
}

#ifndef CTXPAR_HAVE_MPI
Communicator& mpi_world() {
  throw Error(
      "mpi_world: ctxpar was built without MPI; reconfigure with -DCTXPAR_MPI=ON "
      "(needs Debian's libopenmpi-dev)");
}

std::unique_ptr<Communicator> mpi_wrap(const void*) {
  mpi_world();  // throws: built without MPI
  return nullptr;
}

void run_mpi(const std::function<void(Communicator&)>& fn) { fn(mpi_world()); }
#endif

}  // namespace ctxpar

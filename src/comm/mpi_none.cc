// The MPI entry points of a build without MPI (-DCTXPAR_MPI=OFF; src/CMakeLists.txt adds this
// file only then): each throws saying so. The Python package is such a build: its MPI transport
// is a plugin loaded only when MPI is asked for (python/bindings/mpi_plugin.cc).
#include "ctxpar/comm.h"

namespace ctxpar {

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

void abort_mpi_job(int) {}

}  // namespace ctxpar

// The MPI transport of the Python package as a plugin: libctxpar_mpi.so, next to the extension
// ctxpar._ctxpar, holds src/comm/mpi.cc and mpi_progress.cc and is the only part of the package
// linked with libmpi. ctxpar._ctxpar loads it (dlopen, mpi_loader.cc) only when MPI is asked
// for (ctxpar.init() under mpirun or without a launcher, Communicator.from_mpi4py), so
// `import ctxpar`, the threads and gloo transports and everything else run where OpenMPI's
// libraries are absent (docs/python.md, "Which parts need MPI").
//
// The plugin carries its own copy of the comm and core layers it needs; the communicators it
// makes are used through the virtual Communicator interface, so both sides must be compiled
// from the same headers (one build). The one state the two copies must share is the kernel's
// tile progress hook (ctxpar/tile_progress.h): the host hands the plugin its
// set_tile_progress_hook, so that MPI progresses between the host kernel's tiles.
#pragma once
#include <memory>

#include "ctxpar/comm.h"
#include "ctxpar/tile_progress.h"

namespace ctxpar::python {

constexpr int kMpiPluginAbi = 1;  // bumped when MpiPlugin changes

struct MpiPlugin {
  int abi;
  Communicator& (*world)();                                 // ctxpar::mpi_world
  std::unique_ptr<Communicator> (*wrap)(const void* comm);  // ctxpar::mpi_wrap
  void (*abort_job)(int code);                              // ctxpar::abort_mpi_job
};

using SetTileProgressHook = void (*)(TileProgressHook);

}  // namespace ctxpar::python

// The plugin's one exported symbol: its entry points, or nullptr when `abi` differs from its own.
extern "C" const ctxpar::python::MpiPlugin* ctxpar_mpi_plugin(
    int abi, ctxpar::python::SetTileProgressHook set_hook);

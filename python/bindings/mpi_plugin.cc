// libctxpar_mpi.so: the Python package's MPI transport (mpi_plugin.h). Built from
// src/comm/mpi.cc and mpi_progress.cc with this file; everything but ctxpar_mpi_plugin is hidden.
#include "mpi_plugin.h"

namespace ctxpar {
namespace {
python::SetTileProgressHook g_set_hook = nullptr;
}  // namespace

// mpi_progress.cc arms the kernel's tile hook through this; the kernel is the host's, so the
// hook is set there (this definition keeps core's tile_progress.cc out of the plugin).
void set_tile_progress_hook(TileProgressHook hook) {
  if (g_set_hook) g_set_hook(hook);
}
}  // namespace ctxpar

extern "C" __attribute__((visibility("default"))) const ctxpar::python::MpiPlugin*
ctxpar_mpi_plugin(int abi, ctxpar::python::SetTileProgressHook set_hook) {
  static const ctxpar::python::MpiPlugin plugin{ctxpar::python::kMpiPluginAbi, &ctxpar::mpi_world,
                                                &ctxpar::mpi_wrap, &ctxpar::abort_mpi_job};
  if (abi != plugin.abi) return nullptr;
  ctxpar::g_set_hook = set_hook;
  return &plugin;
}

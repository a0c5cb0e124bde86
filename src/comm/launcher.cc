// Launcher detection (always built; the variables are read by core/environment.cc) and the
// gloo entry points of a build without gloo (the MPI ones of a build without MPI are in
// mpi_none.cc).
#include <string>

#include "core/environment.h"
#include "ctxpar/comm.h"
#include "ctxpar/gloo.h"

namespace ctxpar {

bool launched_by_mpi() { return environment::launcher().mpi; }

bool launched_by_torchrun() { return environment::launcher().torchrun; }

ForeignLauncher foreign_launcher() {
  const environment::Launcher l = environment::launcher();
  return {l.foreign_name, l.foreign_ranks};
}

#ifndef CTXPAR_HAVE_GLOO
namespace {
[[noreturn]] void no_gloo() {
  throw Error(
      "gloo: ctxpar was built without the gloo transport; reconfigure with -DCTXPAR_GLOO=ON "
      "(needs Debian's libgloo-dev)");
}
}  // namespace
bool gloo_available() { return false; }
struct GlooBootstrap::State {};
GlooBootstrap::GlooBootstrap(int, int, const GlooOptions&) { no_gloo(); }
GlooBootstrap::~GlooBootstrap() = default;
std::string GlooBootstrap::address() const { no_gloo(); }
std::unique_ptr<Communicator> GlooBootstrap::connect(const std::vector<std::string>&) { no_gloo(); }
std::unique_ptr<Communicator> gloo_from_torchrun_env(const GlooOptions&) { no_gloo(); }
int gloo_failed_rank(const Communicator&) { return -1; }
void run_gloo(Communicator& comm, const std::function<void(Communicator&)>& fn) { fn(comm); }
#endif

}  // namespace ctxpar

// The transports' capability rows, and launch (ctxpar/launch.h).
#include "ctxpar/launch.h"

#include <iterator>
#include <string>

#include "core/environment.h"

namespace ctxpar {
namespace {

// Indexed by TransportKind.
constexpr TransportTraits kTraits[] = {
    // name       one rank per process  needs a launcher  needs a GPU
    {"threads", false, false, false}, {"mpi", true, true, false},       {"gloo", true, true, false},
    {"nccl", true, true, true},       {"loopback", false, false, true},
};
constexpr TransportKind kKinds[] = {TransportKind::threads, TransportKind::mpi, TransportKind::gloo,
                                    TransportKind::nccl, TransportKind::loopback};
static_assert(std::size(kTraits) == std::size(kKinds));

// Under a launcher the job's ranks are its processes.
void check_world_size(const Communicator& world, int ranks, const char* launcher) {
  CTXPAR_CHECK(world.size() == ranks, "launch: ", launcher, " started ", world.size(),
               " processes but the job has ", ranks, " ranks; start ", ranks, " processes");
}

}  // namespace

const TransportTraits& transport_traits(TransportKind kind) {
  const auto i = static_cast<size_t>(kind);
  CTXPAR_ASSERT(i < std::size(kTraits));
  return kTraits[i];
}

TransportKind parse_transport(const std::string& name) {
  std::string names;
  for (TransportKind k : kKinds) {
    if (name == transport_name(k)) return k;
    names += names.empty() ? "" : k == TransportKind::loopback ? " or " : ", ";
    names += transport_name(k);
  }
  throw Error("unknown transport '" + name + "': use " + names);
}

TransportKind host_transport(TransportKind kind) {
  if (kind == TransportKind::nccl)
    return launched_by_mpi() ? TransportKind::mpi : TransportKind::gloo;
  if (kind == TransportKind::loopback) return TransportKind::threads;
  return kind;
}

bool torchrun_job() {
  const environment::Launcher l = environment::launcher();
  return l.torchrun || l.foreign_name.rfind("torchrun", 0) == 0;
}

TransportKind launcher_transport() {
  if (launched_by_mpi()) return TransportKind::mpi;
  return torchrun_job() ? TransportKind::gloo : TransportKind::threads;
}

Communicator& gloo_world(const GlooOptions& options) {
  static Communicator* world = nullptr;  // never destroyed: see above
  if (!world) world = gloo_from_torchrun_env(options).release();
  return *world;
}

void launch(TransportKind kind, int ranks, const std::function<void(Communicator&)>& fn,
            const LaunchOptions& options) {
  switch (host_transport(kind)) {
    case TransportKind::mpi:
      check_world_size(mpi_world(), ranks, "mpirun");
      run_mpi(fn);
      return;
    case TransportKind::gloo: {
      Communicator& world = gloo_world(options.gloo);
      check_world_size(world, ranks, "torchrun");
      run_gloo(world, fn);
      return;
    }
    default:
      run_threads(ranks, fn, options.threads);
      return;
  }
}

}  // namespace ctxpar

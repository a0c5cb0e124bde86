// Launcher detection (always built) and the gloo entry points of a build without gloo (the MPI
// ones of a build without MPI are in mpi_none.cc).
#include <cstdlib>
#include <string>

#include "ctxpar/comm.h"
#include "ctxpar/gloo.h"

namespace ctxpar {

bool launched_by_mpi() {
  // OpenMPI's mpirun sets OMPI_COMM_WORLD_SIZE; MPICH / Hydra and Slurm's PMI set PMI_SIZE.
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(name) != nullptr) return true;
  return false;
}

bool launched_by_torchrun() {
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
    if (std::getenv(name) == nullptr) return false;
  return true;
}

namespace {
// The variable as a whole number >= 0, or -1 when unset or not a number.
long env_count(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return -1;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return *end == '\0' && n >= 0 ? n : -1;
}
}  // namespace

ForeignLauncher foreign_launcher() {
  if (launched_by_mpi()) return {};
  // torchrun (and torch.distributed.launch) set WORLD_SIZE with RANK / LOCAL_RANK.
  const long world = env_count("WORLD_SIZE");
  if (world > 1 && (env_count("RANK") >= 0 || env_count("LOCAL_RANK") >= 0))
    return {"torchrun (WORLD_SIZE=" + std::to_string(world) + ")", static_cast<int>(world)};
  // srun sets SLURM_PROCID and the step's task count for each task it starts. A batch
  // script (one process, SLURM_NTASKS from #SBATCH --ntasks) is not a step of several tasks.
  if (env_count("SLURM_PROCID") >= 0) {
    long tasks = env_count("SLURM_STEP_NUM_TASKS");
    const char* name = "SLURM_STEP_NUM_TASKS";
    if (tasks < 0 && (std::getenv("SLURM_STEP_ID") || std::getenv("SLURM_STEPID")))
      tasks = env_count("SLURM_NTASKS"), name = "SLURM_NTASKS";
    if (tasks > 1)
      return {std::string("srun (") + name + "=" + std::to_string(tasks) + ")",
              static_cast<int>(tasks)};
  }
  return {};
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
void run_gloo(Communicator& comm, const std::function<void(Communicator&)>& fn) { fn(comm); }
#endif

}  // namespace ctxpar

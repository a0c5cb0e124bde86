// The one reader of the environment in src/ outside the kernel (environment.h).
#include "core/environment.h"

#include <net/if.h>

#include <cstdlib>
#include <initializer_list>

#include "ctxpar/error.h"
#include "ctxpar/memory.h"

namespace ctxpar::environment {
namespace {

std::optional<std::string> variable(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

std::string text(const char* name) { return variable(name).value_or(""); }

bool is_set(const char* name) { return variable(name).has_value(); }

// The variable as a whole number >= 0, or -1 when unset or not a number.
long count(const char* name) {
  const std::string v = text(name);
  if (v.empty()) return -1;
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  return *end == '\0' && n >= 0 ? n : -1;
}

// The first of `names` that is set, read as atoi reads it; nullopt when none is set.
std::optional<int> first_number(std::initializer_list<const char*> names) {
  for (const char* name : names)
    if (const std::optional<std::string> v = variable(name)) return std::atoi(v->c_str());
  return std::nullopt;
}

void find_foreign_launcher(Launcher& l) {
  // torchrun (and torch.distributed.launch) set WORLD_SIZE with RANK / LOCAL_RANK.
  const long world = count("WORLD_SIZE");
  if (world > 1 && (count("RANK") >= 0 || count("LOCAL_RANK") >= 0)) {
    l.foreign_name = "torchrun (WORLD_SIZE=" + std::to_string(world) + ")";
    l.foreign_ranks = static_cast<int>(world);
    return;
  }
  // srun sets SLURM_PROCID and the step's task count for each task it starts. A batch
  // script (one process, SLURM_NTASKS from #SBATCH --ntasks) is not a step of several tasks.
  if (count("SLURM_PROCID") < 0) return;
  long tasks = count("SLURM_STEP_NUM_TASKS");
  const char* name = "SLURM_STEP_NUM_TASKS";
  if (tasks < 0 && (is_set("SLURM_STEP_ID") || is_set("SLURM_STEPID")))
    tasks = count("SLURM_NTASKS"), name = "SLURM_NTASKS";
  if (tasks <= 1) return;
  l.foreign_name = std::string("srun (") + name + "=" + std::to_string(tasks) + ")";
  l.foreign_ranks = static_cast<int>(tasks);
}

}  // namespace

Launcher launcher() {
  Launcher l;
  // OpenMPI's mpirun sets OMPI_COMM_WORLD_SIZE; MPICH / Hydra and Slurm's PMI set PMI_SIZE.
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    l.mpi = l.mpi || is_set(name);
  l.torchrun = true;
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
    l.torchrun = l.torchrun && is_set(name);
  if (!l.mpi) find_foreign_launcher(l);
  if (const std::optional<int> r =
          first_number({"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "LOCAL_RANK"}))
    l.local_rank = *r < 0 ? 0 : *r;
  if (const std::optional<int> n =
          first_number({"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "LOCAL_WORLD_SIZE"}))
    l.local_size = *n < 1 ? 1 : *n;
  return l;
}

Torchrun torchrun() {
  Torchrun t;
  t.rank = text("RANK"), t.world_size = text("WORLD_SIZE");
  t.local_rank = text("LOCAL_RANK"), t.local_world_size = text("LOCAL_WORLD_SIZE");
  t.master_addr = text("MASTER_ADDR"), t.master_port = text("MASTER_PORT");
  t.use_agent_store = text("TORCHELASTIC_USE_AGENT_STORE");
  t.run_id = text("TORCHELASTIC_RUN_ID"), t.restart_count = text("TORCHELASTIC_RESTART_COUNT");
  t.error_file = text("TORCHELASTIC_ERROR_FILE");
  return t;
}

std::string gloo_interface() {
  for (const char* name : {"CTXPAR_GLOO_IFNAME", "CTXPAR_GLOO_HOST"})
    if (std::string v = text(name); !v.empty()) return v;
  // torch's variable, as torch reads it: network interfaces, comma-separated (torch makes a
  // gloo device per name; ctxpar's transport has one device, on the first). Only an interface:
  // a name that is not one is refused here, where the variable's name is still known (as a
  // host name it would fail later naming neither).
  std::string ifname = text("GLOO_SOCKET_IFNAME");
  ifname = ifname.substr(0, ifname.find(','));
  if (ifname.empty() || if_nametoindex(ifname.c_str()) != 0) return ifname;
  std::string have;
  if (struct if_nameindex* all = if_nameindex()) {
    for (struct if_nameindex* i = all; i->if_index != 0; ++i)
      have += detail::concat(have.empty() ? "" : ", ", i->if_name);
    if_freenameindex(all);
  }
  throw Error(detail::concat("GLOO_SOCKET_IFNAME=", text("GLOO_SOCKET_IFNAME"),
                             ": this host has no network interface '", ifname,
                             "' (it has: ", have.empty() ? "none listed" : have,
                             "); set GLOO_SOCKET_IFNAME to one of them, or unset it"));
}

Mpi mpi() {
  return {variable("CTXPAR_MPI_INIT_TIMEOUT"), variable("CTXPAR_MPI_PROGRESS"),
          variable("CTXPAR_MPI_PROGRESS_US")};
}

std::optional<std::string> memory_limit_override() { return variable(kMemoryLimitEnv); }

Cuda cuda() {
  return {variable("CTXPAR_CUDNN"), variable("CTXPAR_NCCL_LIBRARY"), variable("LOCAL_RANK"),
          variable("CUDA_VISIBLE_DEVICES")};
}

KernelEnvironment kernel() {
  KernelEnvironment env;
  env.simd = text("CTXPAR_SIMD");
  env.kernel = text("CTXPAR_KERNEL");
  env.bf16_products = text("CTXPAR_BF16_PRODUCTS");
  env.fp32_products = text("CTXPAR_FP32_PRODUCTS");
  env.l1d = text("CTXPAR_KERNEL_L1D");
  return env;
}

}  // namespace ctxpar::environment

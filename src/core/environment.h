// The environment, read in one place: every variable that src/ honours is read here (the only
// getenv of src/), as typed values. The commands
// (tools/ctxpar) and the Python extension take them from here and pass them in as options
// (the gloo transport's address, a job's local rank and size); the library entry points that
// are named after the environment -- launched_by_mpi, gloo_from_torchrun_env, mpi_world's
// CTXPAR_MPI_* settings, MemoryLimitSources::system, the cuda device's defaults -- read theirs
// here too; so are the kernel's (kernel(), which the edge installs into the kernel). The
// variables and what they do: docs/comm.md, docs/cuda.md, docs/cli.md, docs/kernel.md.
#pragma once
#include <optional>
#include <string>

#include "ctxpar/kernel.h"

namespace ctxpar::environment {

// The launcher that started this process, from the variables it sets.
struct Launcher {
  // mpirun / mpiexec (OpenMPI's OMPI_COMM_WORLD_SIZE, MPICH's PMI_SIZE) or srun with a PMI
  // plugin (PMIX_RANK).
  bool mpi = false;
  // torchrun: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT all set.
  bool torchrun = false;
  // A launcher that started several copies of this program without MPI, each of which would
  // run the whole job alone: "torchrun (WORLD_SIZE=4)" (WORLD_SIZE > 1 with RANK or
  // LOCAL_RANK), "srun (SLURM_STEP_NUM_TASKS=4)" (a step of several tasks). foreign_ranks is 0
  // (and the name "") when there is none, or when MPI started us.
  std::string foreign_name;
  int foreign_ranks = 0;
  // This process's rank among the job's ranks on this machine (OMPI_COMM_WORLD_LOCAL_RANK,
  // MPI_LOCALRANKID or LOCAL_RANK, the first set; a negative number reads as 0), -1 when none
  // is set; and how many ranks this machine runs (OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS
  // or LOCAL_WORLD_SIZE; at least 1), 0 when none is set.
  int local_rank = -1;
  int local_size = 0;
};
Launcher launcher();

// torchrun's variables as set ("" when unset), for gloo_from_torchrun_env to check and use.
struct Torchrun {
  std::string rank, world_size;              // RANK, WORLD_SIZE
  std::string local_rank, local_world_size;  // LOCAL_RANK, LOCAL_WORLD_SIZE
  std::string master_addr, master_port;      // MASTER_ADDR, MASTER_PORT
  std::string use_agent_store;               // TORCHELASTIC_USE_AGENT_STORE
  std::string run_id, restart_count;         // TORCHELASTIC_RUN_ID, _RESTART_COUNT
  std::string error_file;                    // TORCHELASTIC_ERROR_FILE: run_gloo's report
};
Torchrun torchrun();

// The address the gloo transport listens on and publishes (GlooOptions::hostname_or_interface):
// CTXPAR_GLOO_IFNAME (an interface) when set, else CTXPAR_GLOO_HOST, else torch's
// GLOO_SOCKET_IFNAME (its first interface; one this host lacks throws Error naming it), else
// "" (automatic).
std::string gloo_interface();

// The MPI transport's settings as set (nullopt: unset), checked where they are used
// (src/comm/mpi.cc, mpi_progress.cc; the command checks them first: check_mpi_environment).
struct Mpi {
  std::optional<std::string> init_timeout;  // CTXPAR_MPI_INIT_TIMEOUT: seconds MPI_Init may take
  std::optional<std::string> progress;      // CTXPAR_MPI_PROGRESS: thread | tiles | both | off
  std::optional<std::string> progress_us;   // CTXPAR_MPI_PROGRESS_US: the progress interval
};
Mpi mpi();

// CTXPAR_MEMORY_LIMIT_BYTES as set (nullopt: unset): the user's own memory limit
// (MemoryLimitSources::system, ctxpar/memory.h).
std::optional<std::string> memory_limit_override();

// The cuda device's and nccl transport's settings as set (nullopt: unset).
struct Cuda {
  std::optional<std::string> cudnn;            // CTXPAR_CUDNN: off | require | auto
  std::optional<std::string> nccl_library;     // CTXPAR_NCCL_LIBRARY: the path of libnccl.so.2
  std::optional<std::string> local_rank;       // LOCAL_RANK: a cuda device's GPU when none is given
  std::optional<std::string> visible_devices;  // CUDA_VISIBLE_DEVICES, for the no-GPU message
};
Cuda cuda();

// The kernel's variables as set ("" where unset): CTXPAR_SIMD, CTXPAR_KERNEL,
// CTXPAR_BF16_PRODUCTS, CTXPAR_FP32_PRODUCTS and CTXPAR_KERNEL_L1D. The command, the Python module and the test
// programs install them once, before any kernel call (set_kernel_environment, ctxpar/kernel.h).
KernelEnvironment kernel();

}  // namespace ctxpar::environment

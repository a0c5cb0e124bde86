// --device cuda and the CUDA lines of --version (docs/cuda.md). Where there is no GPU (with
// cudaGetDeviceCount's error) or the build has no CUDA, the command says so and exits 2 before
// anything runs; on a GPU it goes on, and make_device builds the cuda device (src/cuda).
#include <cstdlib>
#include <string>

#include "ctxpar/comm.h"
#include "ctxpar/error.h"
#include "ctxpar/gloo.h"
#include "cuda/cudnn_use.h"
#include "options.h"
#ifdef CTXPAR_HAVE_CUDA
#include "cuda/runtime.h"
#endif
#ifdef CTXPAR_HAVE_NCCL
#include "cuda/nccl_comm.h"
#endif

namespace ctxpar::cli {

// ctxpar-faults only: CTXPAR_FAULT_CUDA_RECORDING runs --device cuda --transport loopback over
// the recording CUDA API on the CPU (job_run.cc), so the checks below let it through.
static bool recording_cuda() {
#ifdef CTXPAR_FAULT_HOOKS
  return std::getenv("CTXPAR_FAULT_CUDA_RECORDING") != nullptr;
#else
  return false;
#endif
}

void check_cuda_device() {
  cuda::cudnn_mode();  // a CTXPAR_CUDNN that is none of off / require / auto: bad usage, first
  if (recording_cuda()) return;
#ifdef CTXPAR_HAVE_CUDA
  const cuda::DeviceProbe p = cuda::probe_devices();
  if (p.count == 0) throw Error("--device cuda: " + cuda::no_device_message(p));
#else
  throw Error(
      "--device cuda: this ctxpar was built without CUDA (CTXPAR_CUDA=OFF, or no nvcc "
      "at configure time); rebuild with -DCTXPAR_CUDA=ON where the CUDA toolkit is "
      "installed, or use --device cpu");
#endif
}

void check_gpu_transport(TransportKind transport, const std::string& device) {
  if (!transport_traits(transport).needs_gpu) return;
  const bool nccl = transport == TransportKind::nccl;
  const std::string opt = std::string("--transport ") + transport_name(transport);
  if (device != "cuda")
    throw Error(opt + (nccl ? " moves GPU memory between processes" : " runs P ranks on one GPU") +
                " and needs --device cuda (got --device " + device +
                "); add --device cuda, or "
                "use " +
                (nccl ? "--transport threads, mpi or gloo" : "--transport threads") +
                " with --device cpu");
  if (!nccl && recording_cuda()) return;
#ifdef CTXPAR_HAVE_CUDA
  const cuda::DeviceProbe p = cuda::probe_devices();
  if (p.count == 0)
    throw Error(opt + " --device cuda: " + cuda::no_device_message(p) +
                " (with --device cpu: --transport threads" + (nccl ? ", mpi or gloo)" : ")"));
  if (!nccl) return;
  if (!launched_by_mpi() && !launched_by_torchrun())
    throw Error(opt +
                " runs one rank per GPU, one process each: start it with mpirun -n P or "
                "torchrun --nproc-per-node P --no-python ctxpar ...; for P ranks on one GPU use "
                "--transport loopback");
#ifdef CTXPAR_HAVE_NCCL
  cuda::load_nccl();  // throws, saying what it looked for, where NCCL is missing
#else
  throw Error(opt +
              ": this ctxpar was built without NCCL's headers (nccl.h not found at "
              "configure time); install NCCL's development files and reconfigure, or use "
              "--transport mpi or gloo");
#endif
#else
  throw Error(opt +
              ": this ctxpar was built without CUDA (CTXPAR_CUDA=OFF, or no nvcc at "
              "configure time); rebuild with -DCTXPAR_CUDA=ON where the CUDA toolkit is "
              "installed, or use --device cpu with --transport threads");
#endif
}

std::string cuda_version_lines() {
#ifdef CTXPAR_HAVE_CUDA
  return cuda::build_summary();
#else
  return "CUDA: not built (CTXPAR_CUDA=OFF, or no nvcc at configure time)\n";
#endif
}

}  // namespace ctxpar::cli

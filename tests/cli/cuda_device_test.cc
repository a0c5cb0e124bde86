// --device cuda and --version's CUDA lines (docs/cuda.md): on a machine without a GPU the
// command exits 2 at once with one line naming cudaGetDeviceCount's error and what it looked
// for; on a GPU it runs on the cuda device.
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "cli/cli_support.h"

namespace ctxpar::test {
namespace {

TEST(CliCuda, DeviceCudaIsRefusedInOneLineWithTheReason) {
  const auto start = std::chrono::steady_clock::now();
  const CommandResult r =
      run_ctxpar("attention --seq 256 --heads 2 --head-dim 16 --ranks 2 --device cuda");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
#ifdef CTXPAR_HAVE_CUDA
  if (r.exit_code == 0) {  // a machine with a GPU: the cuda device ran (never seen yet)
    EXPECT_EQ(r.err.find("no CUDA device found"), std::string::npos) << r.err;
    return;
  }
#endif
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_LT(seconds, 5.0);
  EXPECT_EQ(r.out, "");
  ASSERT_FALSE(r.err.empty());
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line: " << r.err;
  EXPECT_EQ(r.err.rfind("ctxpar attention: error: --device cuda: ", 0), 0u) << r.err;
#ifdef CTXPAR_HAVE_CUDA
  EXPECT_NE(r.err.find("no CUDA device found"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("cudaGetDeviceCount returned "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("looked for NVIDIA GPUs through the driver library libcuda.so.1"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("use --device cpu"), std::string::npos) << r.err;
#else
  EXPECT_NE(r.err.find("built without CUDA"), std::string::npos) << r.err;
#endif
}

// --transport nccl / loopback move GPU memory: without --device cuda, and on a machine without a
// GPU, they are refused at once in one line that names the transport and the fix.
CommandResult run_gpu_transport(const std::string& transport, const std::string& device,
                                double* seconds) {
  const auto start = std::chrono::steady_clock::now();
  const CommandResult r = run_ctxpar(
      "attention --seq 256 --heads 2 --head-dim 16 --ranks 2 "
      "--transport " +
      transport + " --device " + device);
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_FALSE(r.err.empty());
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line: " << r.err;
  EXPECT_EQ(r.err.rfind("ctxpar attention: error: --transport " + transport, 0), 0u) << r.err;
  return r;
}

TEST(CliCuda, GpuTransportsNeedDeviceCuda) {
  double s = 0;
  CommandResult r = run_gpu_transport("nccl", "cpu", &s);
  EXPECT_NE(r.err.find("--transport nccl moves GPU memory between processes and needs --device "
                       "cuda (got --device cpu); add --device cuda, or use --transport threads, "
                       "mpi or gloo with --device cpu"),
            std::string::npos)
      << r.err;
  r = run_gpu_transport("loopback", "sim", &s);
  EXPECT_NE(r.err.find("--transport loopback runs P ranks on one GPU and needs --device cuda "
                       "(got --device sim); add --device cuda, or use --transport threads with "
                       "--device cpu"),
            std::string::npos)
      << r.err;
}

TEST(CliCuda, GpuTransportsWithoutAGpuAreRefusedAtOnce) {
  for (const std::string transport : {"nccl", "loopback"}) {
    double seconds = 0;
    const CommandResult r = run_gpu_transport(transport, "cuda", &seconds);
    EXPECT_LT(seconds, 5.0);
#ifdef CTXPAR_HAVE_CUDA
    if (r.err.find("no CUDA device found") != std::string::npos) {
      EXPECT_EQ(
          r.err.rfind("ctxpar attention: error: --transport " + transport +
                          " --device cuda: no CUDA device found: cudaGetDeviceCount returned ",
                      0),
          0u)
          << r.err;
      EXPECT_NE(r.err.find("use --device cpu"), std::string::npos) << r.err;
    } else if (transport == "nccl") {  // a machine with a GPU, no launcher
      EXPECT_NE(r.err.find("start it with mpirun -n P or torchrun"), std::string::npos) << r.err;
    }
#else
    EXPECT_NE(r.err.find("built without CUDA"), std::string::npos) << r.err;
#endif
  }
}

TEST(CliCuda, VersionDescribesTheCudaBuild) {
  const CommandResult r = run_ctxpar("--version");
  ASSERT_EQ(r.exit_code, 0) << r.err;
#ifdef CTXPAR_HAVE_CUDA
  EXPECT_NE(r.out.find("CUDA: built with nvcc "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" for 90a-real, 90-virtual"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("CUDA: cuDNN headers "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("CUDA: NCCL headers "), std::string::npos) << r.out;
#else
  EXPECT_NE(r.out.find("CUDA: not built"), std::string::npos) << r.out;
#endif
}

}  // namespace
}  // namespace ctxpar::test

namespace ctxpar::test {
namespace {

// The command's whole `--device cuda --transport loopback` path (job_run.cc's run_loopback: P
// threads, each rank's cuda device and the loopback world on one CudaApi) on the CPU:
// ctxpar-faults with CTXPAR_FAULT_CUDA_RECORDING puts RecordingCudaApi under it, so the
// fallback kernel's tile math runs on the host, and --check compares with the fp64 reference.
// Every strategy, forward and backward, bf16 too: what scripts/gpu_check.sh's grid runs on a GPU.
TEST(CliCuda, LoopbackOverTheRecordingApiMeetsTheReference) {
  for (const std::string strategy : {"ring", "allgather", "ulysses", "hybrid"}) {
    for (const std::string dtype : {"fp32", "bf16"}) {
      const std::string args =
          "attention --seq 200 --heads 4 --kv-heads 2 --head-dim 24 "
          "--ranks 4 --layout zigzag --mask causal --backward --check "
          "--device cuda --transport loopback --strategy " +
          strategy + (strategy == "hybrid" ? " --ulysses-degree 2" : "") + " --dtype " + dtype;
      const CommandResult r =
          run_shell("CTXPAR_FAULT_CUDA_RECORDING=1 " + fault_ctxpar_path() + " " + args);
      EXPECT_EQ(r.exit_code, 0) << args << "\n" << r.err;
      EXPECT_NE(r.out.find("check: PASSED"), std::string::npos) << args << "\n" << r.out;
    }
  }
  // The release binary has no such hook: there the same command needs a GPU.
  const CommandResult r = run_shell("CTXPAR_FAULT_CUDA_RECORDING=1 " + ctxpar_path() +
                                    " attention --seq 64 --ranks 2 --device cuda "
                                    "--transport loopback");
  EXPECT_EQ(r.exit_code, 2) << r.err;
}

// --json's cuDNN report on the cuda device: cuDNN's version or why it is off, and
// where the attention blocks went, per rank and in all. Over the recording API (no cuDNN)
// every block is the fallback kernel's: the ring over P ranks runs P K/V blocks per rank
// forward and P backward.
TEST(CliCuda, JsonReportsWhereTheBlocksWentAndWhyCudnnIsOff) {
  const int P = 2;
  const CommandResult r = run_shell(
      "CTXPAR_FAULT_CUDA_RECORDING=1 " + fault_ctxpar_path() +
      " attention --seq 128 --heads 4 --kv-heads 2 --head-dim 16 --ranks 2 --strategy ring "
      "--layout zigzag --mask causal --backward --device cuda --transport loopback --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = parse_json(r);
  const nlohmann::json& c = j.at("cudnn");
  EXPECT_EQ(c.at("used"), false);
  EXPECT_TRUE(c.at("version").is_null());
  EXPECT_NE(c.at("off_reason").get<std::string>().find("no cuDNN"), std::string::npos) << c;
  EXPECT_EQ(c.at("blocks"), 0);
  EXPECT_EQ(c.at("fallback_blocks"), P * P * 2);
  EXPECT_EQ(c.at("refused_blocks"), 0);
  for (const auto& rank : j.at("ranks")) EXPECT_EQ(rank.at("cudnn").at("fallback_blocks"), P * 2);
  // Not a cuda run: no cudnn keys.
  const CommandResult cpu =
      run_ctxpar("attention --seq 64 --heads 2 --head-dim 16 --ranks 2 --json");
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  EXPECT_FALSE(parse_json(cpu).contains("cudnn"));
}

// CTXPAR_CUDNN that is none of off / require / auto: bad usage, named, before anything runs.
TEST(CliCuda, AnUnknownCtxparCudnnIsBadUsage) {
  const CommandResult r = run_shell("CTXPAR_CUDNN=yes " + ctxpar_path() +
                                    " attention --seq 64 --ranks 2 --device cuda");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("CTXPAR_CUDNN='yes': use off"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace ctxpar::test

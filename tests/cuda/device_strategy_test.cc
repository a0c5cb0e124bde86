// The cuda device on the CPU (CudaDevice over RecordingCudaApi: host memory, the fallback
// kernel's own tile math, every stream operation logged and checked): every strategy x layout
// x mask x P, forward and backward, gives the cpu device's bits (CTXPAR_KERNEL=scalar: the tile
// math is bitwise the scalar path, docs/cuda.md), meets the accuracy rule against the fp64
// reference, keeps the ordering rules and frees everything.
#include <gtest/gtest.h>

#include <cstring>

#include "ctxpar/device.h"
#include "cuda/device_support.h"
#include "device/forwarding_device.h"
#include "strategy/strategy_support.h"

namespace ctxpar::testing {
namespace {

struct Case {
  StrategyKind kind;
  int u;  // hybrid's ulysses degree
};

std::vector<Case> cases_for(int p) {
  std::vector<Case> cases = {
      {StrategyKind::ring, 0}, {StrategyKind::allgather, 0}, {StrategyKind::ulysses, 0}};
  for (int u = 1; u < p; ++u)
    if (p % u == 0) cases.push_back({StrategyKind::hybrid, u});
  return cases;
}

// fp32 and bf16 storage (out, dout and the gradients as the inputs: bf16 ranks hold them so).
void every_strategy(DType dtype) {
  Problem pr;
  pr.hq = 12;
  pr.hkv = 4;
  pr.tokens = 48;
  pr.dtype = dtype;
  pr.out_dtype = dtype;
  pr.build();
  for (const char* mask : {"none", "causal", "window:7,3", "causal+documents"})
    for (int p = 1; p <= 4; ++p)
      for (const Case& c : cases_for(p))
        for (LayoutKind layout :
             {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped}) {
          StrategyOptions opt{.kind = c.kind, .ulysses_degree = c.u, .mask = parse_mask(mask)};
          const RunResult cpu = run_sharded(pr, p, layout, opt);
          RecordingCudaDevices devices;
          opt.device = devices.options();
          const RunResult cuda = run_sharded(pr, p, layout, opt);
          const std::string where = std::string(strategy_name(c.kind)) +
                                    " u=" + std::to_string(c.u) + " P=" + std::to_string(p) + " " +
                                    layout_name(layout) + " " + mask;
          EXPECT_EQ(bits_differ(cpu, cuda), "") << where;
          EXPECT_EQ(devices.problems(), "") << where;
          EXPECT_EQ(int(devices.reports().size()), p) << where;
          for (int r = 0; r < p; ++r)
            EXPECT_EQ(cpu.forward_stats[r].attention_flops, cuda.forward_stats[r].attention_flops)
                << where << " rank " << r;
        }
}

TEST(CudaDevice, BitwiseTheCpuScalarPathEveryStrategyLayoutMaskP) { every_strategy(DType::f32); }
TEST(CudaDevice, Bf16BitwiseTheCpuScalarPathEveryStrategyLayoutMaskP) {
  every_strategy(DType::bf16);
}

// The ring on a cuda device that leaves out the compute stream's waits for received blocks
// (SkippingReceiveWaits): the run does not throw, but the recording API's log shows a read of
// the comm stream's write with no wait in between.
TEST(CudaDevice, RemovedWaitIsSeenInTheLog) {
  Problem pr;
  pr.mask = parse_mask("causal");
  pr.build();
  StrategyOptions opt;
  opt.mask = pr.mask;
  opt.kind = StrategyKind::ring;
  RecordingCudaDevices devices;
  opt.device = devices.options();
  opt.device.registry = skipping_receive_waits(opt.device.registry, DeviceKind::cuda);
  run_sharded(pr, 2, LayoutKind::zigzag, opt);
  const std::string problems = devices.problems();
  EXPECT_NE(problems.find("with no wait in between"), std::string::npos) << problems;
}

}  // namespace
}  // namespace ctxpar::testing

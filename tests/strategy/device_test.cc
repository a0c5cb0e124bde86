// One strategy code for every device: on the simulated asynchronous device (sim: streams run
// by worker threads, random delays, race checks) every strategy gives the cpu device's bits,
// forward and backward, for every layout, mask and P; and a wait left out is caught by sim.
#include <gtest/gtest.h>

#include <cstring>

#include "ctxpar/device.h"
#include "device/forwarding_device.h"
#include "strategy/strategy_support.h"

namespace ctxpar::testing {
namespace {

struct Case {
  StrategyKind kind;
  int u;  // hybrid's ulysses degree
};

bool same_bits(const RunResult& a, const RunResult& b) {
  for (auto [x, y] :
       {std::pair{&a.o, &b.o}, {&a.lse, &b.lse}, {&a.dq, &b.dq}, {&a.dk, &b.dk}, {&a.dv, &b.dv}})
    if (x->bytes() != y->bytes() || std::memcmp(x->data(), y->data(), x->bytes()) != 0)
      return false;
  return true;
}

// Hq = 12 divides over every P in 1..4 (Ulysses); Hkv = 4 is split (P = 1, 2, 4) or
// replicated (P = 3). T = 48 divides by 2P for zigzag.
TEST(Device, SimBitwiseEqualsCpuEveryStrategyLayoutMaskP) {
  Problem pr;
  pr.hq = 12;
  pr.hkv = 4;
  pr.tokens = 48;
  pr.build();
  uint64_t seed = 1;
  for (int p = 1; p <= 4; ++p) {
    std::vector<Case> cases = {
        {StrategyKind::ring, 0}, {StrategyKind::allgather, 0}, {StrategyKind::ulysses, 0}};
    for (int u = 1; u < p; ++u)
      if (p % u == 0) cases.push_back({StrategyKind::hybrid, u});
    for (const Case& c : cases)
      for (LayoutKind layout : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped})
        for (const char* mask : {"none", "causal", "window:7,3", "causal+documents"}) {
          StrategyOptions opt;
          opt.kind = c.kind;
          opt.ulysses_degree = c.u;
          opt.mask = parse_mask(mask);
          const RunResult cpu = run_sharded(pr, p, layout, opt);
          opt.device.kind = DeviceKind::sim;
          opt.device.sim_seed = seed++;
          opt.device.sim_max_delay_us = 50;
          const RunResult sim = run_sharded(pr, p, layout, opt);
          EXPECT_TRUE(same_bits(cpu, sim))
              << strategy_name(c.kind) << " u=" << c.u << " P=" << p << " " << layout_name(layout)
              << " " << mask << " sim seed " << opt.device.sim_seed;
        }
  }
}

// Devices that leave out the compute stream's wait for each received K/V block
// (SkippingReceiveWaits, injected through the options' registry): sim refuses the compute that
// reads it, naming both operations; cpu (where a received buffer is complete once the host
// reads it) still gives the right bits.
TEST(Device, RemovedWaitFailsSimNotCpu) {
  const std::shared_ptr<const DeviceRegistry> skipping = skipping_receive_waits(
      skipping_receive_waits(DeviceRegistry::builtin(), DeviceKind::cpu), DeviceKind::sim);
  Problem pr;
  pr.mask = parse_mask("causal");
  pr.build();
  StrategyOptions opt;
  opt.mask = pr.mask;
  for (StrategyKind kind : {StrategyKind::ring, StrategyKind::hybrid}) {
    opt.kind = kind;
    opt.ulysses_degree = kind == StrategyKind::hybrid ? 2 : 0;
    const RunResult good = run_sharded(pr, 4, LayoutKind::zigzag, opt);
    {
      opt.device.registry = skipping;
      const RunResult cpu = run_sharded(pr, 4, LayoutKind::zigzag, opt);
      EXPECT_TRUE(same_bits(good, cpu)) << strategy_name(kind);
      opt.device.kind = DeviceKind::sim;
      try {
        run_sharded(pr, 4, LayoutKind::zigzag, opt);
        ADD_FAILURE() << strategy_name(kind) << ": sim ran without the wait";
      } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("'forward_block' on the compute stream reads a buffer that 'recv' on "
                         "the comm stream writes, with no wait in between"),
                  std::string::npos)
            << m;
      }
      opt.device.kind = DeviceKind::cpu;
      opt.device.registry = nullptr;
    }
    opt.device.kind = DeviceKind::sim;
    EXPECT_TRUE(same_bits(good, run_sharded(pr, 4, LayoutKind::zigzag, opt)))
        << strategy_name(kind) << ": with the wait back, sim is right again";
    opt.device.kind = DeviceKind::cpu;
  }
}

}  // namespace
}  // namespace ctxpar::testing

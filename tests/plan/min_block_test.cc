// The minimal ring block size against the Ring Attention paper (Liu, Zaharia, Abbeel 2023,
// arXiv 2310.01889, Table 2) and against our own schedule simulation.
#include <gtest/gtest.h>

#include "ctxpar/plan.h"

namespace ctxpar {
namespace {

// The paper's assumptions: bf16 K/V (s = 2), every query head has its own K/V head, no mask,
// forward only, F = the device's peak FLOP/s, B = one-direction link bandwidth, no latency.
// Then per step compute 4 c^2 d / F >= transfer 2 c d s / B  <=>  c >= F / B.
// Table 2: A100 NVLink 1.0K, A100 InfiniBand 24.5K, TPU v4 1.0K tokens (rounded by the paper;
// 312e12 / 12.5e9 = 24.96K, so 2% is the tolerance).
TEST(MinBlock, RingAttentionTable2) {
  // The paper's minimal sequence length per device is s = 6c: 6.2K, 149.5K and 6.2K.
  struct Case {
    const char* hardware;
    bool inter;
    double paper_tokens, paper_sequence;
  } cases[] = {{"a100-nvlink", false, 1.0e3, 6.2e3},
               {"a100-infiniband", true, 24.5e3, 149.5e3},
               {"tpu-v4", false, 1.0e3, 6.2e3}};
  for (const auto& c : cases) {
    HardwareSpec h = hardware_preset(c.hardware);
    LinkSpec link = c.inter ? h.inter : h.intra;
    link.latency_us = 0;
    const MinBlock m = min_block_tokens(h.flops, link, 32, 32, 128, 2, 1.0);
    EXPECT_NEAR(m.forward / c.paper_tokens, 1.0, 0.05) << c.hardware << ": " << m.forward;
    EXPECT_NEAR(m.forward, h.flops / (link.gbytes_per_second * 1e9), 1e-6 * m.forward);
    EXPECT_NEAR(6 * m.forward / c.paper_sequence, 1.0, 0.02) << c.hardware;
  }
}

TEST(MinBlock, GeneralisedToDtypeGqaAndCausal) {
  const LinkSpec link{100, 0};
  const double F = 400e12, base = F / 100e9;
  EXPECT_NEAR(min_block_tokens(F, link, 32, 32, 128, 2, 1.0).forward, base, 1e-6 * base);
  EXPECT_NEAR(min_block_tokens(F, link, 32, 32, 128, 4, 1.0).forward, 2 * base, 1e-6 * base);
  EXPECT_NEAR(min_block_tokens(F, link, 32, 8, 128, 2, 1.0).forward, base / 4, 1e-6 * base);
  EXPECT_NEAR(min_block_tokens(F, link, 32, 32, 128, 2, 0.5).forward, 2 * base, 1e-6 * base);
  // Backward: 2.5x the compute against K, V (bf16) plus dK, dV (fp32): 3x the bytes.
  EXPECT_NEAR(min_block_tokens(F, link, 32, 32, 128, 2, 1.0).backward, base * 3 / 2.5, 1e-6 * base);
  // Latency only ever makes the block larger.
  EXPECT_GT(min_block_tokens(F, LinkSpec{100, 10}, 32, 32, 128, 2, 1.0).forward, base);
}

// The closed form and the step-by-step simulation agree: a block 20% above the minimum
// hides its transfers (no exposed time beyond the first step's), one 40% below does not.
TEST(MinBlock, AgreesWithTheScheduleSimulation) {
  const int P = 8;
  RingProblem pr;
  pr.ranks = P;
  pr.heads = pr.kv_heads = 4;
  pr.head_dim = 64;
  pr.dtype_bytes = 2;
  pr.causal = false;
  pr.backward = false;
  pr.links = {LinkSpec{1.0, 0}};
  pr.flops_per_second = {1e11};
  const double c = min_block_tokens(1e11, pr.links[0], 4, 4, 64, 2, 1.0).forward;  // 100
  auto exposed_share = [&](double block) {
    pr.seq = static_cast<int64_t>(block) * P;
    const RingSimulation sim = simulate_ring(pr);
    return sim.exposed_comm / sim.seconds;
  };
  // Positions (8 bytes a token) ride along with the block, so the hidden case needs margin.
  EXPECT_LT(exposed_share(1.2 * c), 1e-9);
  EXPECT_GT(exposed_share(0.6 * c), 0.2);
}

}  // namespace
}  // namespace ctxpar

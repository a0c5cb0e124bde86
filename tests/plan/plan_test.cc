// The whole plan: memory, FLOPs, the video example, JSON, argument checks.
#include <gtest/gtest.h>

#include <ctime>
#include <functional>
#include <vector>

#include <nlohmann/json.hpp>

#include "ctxpar/error.h"
#include "ctxpar/kernel.h"
#include "ctxpar/plan.h"
#include "error_text.h"

namespace ctxpar {
namespace {

PlanInput llama8b(int64_t seq, int cp) {
  PlanInput in;
  in.model = model_preset("llama3-8b");
  in.hardware = hardware_preset("h100");
  in.seq = seq;
  in.cp = cp;
  return in;
}

// Mixed-precision Adam is 2 + 4 + 12 = 18 bytes a parameter when nothing is sharded, and
// ZeRO-3 over dp x cp divides all of it by dp * cp.
TEST(Plan, ModelStatesAndZero) {
  PlanInput in = llama8b(8192, 1);
  in.zero = 0;
  const ModelSpec& m = in.model;
  const MemoryBreakdown a = plan_memory(in);
  EXPECT_NEAR(a.weights + a.gradients + a.optimizer, 18 * m.params(), 1e-6 * m.params());
  in.cp = 4;
  in.dp = 2;
  in.zero = 3;
  const MemoryBreakdown b = plan_memory(in);
  EXPECT_NEAR(b.weights + b.gradients + b.optimizer, 18 * m.params() / 8, 1e-6 * m.params());
  EXPECT_GT(b.gathered_weights, 0);
  in.zero = 1;  // only the optimizer state is sharded
  const MemoryBreakdown c = plan_memory(in);
  EXPECT_NEAR(c.weights, 2 * m.params(), 1e-6 * m.params());
  EXPECT_NEAR(c.optimizer, 12 * m.params() / 8, 1e-6 * m.params());
}

// Activations live on the device's own tokens: cp and tp divide them; full recomputation
// keeps one hidden vector per token per layer (plus one layer's working set).
TEST(Plan, ActivationsScale) {
  PlanInput in = llama8b(65536, 2);
  const MemoryBreakdown two = plan_memory(in);
  in.cp = 8;
  const MemoryBreakdown eight = plan_memory(in);
  EXPECT_NEAR(two.activations / eight.activations, 4.0, 1e-9);
  in.tp = 4;
  EXPECT_NEAR(eight.activations / plan_memory(in).activations, 4.0, 1e-9);
  in.tp = 1;
  in.recompute = Recompute::full;
  const MemoryBreakdown rc = plan_memory(in);
  const double n = 65536 / 8;
  EXPECT_NEAR(rc.activations, 32 * n * 4096 * 2 + eight.activations_per_layer, 1);
  EXPECT_EQ(rc.fits, rc.total <= rc.capacity);
  // The ring's buffers hold two K/V blocks (double buffer): at least 2 * 2 * n * Hkv * D * 2.
  EXPECT_GE(eight.attention_buffers, 2 * 2 * n * 8 * 128 * 2);
}

// Dense FLOPs follow the 6 N D rule (N without the input embedding, which is a lookup); the
// attention FLOPs are the kernel's own count, halved by the causal mask, x3.5 for fwd + bwd.
TEST(Plan, FlopsPerStep) {
  PlanInput in = llama8b(8192, 1);
  const FlopCount f = plan_flops(in);
  const ModelSpec& m = in.model;
  const double n_matmul = m.params() - double(m.vocab) * m.hidden;
  EXPECT_NEAR(f.dense_step / (6 * n_matmul * 8192), 1.0, 1e-3);
  const double full = attention_flops(1, m.heads, 8192, 8192, m.head_dim);
  EXPECT_NEAR(f.attention_forward / (full / 2), 1.0, 1.0 / 8192 + 1e-12);
  EXPECT_NEAR(f.attention_step, 3.5 * m.layers * f.attention_forward, 1);
  in.cp = 4;
  in.tp = 2;
  in.dp = 4;
  EXPECT_NEAR(plan_flops(in).per_device, f.total_step / 8, 1e-6 * f.total_step);
}

// One hour of video for LWM-7B: the plan says how many ranks it needs, and that figure is
// the smallest power of two that fits.
TEST(Plan, OneHourOfVideoOnLwm7b) {
  PlanInput in;
  in.model = model_preset("lwm-7b");
  in.hardware = hardware_preset("a100-nvlink");
  in.seq = video_tokens(1, 1, 256);
  ASSERT_EQ(in.seq, 921600);
  in.cp = 8;
  const Plan p = make_plan(in);
  ASSERT_GT(p.cp_to_fit, 8);
  EXPECT_FALSE(p.memory.fits);
  EXPECT_LE(p.cp_to_fit_recompute, p.cp_to_fit);
  in.cp = p.cp_to_fit;
  EXPECT_TRUE(plan_memory(in).fits);
  in.cp = p.cp_to_fit / 2;
  EXPECT_FALSE(plan_memory(in).fits);
}

TEST(Plan, JsonCarriesEveryFigure) {
  PlanInput in = llama8b(131072, 8);
  const Plan p = make_plan(in, true);
  const auto j = nlohmann::json::parse(plan_json(p));
  EXPECT_DOUBLE_EQ(j["min_block_tokens"].get<double>(), p.min_block.tokens);
  EXPECT_DOUBLE_EQ(j["memory"]["total"].get<double>(), p.memory.total);
  EXPECT_EQ(j["memory"]["fits"].get<bool>(), p.memory.fits);
  EXPECT_EQ(j["ring_layer"]["ranks"].size(), 8u);
  EXPECT_EQ(j["ring_layer"]["ranks"][0]["steps"].size(), 16u);  // 8 forward + 8 backward
  EXPECT_EQ(j["strategies"].size(), 4u);
  EXPECT_EQ(j["comm_bytes_per_device"].size(), p.comm.size());
  EXPECT_FALSE(plan_table(p).empty());
}

// Across nodes on a slow network, Ulysses inside the node (hybrid) beats the ring whose
// every hop is as slow as its slowest; inside one NVLink node zigzag beats contiguous.
TEST(Plan, CompareRanksStrategies) {
  PlanInput in = llama8b(262144, 16);
  in.hardware = hardware_preset("a100-nvlink");
  in.hardware.inter.gbytes_per_second = 1;
  const Plan p = make_plan(in, true);
  ASSERT_EQ(p.compare.size(), 4u);
  for (size_t i = 1; i < p.compare.size(); ++i)
    if (p.compare[i].valid) {
      EXPECT_LE(p.compare[i - 1].attention_seconds, p.compare[i].attention_seconds);
    }
  double ring = 0, hybrid = 0;
  for (const auto& e : p.compare) {
    if (e.strategy == StrategyKind::ring) ring = e.attention_seconds;
    if (e.strategy == StrategyKind::hybrid) hybrid = e.attention_seconds;
  }
  EXPECT_LT(hybrid, ring);
  PlanInput node = llama8b(131072, 8);
  node.hardware = hardware_preset("a100-nvlink");
  const double zigzag = make_plan(node).ring.efficiency;
  node.layout = LayoutKind::contiguous;
  EXPECT_GT(zigzag, make_plan(node).ring.efficiency + 0.3);
}

double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// `ctxpar plan --seq 4M --cp 4096` once took minutes and ~1 GB: P^2 tile walks (16 tiles
// each) and P^2 step traces per simulation. In CPU seconds, so a loaded machine cannot fail
// it; the simulation is still P^2 steps (~0.3 s each here), so 5 s leaves room for slower CPUs.
TEST(Plan, ManyRanksAnswerInSeconds) {
  PlanInput in = llama8b(int64_t{4} << 20, 4096);
  in.tile = 64;  // as --hardware local: the kernel's tile skipping, the expensive count
  const double c0 = process_cpu_seconds();
  const Plan p = make_plan(in, true);
  EXPECT_LT(process_cpu_seconds() - c0, 5.0);
  ASSERT_EQ(p.ring.ranks.size(), 4096u);
  EXPECT_TRUE(p.ring.ranks[0].forward.empty());  // no P^2 traces above kRingStepsTraced
  EXPECT_GT(p.ring.ranks[0].compute, 0.0);
  EXPECT_EQ(p.compare.size(), 4u);
  // The totals are those of the traces where traces are kept.
  PlanInput small = llama8b(int64_t{1} << 20, kRingStepsTraced);
  small.tile = 64;
  const Plan q = make_plan(small, false);
  for (const auto& t : q.ring.ranks) {
    double compute = 0, wait = 0;
    for (const auto* pass : {&t.forward, &t.backward})
      for (const auto& st : *pass) compute += st.compute, wait += st.wait;
    ASSERT_EQ(t.forward.size(), size_t(kRingStepsTraced));
    EXPECT_NEAR(t.compute, compute, 1e-12 * compute);
    EXPECT_NEAR(t.wait, wait, 1e-9 * (t.compute + wait));
  }
}

TEST(Plan, BadInputNamesTheArgument) {
  auto message = [](PlanInput in) {
    try {
      make_plan(in);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  PlanInput in = llama8b(8192, 8);
  in.tp = 3;
  EXPECT_NE(message(in).find("tp = 3 must divide"), std::string::npos) << message(in);
  in = llama8b(8192, 64);
  in.strategy = StrategyKind::ulysses;  // 32 heads over 64 ranks
  EXPECT_NE(message(in).find("ulysses"), std::string::npos) << message(in);
  in = llama8b(0, 1);
  EXPECT_NE(message(in).find("seq must be > 0"), std::string::npos) << message(in);
}

// The library names its fields, not the ctxpar command's flags (the command adds those where
// it knows them, e.g. --model for an unknown preset: the plan_unknown_model CTest entry).
TEST(Plan, LibraryMessagesNameNoCommandFlag) {
  const auto message = test::error_text;
  std::vector<PlanInput> bad(9, llama8b(8192, 8));
  bad[0].tp = 3;
  bad[1].seq = 0;
  bad[2].batch = 0;
  bad[3].zero = 5;
  bad[4].pp = 1000;
  bad[5].model.heads = 0;
  bad[6].hardware.flops = 0;
  bad[7].hardware.efficiency = 2;
  bad[8].cp = 64;
  bad[8].strategy = StrategyKind::ulysses;
  std::vector<std::string> messages;
  for (const PlanInput& in : bad) messages.push_back(message([&] { make_plan(in); }));
  messages.push_back(message([] { model_preset("nope"); }));
  messages.push_back(message([] { hardware_preset("nope"); }));
  messages.push_back(message([] { video_tokens(0, 1, 1); }));
  for (const std::string& m : messages) {
    EXPECT_NE(m, "no error");
    EXPECT_EQ(m.find("--"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace ctxpar

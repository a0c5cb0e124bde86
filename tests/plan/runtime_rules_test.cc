// The planner holds the runtime's rules, not copies of them: the all-gather head groups, the
// layout's padded length and the ring forward's barrier (docs/faults.md, "Round two: one home for
// every shared rule and model").
#include <gtest/gtest.h>

#include "ctxpar/comm.h"
#include "ctxpar/device.h"
#include "ctxpar/error.h"
#include "ctxpar/layout.h"
#include "ctxpar/plan.h"
#include "ctxpar/strategy.h"
#include "ctxpar/strategy_memory.h"

namespace ctxpar {
namespace {

PlanInput small(int64_t seq, int cp, int64_t heads, int64_t kv_heads) {
  PlanInput in;
  in.model = model_preset("llama3-8b");
  in.model.heads = heads;
  in.model.kv_heads = kv_heads;
  in.hardware = hardware_preset("h100");
  in.seq = seq;
  in.cp = cp;
  return in;
}

// The runtime runs all-gather in the largest divisor of Hkv up to 4 head groups; the planner
// once used min(Hkv, 4), which differs at Hkv = 5, 6, 7 (and every Hkv with no
// divisor 4 or 3 or 2 <= 4 that min picks: 5 -> 1, 6 -> 3, 7 -> 1, 9 -> 3, ...).
TEST(PlanMatchesRuntime, AllGatherHeadGroups) {
  for (int64_t hkv = 1; hkv <= 64; ++hkv) {
    const PlanInput in = small(4096, 4, hkv * 2, hkv);
    EXPECT_EQ(plan_allgather_groups(in), allgather_head_groups(hkv)) << "Hkv = " << hkv;
    EXPECT_EQ(hkv % allgather_head_groups(hkv), 0) << "Hkv = " << hkv;
  }
  EXPECT_EQ(allgather_head_groups(6), 3);
  EXPECT_EQ(allgather_head_groups(7), 1);
  EXPECT_EQ(allgather_head_groups(8), 4);
  EXPECT_EQ(allgather_head_groups(8, 2), 2);  // given groups win
}

// The runtime pads any T to the layout's granule; the planner once refused T % (2)cp != 0.
// Now it plans every length the runtime runs, on the runtime's padded length.
TEST(PlanMatchesRuntime, AnyLengthPlansOnTheRuntimesPaddedLength) {
  for (LayoutKind kind : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped})
    for (int cp : {1, 2, 3, 4, 8})
      for (int64_t seq = 1; seq <= 40; ++seq) {
        const Layout runtime(kind, seq, cp);
        PlanInput in = small(seq, cp, 32, 8);
        in.layout = kind;
        Plan plan;
        try {
          plan = make_plan(in, true);
        } catch (const Error& e) {
          ADD_FAILURE() << layout_name(kind) << " seq " << seq << " cp " << cp << ": " << e.what();
          continue;
        }
        EXPECT_EQ(plan.padded_seq, runtime.padded_tokens())
            << layout_name(kind) << " seq " << seq << " cp " << cp;
        EXPECT_EQ(plan_padded_seq(in), runtime.padded_tokens());
        EXPECT_EQ(plan.block_tokens, runtime.local_tokens());
        EXPECT_EQ(plan.input.seq, seq);
      }
  EXPECT_EQ(layout_granule(LayoutKind::zigzag, 3), 6);
  EXPECT_EQ(layout_granule(LayoutKind::striped, 3), 3);
  EXPECT_EQ(layout_padded_tokens(LayoutKind::zigzag, 8200, 8), 8208);
}

// A length the layout divides plans as it always did: the padded length is the length.
TEST(PlanMatchesRuntime, DividedLengthIsUnchanged) {
  PlanInput in = small(8192, 8, 32, 8);
  const Plan p = make_plan(in, true);
  EXPECT_EQ(p.padded_seq, 8192);
  EXPECT_EQ(p.block_tokens, 1024);
  EXPECT_EQ(plan_table(p).find("padded"), std::string::npos);
  in.seq = 8200;
  EXPECT_NE(plan_table(make_plan(in)).find("sequence 8200 tokens (padded to 8208)"),
            std::string::npos);
}

// ring.cc ends its forward with a barrier when its device lends sent buffers (threads on the
// cpu device). The planner modelled it for hardware named "local", so `plan --hardware local`
// under mpirun (the MPI link, which lends nothing) modelled a barrier the run does not have.
// Now it asks the capability the measurement reports.
TEST(PlanMatchesRuntime, RingBarrierFollowsTheCapabilityNotTheName) {
  PlanInput in = small(65536, 4, 32, 8);
  in.layout = LayoutKind::contiguous;  // causal: the ranks end their forward far apart
  auto forward_wait = [&](const std::string& name, bool lends) {
    in.hardware.name = name;
    in.hardware.lends_sent_buffers = lends;
    double wait = 0;
    for (const RingRankTrace& r : make_plan(in).ring.ranks)
      for (const RingStepTrace& st : r.forward) wait += st.wait;
    return wait;
  };
  EXPECT_EQ(forward_wait("local", false), forward_wait("h100", false));
  EXPECT_GT(forward_wait("h100", true), forward_wait("local", false));
  EXPECT_TRUE(ring_forward_ends_with_barrier(3, true));
  EXPECT_FALSE(ring_forward_ends_with_barrier(2, true));
  EXPECT_FALSE(ring_forward_ends_with_barrier(8, false));
  // What measure_local reports is the cpu device's answer on the threads transport.
  LocalOptions o;  // a quick measurement: its figures do not matter here
  o.ranks = 2, o.block_tokens = 64, o.heads = o.kv_heads = 1, o.head_dim = 16;
  o.min_seconds = 0.001, o.message_bytes = 64;
  bool device_lends = false;
  run_threads(1, [&](Communicator& comm) {
    device_lends = make_device(DeviceOptions{}, 0)->lends_sent_buffers(comm);
  });
  EXPECT_TRUE(device_lends);
  EXPECT_EQ(local_hardware(measure_local(o), 2).lends_sent_buffers, device_lends);
}

}  // namespace
}  // namespace ctxpar

// The memory model every estimate uses (ctxpar/strategy_memory.h) against what the strategies
// really hold: StrategyStats::peak_bytes, the device's count of DeviceBuffers and forward
// states from allocation to release, on P thread ranks. That count does not depend on timing,
// so the model must equal it exactly, for every strategy, pass, layout, mask, dtype, GQA
// shape and P: a change to what a strategy allocates fails here until the model follows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include "ctxpar/plan.h"
#include "ctxpar/strategy_memory.h"
#include "strategy/strategy_support.h"

namespace ctxpar::testing {
namespace {

struct MemoryCase {
  StrategyKind kind;
  int ranks;
  int64_t tokens = 128, hq = 4, hkv = 2;
  DType dtype = DType::f32;
  int ulysses_degree = 0, head_groups = 0, ulysses_groups = 0;
};

std::string describe(const MemoryCase& c, LayoutKind layout, bool documents, AttentionPass pass) {
  return detail::concat(strategy_name(c.kind), " P=", c.ranks, " T=", c.tokens, " Hq=", c.hq,
                        " Hkv=", c.hkv, " ", dtype_name(c.dtype), " u=", c.ulysses_degree,
                        " head_groups=", c.head_groups, " ulysses_groups=", c.ulysses_groups, " ",
                        layout_name(layout), documents ? " documents" : "",
                        pass == AttentionPass::backward ? " backward" : " forward");
}

TEST(MemoryModel, EqualsEveryStrategysMeasuredPeak) {
  const std::vector<MemoryCase> cases = {
      {StrategyKind::ring, 1},
      {StrategyKind::ring, 2},
      {StrategyKind::ring, 3},
      {StrategyKind::ring, 4},
      {StrategyKind::ring, 4, 128, 4, 2, DType::bf16},
      {StrategyKind::ring, 2, 2048, 2, 1},  // two pieces on the last hop (Tl = 1024)
      {StrategyKind::allgather, 1},
      {StrategyKind::allgather, 2},
      {StrategyKind::allgather, 4},
      {StrategyKind::allgather, 3, 96, 4, 4, DType::f32, 0, 1},
      {StrategyKind::allgather, 4, 128, 8, 4, DType::bf16, 0, 4},  // four head groups
      {StrategyKind::ulysses, 2},
      {StrategyKind::ulysses, 4},
      {StrategyKind::ulysses, 2, 128, 8, 8},                        // four pipeline groups
      {StrategyKind::ulysses, 2, 128, 8, 4, DType::bf16, 0, 0, 2},  // two
      {StrategyKind::ulysses, 4, 128, 8, 2},                        // replicated KV heads
      {StrategyKind::hybrid, 2},
      {StrategyKind::hybrid, 4, 128, 4, 2, DType::f32, 2},
      {StrategyKind::hybrid, 8, 256, 4, 4, DType::f32, 2},        // a ring of four
      {StrategyKind::hybrid, 6, 96, 4, 2, DType::bf16, 2, 0, 2},  // a ring of three
  };
  for (const MemoryCase& c : cases)
    for (LayoutKind layout : {LayoutKind::zigzag, LayoutKind::contiguous})
      for (bool documents : {false, true}) {
        Problem pr;
        pr.tokens = c.tokens, pr.hq = c.hq, pr.hkv = c.hkv, pr.dtype = c.dtype;
        pr.mask = Mask::causal_mask();
        pr.mask.documents = documents;
        pr.build();
        StrategyOptions opt;
        opt.kind = c.kind;
        opt.mask = pr.mask;
        opt.ulysses_degree = c.ulysses_degree;
        opt.head_groups = c.head_groups;
        opt.ulysses_groups = c.ulysses_groups;
        opt.exchange = Exchange::ring;  // exact; the needed exchange: the test below
        const RunResult res = run_sharded(pr, c.ranks, layout, opt, true);
        AttentionDims dims;
        dims.batch = pr.batch;
        dims.seq = layout_padded_tokens(layout, pr.tokens, c.ranks);
        dims.heads = pr.hq, dims.kv_heads = pr.hkv, dims.head_dim = pr.d;
        dims.dtype = pr.dtype, dims.out_dtype = pr.out_dtype;
        for (AttentionPass pass : {AttentionPass::forward, AttentionPass::backward}) {
          const auto& stats =
              pass == AttentionPass::backward ? res.backward_stats : res.forward_stats;
          size_t measured = 0;
          for (const StrategyStats& s : stats) measured = std::max(measured, s.peak_bytes);
          EXPECT_EQ(attention_buffer_bytes(opt, dims, c.ranks, pass), double(measured))
              << describe(c, layout, documents, pass);
        }
      }
}

// The ring's needed exchange holds the tiles the mask needs: the model is its most (every tile
// needed, as under a documents mask of one document), reached exactly there, and a bound when
// fewer tiles travel.
TEST(MemoryModel, IsTheNeededExchangesMostAndBoundsIt) {
  for (StrategyKind kind : {StrategyKind::ring, StrategyKind::allgather})
    for (int p : {1, 2, 3, 4, 5})
      for (bool one_document : {true, false}) {
        Problem pr;
        pr.tokens = 64 * 2 * p, pr.hq = 4, pr.hkv = 2;
        pr.mask = parse_mask(one_document ? "documents" : "causal+documents");
        pr.seed = 60 + p;
        pr.build();
        if (one_document) std::fill(pr.documents.begin(), pr.documents.end(), 0);
        StrategyOptions opt;
        opt.kind = kind;
        opt.mask = pr.mask;
        opt.exchange = Exchange::needed;
        const RunResult res = run_sharded(pr, p, LayoutKind::contiguous, opt, true);
        AttentionDims dims;
        dims.seq = pr.tokens, dims.heads = pr.hq, dims.kv_heads = pr.hkv, dims.head_dim = pr.d;
        for (AttentionPass pass : {AttentionPass::forward, AttentionPass::backward}) {
          size_t measured = 0;
          for (const StrategyStats& st :
               pass == AttentionPass::backward ? res.backward_stats : res.forward_stats)
            measured = std::max(measured, st.peak_bytes);
          const double model = attention_buffer_bytes(opt, dims, p, pass);
          const std::string where =
              detail::concat(strategy_name(kind), " P=", p, " mask=", pr.mask.describe(),
                             one_document ? " one document" : "",
                             pass == AttentionPass::backward ? " bwd" : " fwd");
          if (one_document)
            EXPECT_EQ(model, double(measured)) << where;
          else
            EXPECT_LE(double(measured), model) << where;
        }
      }
}

// The planner, `ctxpar attention` and `ctxpar train` once had a model each (ring forward: two
// K/V blocks in one, three in another); they now call this one, so a plan's attention buffers
// are the runtime's peak for the plan's shape.
TEST(MemoryModel, IsTheOneThePlannerUses) {
  PlanInput in;
  in.model = model_preset("llama3-8b");
  in.hardware = hardware_preset("h100");
  in.seq = 131072;
  in.cp = 8;
  in.tp = 1;
  for (StrategyKind kind :
       {StrategyKind::ring, StrategyKind::allgather, StrategyKind::ulysses, StrategyKind::hybrid}) {
    in.strategy = kind;
    StrategyOptions opt;
    opt.kind = kind;
    opt.ulysses_degree = kind == StrategyKind::hybrid ? plan_ulysses_degree(in) : 0;
    opt.mask = Mask::causal_mask();
    AttentionDims dims;
    dims.seq = plan_padded_seq(in);
    dims.heads = in.model.heads, dims.kv_heads = in.model.kv_heads;
    dims.head_dim = in.model.head_dim;
    dims.dtype = dims.out_dtype = in.dtype;
    EXPECT_EQ(plan_memory(in).attention_buffers,
              std::max(attention_buffer_bytes(opt, dims, in.cp, AttentionPass::forward),
                       attention_buffer_bytes(opt, dims, in.cp, AttentionPass::backward)))
        << strategy_name(kind);
  }
}

// The planner's all-gather head groups are the runtime's, seen running: at P = 2 each group's
// gather is one send per rank, so a forward's sends count the groups the strategy ran.
TEST(PlanMatchesRunningRuntime, AllGatherHeadGroups) {
  for (int64_t hkv = 1; hkv <= 8; ++hkv) {
    Problem pr;
    pr.tokens = 32, pr.hq = 2 * hkv, pr.hkv = hkv;
    pr.mask = Mask::causal_mask();
    pr.build();
    StrategyOptions opt;
    opt.kind = StrategyKind::allgather;
    opt.mask = pr.mask;
    const RunResult res = run_sharded(pr, 2, LayoutKind::zigzag, opt, false);
    const uint64_t groups = res.counters[0].calls_of(CommKind::send);
    PlanInput in;
    in.model = model_preset("llama3-8b");
    in.model.heads = pr.hq, in.model.kv_heads = hkv;
    in.hardware = hardware_preset("h100");
    in.seq = 4096, in.cp = 2, in.strategy = StrategyKind::allgather;
    EXPECT_EQ(uint64_t(plan_allgather_groups(in)), groups) << "Hkv = " << hkv;
  }
}

}  // namespace
}  // namespace ctxpar::testing

// Note [One call frame] (ctxpar/strategy.h): every algorithm's forward / backward goes through
// the one frame of the base class -- the same argument checks, the same cross-rank agreement
// (which names the field that differs), the same stats -- and create() takes the caller's device.
#include <gtest/gtest.h>

#include <cstring>

#include "strategy/strategy_support.h"

namespace ctxpar::testing {
namespace {

struct Kind {
  StrategyKind kind;
  int u;
};
const Kind kKinds[] = {{StrategyKind::ring, 0},
                       {StrategyKind::allgather, 0},
                       {StrategyKind::ulysses, 0},
                       {StrategyKind::hybrid, 2}};

StrategyOptions options_of(const Kind& k) {
  StrategyOptions o;
  o.kind = k.kind;
  o.ulysses_degree = k.u;
  o.mask = parse_mask("causal");
  return o;
}

std::string differs(const Kind& k, const char* call, const std::string& difference) {
  return std::string(strategy_name(k.kind)) + " " + call +
         ": the ranks were called with different arguments: " + difference +
         "; every rank of the communicator must pass the same";
}

// A rank that has thrown may stop another still in the agreement's last exchange: that one's
// error then opens with "rank r: stopped because rank s failed: " and goes on with the same text.
void expect_ends_with(const std::string& e, const std::string& want) {
  EXPECT_TRUE(e.size() >= want.size() && e.compare(e.size() - want.size(), want.size(), want) == 0)
      << "got:  " << e << "\nwant: " << want;
}

TEST(Frame, EveryStrategyRecordsItsStats) {
  Problem pr;
  pr.mask = parse_mask("causal");
  pr.build();
  for (const Kind& k : kKinds) {
    const RunResult r = run_sharded(pr, 4, LayoutKind::zigzag, options_of(k));
    for (const auto* stats : {&r.forward_stats, &r.backward_stats})
      for (const StrategyStats& s : *stats) {
        EXPECT_GT(s.attention_flops, 0) << strategy_name(k.kind);
        EXPECT_GT(s.wall_seconds, 0) << strategy_name(k.kind);
        EXPECT_GT(s.bytes_sent, 0u) << strategy_name(k.kind);
        EXPECT_GT(s.bytes_received, 0u) << strategy_name(k.kind);
        EXPECT_GT(s.peak_bytes, 0u) << strategy_name(k.kind);
      }
  }
}

// A field that differs on one rank is named, with both values, on every rank, for every
// strategy: an option at create(), a shape or dtype at forward / backward.
TEST(Frame, ADisagreeingFieldIsNamedForEveryStrategy) {
  for (const Kind& k : kKinds) {
    auto create_errors = errors_on_ranks(4, [&](Communicator& comm) {
      StrategyOptions o = options_of(k);
      o.mask = parse_mask(comm.rank() == 1 ? "causal+window:64,0" : "causal+window:128,0");
      Strategy::create(comm, o);
    });
    for (const std::string& e : create_errors)
      expect_ends_with(e, differs(k, "create",
                                  "mask is causal+window:128,0 on rank 0 but "
                                  "causal+window:64,0 on rank 1"));
    auto groups_errors = errors_on_ranks(2, [&](Communicator& comm) {
      StrategyOptions o = options_of(k);
      o.ulysses_groups = comm.rank() == 0 ? 2 : 0;
      Strategy::create(comm, o);
    });
    for (const std::string& e : groups_errors)
      expect_ends_with(e, differs(k, "create", "ulysses_groups is 2 on rank 0 but 0 on rank 1"));
    auto tier_errors = errors_on_ranks(2, [&](Communicator& comm) {
      StrategyOptions o = options_of(k);  // one rank on the fast bf16 tier: refused, not mixed
      o.kernel.bf16_tier = comm.rank() == 1 ? Bf16Tier::fast : Bf16Tier::exact;
      Strategy::create(comm, o);
    });
    for (const std::string& e : tier_errors)
      expect_ends_with(e, differs(k, "create",
                                  "kernel bf16 tier is exact on rank 0 but fast on "
                                  "rank 1"));

    for (bool backward : {false, true}) {
      auto errors = errors_on_ranks(4, [&](Communicator& comm) {
        auto s = Strategy::create(comm, options_of(k));
        const int64_t tl = 12, hq = 4, hkv = comm.rank() == 3 ? 4 : 2, d = 16;
        Tensor q(DType::f32, {1, tl, hq, d}), k(DType::f32, {1, tl, hkv, d}),
            v(DType::f32, {1, tl, hkv, d}), o(DType::f32, {1, tl, hq, d}),
            lse(DType::f32, {1, hq, tl}), dout(DType::f32, {1, tl, hq, d}),
            dq(DType::f32, {1, tl, hq, d}), dk(DType::f32, {1, tl, hkv, d}),
            dv(DType::f32, {1, tl, hkv, d});
        const Layout layout(LayoutKind::zigzag, tl * 4, 4);
        const std::vector<int64_t> positions = layout.positions(comm.rank());
        const Tokens tokens{positions, {}};
        if (backward)
          s->backward(q, k, v, tokens, o, lse, dout, dq, dk, dv);
        else
          s->forward(q, k, v, tokens, o, lse);
      });
      for (const std::string& e : errors)
        expect_ends_with(e, differs(k, backward ? "backward" : "forward",
                                    "kv heads Hkv is 2 on rank 0 but 4 on rank 3"));
    }
  }
}

// create() on the caller's device: the strategy enqueues on it (its counters move), and the
// answer is the same bits as on the device the options name.
TEST(Frame, CreateTakesTheCallersDevice) {
  Problem pr;
  pr.mask = parse_mask("causal");
  pr.build();
  const Layout layout(LayoutKind::contiguous, pr.tokens, 2);
  for (const Kind& k : {kKinds[0], kKinds[2]}) {
    std::vector<Tensor> outs(2);
    for (bool own_device : {false, true})
      run_threads(2, [&](Communicator& comm) {
        const int r = comm.rank();
        std::unique_ptr<Device> dev;
        Device* given = nullptr;
        if (own_device) {
          DeviceOptions sim;
          sim.kind = DeviceKind::sim;
          dev = make_device(sim, r);
          given = dev.get();
        }
        auto s = Strategy::create(comm, options_of(k), std::move(dev));
        if (own_device) {
          EXPECT_EQ(&s->device(), given);
          EXPECT_EQ(s->device().name(), "sim");
        }
        Tensor q = layout.shard(pr.q, r), kk = layout.shard(pr.k, r), v = layout.shard(pr.v, r);
        Tensor o(DType::f32, q.shape()), lse(DType::f32, {pr.batch, pr.hq, q.dim(1)});
        const std::vector<int64_t> positions = layout.positions(r);
        s->forward(q, kk, v, Tokens{positions, {}}, o, lse);
        if (own_device) {
          EXPECT_GT(given->counters().flops, 0);
        }
        if (r == 0) {
          if (!own_device)
            outs[0] = std::move(o);
          else
            outs[1] = std::move(o);
        }
      });
    EXPECT_EQ(std::memcmp(outs[0].data(), outs[1].data(), outs[0].bytes()), 0)
        << strategy_name(k.kind);
  }
}

}  // namespace
}  // namespace ctxpar::testing

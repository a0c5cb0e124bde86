// Every strategy x layout x mask x P x (MHA, GQA), forward and backward, against the fp64
// reference of the whole unsharded problem.
// Rule (as the kernel's): max|strategy - ref64| <= 2 * max|naive32 - ref64| + floor, with
// floor = 1e-5 * max(1, max|ref64|); and no drift with P: err_P <= 1.5 * err_1 + floor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <sstream>

#include "strategy/strategy_support.h"

namespace ctxpar::testing {
namespace {

struct Heads {
  int64_t batch, hq, hkv, d;
  const char* name;
};
// MHA with 24 heads lets Ulysses split over every P in {1, 2, 3, 4, 8}; GQA 8/2 (batch 2) splits
// KV heads for P = 2 and replicates them for P = 4, 8 (P = 3 is invalid for Ulysses: Hq % P).
const Heads kHeads[] = {{1, 24, 24, 16, "MHA"}, {2, 8, 2, 32, "GQA"}};
const char* const kMasks[] = {
    "none", "causal", "window:8,4", "documents", "causal+window:6,-1", "causal+documents"};
const int kRanks[] = {1, 2, 3, 4, 8};
const LayoutKind kLayouts[] = {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped};

bool valid_for(StrategyKind kind, const Heads& h, int p, int u) {
  auto ulysses_ok = [&](int n) { return h.hq % n == 0; };
  if (kind == StrategyKind::ulysses) return ulysses_ok(p);
  if (kind == StrategyKind::hybrid) return ulysses_ok(u);
  return true;
}

// Hybrid's Ulysses degree for P: a real mix where P allows it.
int hybrid_degree(int p, int mask_index) {
  switch (p) {
    case 2:
      return mask_index % 2 ? 2 : 1;
    case 3:
      return mask_index % 2 ? 3 : 1;
    case 4:
      return 2;
    case 8:
      return mask_index % 2 ? 4 : 2;
  }
  return 1;
}

void check_grid(StrategyKind kind) {
  int runs = 0;
  for (const Heads& h : kHeads)
    for (int mi = 0; mi < 6; ++mi) {
      Problem pr;
      pr.batch = h.batch;
      pr.hq = h.hq;
      pr.hkv = h.hkv;
      pr.d = h.d;
      pr.mask = parse_mask(kMasks[mi]);
      pr.seed = 3 + mi;
      pr.build();
      const References& refs = references_of(pr);
      const Errors bound = bounds_of(refs);
      StrategyOptions opt;
      opt.kind = kind;
      opt.mask = pr.mask;
      // Single rank: the kernel's own error on this problem.
      const Errors e1 = errors_of(run_sharded(pr, 1, LayoutKind::contiguous, opt), refs);
      for (int p : kRanks)
        for (LayoutKind lk : kLayouts) {
          if (p == 1 && lk != LayoutKind::contiguous) continue;
          opt.ulysses_degree = kind == StrategyKind::hybrid ? hybrid_degree(p, mi) : 0;
          if (!valid_for(kind, h, p, opt.ulysses_degree ? opt.ulysses_degree : p)) continue;
          const Errors e = errors_of(run_sharded(pr, p, lk, opt), refs);
          ++runs;
          std::ostringstream where;
          where << strategy_name(kind) << " " << h.name << " mask=" << kMasks[mi] << " P=" << p
                << " u=" << opt.ulysses_degree << " layout=" << layout_name(lk);
          auto check = [&](const char* what, double err, double bnd, double err1,
                           const std::vector<double>& ref) {
            EXPECT_LE(err, bnd) << where.str() << ": " << what << " vs fp64 reference";
            EXPECT_LE(err, 1.5 * err1 + floor_of(ref))
                << where.str() << ": " << what << " error grew with P (P=1 error " << err1 << ")";
          };
          check("O", e.o, bound.o, e1.o, refs.ref64.o);
          check("LSE", e.lse, bound.lse, e1.lse, refs.ref64.lse);
          check("dQ", e.dq, bound.dq, e1.dq, refs.ref64.dq);
          check("dK", e.dk, bound.dk, e1.dk, refs.ref64.dk);
          check("dV", e.dv, bound.dv, e1.dv, refs.ref64.dv);
        }
    }
  EXPECT_GT(runs, 100) << "the grid should cover most of strategy x layout x mask x P x heads";
}

TEST(Accuracy, RingMatchesReference) { check_grid(StrategyKind::ring); }
TEST(Accuracy, AllGatherMatchesReference) { check_grid(StrategyKind::allgather); }
TEST(Accuracy, UlyssesMatchesReference) { check_grid(StrategyKind::ulysses); }
TEST(Accuracy, HybridMatchesReference) { check_grid(StrategyKind::hybrid); }

// Any length: T = 45 divides by none of the layouts' granules for P in {2, 4} (nor zigzag's 6
// for P = 3); the layout pads, and the real tokens' results obey the same rule against the
// fp64 reference of the unpadded problem, for every strategy x layout x mask.
TEST(Accuracy, AnyLengthEveryStrategyLayoutMask) {
  int runs = 0;
  for (int mi = 0; mi < 6; ++mi) {
    Problem pr;
    pr.tokens = 45;
    pr.hq = 12;
    pr.hkv = 4;
    pr.mask = parse_mask(kMasks[mi]);
    pr.seed = 40 + mi;
    pr.build();
    const References& refs = references_of(pr);
    const Errors bound = bounds_of(refs);
    for (StrategyKind kind :
         {StrategyKind::ring, StrategyKind::allgather, StrategyKind::ulysses, StrategyKind::hybrid})
      for (int p : {2, 3, 4})
        for (LayoutKind lk : kLayouts) {
          StrategyOptions opt;
          opt.kind = kind;
          opt.mask = pr.mask;
          opt.ulysses_degree = kind == StrategyKind::hybrid ? (p == 4 ? 2 : 1) : 0;
          const Errors e = errors_of(run_sharded(pr, p, lk, opt), refs);
          ++runs;
          const std::string where = std::string(strategy_name(kind)) + " mask=" + kMasks[mi] +
                                    " P=" + std::to_string(p) + " layout=" + layout_name(lk);
          EXPECT_LE(e.o, bound.o) << where;
          EXPECT_LE(e.lse, bound.lse) << where;
          EXPECT_LE(e.dq, bound.dq) << where;
          EXPECT_LE(e.dk, bound.dk) << where;
          EXPECT_LE(e.dv, bound.dv) << where;
        }
  }
  EXPECT_EQ(runs, 6 * 4 * 3 * 3);
}

// bf16 storage: the K/V that travel are bf16; accumulation stays fp32, outputs fp32.
TEST(Accuracy, Bf16StorageEveryStrategy) {
  Problem pr;
  pr.hq = 8;
  pr.hkv = 4;
  pr.tokens = 64;
  pr.dtype = DType::bf16;
  pr.mask = Mask::causal_mask();
  pr.build();
  const References& refs = references_of(pr);
  const Errors bound = bounds_of(refs);
  for (StrategyKind kind :
       {StrategyKind::ring, StrategyKind::allgather, StrategyKind::ulysses, StrategyKind::hybrid}) {
    StrategyOptions opt;
    opt.kind = kind;
    opt.mask = pr.mask;
    opt.ulysses_degree = kind == StrategyKind::hybrid ? 2 : 0;
    const Errors e = errors_of(run_sharded(pr, 4, LayoutKind::zigzag, opt), refs);
    EXPECT_LE(e.o, bound.o) << strategy_name(kind);
    EXPECT_LE(e.lse, bound.lse) << strategy_name(kind);
    EXPECT_LE(e.dq, bound.dq) << strategy_name(kind);
    EXPECT_LE(e.dk, bound.dk) << strategy_name(kind);
    EXPECT_LE(e.dv, bound.dv) << strategy_name(kind);
  }
}

// bf16 outputs and gradients (out, dout, dq, dk, dv held as bf16 by the ranks): accumulation
// is fp32 until the single final rounding, so the error is the rule's plus one bf16 rounding
// (relative 2^-8) of the largest value.
TEST(Accuracy, Bf16OutputsAndGradients) {
  Problem pr;
  pr.hq = 8;
  pr.hkv = 2;
  pr.dtype = DType::bf16;
  pr.out_dtype = DType::bf16;
  pr.mask = parse_mask("causal+window:20,-1");
  pr.build();
  const References& refs = references_of(pr);
  const Errors bound = bounds_of(refs);
  const double r = std::ldexp(1.0, -8);
  for (StrategyKind kind :
       {StrategyKind::ring, StrategyKind::allgather, StrategyKind::ulysses, StrategyKind::hybrid}) {
    StrategyOptions opt;
    opt.kind = kind;
    opt.mask = pr.mask;
    opt.ulysses_degree = kind == StrategyKind::hybrid ? 2 : 0;
    const Errors e = errors_of(run_sharded(pr, 4, LayoutKind::zigzag, opt), refs);
    EXPECT_LE(e.o, bound.o + r * max_abs(refs.ref64.o)) << strategy_name(kind);
    EXPECT_LE(e.lse, bound.lse) << strategy_name(kind);  // LSE stays fp32
    EXPECT_LE(e.dq, bound.dq + r * max_abs(refs.ref64.dq)) << strategy_name(kind);
    EXPECT_LE(e.dk, bound.dk + r * max_abs(refs.ref64.dk)) << strategy_name(kind);
    EXPECT_LE(e.dv, bound.dv + r * max_abs(refs.ref64.dv)) << strategy_name(kind);
  }
}

// Ulysses' KV-head replication when Hkv does not split over the ranks: one KV head per rank
// (Hq 8, Hkv 2, P 4 in the grid above), or one KV slot per query head when a rank's query heads
// straddle KV heads (Hq 6, Hkv 2, P 3: rank 1 reads KV heads 0 and 1; Hq 12, Hkv 3, P 2).
TEST(Accuracy, UlyssesReplicatesKvHeadsThatDoNotSplit) {
  struct Case {
    int64_t hq, hkv;
    int p, u;
    StrategyKind kind;
  } cases[] = {{6, 2, 3, 0, StrategyKind::ulysses},
               {12, 3, 2, 0, StrategyKind::ulysses},
               {6, 2, 6, 3, StrategyKind::hybrid}};
  for (const Case& c : cases)
    for (const char* mask : {"causal", "window:7,7+documents"}) {
      Problem pr;
      pr.hq = c.hq;
      pr.hkv = c.hkv;
      pr.mask = parse_mask(mask);
      pr.build();
      const References& refs = references_of(pr);
      const Errors bound = bounds_of(refs);
      StrategyOptions opt;
      opt.kind = c.kind;
      opt.mask = pr.mask;
      opt.ulysses_degree = c.u;
      const Errors e = errors_of(run_sharded(pr, c.p, LayoutKind::zigzag, opt), refs);
      const std::string where = std::string(strategy_name(c.kind)) + " Hq=" + std::to_string(c.hq) +
                                " Hkv=" + std::to_string(c.hkv) + " P=" + std::to_string(c.p) +
                                " mask=" + mask;
      EXPECT_LE(e.o, bound.o) << where;
      EXPECT_LE(e.lse, bound.lse) << where;
      EXPECT_LE(e.dq, bound.dq) << where;
      EXPECT_LE(e.dk, bound.dk) << where;
      EXPECT_LE(e.dv, bound.dv) << where;
    }
}

// Kernel threads inside each rank (OpenMP within a run_threads rank) change nothing but speed.
TEST(Accuracy, KernelThreadsInsideRanks) {
  Problem pr;
  pr.hq = 4;
  pr.hkv = 2;
  pr.tokens = 96;
  pr.mask = Mask::causal_mask();
  pr.build();
  const References& refs = references_of(pr);
  const Errors bound = bounds_of(refs);
  for (StrategyKind kind :
       {StrategyKind::ring, StrategyKind::allgather, StrategyKind::ulysses, StrategyKind::hybrid}) {
    StrategyOptions opt;
    opt.kind = kind;
    opt.mask = pr.mask;
    opt.kernel.threads = 2;
    const Errors e = errors_of(run_sharded(pr, 2, LayoutKind::zigzag, opt), refs);
    EXPECT_LE(e.o, bound.o) << strategy_name(kind);
    EXPECT_LE(e.dq, bound.dq) << strategy_name(kind);
    EXPECT_LE(e.dk, bound.dk) << strategy_name(kind);
    EXPECT_LE(e.dv, bound.dv) << strategy_name(kind);
  }
}

// The same call twice gives the same bits (no order-dependent sums anywhere).
TEST(Accuracy, BitwiseDeterministic) {
  Problem pr;
  pr.hq = 8;
  pr.hkv = 2;
  pr.mask = parse_mask("causal+documents");
  pr.build();
  for (StrategyKind kind :
       {StrategyKind::ring, StrategyKind::allgather, StrategyKind::ulysses, StrategyKind::hybrid}) {
    StrategyOptions opt;
    opt.kind = kind;
    opt.mask = pr.mask;
    opt.ulysses_degree = kind == StrategyKind::hybrid ? 2 : 0;
    const RunResult a = run_sharded(pr, 4, LayoutKind::striped, opt);
    const RunResult b = run_sharded(pr, 4, LayoutKind::striped, opt);
    for (auto [x, y] :
         {std::pair{&a.o, &b.o}, {&a.lse, &b.lse}, {&a.dq, &b.dq}, {&a.dk, &b.dk}, {&a.dv, &b.dv}})
      EXPECT_EQ(std::memcmp(x->data(), y->data(), x->bytes()), 0) << strategy_name(kind);
  }
}

}  // namespace
}  // namespace ctxpar::testing

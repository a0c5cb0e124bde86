// Under `mpirun -n P`: every strategy, forward and backward, on the MPI transport gives the
// same bits as the threads transport with the same P and options (each process also runs the
// P-thread version in-process and compares its own rank's shard). Exit status 0 = all equal.
#include <cstdio>
#include <cstring>

#include "kernel/problem.h"
#include "strategy/strategy_support.h"
#include "same_bits.h"

using namespace ctxpar;
using namespace ctxpar::testing;

namespace {

// `mine`: this rank's KernelConfig::bf16_products; `lowest`, where given: the level the ranks
// must agree on. The P-thread run takes the level the MPI ranks agreed on.
int check(Communicator& world, StrategyKind kind, LayoutKind lk, const char* mask, int64_t hq,
          int64_t hkv, DType dtype, Bf16Products mine = Bf16Products::automatic,
          Bf16Products lowest = Bf16Products::automatic, int64_t tokens = 64) {
  const int p = world.size(), r = world.rank();
  Problem pr;
  pr.batch = 2;
  pr.tokens = tokens;
  pr.hq = hq;
  pr.hkv = hkv;
  pr.d = 16;
  pr.dtype = dtype;
  pr.mask = parse_mask(mask);
  pr.build();
  StrategyOptions opt;
  opt.kind = kind;
  opt.mask = pr.mask;
  opt.ulysses_degree = kind == StrategyKind::hybrid ? (p >= 4 ? 2 : 1) : 0;

  // This rank's run on MPI.
  const Layout layout(lk, pr.tokens, p);
  const int64_t tl = layout.local_tokens();
  Tensor q = layout.shard(pr.q, r), k = layout.shard(pr.k, r), v = layout.shard(pr.v, r);
  Tensor dout = layout.shard(pr.dout, r);
  std::vector<int64_t> pos = layout.positions(r);
  std::vector<int32_t> docs;
  if (pr.mask.documents) docs = layout.shard(pr.documents, r);
  Tensor o(DType::f32, {pr.batch, tl, hq, pr.d}), lse(DType::f32, {pr.batch, hq, tl});
  Tensor dq(DType::f32, {pr.batch, tl, hq, pr.d}), dk(DType::f32, {pr.batch, tl, hkv, pr.d}),
      dv(DType::f32, {pr.batch, tl, hkv, pr.d});
  opt.kernel.bf16_products = mine;
  auto strategy = Strategy::create(world, opt);
  Tokens tok{pos, docs};
  strategy->forward(q, k, v, tok, o, lse);
  strategy->backward(q, k, v, tok, o, lse, dout, dq, dk, dv);

  // The same on P threads in this process; compare this rank's shard.
  const Bf16Products agreed = strategy->options().kernel.bf16_products;
  opt.kernel.bf16_products = agreed;
  const RunResult t = run_sharded(pr, p, lk, opt);
  const bool lowest_agreed = lowest == Bf16Products::automatic || agreed == lowest;
  if (!lowest_agreed)
    std::fprintf(stderr, "rank %d: %s agreed on bf16 products %s, not the lowest (%s)\n", r,
                 strategy_name(kind), bf16_products_name(agreed), bf16_products_name(lowest));
  const bool ok = lowest_agreed && test::same_bits(o, layout.shard(t.o, r)) &&
                  test::same_bits(lse, layout.shard(t.lse, r, 2)) &&
                  test::same_bits(dq, layout.shard(t.dq, r)) &&
                  test::same_bits(dk, layout.shard(t.dk, r)) &&
                  test::same_bits(dv, layout.shard(t.dv, r));
  if (!ok)
    std::fprintf(stderr, "rank %d: %s %s mask=%s Hq=%lld Hkv=%lld %s: MPI != threads\n", r,
                 strategy_name(kind), layout_name(lk), mask, (long long)hq, (long long)hkv,
                 dtype_name(dtype));
  return ok ? 0 : 1;
}

}  // namespace

// Every strategy x layout, once as this CPU chooses; then (where the CPU has bf16 products to
// choose) again with the odd ranks asking for bf16 products and the even ones for the level
// below -- what a timed probe did on four ranks sharing two cores in CI -- which the ranks must
// agree away (Note [The ranks agree on bf16 products], src/kernel/problem.h) for MPI to equal
// threads.
int main() {
  int status = 0;
  run_mpi([&](Communicator& world) {
    double failures = 0, runs = 0;
    // The split: odd ranks at this CPU's top level (AMX where usable), even ones one below.
    const int top = kernel::bf16_top_level();
    const bool can_split = world.size() > 1 && kernel::bf16_products().error.empty() && top > 0;
    const Bf16Products low = kernel::bf16_products_of_level(top - 1);
    const Bf16Products mine = world.rank() % 2 ? kernel::bf16_products_of_level(top) : low;
    for (int split = 0; split <= (can_split ? 1 : 0); ++split) {
      for (StrategyKind kind : {StrategyKind::ring, StrategyKind::allgather, StrategyKind::ulysses,
                                StrategyKind::hybrid})
        for (LayoutKind lk : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped}) {
          if (!split) {
            failures += check(world, kind, lk, "causal", 8, 2, DType::f32);
            runs += 1;
          }
          failures +=
              check(world, kind, lk, "window:9,3+documents", 4, 4, DType::bf16,
                    split ? mine : Bf16Products::automatic, split ? low : Bf16Products::automatic);
          runs += 1;
        }
      // The needed exchange of the ring and the all-gather (auto under a documents mask) over
      // several tiles per rank: their direct messages and the gradients going home. (T = 640:
      // no padding, whose rows this comparison does not gather as the threads run does.)
      if (!split)
        for (StrategyKind kind : {StrategyKind::ring, StrategyKind::allgather})
          for (LayoutKind lk : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped}) {
            failures += check(world, kind, lk, "causal+documents", 2, 1, DType::f32,
                              Bf16Products::automatic, Bf16Products::automatic, 640);
            runs += 1;
          }
      if (split && world.rank() == 0)
        std::printf("strategy mpi: bf16 runs with ranks that disagreed on bf16 products\n");
    }
    world.allreduce(&failures, 1);
    if (world.rank() == 0)
      std::printf(
          "strategy mpi (P = %d): %g of %g runs x %d ranks differ from the threads "
          "transport%s\n",
          world.size(), failures, runs, world.size(),
          can_split ? "" : " (no split pass: this CPU has no bf16 products to choose)");
    status = failures == 0 ? 0 : 1;
  });
  return status;
}

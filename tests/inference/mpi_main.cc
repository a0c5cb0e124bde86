// Under `mpirun -n P`: prefill (both modes) and decode (every KvCacheOptions::merge) on the MPI
// transport give the same bits as on P threads in this process (each process compares its own rank's rows). Exit 0 = equal.
#include <cstdio>
#include <cstring>
#include <string>

#include "inference/inference_support.h"
#include "kernel/problem.h"

using namespace ctxpar;
using namespace ctxpar::testing;

// Then, where this CPU has bf16 products to choose, bf16 again with the odd ranks asking for
// them and the even ones for the level below: the first prefill agrees them down to the lower
// (Note [The ranks agree on bf16 products], src/kernel/problem.h), or MPI would differ from
// threads. The threads run takes the level the MPI ranks agreed on.
int main() {
  Communicator& world = mpi_world();
  int failures = 0;
  // The split: odd ranks at this CPU's top level (AMX where usable), even ones one below.
  const int top = kernel::bf16_top_level();
  const bool can_split = world.size() > 1 && kernel::bf16_products().error.empty() && top > 0;
  const Bf16Products low = kernel::bf16_products_of_level(top - 1);
  // This rank's rows of s on MPI against the same rank's on threads, bitwise.
  auto compare = [&](Scenario& s, const std::string& what) {
    const RankResult mine = run_rank(world, s);
    s.bf16_products = mine.bf16_products;
    const std::vector<RankResult> threads = run_on_threads(s, world.size());
    const RankResult& want = threads[world.rank()];
    for (size_t b = 0; b < mine.out.size(); ++b)
      if (std::memcmp(mine.out[b].data(), want.out[b].data(), want.out[b].bytes()) != 0 ||
          std::memcmp(mine.lse[b].data(), want.lse[b].data(), want.lse[b].bytes()) != 0) {
        std::fprintf(stderr, "rank %d: %s sequence %zu: MPI != threads\n", world.rank(),
                     what.c_str(), b);
        ++failures;
      }
    return mine;
  };
  for (int split = 0; split <= (can_split ? 1 : 0); ++split)
    for (PrefillMode mode : {PrefillMode::pass_kv, PrefillMode::pass_q})
      for (const char* mask : {"causal", "causal+documents"})
        for (DecodeMerge merge : {DecodeMerge::allgather, DecodeMerge::chain, DecodeMerge::tree}) {
          if (split && mask[6] != '\0') continue;  // the split pass: bf16 causal only
          // The point-to-point merges: fp32 pass-KV causal only.
          if (merge != DecodeMerge::allgather && (split || mode != PrefillMode::pass_kv || mask[6]))
            continue;
          Scenario s;
          s.merge = merge;
          s.dtype = split ? DType::bf16 : DType::f32;
          s.mode = mode;
          s.mask = parse_mask(mask);
          s.prefill = {90, 41};
          s.chunk = 40;
          s.decode_steps = 3;
          if (split) s.bf16_products = world.rank() % 2 ? kernel::bf16_products_of_level(top) : low;
          s.build();
          const RankResult mine = compare(s, std::string(prefill_mode_name(mode)) + " " + mask +
                                                 " merge " + decode_merge_name(merge));
          if (split && mine.bf16_products != low) {
            std::fprintf(stderr,
                         "rank %d: ranks that disagreed on bf16 products agreed on %s, not "
                         "the lowest (%s)\n",
                         world.rank(), bf16_products_name(mine.bf16_products),
                         bf16_products_name(low));
            ++failures;
          }
        }
  {  // Decode of forks: pages shared with the parents, the last one copied on write.
    Scenario s;
    s.prefill = {90, 41};
    s.chunk = 40;
    s.fork = true;
    s.build();
    compare(s, "forks");
  }
  if (world.rank() == 0 && failures == 0)
    std::printf("inference MPI == threads%s\n", can_split ? " (and with ranks that disagreed on "
                                                            "bf16 products)"
                                                          : "");
  return failures == 0 ? 0 : 1;
}

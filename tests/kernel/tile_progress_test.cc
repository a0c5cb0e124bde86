// The tile progress hook (ctxpar/tile_progress.h; the MPI transport's CTXPAR_MPI_PROGRESS=tiles
// mode installs it): the kernel calls it exactly once per computed (query tile x key tile)
// unit, forward and backward, from any of its threads, and the results are bitwise those of a
// run without it.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>

#include "ctxpar/tile_progress.h"
#include "kernel/kernel_support.h"

namespace ctxpar::test {
namespace {

std::atomic<int64_t> calls{0};
void count_call() { calls.fetch_add(1, std::memory_order_relaxed); }

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

TEST(TileProgress, CalledOncePerComputedTileAndChangesNoBit) {
  Case c;
  c.batch = 2, c.tq = 200, c.tk = 150, c.hq = 4, c.hkv = 2, c.d = 32;
  c.mask = Mask::causal_mask();
  c.k_offset = 60;  // some tiles fully masked (skipped: no call), some partial
  const Inputs in = make_inputs(c);
  for (int threads : {1, 3}) {
    const Outputs plain = run_fast(in, c.mask, threads);
    calls = 0;
    set_tile_progress_hook(&count_call);
    const Outputs hooked = run_fast(in, c.mask, threads, /*backward=*/false);
    const int64_t forward_calls = calls.exchange(0);
    const Outputs both = run_fast(in, c.mask, threads);
    const int64_t all_calls = calls.exchange(0);
    set_tile_progress_hook(nullptr);
    const Outputs after = run_fast(in, c.mask, threads, /*backward=*/false);
    EXPECT_EQ(calls.load(), 0) << "the hook was called after it was removed";
    ASSERT_GT(plain.fwd.tiles_skipped, 0) << "the case should skip some tiles";
    EXPECT_EQ(forward_calls, hooked.fwd.tiles_computed) << "threads " << threads;
    EXPECT_EQ(all_calls, both.fwd.tiles_computed + both.bwd.tiles_computed)
        << "threads " << threads;
    for (const auto& [name, a, b] :
         {std::tuple{"o", &plain.o, &both.o}, std::tuple{"lse", &plain.lse, &both.lse},
          std::tuple{"dq", &plain.dq, &both.dq}, std::tuple{"dk", &plain.dk, &both.dk},
          std::tuple{"dv", &plain.dv, &both.dv}})
      EXPECT_TRUE(same_bytes(*a, *b)) << name << " changed with the hook, threads " << threads;
    EXPECT_TRUE(same_bytes(plain.o, after.o));
  }
}

}  // namespace
}  // namespace ctxpar::test

// Under `mpirun -n P`: prefill (both modes) and decode on the MPI transport give the same bits
// as on P threads in this process (each process compares its own rank's rows). Exit 0 = equal.
#include <cstdio>
#include <cstring>

#include "inference/inference_support.h"

using namespace ctxpar;
using namespace ctxpar::testing;

int main() {
  Communicator& world = mpi_world();
  int failures = 0;
  for (PrefillMode mode : {PrefillMode::pass_kv, PrefillMode::pass_q})
    for (const char* mask : {"causal", "causal+documents"}) {
      Scenario s;
      s.mode = mode;
      s.mask = parse_mask(mask);
      s.prefill = {90, 41};
      s.chunk = 40;
      s.decode_steps = 3;
      s.build();
      const RankResult mine = run_rank(world, s);
      const std::vector<RankResult> threads = run_on_threads(s, world.size());
      const RankResult& want = threads[world.rank()];
      for (size_t b = 0; b < mine.out.size(); ++b)
        if (std::memcmp(mine.out[b].data(), want.out[b].data(), want.out[b].bytes()) != 0 ||
            std::memcmp(mine.lse[b].data(), want.lse[b].data(), want.lse[b].bytes()) != 0) {
          std::fprintf(stderr, "rank %d: %s %s sequence %zu: MPI != threads\n", world.rank(),
                       prefill_mode_name(mode), mask, b);
          ++failures;
        }
    }
  if (world.rank() == 0 && failures == 0) std::printf("inference MPI == threads\n");
  return failures == 0 ? 0 : 1;
}

// The needed exchange's planning, one home for the ring (src/strategy/ring_needed.cc) and the
// all-gather (src/strategy/allgather.cc) under Exchange::needed (docs/ring.md, "Moving only
// what is needed"; docs/allgather.md): which 64-row K/V tiles of each rank each peer's queries
// can see, decided by mask_rules.h's classify on tile summaries the ranks all-gather once per
// call, and how those rows travel (packed as one KvPacking block) and their gradients go home.
#pragma once
#include <cstdint>
#include <vector>

#include "strategy/internal.h"

namespace ctxpar::strategy {

// Rows [r0, r1) of a rank's block: whole 64-row tiles (the block's last may be shorter).
struct NeededRun {
  int64_t r0, r1;
};

// Every rank's tile summaries (one host all-gather, counted in the call's bytes) and, per peer,
// the runs of this rank's rows the peer needs and the count of the peer's rows this rank
// needs. Every rank computes the same plan from the same summaries, so both ends of a message
// know its size; a tile that no query tile of the reader can see (classify: skip for all) is
// one the kernel would skip anyway, so leaving it home loses nothing.
class NeededPlan {
 public:
  NeededPlan(Communicator& comm, Call& call, const Tokens& tokens, int64_t rows);

  // This rank's rows that `peer` needs (ascending runs), their count, and the count of
  // `peer`'s rows this rank needs (0 for this rank itself: its own block is read in place).
  const std::vector<NeededRun>& to(int peer) const { return to_[size_t(peer)]; }
  int64_t to_rows(int peer) const;
  int64_t from_rows(int peer) const { return from_rows_[size_t(peer)]; }

 private:
  std::vector<std::vector<NeededRun>> to_;
  std::vector<int64_t> from_rows_;
};

// fp32 [dk | dv] rows, the layout of the gradients going home (no tokens).
inline KvPacking grad_of(const TensorView& k, int64_t rows) {
  return {k.dim(0), rows, k.dim(2), k.dim(3), DType::f32, false};
}

// `runs` (`rows` in all) of `own` as one travelling block (packing_of's layout), on the
// compute stream: K/V copied run by run, the token ids gathered by an index of the rows.
DeviceBuffer pack_rows(Device& dev, const KvBlock& own, const std::vector<NeededRun>& runs,
                       int64_t rows, bool documents);

// Adds `piece` (grad_of layout, the rows of `runs` one after the other) into `whole` (grad_of
// layout of the whole block), run by run, on the compute stream.
void add_runs(Device& dev, const KvPacking& piece_layout, const DeviceBuffer& piece,
              const KvPacking& whole_layout, const DeviceBuffer& whole,
              const std::vector<NeededRun>& runs);

}  // namespace ctxpar::strategy

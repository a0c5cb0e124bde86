// The needed exchange's planning and packing (strategy/needed.h), shared by the ring and the
// all-gather.
#include "strategy/needed.h"

#include <algorithm>
#include <cstring>

#include "kernel/problem.h"

namespace ctxpar::strategy {
namespace {

// The tiles of `owner`'s block that some query tile of `reader` does not skip.
std::vector<NeededRun> needed_runs(const Mask& mask, const std::vector<TileRange>& all, int64_t nt,
                                   int64_t rows, int owner, int reader) {
  std::vector<NeededRun> runs;
  const TileRange* keys = all.data() + owner * nt;
  const TileRange* queries = all.data() + reader * nt;
  for (int64_t kt = 0; kt < nt; ++kt) {
    bool seen = false;
    for (int64_t qt = 0; qt < nt && !seen; ++qt)
      seen = classify(mask, queries[qt], keys[kt]) != TileKind::skip;
    if (!seen) continue;
    const int64_t r0 = kt * kKernelTile, r1 = std::min(rows, r0 + kKernelTile);
    if (!runs.empty() && runs.back().r1 == r0)
      runs.back().r1 = r1;
    else
      runs.push_back({r0, r1});
  }
  return runs;
}

int64_t rows_of(const std::vector<NeededRun>& runs) {
  int64_t n = 0;
  for (const NeededRun& r : runs) n += r.r1 - r.r0;
  return n;
}

}  // namespace

NeededPlan::NeededPlan(Communicator& comm, Call& call, const Tokens& tokens, int64_t rows)
    : to_(size_t(comm.size())), from_rows_(size_t(comm.size())) {
  const int p = comm.size(), me = comm.rank();
  if (p == 1) return;
  const int64_t nt = (rows + kKernelTile - 1) / kKernelTile;
  const kernel::TileRanges mine =
      kernel::tile_ranges(tokens, rows, kKernelTile, call.mask.documents);
  // Zeroed first: the struct's padding bytes travel too, and should not be uninitialised.
  std::vector<TileRange> local(static_cast<size_t>(nt)), all(static_cast<size_t>(p * nt));
  std::memset(static_cast<void*>(local.data()), 0, local.size() * sizeof(TileRange));
  for (int64_t t = 0; t < nt; ++t) local[size_t(t)] = mine.at(t);
  call.host_collective(
      [&] { comm.allgather(local.data(), all.data(), local.size() * sizeof(TileRange)); });
  for (int peer = 0; peer < p; ++peer) {
    if (peer == me) continue;
    to_[size_t(peer)] = needed_runs(call.mask, all, nt, rows, me, peer);
    from_rows_[size_t(peer)] = rows_of(needed_runs(call.mask, all, nt, rows, peer, me));
  }
}

int64_t NeededPlan::to_rows(int peer) const { return rows_of(to_[size_t(peer)]); }

DeviceBuffer pack_rows(Device& dev, const KvBlock& own, const std::vector<NeededRun>& runs,
                       int64_t rows, bool documents) {
  const KvPacking pack = packing_of(own.k, rows, documents);
  DeviceBuffer b = dev.alloc(pack.bytes());
  std::vector<int64_t> index;
  index.reserve(size_t(rows));
  for (const NeededRun& r : runs) {
    const int64_t at = int64_t(index.size()), n = r.r1 - r.r0;
    dev.copy(kComputeStream, own.k.slice(1, r.r0, r.r1), pack.k(b).slice(1, at, at + n));
    dev.copy(kComputeStream, own.v.slice(1, r.r0, r.r1), pack.v(b).slice(1, at, at + n));
    for (int64_t i = r.r0; i < r.r1; ++i) index.push_back(i);
  }
  const DeviceBuffer idx = dev.upload(index.data(), index.size() * 8);
  const TensorView iv = idx.view(DType::i64, {rows});
  const int64_t all = own.k.dim(1);
  // Token ids as [1, 1, T] views (rows of one element) of the caller's host arrays.
  dev.gather_tokens(
      kComputeStream,
      TensorView(const_cast<int64_t*>(own.tokens.positions.data()), DType::i64, {1, 1, all}),
      b.view(DType::i64, {1, 1, rows}, pack.tokens_offset()), iv);
  if (documents)
    dev.gather_tokens(
        kComputeStream,
        TensorView(const_cast<int32_t*>(own.tokens.documents.data()), DType::i32, {1, 1, all}),
        b.view(DType::i32, {1, 1, rows}, pack.tokens_offset() + size_t(rows) * 8), iv);
  return b;
}

void add_runs(Device& dev, const KvPacking& piece_layout, const DeviceBuffer& piece,
              const KvPacking& whole_layout, const DeviceBuffer& whole,
              const std::vector<NeededRun>& runs) {
  int64_t at = 0;
  for (const NeededRun& r : runs) {
    const int64_t n = r.r1 - r.r0;
    dev.add(kComputeStream, piece_layout.k(piece).slice(1, at, at + n),
            whole_layout.k(whole).slice(1, r.r0, r.r1));
    dev.add(kComputeStream, piece_layout.v(piece).slice(1, at, at + n),
            whole_layout.v(whole).slice(1, r.r0, r.r1));
    at += n;
  }
}

}  // namespace ctxpar::strategy

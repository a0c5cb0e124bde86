// Ring attention: every rank keeps its queries; K/V blocks travel around the ring so that after
// P-1 hops each rank has seen every block. See docs/ring.md (and its
// "Note [load balance for causal masks]").
//
//   step s: rank r holds the block of rank (r - s) mod P
//           post  send(block -> r+1), recv(block of r-s-1 <- r-1)     (for step s+1)
//           compute q_r x block                                        (overlaps the transfer)
//           wait
//
// Backward adds a second ring for the fp32 dK/dV accumulators: the accumulator of block j is
// created by its first visitor (rank j+1), added to by every rank that holds block j and sent
// on after that rank's compute, so after P-1 hops it is back at rank j, which adds it to its
// own contribution. Each rank computes its share into a local buffer first and adds it to the
// travelling accumulator afterwards, so that accumulator transfers hide behind compute.
#include <algorithm>
#include <optional>

#include "ctxpar/strategy_memory.h"
#include "strategy/internal.h"

namespace ctxpar::strategy {
namespace {

// Note [Pipelined last hop]: after the last step every accumulator still has one hop to go
// home, and no compute is left to hide it behind. Sent whole, that hop was fully exposed (1/3
// of all the bytes a rank moves in forward + backward at P = 2, measured over a shaped TCP
// link: docs/BENCHMARKS.md). So the last step computes its block in pieces of key rows and
// sends each piece's finished accumulator as soon as it is done: the hop of piece c overlaps
// the compute of pieces c+1, ...; only the last piece's hop (1/pieces of it) is exposed. The
// backward kernel owns dK/dV rows per key tile (Note [Backward tasks]), so cutting at tile
// multiples leaves dK/dV bitwise as in one call; dQ is accumulated piece by piece (a fixed
// order: still deterministic, and the same on every transport and device: the pieces depend
// on the problem alone). Pieces cost compute (each call packs the query rows again), hence
// pieces of at least 512 rows.
// Rows [r0, r1) of the fp32 [dk | dv] accumulator `grad` as a message of their own.
KvPacking rows_of(const KvPacking& grad, int64_t r0, int64_t r1) {
  return {grad.batch, r1 - r0, grad.heads, grad.d, DType::f32, false};
}

Tokens token_rows(const Tokens& t, int64_t r0, int64_t r1) {
  Tokens out;
  out.positions = t.positions.subspan(size_t(r0), size_t(r1 - r0));
  if (!t.documents.empty()) out.documents = t.documents.subspan(size_t(r0), size_t(r1 - r0));
  return out;
}

// Sends rows [r0, r1) of the [dk | dv] accumulator `acc` to the next rank, packed into a new
// [dk rows | dv rows] buffer (copied on the compute stream, after the compute that finished
// them; the send follows on the comm stream).
void send_piece(Device& dev, Communicator& comm, const KvPacking& grad, const DeviceBuffer& acc,
                int64_t r0, int64_t r1, int tag) {
  const KvPacking piece = rows_of(grad, r0, r1);
  DeviceBuffer out = dev.alloc(2 * piece.kv_bytes());
  dev.copy(kComputeStream, grad.k(acc).slice(1, r0, r1), piece.k(out));
  dev.copy(kComputeStream, grad.v(acc).slice(1, r0, r1), piece.v(out));
  dev.wait(kCommStream, dev.record(kComputeStream));
  dev.send(kCommStream, comm, out, (comm.rank() + 1) % comm.size(), tag);
}
}  // namespace

void ring_forward(Communicator& comm, Call& call, const ForwardArgs& a) {
  // q, out [B, Tq, Hq, D]; k, v [B, Tk, Hkv, D]; lse [B, Hq, Tq]
  Device& dev = *call.dev;
  const int p = comm.size();
  const KvPacking pack = packing_of(a.k, call.mask.documents);
  DeviceForwardState state(dev, a.q.dim(0), a.q.dim(1), a.q.dim(2), a.q.dim(3));

  // Step 0 computes on the caller's k, v directly; step s on `block`, the block of rank r-s,
  // which is also the one in flight to the next rank (sent before the compute: it overlaps).
  const KvBlock own{a.k, a.v, a.tokens};
  DeviceBuffer block;
  if (p > 1) block = pack.pack(dev, kComputeStream, own);
  ring_steps(dev, comm, std::move(block),
             {0, [&](int) { return pack.bytes(); },
              [&](int s, int, const DeviceBuffer& b) {
                const KvBlock kv = s == 0 ? own : pack.block(b);
                dev.forward_block(kComputeStream, a.q, a.tokens, kv.k, kv.v, kv.tokens, call.mask,
                                  state.get(), call.kernel);
              }});
  dev.forward_finalize(kComputeStream, state.get(), a.out, a.lse, call.kernel);
  // When sends lend their memory (threads transport on cpu), the memory of a forwarded block
  // lives until its last holder lets go (reference-counted), so its final owner may return
  // while a rank that forwarded it earlier still computes on it. The ranks still end the forward
  // together there: a rank that failed mid-ring then fails every rank, naming it, and
  // `plan --hardware local` models this barrier.
  if (ring_forward_ends_with_barrier(p, dev.lends_sent_buffers(comm))) {
    dev.wait(kCommStream, dev.record(kComputeStream));
    dev.barrier(kCommStream, comm);
  }
}

namespace {

// The backward's steps (ring_backward below). Step 0 (this rank's own block) adds into `own`,
// which never travels. The accumulator of block r-s starts on its first visitor after the
// owner (step 1) and moves on after every step: P-1 hops bring it home, where it is added to
// `own`. From step 2 on, a step computes into a local `part` while the accumulator is still
// in flight from the previous rank, and adds `part` into it only after the compute: the
// accumulator's transfer hides behind the compute instead of being waited for before it (one
// more fp32 buffer per rank). The last step sends it home in pieces of key rows (Note
// [Pipelined last hop]).
class RingBackward {
 public:
  RingBackward(Communicator& comm, Call& call, const GradArgs& a)
      : comm_(comm),
        call_(call),
        dev_(*call.dev),
        a_(a),
        pack_(packing_of(a.k, call.mask.documents)),
        grad_{a.k.dim(0), a.k.dim(1), a.k.dim(2), a.k.dim(3), DType::f32, false},
        grad_bytes_(2 * grad_.kv_bytes()),  // [dk | dv] fp32, no tokens
        cuts_(ring_last_hop_cuts(a.k.dim(1))) {}

  void run() {
    const int p = comm_.size();
    const KvBlock mine{a_.k, a_.v, a_.tokens};
    DeviceBuffer block;
    if (p > 1) block = pack_.pack(dev_, kComputeStream, mine);
    own_ = dev_.alloc(grad_bytes_);
    dev_.fill_zero(kComputeStream, flat_f32(own_));
    ring_steps(dev_, comm_, std::move(block),
               {0, [&](int) { return pack_.bytes(); },
                [&](int s, int, const DeviceBuffer& b) {
                  const KvBlock kv = s == 0 ? mine : pack_.block(b);
                  if (s > 0 && s == p - 1) return last_step(s, kv);
                  compute(s, kv, into_of(s), 0, grad_.tokens);
                  if (s > 0)
                    grad_hop_.emplace(dev_, comm_, &acc_, grad_bytes_, kRingGradTag + s + 1);
                }});
    dev_.copy(kComputeStream, grad_.k(own_), a_.dk);
    dev_.copy(kComputeStream, grad_.v(own_), a_.dv);
  }

 private:
  // Step s's gradient buffer: `own`, a new zeroed accumulator (step 1) or the zeroed `part`.
  const DeviceBuffer& into_of(int s) {
    if (s == 1) {
      acc_ = dev_.alloc(grad_bytes_);
      dev_.fill_zero(kComputeStream, flat_f32(acc_));
    } else if (s >= 2) {
      if (part_.empty()) part_ = dev_.alloc(grad_bytes_);
      dev_.fill_zero(kComputeStream, flat_f32(part_));
    }
    return s == 0 ? own_ : s == 1 ? acc_ : part_;
  }

  // Key rows [r0, r1) of step s's block into `into`; from step 2 on, added into the
  // accumulator (which left the previous rank after its compute on this block: waited for at
  // row 0).
  void compute(int s, const KvBlock& kv, const DeviceBuffer& into, int64_t r0, int64_t r1) {
    dev_.backward_block(kComputeStream, a_.q, a_.tokens, kv.k.slice(1, r0, r1),
                        kv.v.slice(1, r0, r1), token_rows(kv.tokens, r0, r1), call_.mask, a_.dout,
                        a_.lse, a_.delta, a_.dq, grad_.k(into).slice(1, r0, r1),
                        grad_.v(into).slice(1, r0, r1), call_.kernel);
    if (s < 2) return;
    if (r0 == 0) acc_ = grad_hop_->wait();
    dev_.add(kComputeStream, grad_.k(part_).slice(1, r0, r1), grad_.k(acc_).slice(1, r0, r1));
    dev_.add(kComputeStream, grad_.v(part_).slice(1, r0, r1), grad_.v(acc_).slice(1, r0, r1));
  }

  // The last step: computes only, and sends the accumulator home piece by piece.
  void last_step(int s, const KvBlock& kv) {
    const int p = comm_.size(), pieces = int(cuts_.size()) - 1;
    auto piece_tag = [&](int c) { return kRingGradTag + p + 1 + c; };  // after the grad ring's tags
    const DeviceBuffer& into = into_of(s);
    std::vector<DeviceBuffer> home;  // the pieces of our own block's accumulator
    dev_.wait(kCommStream, dev_.record(kComputeStream));  // receives first: they may arrive
    for (int c = 0; c < pieces; ++c)                      // while this step computes
      home.push_back(dev_.recv(kCommStream, comm_,
                               2 * rows_of(grad_, cuts_[c], cuts_[c + 1]).kv_bytes(),
                               (comm_.rank() + p - 1) % p, piece_tag(c)));
    for (int c = 0; c < pieces; ++c) {
      compute(s, kv, into, cuts_[c], cuts_[c + 1]);
      send_piece(dev_, comm_, grad_, acc_, cuts_[c], cuts_[c + 1], piece_tag(c));
    }
    dev_.wait(kComputeStream, dev_.record(kCommStream));
    for (int c = 0; c < pieces; ++c) {
      const KvPacking piece = rows_of(grad_, cuts_[c], cuts_[c + 1]);
      const int64_t r0 = cuts_[c], r1 = cuts_[c + 1];
      dev_.add(kComputeStream, piece.k(home[c]), grad_.k(own_).slice(1, r0, r1));
      dev_.add(kComputeStream, piece.v(home[c]), grad_.v(own_).slice(1, r0, r1));
    }
  }

  Communicator& comm_;
  Call& call_;
  Device& dev_;
  const GradArgs& a_;
  const KvPacking pack_, grad_;
  const size_t grad_bytes_;
  const std::vector<int64_t> cuts_;
  DeviceBuffer own_, acc_, part_;
  std::optional<RingHop> grad_hop_;  // the accumulator's hop to the next rank
};

}  // namespace

void ring_backward(Communicator& comm, Call& call, const GradArgs& a) {
  // q, dout, dq [B, Tq, Hq, D]; k, v, dk, dv [B, Tk, Hkv, D]; lse, delta [B, Hq, Tq]
  RingBackward(comm, call, a).run();
}

namespace {

class RingStrategy final : public Strategy {
 public:
  RingStrategy(Communicator& comm, const StrategyOptions& options, std::unique_ptr<Device> device)
      : Strategy(comm, options, std::move(device)) {}

 protected:
  // options_.exchange is resolved (Strategy::create): ring or needed.
  bool needed() const { return options_.exchange == Exchange::needed; }

  void run_forward(const ForwardArgs& a, Call& call) override {
    needed() ? ring_needed_forward(comm_, call, a) : ring_forward(comm_, call, a);
  }

  void run_backward(const BackwardArgs& a, Call& call) override {
    const BackwardRows rows(call, a);
    const GradArgs g{a.q, a.k, a.v, a.tokens, a.dout, a.lse, rows.delta, rows.dq32, a.dk, a.dv};
    needed() ? ring_needed_backward(comm_, call, g) : ring_backward(comm_, call, g);
    call.dev->copy(kComputeStream, rows.dq32, a.dq);
  }
};

}  // namespace

std::unique_ptr<Strategy> make_ring(Communicator& comm, const StrategyOptions& options,
                                    std::unique_ptr<Device> device) {
  return std::make_unique<RingStrategy>(comm, options, std::move(device));
}

}  // namespace ctxpar::strategy

namespace ctxpar {

std::vector<int64_t> ring_last_hop_cuts(int64_t key_rows) {
  constexpr int64_t kPieceRows = kKernelTile;  // whole kernel key tiles
  constexpr int64_t kMaxPieces = 8;
  // Each piece is one more kernel call, which packs the query rows again (what that costs the
  // backward: docs/ring.md), so a piece has at least 512 rows; the exposed share of the hop is
  // 1/pieces of it.
  constexpr int64_t kMinPieceRows = 512;
  const int64_t tiles = (key_rows + kPieceRows - 1) / kPieceRows;
  const int64_t pieces = std::max<int64_t>(1, std::min(kMaxPieces, key_rows / kMinPieceRows));
  const int64_t per = (tiles + pieces - 1) / pieces * kPieceRows;
  std::vector<int64_t> cuts{0};
  while (cuts.back() < key_rows) cuts.push_back(std::min(key_rows, cuts.back() + per));
  if (key_rows <= 0) cuts.push_back(0);
  return cuts;
}

}  // namespace ctxpar

// The ring under Exchange::needed: each rank sends a peer only the K/V rows the peer's queries
// can see (docs/ring.md, "Moving only what is needed").
//
//   once:   all-gather every rank's key/query tile summaries (TileRange per 64 tokens)
//   step s: send rank r+s the tiles of this rank it needs, receive from r-s those this rank
//           needs (both sides know the sizes, a step with nothing to carry moves nothing);
//           the next step's transfer is posted before this step's compute, as in the ring
//
// Which tiles a peer needs is decided by mask_rules.h's classify (the one home of the mask's
// rules): a key tile travels when some query tile of the peer does not classify it as skip.
// A tile that does not travel is skipped by the kernel anyway, so nothing it would have
// computed is lost. Backward sends the dK/dV of the received rows straight back to their
// owner, which adds them to its own in step order (1, 2, ..., P-1): the same bits on every
// transport and timing. dQ stays local.
#include <cstring>
#include <optional>

#include "ctxpar/strategy_memory.h"
#include "kernel/problem.h"
#include "strategy/internal.h"

namespace ctxpar::strategy {
namespace {

constexpr int kGradTag = kRingGradTag;  // dK/dV going home: kGradTag + step; K/V: step

struct Run {
  int64_t r0, r1;  // rows [r0, r1) of a rank's block
};

// What moves at each step, from every rank's tile summaries.
class NeededPlan {
 public:
  NeededPlan(Communicator& comm, Call& call, const Tokens& tokens, int64_t rows)
      : p_(comm.size()), me_(comm.rank()), rows_(rows), to_(size_t(p_)), from_rows_(size_t(p_)) {
    if (p_ == 1) return;
    const int64_t nt = (rows + kKernelTile - 1) / kKernelTile;
    const kernel::TileRanges mine =
        kernel::tile_ranges(tokens, rows, kKernelTile, call.mask.documents);
    // Zeroed first: the struct's padding bytes travel too, and should not be uninitialised.
    std::vector<TileRange> local(static_cast<size_t>(nt)), all(static_cast<size_t>(p_ * nt));
    std::memset(static_cast<void*>(local.data()), 0, local.size() * sizeof(TileRange));
    for (int64_t t = 0; t < nt; ++t) local[size_t(t)] = mine.at(t);
    call.host_collective(
        [&] { comm.allgather(local.data(), all.data(), local.size() * sizeof(TileRange)); });
    for (int s = 1; s < p_; ++s) {
      to_[size_t(s)] = needed(call.mask, all, nt, me_, (me_ + s) % p_);
      for (const Run& r : needed(call.mask, all, nt, (me_ - s + p_) % p_, me_))
        from_rows_[size_t(s)] += r.r1 - r.r0;
    }
  }

  // This rank's rows that rank r+s needs (ascending runs of whole tiles), their count, and the
  // count of rank r-s's rows this rank needs, at step s >= 1.
  const std::vector<Run>& to(int s) const { return to_[size_t(s)]; }
  int64_t to_rows(int s) const {
    int64_t n = 0;
    for (const Run& r : to_[size_t(s)]) n += r.r1 - r.r0;
    return n;
  }
  int64_t from_rows(int s) const { return from_rows_[size_t(s)]; }

 private:
  // The tiles of `owner`'s block that some query tile of `reader` does not skip.
  std::vector<Run> needed(const Mask& mask, const std::vector<TileRange>& all, int64_t nt,
                          int owner, int reader) const {
    std::vector<Run> runs;
    const TileRange* keys = all.data() + owner * nt;
    const TileRange* queries = all.data() + reader * nt;
    for (int64_t kt = 0; kt < nt; ++kt) {
      bool seen = false;
      for (int64_t qt = 0; qt < nt && !seen; ++qt)
        seen = classify(mask, queries[qt], keys[kt]) != TileKind::skip;
      if (!seen) continue;
      const int64_t r0 = kt * kKernelTile, r1 = std::min(rows_, r0 + kKernelTile);
      if (!runs.empty() && runs.back().r1 == r0)
        runs.back().r1 = r1;
      else
        runs.push_back({r0, r1});
    }
    return runs;
  }

  int p_, me_;
  int64_t rows_;
  std::vector<std::vector<Run>> to_;
  std::vector<int64_t> from_rows_;
};

KvPacking packing_of(const TensorView& k, int64_t rows, bool documents) {
  return {k.dim(0), rows, k.dim(2), k.dim(3), k.dtype(), documents};
}

// `runs` of this rank's block as one travelling block (KvPacking's layout), on the compute
// stream: K/V copied run by run, the tokens gathered by an index of the rows.
DeviceBuffer pack_rows(Device& dev, const KvBlock& own, const std::vector<Run>& runs, int64_t rows,
                       bool documents) {
  const KvPacking pack = packing_of(own.k, rows, documents);
  DeviceBuffer b = dev.alloc(pack.bytes());
  std::vector<int64_t> index;
  index.reserve(size_t(rows));
  for (const Run& r : runs) {
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

// The P steps: compute(s, kv) on this rank's own block (s = 0) or on the rows of rank r-s it
// received (nullptr: it needs none), while the next step's rows travel.
void needed_steps(Device& dev, Communicator& comm, const NeededPlan& plan, const KvBlock& own,
                  bool documents, const std::function<void(int, const KvBlock*)>& compute) {
  const int p = comm.size();
  DeviceBuffer block;
  for (int s = 0; s < p; ++s) {
    std::optional<RingHop> hop;
    DeviceBuffer out;  // freed stream-ordered: the send keeps reading it until done
    if (s + 1 < p) {
      const int64_t n = plan.to_rows(s + 1), in = plan.from_rows(s + 1);
      if (n > 0) out = pack_rows(dev, own, plan.to(s + 1), n, documents);
      if (n > 0 || in > 0)
        hop.emplace(dev, comm, n > 0 ? &out : nullptr,
                    in > 0 ? packing_of(own.k, in, documents).bytes() : 0, s + 1, s + 1);
    }
    if (s == 0) {
      compute(0, &own);
    } else {
      const int64_t in = plan.from_rows(s);
      const KvBlock kv = in > 0 ? packing_of(own.k, in, documents).block(block) : KvBlock{};
      compute(s, in > 0 ? &kv : nullptr);
    }
    block = hop ? hop->wait() : DeviceBuffer{};
  }
}

// fp32 [dk | dv] rows, the layout of the gradients going home (no tokens).
KvPacking grad_of(const TensorView& k, int64_t rows) {
  return {k.dim(0), rows, k.dim(2), k.dim(3), DType::f32, false};
}

class NeededBackward {
 public:
  NeededBackward(Communicator& comm, Call& call, const GradArgs& a)
      : comm_(comm), call_(call), dev_(*call.dev), a_(a), plan_(comm, call, a.tokens, a.k.dim(1)) {}

  void run() {
    const KvPacking mine = grad_of(a_.k, a_.k.dim(1));
    own_ = dev_.alloc(2 * mine.kv_bytes());
    dev_.fill_zero(kComputeStream, flat_f32(own_));
    needed_steps(dev_, comm_, plan_, {a_.k, a_.v, a_.tokens}, call_.mask.documents,
                 [&](int s, const KvBlock* kv) { step(s, kv); });
    add_home();
    dev_.copy(kComputeStream, mine.k(own_), a_.dk);
    dev_.copy(kComputeStream, mine.v(own_), a_.dv);
  }

 private:
  void compute(const KvBlock& kv, const KvPacking& grad, const DeviceBuffer& into) {
    dev_.backward_block(kComputeStream, a_.q, a_.tokens, kv.k, kv.v, kv.tokens, call_.mask, a_.dout,
                        a_.lse, a_.delta, a_.dq, grad.k(into), grad.v(into), call_.kernel);
  }

  // Step s: the gradients of rank r-s's rows go back to it, those of this rank's rows that
  // r+s computed come home; the previous step's are added once this step's compute is queued
  // (their transfer hid behind it).
  void step(int s, const KvBlock* kv) {
    if (s == 0) return compute(*kv, grad_of(a_.k, a_.k.dim(1)), own_);
    DeviceBuffer part;
    if (kv) {
      const KvPacking grad = grad_of(a_.k, kv->k.dim(1));
      part = dev_.alloc(2 * grad.kv_bytes());
      dev_.fill_zero(kComputeStream, flat_f32(part));
      compute(*kv, grad, part);
    }
    const int64_t back = plan_.to_rows(s);
    std::optional<RingHop> hop;
    if (kv || back > 0)
      hop.emplace(dev_, comm_, kv ? &part : nullptr,
                  back > 0 ? 2 * grad_of(a_.k, back).kv_bytes() : 0, kGradTag + s, -s);
    add_home();
    if (hop) pending_.emplace(std::move(*hop)), pending_step_ = s;
  }

  // Adds the gradients that came home for the pending step into this rank's own, run by run.
  void add_home() {
    if (!pending_) return;
    const DeviceBuffer home = pending_->wait();
    const int s = pending_step_;
    pending_.reset();
    if (home.empty()) return;
    const KvPacking mine = grad_of(a_.k, a_.k.dim(1)), piece = grad_of(a_.k, plan_.to_rows(s));
    int64_t at = 0;
    for (const Run& r : plan_.to(s)) {
      const int64_t n = r.r1 - r.r0;
      dev_.add(kComputeStream, piece.k(home).slice(1, at, at + n),
               mine.k(own_).slice(1, r.r0, r.r1));
      dev_.add(kComputeStream, piece.v(home).slice(1, at, at + n),
               mine.v(own_).slice(1, r.r0, r.r1));
      at += n;
    }
  }

  Communicator& comm_;
  Call& call_;
  Device& dev_;
  const GradArgs& a_;
  const NeededPlan plan_;
  DeviceBuffer own_;
  std::optional<RingHop> pending_;  // the gradients of step pending_step_, on their way
  int pending_step_ = 0;
};

}  // namespace

void ring_needed_forward(Communicator& comm, Call& call, const ForwardArgs& a) {
  Device& dev = *call.dev;
  const NeededPlan plan(comm, call, a.tokens, a.k.dim(1));
  DeviceForwardState state(dev, a.q.dim(0), a.q.dim(1), a.q.dim(2), a.q.dim(3));
  needed_steps(dev, comm, plan, {a.k, a.v, a.tokens}, call.mask.documents,
               [&](int, const KvBlock* kv) {
                 if (kv)
                   dev.forward_block(kComputeStream, a.q, a.tokens, kv->k, kv->v, kv->tokens,
                                     call.mask, state.get(), call.kernel);
               });
  dev.forward_finalize(kComputeStream, state.get(), a.out, a.lse, call.kernel);
  // As ring_forward: a lent block lives until its last holder lets go, and a rank that failed
  // mid-exchange fails every rank here, naming it.
  if (ring_forward_ends_with_barrier(comm.size(), dev.lends_sent_buffers(comm))) {
    dev.wait(kCommStream, dev.record(kComputeStream));
    dev.barrier(kCommStream, comm);
  }
}

void ring_needed_backward(Communicator& comm, Call& call, const GradArgs& a) {
  NeededBackward(comm, call, a).run();
}

}  // namespace ctxpar::strategy

// The ring's pieces, one home for the ring strategy (src/strategy/ring.cc, and hybrid's ring)
// and inference's prefill (pass-KV and pass-Q, src/inference/prefill.cc): the block that
// travels, one hop of the rotation, and the P steps of a ring. docs/ring.md.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>

#include "ctxpar/comm.h"
#include "ctxpar/device.h"
#include "ctxpar/tensor.h"

namespace ctxpar::strategy {

// Message tags of the ring strategy's exchanges on one communicator: K/V blocks at step s
// are tagged s, the fp32 dK/dV going back kRingGradTag + s (ring.cc, ring_needed.cc).
inline constexpr int kRingGradTag = 16384;

// A K/V block: what rotates in the ring (and what all-gather gathers): the keys and values
// [B, T, Hkv, D] of T tokens, with those tokens' positions (and document ids).
struct KvBlock {
  TensorView k, v;
  Tokens tokens;
};

// The layout of a block that travels, packed into one buffer:
// [k | v | positions (int64) | documents (int32, only with a documents mask)], k and v
// [B, T, H, D] in their storage dtype. `tensors` = 1 is a block of one tensor (pass-Q's
// queries, read with k()); the fp32 [dK | dV] accumulators use the layout without tokens.
// No padding: every section is a multiple of 8 bytes because D >= 16.
struct KvPacking {
  int64_t batch, tokens, heads, d;
  DType dtype;
  bool documents;
  int tensors = 2;
  size_t kv_bytes() const { return size_t(batch * tokens * heads * d) * dtype_size(dtype); }
  size_t tokens_offset() const { return size_t(tensors) * kv_bytes(); }
  size_t bytes() const { return tokens_offset() + size_t(tokens) * (8 + (documents ? 4 : 0)); }
  // A new block holding k, v and tokens, packed on `s`.
  DeviceBuffer pack(Device& dev, Stream s, const KvBlock& block) const;
  TensorView k(const DeviceBuffer& b) const;
  TensorView v(const DeviceBuffer& b) const;
  Tokens tokens_of(const DeviceBuffer& b) const;
  KvBlock block(const DeviceBuffer& b) const { return {k(b), v(b), tokens_of(b)}; }
};

// The travelling block of `rows` K/V rows shaped as k (heads, dtype), with token ids; all of
// k's rows by default.
inline KvPacking packing_of(const TensorView& k, int64_t rows, bool documents) {
  return {k.dim(0), rows, k.dim(2), k.dim(3), k.dtype(), documents};
}
inline KvPacking packing_of(const TensorView& k, bool documents) {
  return packing_of(k, k.dim(1), documents);
}

// A whole buffer as one flat fp32 tensor (for add / fill_zero).
inline TensorView flat_f32(const DeviceBuffer& b) {
  return b.view(DType::f32, {int64_t(b.size() / 4)});
}

// One hop around the ring of `comm` (ring-flash-attention's RingComm): enqueues on the comm
// stream, after the compute stream's work so far (which may have written the block), the
// receive of `in_bytes` from rank r-1 (none when 0: the sender has no block) and the send of
// `*send` to rank r+1 (none when null); wait() makes the compute stream wait for both and
// hands over the received block. The receive's size is the caller's: blocks may differ from
// rank to rank (prefill's shares differ by up to a placement block). The sent block stays
// readable: the caller keeps it while it computes on it (a lent block's memory lives until
// both the sender and the receiver let go of it, so a peer that unwinds from a failure cannot
// free it under this rank's compute). `distance` d generalises the hop: send to rank r+d,
// receive from rank r-d (mod P; the needed exchange's step s is d = s, its gradients going
// home d = -s).
class RingHop {
 public:
  RingHop(Device& dev, Communicator& comm, DeviceBuffer* send, size_t in_bytes, int tag,
          int distance = 1);
  DeviceBuffer wait();

 private:
  Device& dev_;
  DeviceBuffer incoming_;
  Event arrived_;
};

// The P steps of a ring: at step s this rank holds the block of rank (r - s) mod P (its own
// at s = 0) and op.compute(s, holding, block) is enqueued while the next hop (tag op.tag +
// s + 1) travels; the last step only computes. op.bytes(owner) is the size of owner's block
// (0: it has none, and nothing moves for it).
struct RingOp {
  int tag = 0;
  std::function<size_t(int owner)> bytes;
  std::function<void(int step, int holding, const DeviceBuffer& block)> compute;
};
// `block` is this rank's own block, packed (empty when P = 1: nothing travels).
void ring_steps(Device& dev, Communicator& comm, DeviceBuffer block, const RingOp& op);

}  // namespace ctxpar::strategy

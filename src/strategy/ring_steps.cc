#include "strategy/ring_steps.h"

#include <optional>

namespace ctxpar::strategy {

DeviceBuffer KvPacking::pack(Device& dev, Stream s, const KvBlock& block) const {
  DeviceBuffer b = dev.alloc(bytes());
  dev.pack_kv(s, block.k, block.v, block.tokens, documents, k(b), v(b), b.data() + tokens_offset());
  return b;
}

TensorView KvPacking::k(const DeviceBuffer& b) const {
  return b.view(dtype, {batch, tokens, heads, d});
}

TensorView KvPacking::v(const DeviceBuffer& b) const {
  return b.view(dtype, {batch, tokens, heads, d}, kv_bytes());
}

Tokens KvPacking::tokens_of(const DeviceBuffer& b) const {
  Tokens t;
  t.positions = {reinterpret_cast<const int64_t*>(b.data() + tokens_offset()), size_t(tokens)};
  if (documents)
    t.documents = {reinterpret_cast<const int32_t*>(b.data() + tokens_offset() + tokens * 8),
                   size_t(tokens)};
  return t;
}

RingHop::RingHop(Device& dev, Communicator& comm, DeviceBuffer* send, size_t in_bytes, int tag,
                 int distance)
    : dev_(dev) {
  const int p = comm.size(), me = comm.rank(), d = (distance % p + p) % p;
  dev.wait(kCommStream, dev.record(kComputeStream));
  if (in_bytes > 0) incoming_ = dev.recv(kCommStream, comm, in_bytes, (me + p - d) % p, tag);
  if (send) dev.send(kCommStream, comm, *send, (me + d) % p, tag);
  arrived_ = dev.record(kCommStream);
}

DeviceBuffer RingHop::wait() {
  dev_.wait(kComputeStream, arrived_);
  return std::move(incoming_);
}

void ring_steps(Device& dev, Communicator& comm, DeviceBuffer block, const RingOp& op) {
  const int p = comm.size(), me = comm.rank();
  for (int s = 0; s < p; ++s) {
    const int holding = (me - s + p) % p, next_owner = (me - s - 1 + 2 * p) % p;
    std::optional<RingHop> hop;
    if (s + 1 < p)
      hop.emplace(dev, comm, op.bytes(holding) > 0 ? &block : nullptr, op.bytes(next_owner),
                  op.tag + s + 1);
    op.compute(s, holding, block);
    if (hop) block = hop->wait();  // the block just used is freed stream-ordered
  }
}

}  // namespace ctxpar::strategy

// The ring backward's last hop home is pipelined (Note [Pipelined last hop] in
// src/strategy/ring.cc): the last step computes its K/V block in pieces of key rows and sends
// each piece's finished dK/dV accumulator before computing the next piece. Checked on the
// order of the operations a rank enqueues (a recording device around the cpu device), which
// does not depend on the machine's speed; the accuracy of multi-piece runs is checked against
// the fp64 reference.
#include <gtest/gtest.h>

#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "ctxpar/comm.h"
#include "ctxpar/device.h"
#include "device/forwarding_device.h"
#include "strategy/internal.h"
#include "strategy/strategy_support.h"

namespace ctxpar::testing {
namespace {

// Forwards every operation to a cpu device and logs the ones that show the schedule:
// "bwd <key rows>" and "send <bytes> <tag>".
class RecordingDevice final : public ForwardingDevice {
 public:
  explicit RecordingDevice(int rank) : ForwardingDevice(make_device({}, rank)) {}
  std::vector<std::string> log;

  void send(Stream s, Communicator& comm, DeviceBuffer& buffer, int peer, int tag) override {
    log.push_back("send " + std::to_string(buffer.size()) + " " + std::to_string(tag));
    ForwardingDevice::send(s, comm, buffer, peer, tag);
  }
  void run(Stream s, const Op& op) override {
    if (const auto* b = std::get_if<op::BackwardBlock>(&op.args))
      log.push_back("bwd " + std::to_string(b->k.dim(1)));
    ForwardingDevice::run(s, op);
  }
};

std::string joined(const std::vector<std::string>& v) {
  std::ostringstream o;
  for (const std::string& s : v) o << "\n  " << s;
  return o.str();
}

// P = 2, 1600 key rows a rank: step 0 computes the own block whole; step 1, the last,
// computes 3 pieces (576, 576, 448 rows: whole 64-row tiles, at least 512 rows each but the
// last), each sent home right after its compute, before the next piece's compute. Batch 2
// makes every piece a strided view.
TEST(RingPipeline, LastHopGoesHomeInPiecesAsTheyAreComputed) {
  const int64_t b = 2, tl = 1600, h = 2, d = 16;
  std::vector<std::vector<std::string>> logs(2);
  run_threads(2, [&](Communicator& comm) {
    RecordingDevice dev(comm.rank());
    strategy::Call call{{}, &dev, Mask{}, KernelConfig{}};
    auto zeros = [](const Shape& s) { return Tensor(DType::f32, s); };  // zero-filled
    Tensor q = zeros({b, tl, h, d}), k = zeros({b, tl, h, d}), v = zeros({b, tl, h, d});
    Tensor dout = zeros({b, tl, h, d}), lse = zeros({b, h, tl}), delta = zeros({b, h, tl});
    Tensor dq = zeros({b, tl, h, d}), dk = zeros({b, tl, h, d}), dv = zeros({b, tl, h, d});
    std::vector<int64_t> pos(tl);
    for (int64_t i = 0; i < tl; ++i) pos[i] = comm.rank() * tl + i;
    const Tokens tokens{pos, {}};
    strategy::ring_backward(comm, call, {q, k, v, tokens, dout, lse, delta, dq, dk, dv});
    dev.synchronize();
    logs[comm.rank()] = dev.log;
  });
  const size_t kv_block = 2 * b * tl * h * d * 4 + tl * 8;
  const int tag0 = 16384 + 2 + 1;  // kGradTag + P + 1: the first piece
  std::vector<std::string> want = {"send " + std::to_string(kv_block) + " 1", "bwd 1600"};
  const int64_t rows[] = {576, 576, 448};
  for (int c = 0; c < 3; ++c) {
    want.push_back("bwd " + std::to_string(rows[c]));
    want.push_back("send " + std::to_string(2 * b * rows[c] * h * d * 4) + " " +
                   std::to_string(tag0 + c));
  }
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(logs[r], want) << "rank " << r << " enqueued:" << joined(logs[r])
                             << "\nwanted:" << joined(want);
}

// Multi-piece runs (GQA, causal with documents: partial tiles in the pieces) against the fp64
// reference with the strategies' rule; P = 2 (1152 key rows a rank: 2 pieces of 576) and 4
// (576: 1 piece), contiguous and zigzag. (The reference is O(T^2) in fp64: one mask.)
TEST(RingPipeline, MultiPieceBackwardMatchesReference) {
  for (const char* mask : {"causal+documents"}) {
    Problem pr;
    pr.tokens = 2304;
    pr.hq = 2;
    pr.hkv = 1;
    pr.mask = parse_mask(mask);
    pr.build();
    const References& refs = references_of(pr);
    const Errors bound = bounds_of(refs);
    StrategyOptions opt;
    opt.kind = StrategyKind::ring;
    opt.mask = pr.mask;
    for (int p : {2, 4})
      for (LayoutKind layout : {LayoutKind::contiguous, LayoutKind::zigzag}) {
        const RunResult cpu = run_sharded(pr, p, layout, opt);
        const Errors e = errors_of(cpu, refs);
        const std::string where =
            std::string(mask) + " P=" + std::to_string(p) + " " + layout_name(layout);
        EXPECT_LE(e.dq, bound.dq) << where;
        EXPECT_LE(e.dk, bound.dk) << where;
        EXPECT_LE(e.dv, bound.dv) << where;
        // The simulated asynchronous device (random delays, race checks) must give the same
        // bits: the pieces' copies, sends and receives are ordered by events, not by luck.
        StrategyOptions sim = opt;
        sim.device.kind = DeviceKind::sim;
        sim.device.sim_seed = uint64_t(p) * 10 + (layout == LayoutKind::zigzag);
        sim.device.sim_max_delay_us = 50;
        const RunResult on_sim = run_sharded(pr, p, layout, sim);
        for (auto [x, y] :
             {std::pair{&cpu.dq, &on_sim.dq}, {&cpu.dk, &on_sim.dk}, {&cpu.dv, &on_sim.dv}})
          EXPECT_EQ(std::memcmp(x->data(), y->data(), x->bytes()), 0) << where << ": sim != cpu";
      }
  }
}

}  // namespace
}  // namespace ctxpar::testing

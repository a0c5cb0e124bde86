// The loopback transport (src/cuda/loopback.h): P ranks on one (recording) GPU, device-to-
// device copies ordered by events through one shared RecordingCudaApi. Every strategy x layout
// x mask gives the cpu device's bits, the one log keeps the ordering rules (across the ranks'
// streams too) and nothing leaks; a rank waiting for a message that never comes times out
// naming the peer.
#include <gtest/gtest.h>

#include <array>
#include <cstring>

#include "cuda/api_recording.h"
#include "cuda/cuda_device.h"
#include "cuda/device_support.h"
#include "cuda/loopback.h"
#include "strategy/strategy_support.h"

namespace ctxpar::testing {
namespace {

// run_whole_on_threads (threads_run.cc) with each rank's communicator wrapped in a LoopbackComm
// and its device a CudaDevice over the one shared API.
RunResult run_loopback(const Problem& pr, int ranks, LayoutKind kind, const StrategyOptions& opt,
                       std::shared_ptr<cuda::RecordingCudaApi> api) {
  const Layout layout(kind, pr.tokens, ranks);
  const int64_t tl = layout.local_tokens();
  auto world = std::make_shared<cuda::LoopbackWorld>(api);
  std::vector<std::array<Tensor, 5>> out(static_cast<size_t>(ranks));
  ThreadsOptions topt;
  topt.timeout = std::chrono::seconds(20);
  run_threads(
      ranks,
      [&](Communicator& host) {
        cuda::LoopbackComm comm(host, world);
        const int r = comm.rank();
        const std::vector<int64_t> pos = layout.token_positions(r, pr.positions);
        const std::vector<int32_t> docs =
            opt.mask.documents ? layout.shard(pr.documents, r) : std::vector<int32_t>{};
        const Tensor q = layout.shard(pr.q, r), k = layout.shard(pr.k, r),
                     v = layout.shard(pr.v, r);
        auto strategy = Strategy::create(comm, opt, std::make_unique<cuda::CudaDevice>(api, r));
        auto& [o, lse, dq, dk, dv] = out[size_t(r)];
        o = Tensor(DType::f32, {pr.batch, tl, pr.hq, pr.d});
        lse = Tensor(DType::f32, {pr.batch, pr.hq, tl});
        strategy->forward(q, k, v, Tokens{pos, docs}, o, lse);
        const Tensor dout = layout.shard(pr.dout, r);
        dq = Tensor(DType::f32, {pr.batch, tl, pr.hq, pr.d});
        dk = Tensor(DType::f32, {pr.batch, tl, pr.hkv, pr.d});
        dv = Tensor(DType::f32, {pr.batch, tl, pr.hkv, pr.d});
        strategy->backward(q, k, v, Tokens{pos, docs}, o, lse, dout, dq, dk, dv);
      },
      topt);
  RunResult res;
  res.o = Tensor(DType::f32, {pr.batch, pr.tokens, pr.hq, pr.d});
  res.lse = Tensor(DType::f32, {pr.batch, pr.hq, pr.tokens});
  res.dq = Tensor(DType::f32, {pr.batch, pr.tokens, pr.hq, pr.d});
  res.dk = Tensor(DType::f32, {pr.batch, pr.tokens, pr.hkv, pr.d});
  res.dv = Tensor(DType::f32, {pr.batch, pr.tokens, pr.hkv, pr.d});
  Tensor* whole[] = {&res.o, &res.lse, &res.dq, &res.dk, &res.dv};
  for (int i = 0; i < 5; ++i) {
    std::vector<TensorView> parts;
    for (auto& x : out) parts.push_back(x[size_t(i)]);
    layout.unshard(parts, *whole[i], i == 1 ? 2 : 1);
  }
  return res;
}

TEST(CudaLoopback, BitwiseTheCpuDeviceEveryStrategyLayoutMask) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    Problem pr;
    pr.hq = 8;
    pr.hkv = 4;
    pr.tokens = 48;
    pr.dtype = dtype;
    pr.build();
    for (const char* mask :
         {"none", "causal", "window:7,3", "causal+documents", "prefix-tree:16,16,16"})
      for (int p : {2, 4})
        for (StrategyKind kind : {StrategyKind::ring, StrategyKind::allgather,
                                  StrategyKind::ulysses, StrategyKind::hybrid})
          for (LayoutKind layout :
               {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped}) {
            StrategyOptions opt;
            opt.kind = kind;
            opt.ulysses_degree = kind == StrategyKind::hybrid ? 2 : 0;
            opt.mask = parse_mask(mask);
            const RunResult cpu = run_sharded(pr, p, layout, opt);
            auto api = std::make_shared<cuda::RecordingCudaApi>();
            const RunResult loop = run_loopback(pr, p, layout, opt, api);
            const std::string where = std::string(dtype_name(dtype)) + " " + strategy_name(kind) +
                                      " P=" + std::to_string(p) + " " + layout_name(layout) + " " +
                                      mask;
            EXPECT_EQ(bits_differ(cpu, loop), "") << where;
            const auto v = api->violations();
            EXPECT_TRUE(v.empty()) << where << ": " << v[0];
            EXPECT_EQ(api->live_allocations(), 0u) << where;
            EXPECT_EQ(api->live_events(), 0u) << where;
            EXPECT_EQ(api->live_streams(), 0u) << where;
          }
  }
}

TEST(CudaLoopback, MissingMessageTimesOutNamingThePeer) {
  auto api = std::make_shared<cuda::RecordingCudaApi>();
  auto world = std::make_shared<cuda::LoopbackWorld>(api);
  const auto errors = errors_on_ranks(2, [&](Communicator& host) {
    cuda::LoopbackComm comm(host, world);
    comm.set_timeout(std::chrono::milliseconds(300));
    cuda::CudaDevice dev(api, comm.rank());
    DeviceBuffer got = dev.recv(kCommStream, comm, 64, 1 - comm.rank(), 3);
    dev.synchronize();
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(errors[size_t(r)].find("waiting for a loopback message from rank " +
                                     std::to_string(1 - r) + " (tag 3)"),
              std::string::npos)
        << errors[size_t(r)];
}

}  // namespace
}  // namespace ctxpar::testing

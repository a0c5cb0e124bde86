// The cuda device's own rules on the CPU (CudaDevice over RecordingCudaApi): staged transfers
// and all-to-all over the threads transport, a failed or stuck peer ends in an error naming it
// (no hang), frees wait for every stream, host memory is staged, and the cuDNN dispatch path
// (a CPU fake running each fused call through the tile math) meets the accuracy rule.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <numeric>

#include "ctxpar/device.h"
#include "cuda/api_recording.h"
#include "cuda/cuda_device.h"
#include "cuda/device_support.h"
#include "strategy/strategy_support.h"

namespace ctxpar::testing {
namespace {

TensorView floats(const DeviceBuffer& b) { return b.view(DType::f32, {int64_t(b.size() / 4)}); }

void fill(Device& dev, DeviceBuffer& b, float first) {
  std::vector<float> host(b.size() / 4);
  std::iota(host.begin(), host.end(), first);
  dev.copy(kComputeStream, TensorView(host.data(), DType::f32, {int64_t(host.size())}), floats(b));
  dev.synchronize();  // host's memory is read by then
}

std::vector<float> read(Device& dev, const DeviceBuffer& b) {
  std::vector<float> host(b.size() / 4);
  dev.copy(kComputeStream, floats(b), TensorView(host.data(), DType::f32, {int64_t(host.size())}));
  dev.synchronize();
  return host;
}

TEST(CudaDeviceOps, SendRecvAndAlltoallStagedThroughTheHost) {
  RecordingCudaDevices devices;
  const auto errors = errors_on_ranks(3, [&](Communicator& comm) {
    auto dev = devices.make(comm.rank());
    const int r = comm.rank(), p = comm.size();
    DeviceBuffer mine = dev->alloc(64);
    fill(*dev, mine, float(100 * r));
    dev->send(kCommStream, comm, mine, (r + 1) % p, 5);
    DeviceBuffer got = dev->recv(kCommStream, comm, 64, (r + p - 1) % p, 5);
    dev->wait(kComputeStream, dev->record(kCommStream));
    const std::vector<float> v = read(*dev, got);
    for (int i = 0; i < 16; ++i) ASSERT_EQ(v[size_t(i)], float(100 * ((r + p - 1) % p) + i));
    DeviceBuffer send = dev->alloc(size_t(p) * 16), recv = dev->alloc(size_t(p) * 16);
    fill(*dev, send, float(10 * r));  // chunk j: 10 r + 4 j .. 10 r + 4 j + 3
    dev->alltoall(kCommStream, comm, send, recv, 16, 6);
    dev->wait(kComputeStream, dev->record(kCommStream));
    const std::vector<float> a = read(*dev, recv);
    for (int i = 0; i < p; ++i)
      for (int c = 0; c < 4; ++c) ASSERT_EQ(a[size_t(4 * i + c)], float(10 * i + 4 * r + c));
  });
  for (const std::string& e : errors) EXPECT_EQ(e, "");
  EXPECT_EQ(devices.problems(), "");
  EXPECT_EQ(devices.reports().size(), 3u);
}

// A peer that fails: the receiver's next synchronize throws naming it, at once.
TEST(CudaDeviceOps, FailedPeerIsNamed) {
  RecordingCudaDevices devices;
  const auto errors = errors_on_ranks(2, [&](Communicator& comm) {
    auto dev = devices.make(comm.rank());
    if (comm.rank() == 1) throw Error("rank 1 gave up");
    DeviceBuffer got = dev->recv(kCommStream, comm, 64, 1, 9);
    dev->synchronize();
  });
  EXPECT_NE(errors[0].find("rank 1 failed"), std::string::npos) << errors[0];
  EXPECT_EQ(devices.problems(), "");
}

// Two ranks that each wait for a message the other never sends: both end within the
// communicator's timeout, naming the peer and the tag; nothing hangs.
TEST(CudaDeviceOps, StuckPeerTimesOutNamingIt) {
  RecordingCudaDevices devices;
  double seconds = 0;
  const auto errors = errors_on_ranks(
      2,
      [&](Communicator& comm) {
        comm.set_timeout(std::chrono::milliseconds(500));
        auto dev = devices.make(comm.rank());
        DeviceBuffer got = dev->recv(kCommStream, comm, 64, 1 - comm.rank(), 11);
        dev->synchronize();
      },
      &seconds);
  bool named = false;
  for (int r = 0; r < 2; ++r)
    named |= errors[size_t(r)].find("rank " + std::to_string(1 - r)) != std::string::npos;
  EXPECT_TRUE(named) << errors[0] << " | " << errors[1];
  EXPECT_LT(seconds, 5.0);
}

// A buffer written on the comm stream and freed at once: the free waits for both streams
// (the log's checker would say otherwise), and the memory is quarantined, not reused.
TEST(CudaDeviceOps, FreeWaitsForEveryStream) {
  auto owned = std::make_unique<cuda::RecordingCudaApi>();
  cuda::RecordingCudaApi* api = owned.get();
  cuda::CudaDevice dev(std::move(owned), 0);
  DeviceBuffer a = dev.alloc(256);
  dev.fill_zero(kCommStream, floats(a));  // first use on comm: waits for the allocation
  DeviceBuffer b = dev.alloc(256);
  dev.copy(kComputeStream, floats(b), floats(b));
  a.reset();
  b.reset();
  dev.synchronize();
  EXPECT_TRUE(api->violations().empty()) << api->violations()[0];
  EXPECT_EQ(api->live_allocations(), 0u);
  // Each free: after a wait on an event of stream 0 and of stream 1, on the free stream (2).
  const auto log = api->log();
  int frees = 0;
  for (size_t i = 0; i < log.size(); ++i) {
    if (log[i].op != "free") continue;
    ++frees;
    ASSERT_GE(i, 4u);  // record on 0, wait on 2 for it, record on 1, wait on 2 for it, free
    EXPECT_EQ(log[i].stream, 2);
    EXPECT_EQ(log[i - 3].op, "wait");
    EXPECT_EQ(log[i - 1].op, "wait");
    EXPECT_EQ(log[i - 3].stream, 2);
    EXPECT_EQ(log[i - 1].stream, 2);
    EXPECT_EQ(log[i - 3].event_stream, 0);
    EXPECT_EQ(log[i - 1].event_stream, 1);
  }
  EXPECT_EQ(frees, 2);
}

// Counters: the attention operations' time comes from event pairs read at synchronize (the
// recording API's events carry the host time of their record).
TEST(CudaDeviceOps, BusyTimeFromEventPairs) {
  cuda::CudaDevice dev(std::make_unique<cuda::RecordingCudaApi>(), 0);
  Tensor q(DType::f32, {1, 256, 2, 64}), out(DType::f32, {1, 256, 2, 64});
  Tensor lse(DType::f32, {1, 2, 256});
  for (int64_t i = 0; i < q.numel(); ++i) q.ptr<float>()[i] = float(i % 7) * 0.1f;
  std::vector<int64_t> pos(256);
  std::iota(pos.begin(), pos.end(), 0);
  DeviceForwardState st(dev, 1, 256, 2, 64);
  dev.forward_block(kComputeStream, q, Tokens{pos, {}}, q, q, Tokens{pos, {}}, Mask{}, st.get(),
                    {});
  dev.forward_finalize(kComputeStream, st.get(), out, lse, {});
  EXPECT_EQ(dev.counters().busy_seconds, 0.0);  // not read before synchronize
  dev.synchronize();
  EXPECT_GT(dev.counters().busy_seconds, 0.0);
  EXPECT_EQ(dev.counters().flops, 4.0 * 64 * 256 * 256 * 2);
}

// The cuda device does not offer op::Forward (caps().whole_forward is false): forward_whole
// makes a state, runs the block and its finalize (the same bits as doing so by hand), and an
// op::Forward enqueued anyway is refused naming the call to use.
TEST(CudaDeviceOps, WholeForwardIsTheStateBlockAndFinalize) {
  cuda::CudaDevice dev(std::make_unique<cuda::RecordingCudaApi>(), 0);
  EXPECT_FALSE(dev.caps().whole_forward);
  const int64_t t = 96;
  Tensor q(DType::f32, {1, t, 2, 32}), k(DType::f32, {1, t, 2, 32}), v(DType::f32, {1, t, 2, 32});
  fill_normal(q, 1), fill_normal(k, 2), fill_normal(v, 3);
  std::vector<int64_t> pos(t);
  std::iota(pos.begin(), pos.end(), 0);
  const Tokens tokens{pos, {}};
  const Mask causal = Mask::causal_mask();
  Tensor o1(DType::f32, {1, t, 2, 32}), o2(DType::f32, {1, t, 2, 32});
  Tensor l1(DType::f32, {1, 2, t}), l2(DType::f32, {1, 2, t});
  {
    DeviceForwardState st(dev, 1, t, 2, 32);
    dev.forward_block(kComputeStream, q, tokens, k, v, tokens, causal, st.get(), {});
    dev.forward_finalize(kComputeStream, st.get(), o1, l1, {});
  }
  dev.forward_whole(kComputeStream, q, tokens, k, v, tokens, causal, o2, l2, {});
  dev.synchronize();
  // Written by both (not two untouched buffers): row 0 sees key 0 alone, so O = v's row 0.
  EXPECT_EQ(o1.ptr<float>()[3], v.ptr<float>()[3]);
  EXPECT_EQ(std::memcmp(o1.ptr<float>(), o2.ptr<float>(), o1.bytes()), 0);
  EXPECT_EQ(std::memcmp(l1.ptr<float>(), l2.ptr<float>(), l1.bytes()), 0);
  try {
    dev.run(kComputeStream, {op::Forward{q, tokens, k, v, tokens, causal, o2, l2, {}}});
    ADD_FAILURE() << "op::Forward ran on the cuda device";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("call Device::forward_whole"), std::string::npos)
        << e.what();
  }
}

// Leaving the lazy wait out is seen: a comm-stream write of memory allocated on the compute
// stream with no ordering (written directly against the API, as a broken device would).
TEST(CudaDeviceOps, TheCheckerSeesAnUnorderedUse) {
  cuda::RecordingCudaApi api;
  auto s0 = api.stream_create(), s1 = api.stream_create();
  void* p = api.malloc_async(64, s0);
  api.memset_async(p, 0, 64, s1);
  api.free_async(p, s0);
  const auto v = api.violations();
  ASSERT_EQ(v.size(), 2u);
  EXPECT_NE(v[0].find("before its allocation on stream 0"), std::string::npos) << v[0];
  EXPECT_NE(v[1].find("writes"), std::string::npos) << v[1];
}

// Host views (the caller's tensors), strided, through copy / add / fill_zero.
TEST(CudaDeviceOps, StridedHostViewsAreStaged) {
  RecordingCudaDevices devices;
  auto dev = devices.make(0);
  Tensor src(DType::f32, {2, 3, 4, 5}), dst(DType::bf16, {2, 3, 4, 5});
  for (int64_t i = 0; i < src.numel(); ++i) src.ptr<float>()[i] = float(i) * 0.37f;
  const TensorView s = src.view().slice(2, 1, 3), d = dst.view().slice(2, 0, 2);
  dev->copy(kComputeStream, s, d);
  dev->synchronize();
  Tensor want(DType::bf16, {2, 3, 4, 5});
  copy_into(s, want.view().slice(2, 0, 2));
  EXPECT_EQ(std::memcmp(dst.data(), want.data(), want.bytes()), 0);
  dev->fill_zero(kComputeStream, src.view().slice(3, 0, 1));
  dev->synchronize();
  for (int64_t i = 0; i < src.numel(); ++i)
    EXPECT_EQ(src.ptr<float>()[i], i % 5 == 0 ? 0.0f : float(i) * 0.37f) << i;
  dev.reset();
  EXPECT_EQ(devices.problems(), "");
}

// The caller's device memory (a CUDA tensor through DLPack): adopted views are used in place,
// with no staging copy, and are neither freed nor counted as a leak.
TEST(CudaDeviceOps, AdoptedMemoryIsUsedInPlace) {
  RecordingCudaDevices devices;
  auto dev = devices.make(0);
  auto& cuda_dev = dynamic_cast<cuda::CudaDevice&>(*dev);
  auto& api = dynamic_cast<cuda::RecordingCudaApi&>(cuda_dev.api());
  Tensor src(DType::f32, {2, 3, 4, 5}), dst(DType::bf16, {2, 3, 4, 5});
  for (int64_t i = 0; i < src.numel(); ++i) src.ptr<float>()[i] = float(i) * 0.37f;
  EXPECT_TRUE(dev->adopt(src.data(), src.bytes()));      // Device's optional member
  EXPECT_TRUE(dev->adopt(dst.data(), dst.bytes() / 2));  // touching halves: one range
  // Its kernels check no finiteness and the host reads no input: the KV cache asks this.
  EXPECT_FALSE(dev->caps().finite_checks);
  cuda_dev.adopt(static_cast<std::byte*>(dst.data()) + dst.bytes() / 2, dst.bytes() / 2);
  EXPECT_EQ(api.adopted(), 2u);
  const TensorView s = src.view().slice(2, 1, 3), d = dst.view().slice(2, 0, 2);
  Tensor want(DType::bf16, {2, 3, 4, 5});
  copy_into(s, want.view().slice(2, 0, 2));
  dev->copy(kComputeStream, s, d);
  dev->fill_zero(kCommStream, src.view().slice(3, 0, 1));  // another stream, no wait: below
  dev->synchronize();
  EXPECT_EQ(std::memcmp(dst.data(), want.data(), want.bytes()), 0);
  for (const auto& e : api.log())
    EXPECT_EQ(e.op.rfind("memcpy", 0), std::string::npos) << "staged: " << e.op;
  // The comm stream's zero fill wrote what the compute stream's copy read, with no wait: the
  // checker sees it in the caller's memory as in the device's own.
  ASSERT_EQ(api.violations().size(), 1u);
  EXPECT_NE(api.violations()[0].find("still reads"), std::string::npos) << api.violations()[0];
  dev.reset();
  const auto reports = devices.reports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].live, 0u);
}

// The recording API refuses to free the caller's memory, and a hand-back (release) before the
// host synchronised with the streams that use it.
TEST(CudaDeviceOps, AdoptedMemoryChecks) {
  cuda::RecordingCudaApi api;
  auto s0 = api.stream_create();
  std::vector<float> mine(16);
  api.adopt(mine.data(), 64);
  api.memset_async(mine.data(), 0, 64, s0);
  api.free_async(mine.data(), s0);
  api.release(mine.data());
  EXPECT_EQ(api.live_allocations(), 0u);
  EXPECT_EQ(api.adopted(), 0u);
  const auto v = api.violations();
  ASSERT_EQ(v.size(), 2u);
  EXPECT_NE(v[0].find("free of the caller's memory"), std::string::npos) << v[0];
  EXPECT_NE(v[1].find("handed back while stream 0 still uses it"), std::string::npos) << v[1];
  api.adopt(mine.data(), 64);
  api.memset_async(mine.data(), 0, 64, s0);
  api.stream_synchronize(s0);
  api.release(mine.data());
  EXPECT_EQ(api.violations().size(), 2u);
}

// The strategies on the cuda device against the fp64 reference under the accuracy rule, for
// every layout and mask: fp32 (the fallback kernel) and bf16 with the fake cuDNN, where blocks
// go to fused calls one at a time and their fp32 partials are merged into the state / added
// into the gradients.
void meets_the_accuracy_rule(DType dtype, bool fake_cudnn) {
  for (const char* mask : {"none", "causal", "window:7,3", "causal+documents"}) {
    Problem pr;
    pr.hq = 4;
    pr.hkv = 2;
    pr.tokens = 48;
    pr.d = 16;
    pr.dtype = dtype;
    pr.mask = parse_mask(mask);
    pr.build();
    const References& refs = references_of(pr);
    for (LayoutKind layout : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped})
      for (StrategyKind kind : {StrategyKind::ring, StrategyKind::ulysses}) {
        RecordingCudaDevices devices(fake_cudnn);
        StrategyOptions opt;
        opt.kind = kind;
        opt.mask = pr.mask;
        opt.device = devices.options();
        const Errors e = errors_of(run_sharded(pr, 2, layout, opt), refs);
        const std::string where =
            std::string(mask) + " " + layout_name(layout) + " " + strategy_name(kind);
        EXPECT_EQ(beyond(e, bounds_of(refs)), "") << where;
        EXPECT_EQ(devices.cudnn_calls() > 0, fake_cudnn) << where;
        EXPECT_EQ(devices.problems(), "") << where;
      }
  }
}

TEST(CudaDeviceOps, FallbackMeetsTheAccuracyRule) { meets_the_accuracy_rule(DType::f32, false); }

#ifdef CTXPAR_CUDA_HEADERS
TEST(CudaDeviceOps, CudnnDispatchMeetsTheAccuracyRule) {
  meets_the_accuracy_rule(DType::bf16, true);
}
#endif

}  // namespace
}  // namespace ctxpar::testing

namespace ctxpar::testing {
namespace {

// make_device(cuda) where there is no GPU: the command's refusal, naming why.
TEST(CudaDeviceOps, MakeDeviceWithoutAGpuRefusesNamingWhy) {
  DeviceOptions o;
  o.kind = DeviceKind::cuda;
  try {
    auto dev = make_device(o, 0);
    GTEST_SKIP() << "this machine has a GPU: " << dev->name();
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("device 'cuda': ", 0), 0u) << m;
    EXPECT_TRUE(m.find("no CUDA device found: cudaGetDeviceCount returned") != std::string::npos ||
                m.find("built without CUDA") != std::string::npos)
        << m;
  }
}

}  // namespace
}  // namespace ctxpar::testing

// The cuda device's error paths and its cuDNN fallback, on the CPU (CudaDevice over
// RecordingCudaApi): the recording API flags double and late destroys of events and streams;
// a failing runtime call (RecordingCudaApi::fail_at) is the error the caller gets, and the
// device then destroys each event once, reads none it did not record, and leaks nothing; a
// graph cuDNN refuses sends its block to the fallback kernel, counted, or under
// CTXPAR_CUDNN=require is an error naming the graph.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <numeric>

#include "ctxpar/device.h"
#include "cuda/api_recording.h"
#include "cuda/cuda_device.h"
#include "cuda/device_support.h"
#include "cuda/loopback.h"
#include "strategy/strategy_support.h"
#ifdef CTXPAR_CUDA_HEADERS
#include "cuda/fake_cudnn.h"
#include "same_bits.h"
#endif

namespace ctxpar::testing {
namespace {

std::string joined(const std::vector<std::string>& v) {
  std::string out;
  for (const std::string& s : v) out += s + "\n";
  return out;
}

TEST(CudaRecording, DoubleAndLateDestroysAreFlagged) {
  cuda::RecordingCudaApi api;
  auto s0 = api.stream_create(), s1 = api.stream_create();
  auto e0 = api.event_create(false), e1 = api.event_create(true), e2 = api.event_create(true);
  api.event_record(e0, s0);
  api.event_destroy(e0);
  api.event_destroy(e0);          // double
  api.stream_wait_event(s1, e0);  // late: a use after the destroy
  api.event_elapsed_ms(e1, e2);   // neither was recorded
  api.stream_destroy(s1);
  api.stream_destroy(s1);               // double
  api.memset_async(nullptr, 0, 0, s1);  // late: an operation on a destroyed stream
  const std::vector<std::string> want = {"event 0 destroyed twice",
                                         "'wait' of event 0 after its destroy",
                                         "'elapsed' of event 1, never recorded",
                                         "'elapsed' of event 2, never recorded",
                                         "stream 1 destroyed twice",
                                         "'memset' on stream 1 after its destroy"};
  EXPECT_EQ(joined(api.violations()), joined(want));
  EXPECT_EQ(api.live_events(), 2u);   // e1, e2
  EXPECT_EQ(api.live_streams(), 1u);  // s0
}

TEST(CudaRecording, FailAtThrowsFromTheNthCallOnly) {
  cuda::RecordingCudaApi api;
  auto s = api.stream_create();
  api.fail_at("memset", 2, "injected: memset failed");
  std::vector<float> host(4);
  void* p = api.malloc_async(16, s);
  api.memset_async(p, 0, 16, s);
  try {
    api.memset_async(p, 0, 16, s);
    FAIL() << "the second memset did not fail";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "injected: memset failed");
  }
  api.memset_async(p, 0, 16, s);  // the fault is spent
  api.free_async(p, s);
  EXPECT_TRUE(api.violations().empty()) << joined(api.violations());
}

// One bf16 block pair (T = 64, Hq 4, Hkv 2, D 16, causal), forward then backward, on `dev`
// (host tensors: staged).
TensorView flat(const Tensor& t) { return TensorView(t.data(), t.dtype(), {t.numel()}); }

struct Block {
  Tensor q{DType::bf16, {1, 64, 4, 16}}, k{DType::bf16, {1, 64, 2, 16}},
      v{DType::bf16, {1, 64, 2, 16}};
  Tensor out{DType::bf16, {1, 64, 4, 16}}, lse{DType::f32, {1, 4, 64}};
  Tensor dout{DType::bf16, {1, 64, 4, 16}}, delta{DType::f32, {1, 4, 64}};
  Tensor dq{DType::f32, {1, 64, 4, 16}}, dk{DType::f32, {1, 64, 2, 16}},
      dv{DType::f32, {1, 64, 2, 16}};
  std::vector<int64_t> pos = std::vector<int64_t>(64);
  Mask mask = parse_mask("causal");
  Block() {
    std::iota(pos.begin(), pos.end(), 0);
    int i = 0;
    for (Tensor* t : {&q, &k, &v, &dout}) {
      ++i;
      for (int64_t e = 0; e < t->numel(); ++e)
        flat(*t).set(float((e * 7 + i) % 11) * 0.1f - 0.5f, e);
    }
  }
  void forward(Device& dev) {
    DeviceForwardState st(dev, 1, 64, 4, 16);
    dev.forward_reset(kComputeStream, st.get());
    dev.forward_block(kComputeStream, q, Tokens{pos, {}}, k, v, Tokens{pos, {}}, mask, st.get(),
                      {});
    dev.forward_finalize(kComputeStream, st.get(), out, lse, {});
  }
  void backward(Device& dev) {
    dev.backward_delta(kComputeStream, out, dout, delta, {});
    for (Tensor* t : {&dq, &dk, &dv}) dev.fill_zero(kComputeStream, *t);
    dev.backward_block(kComputeStream, q, Tokens{pos, {}}, k, v, Tokens{pos, {}}, mask, dout, lse,
                       delta, dq, dk, dv, {});
  }
};

// A kernel launch that fails: its error is the one thrown; the device then synchronizes
// without reading the half-made timing pair, and ends destroying each event and stream once,
// with nothing leaked.
TEST(CudaDeviceErrors, AFailedLaunchIsTheErrorAndNothingIsDestroyedTwiceOrLeaked) {
  auto api = std::make_shared<cuda::RecordingCudaApi>();
  {
    cuda::CudaDevice dev(api, 0);
    Block b;
    api->fail_at("forward", 1, "injected: the forward kernel's launch failed");
    try {
      b.forward(dev);
      FAIL() << "the failed launch was not reported";
    } catch (const Error& e) {
      EXPECT_STREQ(e.what(), "injected: the forward kernel's launch failed");
    }
    dev.synchronize();  // the failure was reported: nothing else to say
    b.forward(dev);     // and the device runs on
    dev.synchronize();
  }
  EXPECT_EQ(joined(api->violations()), "");
  EXPECT_EQ(api->live_events(), 0u);
  EXPECT_EQ(api->live_streams(), 0u);
  EXPECT_EQ(api->live_allocations(), 0u);
}

// Reading an operation's time fails at synchronize (the second pair): that error is thrown,
// and every pair is destroyed once -- none read or destroyed again by a later synchronize or
// the destructor.
TEST(CudaDeviceErrors, AFailedTimeReadIsTheErrorAndEachEventIsDestroyedOnce) {
  auto api = std::make_shared<cuda::RecordingCudaApi>();
  {
    cuda::CudaDevice dev(api, 0);
    Block b;
    b.forward(dev);  // three timed operations: reset is not one; block, finalize are
    api->fail_at("elapsed", 2, "injected: cudaEventElapsedTime failed");
    try {
      dev.synchronize();
      FAIL() << "the failed read was not reported";
    } catch (const Error& e) {
      EXPECT_STREQ(e.what(), "injected: cudaEventElapsedTime failed");
    }
    dev.synchronize();
  }
  EXPECT_EQ(joined(api->violations()), "");
  EXPECT_EQ(api->live_events(), 0u);
  EXPECT_EQ(api->live_allocations(), 0u);
}

// Through a strategy: rank 1's device fails a backward launch; its error is what the rank
// reports, and every device ends with no violation and nothing leaked.
TEST(CudaDeviceErrors, AStrategyReportsTheFailedLaunchAndLeavesNothingBehind) {
  RecordingSetup setup;
  setup.on_api = [](cuda::RecordingCudaApi& api, int rank) {
    if (rank == 1) api.fail_at("backward", 1, "injected: rank 1's backward launch failed");
  };
  RecordingCudaDevices devices(setup);
  Problem pr;
  pr.tokens = 32;
  pr.build();
  StrategyOptions opt;
  opt.kind = StrategyKind::ring;
  opt.mask = parse_mask("causal");
  opt.device = devices.options();
  std::string error;
  try {
    run_sharded(pr, 2, LayoutKind::zigzag, opt);
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("injected: rank 1's backward launch failed"), std::string::npos) << error;
  EXPECT_EQ(devices.problems(), "");
  EXPECT_EQ(devices.reports().size(), 2u);
}

// A free the runtime refuses (free() never throws): the buffer's own event is still destroyed.
// A record that fails: its event is destroyed. An allocation whose event cannot be made: the
// memory is freed.
TEST(CudaDeviceErrors, AFailedFreeRecordOrAllocationEventLeavesNothingBehind) {
  auto api = std::make_shared<cuda::RecordingCudaApi>();
  {
    cuda::CudaDevice dev(api, 0);
    DeviceBuffer b = dev.alloc(256);
    api->fail_at("free", 1, "injected: cudaFreeAsync failed");
    b.reset();
    dev.synchronize();
    api->fail_at("record", 1, "injected: cudaEventRecord failed");
    EXPECT_THROW(dev.record(kComputeStream), Error);
    api->fail_at("event_create", 1, "injected: cudaEventCreate failed");
    EXPECT_THROW(dev.alloc(64), Error);
    dev.synchronize();
  }
  EXPECT_EQ(joined(api->violations()), "");
  EXPECT_EQ(api->live_events(), 0u);
  EXPECT_EQ(api->live_allocations(), 1u);  // the refused free's: the runtime kept it
}

// A loopback message of the wrong size: the receiver's error names both sizes, and the
// staging copy and its event are released all the same.
TEST(CudaDeviceErrors, ALoopbackMessageOfTheWrongSizeIsReleased) {
  auto api = std::make_shared<cuda::RecordingCudaApi>();
  {
    auto world = std::make_shared<cuda::LoopbackWorld>(api);
    const auto errors = errors_on_ranks(2, [&](Communicator& host) {
      cuda::LoopbackComm comm(host, world);
      cuda::CudaDevice dev(api, comm.rank());
      DeviceBuffer mine = dev.alloc(64), got;
      if (comm.rank() == 0) {
        dev.fill_zero(kCommStream, mine.view(DType::f32, {16}));
        dev.send(kCommStream, comm, mine, 1, 4);
      } else {
        got = dev.recv(kCommStream, comm, 128, 0, 4);
      }
      dev.synchronize();
    });
    EXPECT_EQ(errors[0], "");
    EXPECT_NE(errors[1].find("a loopback message of 64 bytes from rank 0 (tag 4) where 128 were "
                             "expected"),
              std::string::npos)
        << errors[1];
  }
  EXPECT_EQ(api->live_events(), 0u);
  EXPECT_EQ(api->live_allocations(), 0u);
}

#ifdef CTXPAR_CUDA_HEADERS
// A graph cuDNN refuses to build: that block runs on the fallback kernel, whole (no call of
// it reached cuDNN), and is counted; the other blocks still go to cuDNN. The refused backward
// is bitwise the fallback kernel's on the same O and LSE (a device without cuDNN).
TEST(CudaDeviceCudnn, ARefusedGraphFallsBackToTheExactKernelCounted) {
  auto api = std::make_shared<cuda::RecordingCudaApi>();
  std::atomic<int64_t> calls{0};
  auto refuse_backward = [](const fused::Call&, bool backward) { return backward; };
  Block refused, fallback;
  {
    cuda::CudaDevice dev(api, 0, std::make_unique<FakeCudnn>(&calls, refuse_backward));
    ::testing::internal::CaptureStderr();
    refused.forward(dev);
    refused.backward(dev);
    dev.synchronize();
    const std::string said = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(dev.cudnn_blocks(), 1);     // the forward
    EXPECT_EQ(dev.cudnn_refused(), 1);    // the backward's graph
    EXPECT_EQ(dev.fallback_blocks(), 1);  // ... ran on the fallback kernel
    EXPECT_GT(dev.cudnn_calls(), 0);
    EXPECT_EQ(calls.load(), dev.cudnn_calls());  // every call that reached cuDNN is counted
    // Said at most once per process (another test may have said it first).
    EXPECT_TRUE(said.empty() || said.find("cuDNN refused a graph") != std::string::npos) << said;
  }
  fallback.out = Tensor::copy_of(refused.out.view());
  fallback.lse = Tensor::copy_of(refused.lse.view());
  {
    cuda::CudaDevice dev(api, 0);  // no cuDNN: the fallback kernel
    fallback.backward(dev);
    dev.synchronize();
    EXPECT_EQ(dev.fallback_blocks(), 1);
  }
  EXPECT_TRUE(test::same_bits(refused.dq, fallback.dq));
  EXPECT_TRUE(test::same_bits(refused.dk, fallback.dk));
  EXPECT_TRUE(test::same_bits(refused.dv, fallback.dv));
  EXPECT_EQ(joined(api->violations()), "");
  EXPECT_EQ(api->live_events(), 0u);
  EXPECT_EQ(api->live_allocations(), 0u);
}

// CTXPAR_CUDNN=require: a refused graph is an error naming it, before anything of the block
// is enqueued.
TEST(CudaDeviceCudnn, UnderRequireARefusedGraphIsAnErrorNamingIt) {
  auto api = std::make_shared<cuda::RecordingCudaApi>();
  auto refuse_all = [](const fused::Call&, bool) { return true; };
  {
    cuda::CudaDevice dev(api, 0, std::make_unique<FakeCudnn>(nullptr, refuse_all), true);
    Block b;
    try {
      b.forward(dev);
      FAIL() << "the refusal was not reported";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.rfind("CTXPAR_CUDNN=require: fake cuDNN refused the forward graph of ", 0), 0u)
          << m;
      EXPECT_NE(m.find("unset CTXPAR_CUDNN"), std::string::npos) << m;
    }
    EXPECT_EQ(dev.fallback_blocks(), 0);
    EXPECT_EQ(dev.cudnn_blocks(), 0);
    for (const auto& e : api->log()) EXPECT_NE(e.op, "absorb_partial");
  }
  EXPECT_EQ(joined(api->violations()), "");
  EXPECT_EQ(api->live_events(), 0u);
}

// Every strategy and layout with cuDNN refusing every backward graph and the windows' forward
// graphs: the results meet the accuracy rule against the fp64 reference.
TEST(CudaDeviceCudnn, StrategiesWithRefusedGraphsMeetTheAccuracyRule) {
  for (const char* mask : {"causal", "window:7,3"}) {
    Problem pr;
    pr.hq = 4;
    pr.hkv = 2;
    pr.tokens = 48;
    pr.d = 16;
    pr.dtype = DType::bf16;
    pr.mask = parse_mask(mask);
    pr.build();
    const References& refs = references_of(pr);
    for (LayoutKind layout : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped}) {
      RecordingSetup setup;
      setup.fake_cudnn = true;
      setup.refuse = [](const fused::Call& c, bool backward) { return backward || c.has_lower; };
      RecordingCudaDevices devices(setup);
      StrategyOptions opt;
      opt.kind = StrategyKind::ring;
      opt.mask = pr.mask;
      opt.device = devices.options();
      const Errors e = errors_of(run_sharded(pr, 2, layout, opt), refs);
      const std::string where = std::string(mask) + " " + layout_name(layout);
      EXPECT_EQ(beyond(e, bounds_of(refs)), "") << where;
      EXPECT_EQ(devices.problems(), "") << where;
    }
  }
}
#endif

}  // namespace
}  // namespace ctxpar::testing

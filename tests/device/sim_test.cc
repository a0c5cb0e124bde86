// The sim device's checks, each on the smallest program that trips it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "ctxpar/device.h"

namespace ctxpar {
namespace {

std::unique_ptr<Device> sim() {
  DeviceOptions o;
  o.kind = DeviceKind::sim;
  return make_device(o, 0);
}

TensorView floats(const DeviceBuffer& b) { return b.view(DType::f32, {int64_t(b.size() / 4)}); }

TEST(Sim, FreedMemoryReadsNaN) {
  auto dev = sim();
  DeviceBuffer b = dev->alloc(256);
  dev->fill_zero(kComputeStream, floats(b));
  dev->synchronize();
  const float* p = reinterpret_cast<const float*>(b.data());
  EXPECT_EQ(p[0], 0.0f);
  b.reset();  // freed once the streams pass this point (quarantined, so p stays readable)
  dev->synchronize();
  for (int i = 0; i < 64; ++i) EXPECT_TRUE(std::isnan(p[i])) << i;
}

TEST(Sim, FreshMemoryIsNaN) {
  auto dev = sim();
  DeviceBuffer b = dev->alloc(64);
  EXPECT_TRUE(std::isnan(reinterpret_cast<const float*>(b.data())[3]));
}

TEST(Sim, UsingAFreedBufferIsRefused) {
  auto dev = sim();
  DeviceBuffer a = dev->alloc(64), b = dev->alloc(64);
  const TensorView dangling = floats(a);
  a.reset();
  dev->synchronize();
  try {
    dev->copy(kComputeStream, dangling, floats(b));
    FAIL() << "a copy from freed memory was enqueued";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'copy' on the compute stream uses a buffer that was "
                                         "already freed"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(dev->synchronize(), Error);
}

// Read after write on another stream with no wait: refused naming both operations.
TEST(Sim, ReadOfAnotherStreamsWriteWithoutWaitIsRefused) {
  auto dev = sim();
  DeviceBuffer a = dev->alloc(64), b = dev->alloc(64);
  dev->fill_zero(kComputeStream, floats(a));
  try {
    dev->copy(kCommStream, floats(a), floats(b));
    FAIL() << "the race was not seen";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'copy' on the comm stream reads a buffer that "
                                         "'fill_zero' on the compute stream writes, with no wait"),
              std::string::npos)
        << e.what();
  }
  // The refusal failed the device: its queued work is dropped and synchronize says why.
  EXPECT_THROW(dev->synchronize(), Error);
}

// Reuse: writing a buffer that an operation queued on another stream still reads.
TEST(Sim, ReuseWhileAnotherStreamReadsIsRefused) {
  for (bool with_wait : {false, true}) {
    auto dev = sim();
    DeviceBuffer a = dev->alloc(64), b = dev->alloc(64);
    dev->fill_zero(kComputeStream, floats(a));
    dev->wait(kCommStream, dev->record(kComputeStream));
    dev->copy(kCommStream, floats(a), floats(b));  // ordered after the fill: fine
    if (with_wait) {
      dev->wait(kComputeStream, dev->record(kCommStream));
      dev->fill_zero(kComputeStream, floats(a));  // after the copy: fine
      dev->synchronize();
      EXPECT_EQ(reinterpret_cast<const float*>(b.data())[0], 0.0f);
      continue;
    }
    try {
      dev->fill_zero(kComputeStream, floats(a));  // but the copy may still be reading a
      FAIL() << "the reuse was not seen";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'fill_zero' on the compute stream writes a buffer "
                                           "that 'copy' on the comm stream reads"),
                std::string::npos)
          << e.what();
    }
  }
}

// A waited-for event orders the streams transitively: compute -> comm -> compute.
TEST(Sim, EventsOrderStreams) {
  auto dev = sim();
  DeviceBuffer a = dev->alloc(4096), b = dev->alloc(4096);
  for (int i = 0; i < 20; ++i) {
    dev->fill_zero(kComputeStream, floats(a));
    dev->wait(kCommStream, dev->record(kComputeStream));
    dev->copy(kCommStream, floats(a), floats(b));
    dev->wait(kComputeStream, dev->record(kCommStream));
  }
  dev->synchronize();
  EXPECT_EQ(reinterpret_cast<const float*>(b.data())[1000], 0.0f);
}

// A forward state in device memory: the device counts its bytes, and forward_block /
// forward_finalize through it give kernel.h's bits on a host ForwardState.
TEST(Device, ForwardStateInDeviceMemoryIsTheKernels) {
  const int64_t b = 1, t = 80, h = 2, d = 16;
  Tensor q(DType::f32, {b, t, h, d}), k(DType::f32, {b, t, h, d}), v(DType::f32, {b, t, h, d});
  fill_normal(q, 1);
  fill_normal(k, 2);
  fill_normal(v, 3);
  std::vector<int64_t> pos(t), pos2(t);
  for (int64_t i = 0; i < t; ++i) pos[i] = t + i, pos2[i] = i;
  const Tokens qt{pos, {}}, kt2{pos2, {}};
  const Mask causal = Mask::causal_mask();
  ForwardState host(b, t, h, d);
  attention_forward_block(q, qt, k, v, kt2, causal, host);
  attention_forward_block(q, qt, k, v, qt, causal, host);
  Tensor want_o(DType::f32, {b, t, h, d}), want_l(DType::f32, {b, h, t});
  attention_forward_finalize(host, want_o, want_l);
  for (DeviceKind kind : {DeviceKind::cpu, DeviceKind::sim}) {
    DeviceOptions opt;
    opt.kind = kind;
    auto dev = make_device(opt, 0);
    Tensor got_o(DType::f32, {b, t, h, d}), got_l(DType::f32, {b, h, t});
    {
      DeviceForwardState state(*dev, b, t, h, d);
      EXPECT_EQ(dev->held_bytes(), host.bytes()) << dev->name();
      dev->forward_block(kComputeStream, q, qt, k, v, kt2, causal, state.get(), {});
      dev->forward_block(kComputeStream, q, qt, k, v, qt, causal, state.get(), {});
      dev->forward_finalize(kComputeStream, state.get(), got_o, got_l, {});
    }
    EXPECT_EQ(dev->held_bytes(), 0u) << dev->name();
    EXPECT_EQ(dev->peak_bytes(), host.bytes()) << dev->name();
    dev->synchronize();
    EXPECT_EQ(std::memcmp(got_o.data(), want_o.data(), want_o.bytes()), 0) << dev->name();
    EXPECT_EQ(std::memcmp(got_l.data(), want_l.data(), want_l.bytes()), 0) << dev->name();
  }
}

// The state is device memory like any buffer: used on another stream with no wait, refused.
TEST(Sim, ForwardStateIsCheckedForRaces) {
  auto dev = sim();
  Tensor q(DType::f32, {1, 8, 1, 16});
  std::vector<int64_t> pos(8);
  const Tokens tokens{pos, {}};
  DeviceForwardState state(*dev, 1, 8, 1, 16);  // reset on the compute stream
  std::string refusal = "(none)";
  try {
    dev->forward_block(kCommStream, q, tokens, q, q, tokens, Mask{}, state.get(), {});
  } catch (const Error& e) {
    refusal = e.what();
  }
  EXPECT_NE(refusal.find("'forward_block' on the comm stream writes a buffer that "
                         "'forward_reset' on the compute stream writes"),
            std::string::npos)
      << refusal;
}

TEST(Device, Names) {
  EXPECT_EQ(parse_device("sim"), DeviceKind::sim);
  EXPECT_EQ(make_device({}, 0)->name(), "cpu");
  EXPECT_THROW(parse_device("gpu"), Error);
}

}  // namespace
}  // namespace ctxpar

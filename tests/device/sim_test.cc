// The sim device's checks, each on the smallest program that trips it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

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
                                         "already freed"), std::string::npos) << e.what();
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
              std::string::npos) << e.what();
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
                std::string::npos) << e.what();
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

// The one operation no strategy uses today: both devices run kernel.h's merge, bit for bit.
TEST(Device, MergeIsTheKernelsMerge) {
  const Shape o{1, 8, 2, 16}, l{1, 2, 8};
  Tensor oa(DType::f32, o), ob(DType::f32, o), la(DType::f32, l), lb(DType::f32, l);
  fill_normal(oa, 1);
  fill_normal(ob, 2);
  fill_normal(la, 3);
  fill_normal(lb, 4);
  la.ptr<float>()[0] = lb.ptr<float>()[0] = -INFINITY;  // a fully masked row stays 0, -inf
  Tensor want_o = Tensor::copy_of(oa), want_l = Tensor::copy_of(la);
  merge(want_o, want_l, ob, lb);
  for (DeviceKind kind : {DeviceKind::cpu, DeviceKind::sim}) {
    DeviceOptions opt;
    opt.kind = kind;
    auto dev = make_device(opt, 0);
    Tensor got_o = Tensor::copy_of(oa), got_l = Tensor::copy_of(la);
    dev->merge(kComputeStream, got_o, got_l, ob, lb);
    dev->synchronize();
    EXPECT_EQ(std::memcmp(got_o.data(), want_o.data(), want_o.bytes()), 0) << dev->name();
    EXPECT_EQ(std::memcmp(got_l.data(), want_l.data(), want_l.bytes()), 0) << dev->name();
  }
}

TEST(Device, Names) {
  EXPECT_EQ(parse_device("sim"), DeviceKind::sim);
  EXPECT_EQ(make_device({}, 0)->name(), "cpu");
  EXPECT_THROW(parse_device("gpu"), Error);
}

}  // namespace
}  // namespace ctxpar

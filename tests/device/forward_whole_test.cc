// Device::forward_whole: op::Forward where the device offers it (the host devices, cpu and sim:
// caps().whole_forward), else a state in device memory, the block and its finalize; the same
// bits either way, and the operations enqueued each way are the ones named.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "ctxpar/device.h"
#include "forwarding_device.h"
#include "same_bits.h"

namespace ctxpar {
namespace {

// Records the name of every kernel operation; `whole` false hides the inner device's op::Forward.
class Recording final : public testing::ForwardingDevice {
 public:
  Recording(std::unique_ptr<Device> inner, bool whole)
      : ForwardingDevice(std::move(inner)), whole_(whole) {}
  DeviceCaps caps() const override {
    DeviceCaps c = ForwardingDevice::caps();
    c.whole_forward = c.whole_forward && whole_;
    return c;
  }
  void run(Stream s, const Op& op) override {
    names.push_back(op.name());
    ForwardingDevice::run(s, op);
  }
  std::vector<std::string> names;

 private:
  bool whole_;
};

TEST(DeviceForwardWhole, HostDevicesRunItAsOneOperationWithTheBitsOfTheState) {
  const int64_t t = 100, h = 2, d = 32;
  Tensor q(DType::bf16, {1, t, h, d}), k(DType::bf16, {1, t, h, d}), v(DType::bf16, {1, t, h, d});
  fill_normal(q, 1), fill_normal(k, 2), fill_normal(v, 3);
  std::vector<int64_t> pos(t);
  std::iota(pos.begin(), pos.end(), 0);
  const Tokens tokens{pos, {}};
  const Mask causal = Mask::causal_mask();
  Tensor want_o(DType::bf16, {1, t, h, d}), want_lse(DType::f32, {1, h, t});
  {
    ForwardState state(1, t, h, d);
    attention_forward_block(q, tokens, k, v, tokens, causal, state);
    attention_forward_finalize(state, want_o, want_lse);
  }
  for (const DeviceKind kind : {DeviceKind::cpu, DeviceKind::sim})
    for (const bool whole : {true, false}) {
      SCOPED_TRACE(std::string(device_name(kind)) + (whole ? " whole" : " state"));
      DeviceOptions o;
      o.kind = kind;
      Recording dev(make_device(o, 0), whole);
      EXPECT_EQ(dev.caps().whole_forward, whole);
      Tensor out(DType::bf16, {1, t, h, d}), lse(DType::f32, {1, h, t});
      dev.forward_whole(kComputeStream, q, tokens, k, v, tokens, causal, out, lse, {});
      dev.synchronize();
      EXPECT_TRUE(test::same_bits(out, want_o));
      EXPECT_TRUE(test::same_bits(lse, want_lse));
      const std::vector<std::string> ops =
          whole ? std::vector<std::string>{"forward"}
                : std::vector<std::string>{"forward_reset", "forward_block", "forward_finalize"};
      EXPECT_EQ(dev.names, ops);
    }
}

}  // namespace
}  // namespace ctxpar

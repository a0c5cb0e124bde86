// DeviceRegistry: the factories of the device kinds, injected through DeviceOptions::registry
// (tests make devices of their own that way, with nothing process-wide to set or restore).
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "ctxpar/device.h"
#include "ctxpar/error.h"
#include "device/forwarding_device.h"

namespace ctxpar::testing {
namespace {

class Named final : public ForwardingDevice {
 public:
  Named(std::unique_ptr<Device> inner, int rank)
      : ForwardingDevice(std::move(inner)), rank_(rank) {}
  std::string name() const override { return "named-" + std::to_string(rank_); }

 private:
  int rank_;
};

TEST(DeviceRegistry, WithReplacesOneKindForTheCallsGivenItOnly) {
  const auto base = DeviceRegistry::builtin();
  const auto mine = base->with(DeviceKind::cpu, [base](const DeviceOptions& o, int rank) {
    return std::unique_ptr<Device>(std::make_unique<Named>(base->make(o, rank), rank));
  });
  DeviceOptions o;
  o.registry = mine;
  EXPECT_EQ(make_device(o, 3)->name(), "named-3");
  o.kind = DeviceKind::sim;  // the other kinds stay the built-in ones
  EXPECT_EQ(make_device(o, 0)->name(), "sim");
  // Nothing process-wide changed: without the registry, and through builtin(), cpu is cpu.
  EXPECT_EQ(make_device({}, 3)->name(), "cpu");
  EXPECT_EQ(base->make({}, 3)->name(), "cpu");
}

TEST(DeviceRegistry, AKindWithoutAFactoryIsRefusedNamingIt) {
  DeviceOptions o;
  o.registry = DeviceRegistry::builtin()->with(DeviceKind::sim, {});
  o.kind = DeviceKind::sim;
  try {
    make_device(o, 0);
    FAIL() << "made a device with no factory";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "this DeviceRegistry has no factory for device 'sim': give it one with "
                  "with(DeviceKind::sim, factory)"),
              std::string::npos)
        << e.what();
  }
}

// Capabilities and optional members, asked for instead of the device's name: the host devices
// read a call's inputs to refuse NaN / Inf, and take no caller's device memory.
TEST(DeviceRegistry, HostDevicesCheckFinitenessAndAdoptNothing) {
  for (DeviceKind kind : {DeviceKind::cpu, DeviceKind::sim}) {
    DeviceOptions o;
    o.kind = kind;
    auto dev = make_device(o, 0);
    EXPECT_TRUE(dev->caps().finite_checks) << device_name(kind);
    float x = 0;
    EXPECT_FALSE(dev->adopt(&x, sizeof x)) << device_name(kind);
  }
}

}  // namespace
}  // namespace ctxpar::testing

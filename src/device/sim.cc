#include "device/devices.h"
namespace ctxpar::device {
std::unique_ptr<Device> make_sim(const DeviceOptions&, int) { throw Error("sim: not yet"); }
}

// Test-only switches of the strategies (not in the public API: tests include this internal
// header). Nothing in the library sets them.
#pragma once

namespace ctxpar::strategy::testing {

// When set, the ring's rotation (RingHop::wait in ring_steps.cc) leaves out the compute stream's
// wait for the received K/V block, so that a test can check that the sim device catches a
// missing wait (tests/strategy/device_test.cc). Process-wide; tests set it around a run.
void set_ring_skip_wait(bool skip);
bool ring_skips_wait();

}  // namespace ctxpar::strategy::testing

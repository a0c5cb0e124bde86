// Private to the kernel layer: whether AMX-BF16 tile products are usable here and how fast
// (issue 26; amx_probe.cc). Probe only: the kernel has no AMX path yet.
#pragma once
#include <string>

namespace ctxpar::kernel {

struct AmxProbe {
  bool usable = false;
  double gflops = 0;  // one thread, _tile_dpbf16ps chains (0: not measured)
  std::string why;    // why not usable ("" when usable)
};
// Checks cpuid (AMX-TILE, AMX-BF16), asks Linux for the tile data state
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): a guest or kernel may refuse), then
// times 4 independent chains of tile products, best of 3 (about a millisecond).
AmxProbe probe_amx();

}  // namespace ctxpar::kernel

// Private to the kernel layer: whether AMX-BF16 tile products are usable here and how fast
// (amx_probe.cc); the AMX kernel path is amx_bf16.cc.
#pragma once
#include <cstdint>
#include <string>

namespace ctxpar::kernel {

struct AmxProbe {
  bool usable = false;
  double gflops = 0;  // one thread, _tile_dpbf16ps chains (0: not measured)
  std::string why;    // why not usable ("" when usable)
};
// Checks cpuid (AMX-TILE, AMX-BF16), asks Linux for the tile data state
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): a guest or kernel may refuse), then
// times 4 independent chains of tile products in thread CPU time, best of 3 (about a
// millisecond).
AmxProbe probe_amx();
// The checks alone, once per process (the permission is per process): "" where AMX-BF16 is
// usable, else why not.
const std::string& amx_unusable_why();

// The 64-byte operand of _tile_loadconfig (palette 1).
struct __attribute__((packed)) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace ctxpar::kernel

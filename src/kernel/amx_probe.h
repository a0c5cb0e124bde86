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

// The 64-byte operand of ldtilecfg (palette 1).
struct __attribute__((packed)) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

// Every tile product here: 8 tiles of 16 rows x 64 bytes.
inline constexpr TileConfig kTiles16x64 = [] {
  TileConfig c;
  for (int i = 0; i < 8; ++i) c.rows[i] = 16, c.colsb[i] = 64;
  return c;
}();

// Note [Tile instructions the compiler can see]: GCC 12's AMX intrinsics are asm statements
// that do not tell the compiler what memory they touch. _tile_loadconfig names the first 8
// bytes of its 64-byte config as its only input, so the stores to the rest of a config built on
// the stack may be dropped (a small noinline function that built one got rows and colsb never
// written, and ldtilecfg raised SIGSEGV: dev/17_amx_switch.cc's first build; lab 14 had worked
// around it). _tile_loadd and _tile_stored pass their address as a plain register with no
// memory operand or clobber, so plain stores that fill a tile's source may be dropped or moved
// after the load, and plain loads of a tile's result moved before the store: with the config
// made a constant, `bf16::dot_pairs_amx` (whose tiles are filled and read in the same function)
// returned 0 in every call. The library and the labs use these instead: the config is a whole
// 64-byte operand, and every tile load and store is a compiler barrier ("memory" clobber).
// Test: AmxProducts.DeltaAddsAsTheBackwardsDp (fails with the intrinsics).
inline void load_tile_config(const TileConfig& cfg) { asm volatile("ldtilecfg %0" : : "m"(cfg)); }
#define CTXPAR_TILE_LOAD(dst, base, stride)                                                 \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #dst ::"r"(static_cast<const void*>(base)), \
                   "r"(static_cast<long>(stride))                                           \
                   : "memory")
#define CTXPAR_TILE_STORE(src, base, stride)                                              \
  __asm__ volatile("tilestored %%tmm" #src ", (%0,%1,1)" ::"r"(static_cast<void*>(base)), \
                   "r"(static_cast<long>(stride))                                         \
                   : "memory")

}  // namespace ctxpar::kernel

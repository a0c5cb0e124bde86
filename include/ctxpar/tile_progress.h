// A process-wide hook the CPU attention kernel calls between tiles: after each (query tile x
// key tile) unit of the forward and the backward, from whichever kernel thread finished it.
// The MPI transport installs it in CTXPAR_MPI_PROGRESS=tiles (or both) mode while a transfer
// is pending, to make MPI progress calls while the rank computes (docs/comm.md, "Progress").
// It lives in the core layer so that neither the kernel nor the transport depends on the other.
//
// With no hook installed a call costs one relaxed atomic load. The hook must be cheap itself
// (rate-limit, never block) and must not touch kernel data: results stay bitwise the same.
#pragma once
#include <atomic>

namespace ctxpar {

using TileProgressHook = void (*)();

// Installs `hook` for every later tile of every kernel call in the process; nullptr removes
// it. A kernel thread that read the old hook just before the change may still call it once.
void set_tile_progress_hook(TileProgressHook hook);

namespace detail {
extern std::atomic<TileProgressHook> tile_progress_hook;
}

// Called by the kernel between tiles.
inline void tile_progress() {
  if (const TileProgressHook hook = detail::tile_progress_hook.load(std::memory_order_relaxed))
    hook();
}

}  // namespace ctxpar

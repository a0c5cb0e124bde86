#include "ctxpar/tile_progress.h"

namespace ctxpar {

namespace detail {
std::atomic<TileProgressHook> tile_progress_hook{nullptr};
}

void set_tile_progress_hook(TileProgressHook hook) {
  detail::tile_progress_hook.store(hook, std::memory_order_release);
}

}  // namespace ctxpar

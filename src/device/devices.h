// Private: the device factories, and the host implementations of the kernel operations that
// the cpu and sim devices share (both run on host memory).
#pragma once
#include <chrono>
#include <memory>

#include "ctxpar/device.h"

namespace ctxpar::device {

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Runs one kernel operation on the host (f returns its KernelStats) and adds its time and
// FLOPs to `c`.
template <typename F>
void count_busy(DeviceCounters& c, F&& f) {
  const double t0 = now_seconds();
  const KernelStats ks = f();
  c.busy_seconds += now_seconds() - t0;
  c.flops += ks.flops;
}

std::unique_ptr<Device> make_cpu();
std::unique_ptr<Device> make_sim(const DeviceOptions& options, int rank);

// y += x (fp32, same shape), element by element in index order.
void host_add(const TensorView& x, const TensorView& y);
void host_fill_zero(const TensorView& t);
void host_pack_kv(const TensorView& k, const TensorView& v, const Tokens& tokens, bool documents,
                  const TensorView& block_k, const TensorView& block_v, std::byte* block_tokens);
void host_scatter_tokens(const TensorView& src, const TensorView& dst, const TensorView& index);
void host_gather_tokens(const TensorView& src, const TensorView& dst, const TensorView& index);

}  // namespace ctxpar::device

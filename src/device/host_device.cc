// The kernel operations of a device whose memory is host memory, each once: its host work and
// the memory it reads and writes, handed to run() (see host_device.h).
#include "device/host_device.h"

#include "device/devices.h"

namespace ctxpar::device {

TensorView HostDevice::bytes_view(const std::byte* p, size_t n) {
  return TensorView(const_cast<std::byte*>(p), DType::i32, {int64_t(n / 4 > 0 ? n / 4 : 1)});
}

template <typename F>
void HostDevice::busy(F&& f) {
  const double t0 = now_seconds();
  const KernelStats ks = f();
  counters_.busy_seconds += now_seconds() - t0;
  counters_.flops += ks.flops;
}

void HostDevice::forward_reset(Stream s, const ForwardStateView& state) {
  submit(s, "forward_reset", {}, {state.acc(), state.m(), state.l()},
         [=] { host_forward_reset(state); });
}

void HostDevice::forward_block(Stream s, const TensorView& q, const Tokens& qt,
                               const TensorView& k, const TensorView& v, const Tokens& kt,
                               const Mask& mask, const ForwardStateView& state,
                               const KernelConfig& config) {
  submit(s, "forward_block", {q, k, v}, {state.acc(), state.m(), state.l()}, [=, this] {
           busy([&] { return attention_forward_block(q, qt, k, v, kt, mask, state, config); });
         });
}

void HostDevice::forward_finalize(Stream s, const ForwardStateView& state, const TensorView& out,
                                  const TensorView& lse, const KernelConfig& config) {
  submit(s, "forward_finalize", {state.acc(), state.m(), state.l()}, {out, lse}, [=, this] {
    busy([&] {
      attention_forward_finalize(state, out, lse, config);
      return KernelStats{};
    });
  });
}

void HostDevice::backward_delta(Stream s, const TensorView& out, const TensorView& dout,
                                const TensorView& delta, const KernelConfig& config) {
  submit(s, "backward_delta", {out, dout}, {delta}, [=, this] {
    busy([&] {
      attention_backward_delta(out, dout, delta, config);
      return KernelStats{};
    });
  });
}

void HostDevice::backward_block(Stream s, const TensorView& q, const Tokens& qt,
                                const TensorView& k, const TensorView& v, const Tokens& kt,
                                const Mask& mask, const TensorView& dout, const TensorView& lse,
                                const TensorView& delta, const TensorView& dq,
                                const TensorView& dk, const TensorView& dv,
                                const KernelConfig& config) {
  submit(s, "backward_block", {q, k, v, dout, lse, delta}, {dq, dk, dv}, [=, this] {
    busy([&] {
      return attention_backward_block(q, qt, k, v, kt, mask, dout, lse, delta, dq, dk, dv,
                                      config);
    });
  });
}

void HostDevice::merge(Stream s, const TensorView& o_a, const TensorView& lse_a,
                       const TensorView& o_b, const TensorView& lse_b) {
  submit(s, "merge", {o_a, lse_a, o_b, lse_b}, {o_a, lse_a},
         [=] { ctxpar::merge(o_a, lse_a, o_b, lse_b); });
}

void HostDevice::add(Stream s, const TensorView& x, const TensorView& y) {
  submit(s, "add", {x}, {y}, [=] { host_add(x, y); });
}

void HostDevice::copy(Stream s, const TensorView& src, const TensorView& dst) {
  submit(s, "copy", {src}, {dst}, [=] { copy_into(src, dst); });
}

void HostDevice::fill_zero(Stream s, const TensorView& t) {
  submit(s, "fill_zero", {}, {t}, [=] { host_fill_zero(t); });
}

void HostDevice::pack_kv(Stream s, const TensorView& k, const TensorView& v, const Tokens& tokens,
                         bool documents, const TensorView& bk, const TensorView& bv,
                         std::byte* bt) {
  const size_t tb = size_t(k.dim(1)) * (8 + (documents ? 4 : 0));
  submit(s, "pack_kv", {k, v}, {bk, bv, bytes_view(bt, tb)},
         [=] { host_pack_kv(k, v, tokens, documents, bk, bv, bt); });
}

void HostDevice::scatter_tokens(Stream s, const TensorView& src, const TensorView& dst,
                                const TensorView& index) {
  submit(s, "scatter_tokens", {src, index}, {dst}, [=] { host_scatter_tokens(src, dst, index); });
}

void HostDevice::gather_tokens(Stream s, const TensorView& src, const TensorView& dst,
                               const TensorView& index) {
  submit(s, "gather_tokens", {src, index}, {dst}, [=] { host_gather_tokens(src, dst, index); });
}

}  // namespace ctxpar::device

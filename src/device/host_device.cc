// The kernel operations of a device whose memory is host memory, each once: its host work and
// the memory it reads and writes, handed to execute() (see host_device.h).
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

template <>
void HostDevice::enqueue(Stream s, const op::ForwardReset& a) {
  const ForwardStateView state = a.state;
  submit(s, a.kName, {}, {state.acc(), state.m(), state.l()}, [=] { host_forward_reset(state); });
}

template <>
void HostDevice::enqueue(Stream s, const op::ForwardBlock& a) {
  submit(s, a.kName, {a.q, a.k, a.v}, {a.state.acc(), a.state.m(), a.state.l()}, [=, this] {
    busy([&] {
      return attention_forward_block(a.q, a.q_tokens, a.k, a.v, a.k_tokens, a.mask, a.state,
                                     a.config);
    });
  });
}

template <>
void HostDevice::enqueue(Stream s, const op::ForwardFinalize& a) {
  submit(s, a.kName, {a.state.acc(), a.state.m(), a.state.l()}, {a.out, a.lse}, [=, this] {
    busy([&] {
      attention_forward_finalize(a.state, a.out, a.lse, a.config);
      return KernelStats{};
    });
  });
}

template <>
void HostDevice::enqueue(Stream s, const op::Forward& a) {
  submit(s, a.kName, {a.q, a.k, a.v}, {a.out, a.lse}, [=, this] {
    busy([&] {
      return attention_forward(a.q, a.q_tokens, a.k, a.v, a.k_tokens, a.mask, a.out, a.lse,
                               a.config);
    });
  });
}

template <>
void HostDevice::enqueue(Stream s, const op::BackwardDelta& a) {
  submit(s, a.kName, {a.out, a.dout}, {a.delta}, [=, this] {
    busy([&] {
      attention_backward_delta(a.out, a.dout, a.delta, a.config);
      return KernelStats{};
    });
  });
}

template <>
void HostDevice::enqueue(Stream s, const op::BackwardBlock& a) {
  submit(s, a.kName, {a.q, a.k, a.v, a.dout, a.lse, a.delta}, {a.dq, a.dk, a.dv}, [=, this] {
    busy([&] {
      return attention_backward_block(a.q, a.q_tokens, a.k, a.v, a.k_tokens, a.mask, a.dout, a.lse,
                                      a.delta, a.dq, a.dk, a.dv, a.config);
    });
  });
}

template <>
void HostDevice::enqueue(Stream s, const op::Merge& a) {
  submit(s, a.kName, {a.o_a, a.lse_a, a.o_b, a.lse_b}, {a.o_a, a.lse_a},
         [=] { ctxpar::merge(a.o_a, a.lse_a, a.o_b, a.lse_b); });
}

template <>
void HostDevice::enqueue(Stream s, const op::Add& a) {
  submit(s, a.kName, {a.x}, {a.y}, [=] { host_add(a.x, a.y); });
}

template <>
void HostDevice::enqueue(Stream s, const op::Copy& a) {
  submit(s, a.kName, {a.src}, {a.dst}, [=] { copy_into(a.src, a.dst); });
}

template <>
void HostDevice::enqueue(Stream s, const op::FillZero& a) {
  submit(s, a.kName, {}, {a.t}, [=] { host_fill_zero(a.t); });
}

template <>
void HostDevice::enqueue(Stream s, const op::PackKv& a) {
  const size_t tb = size_t(a.k.dim(1)) * (8 + (a.documents ? 4 : 0));
  submit(s, a.kName, {a.k, a.v}, {a.block_k, a.block_v, bytes_view(a.block_tokens, tb)}, [=] {
    host_pack_kv(a.k, a.v, a.tokens, a.documents, a.block_k, a.block_v, a.block_tokens);
  });
}

template <>
void HostDevice::enqueue(Stream s, const op::ScatterTokens& a) {
  submit(s, a.kName, {a.src, a.index}, {a.dst},
         [=] { host_scatter_tokens(a.src, a.dst, a.index); });
}

template <>
void HostDevice::enqueue(Stream s, const op::GatherTokens& a) {
  submit(s, a.kName, {a.src, a.index}, {a.dst}, [=] { host_gather_tokens(a.src, a.dst, a.index); });
}

// After every specialisation of enqueue: they are what it instantiates.
void HostDevice::run(Stream s, const Op& op) {
  std::visit([&](const auto& a) { enqueue(s, a); }, op.args);
}

}  // namespace ctxpar::device

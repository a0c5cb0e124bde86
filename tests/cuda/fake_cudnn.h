// A CPU stand-in for CudnnAttention (src/cuda/cudnn_attention.h) for the cuda device's tests:
// each fused call runs through the host tile math (tile_host.h) on its sliced tensors with
// call-local positions and Call::local_mask() -- what a fused call computes -- writing fp32
// partials as cuDNN is asked to. Memory is host memory (the device runs over RecordingCudaApi).
#pragma once
#include <array>
#include <atomic>
#include <functional>
#include <numeric>
#include <vector>

#include "cuda/cudnn_attention.h"
#include "cuda/tile_host.h"

namespace ctxpar::testing {

// `refuse` (when set) says which graphs cuDNN "refuses to build": prepare() and
// workspace_bytes() of such a call throw CudnnRefused, as the real one does when every form of
// a graph is refused; forward() / backward() of it are never reached (checked).
using RefuseGraph = std::function<bool(const fused::Call&, bool backward)>;

class FakeCudnn final : public cuda::CudnnAttention {
 public:
  explicit FakeCudnn(std::atomic<int64_t>* calls = nullptr, RefuseGraph refuse = {})
      : calls_(calls), refuse_(std::move(refuse)) {}
  bool supports(const cuda::SdpaShape& s) const override {
    return s.dtype == DType::bf16 && s.d % 8 == 0 && s.d <= 256 && s.hkv > 0 && s.hq % s.hkv == 0;
  }
  size_t workspace_bytes(const cuda::SdpaShape&, const fused::Call& c, bool backward) override {
    check(c, backward);
    return 64;
  }
  // No graphs here: each call runs directly.
  cuda::SdpaPrepared prepare(const cuda::SdpaShape&, const fused::Call& c,
                             const cuda::SdpaForward&) override {
    check(c, false);
    return {};
  }
  cuda::SdpaPrepared prepare(const cuda::SdpaShape&, const fused::Call& c,
                             const cuda::SdpaBackward&) override {
    check(c, true);
    return {};
  }
  size_t graphs_built() const override { return 0; }

  void forward(const cuda::SdpaShape& s, const fused::Call& c, const cuda::SdpaForward& t, void*,
               cudaStream_t) override {
    CTXPAR_ASSERT(!refuse_ || !refuse_(c, false), "a refused graph was run");
    const int64_t rows = c.rows(), keys = c.keys();
    const auto [q, k, v] = qkv(s, c, t);
    const std::vector<int64_t> qp = local(rows), kp = local(keys);
    ForwardState st(s.batch, rows, s.hq, s.d);
    st.reset();
    cuda::forward_host<cuda::Bf16>(q, Tokens{qp, {}}, k, v, Tokens{kp, {}}, c.local_mask(), st,
                                   s.scale);
    cuda::finalize_host<float>(st, act(t.o, DType::f32, s.batch, 0, rows, s.hq, s.d),
                               rows_view(t.lse, s.batch, 0, rows, s.hq));
    if (calls_) ++*calls_;
  }

  void backward(const cuda::SdpaShape& s, const fused::Call& c, const cuda::SdpaBackward& t, void*,
                cudaStream_t) override {
    CTXPAR_ASSERT(!refuse_ || !refuse_(c, true), "a refused graph was run");
    const int64_t rows = c.rows(), keys = c.keys();
    const auto [q, k, v] = qkv(s, c, t);
    const TensorView o = act(t.out, DType::bf16, s.batch, c.q_begin, rows, s.hq, s.d);
    const TensorView g = act(t.dout, DType::bf16, s.batch, c.q_begin, rows, s.hq, s.d);
    const TensorView lse = rows_view(t.lse, s.batch, c.q_begin, rows, s.hq);
    Tensor delta(DType::f32, {s.batch, s.hq, rows});
    cuda::delta_host<cuda::Bf16>(o, g, delta.view());  // cuDNN forms delta from O and dO
    const TensorView dq = act(t.dq, DType::f32, s.batch, 0, rows, s.hq, s.d);
    const TensorView dk = act(t.dk, DType::f32, s.batch, 0, keys, s.hkv, s.d);
    const TensorView dv = act(t.dv, DType::f32, s.batch, 0, keys, s.hkv, s.d);
    for (const TensorView* z : {&dq, &dk, &dv}) zero(*z);
    const std::vector<int64_t> qp = local(rows), kp = local(keys);
    cuda::backward_host<cuda::Bf16>(q, Tokens{qp, {}}, k, v, Tokens{kp, {}}, c.local_mask(), g, lse,
                                    delta.view(), dq, dk, dv, s.scale);
    if (calls_) ++*calls_;
  }

 private:
  void check(const fused::Call& c, bool backward) const {
    if (refuse_ && refuse_(c, backward))
      throw cuda::CudnnRefused(std::string("fake cuDNN refused the ") +
                               (backward ? "backward" : "forward") + " graph of " + c.describe());
  }
  // The call's slices of q, k, v (SdpaForward or SdpaBackward).
  template <class Tensors>
  static std::array<TensorView, 3> qkv(const cuda::SdpaShape& s, const fused::Call& c,
                                       const Tensors& t) {
    return {act(t.q, DType::bf16, s.batch, c.q_begin, c.rows(), s.hq, s.d),
            act(t.k, DType::bf16, s.batch, c.k_begin, c.keys(), s.hkv, s.d),
            act(t.v, DType::bf16, s.batch, c.k_begin, c.keys(), s.hkv, s.d)};
  }
  static TensorView act(const cuda::SdpaTensor& t, DType dt, int64_t b, int64_t begin, int64_t n,
                        int64_t h, int64_t d) {
    auto* base = static_cast<std::byte*>(t.data) + begin * t.t_stride * int64_t(dtype_size(dt));
    return TensorView(base, dt, {b, n, h, d}, {t.b_stride, t.t_stride, t.h_stride, 1});
  }
  static TensorView rows_view(const cuda::SdpaRows& r, int64_t b, int64_t begin, int64_t n,
                              int64_t h) {
    return TensorView(r.data + begin * r.t_stride, DType::f32, {b, h, n},
                      {r.b_stride, r.h_stride, r.t_stride});
  }
  static std::vector<int64_t> local(int64_t n) {  // call-local positions 0..n-1
    std::vector<int64_t> p(static_cast<size_t>(n));
    std::iota(p.begin(), p.end(), 0);
    return p;
  }
  static void zero(const TensorView& t) {
    for (int64_t a = 0; a < t.dim(0); ++a)
      for (int64_t b = 0; b < t.dim(1); ++b)
        for (int64_t c = 0; c < t.dim(2); ++c)
          for (int64_t d = 0; d < t.dim(3); ++d) t.set(0.0f, a, b, c, d);
  }
  std::atomic<int64_t>* calls_;
  RefuseGraph refuse_;
};

}  // namespace ctxpar::testing

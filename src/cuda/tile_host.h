// The fallback kernel's tile mathematics (tile_math.cuh) run on the host over whole problems,
// with kernel.h's signatures: what tests/cuda checks against the fp64 reference and what
// ctxpar-cuda-check compares the GPU's results with. One host thread walks the rows a GPU
// thread each would; the functions called per row are the GPU's own.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ctxpar/kernel.h"
#include "ctxpar/mask.h"
#include "ctxpar/tensor.h"
#include "cuda/tile_math.cuh"

namespace ctxpar::cuda {

static_assert(kTile == kKernelTile, "the CUDA fallback kernel tiles as the CPU kernel does");

// [B, T, H, D] view (contiguous last dim) and [B, H, T] rows of a TensorView.
template <class T>
View4<T> view4(const TensorView& t) {
  return {reinterpret_cast<T*>(t.data()), t.stride(0), t.stride(1), t.stride(2)};
}
template <class T>
Rows3<T> rows3(const TensorView& t) {
  return {reinterpret_cast<T*>(t.data()), t.stride(0), t.stride(1), t.stride(2)};
}

inline std::vector<TileRange> tile_ranges_host(const Tokens& tokens, int64_t n, bool documents) {
  std::vector<TileRange> r((n + kTile - 1) / kTile);
  for (int64_t t = 0; t < int64_t(r.size()); ++t)
    r[t] = tile_range_of(tokens.positions.data(), documents ? tokens.documents.data() : nullptr,
                         t * kTile, std::min(n, t * kTile + kTile), documents);
  return r;
}

// A Problem<T> over host tensors, with its tile ranges (Problem points into them).
template <class T>
struct HostProblem {
  Problem<T> p;
  std::vector<TileRange> q_tiles, k_tiles;
  HostProblem(const TensorView& q, const Tokens& q_tokens, const TensorView& k, const TensorView& v,
              const Tokens& k_tokens, const Mask& mask, float scale, const TensorView& dout = {})
      : q_tiles(tile_ranges_host(q_tokens, q.dim(1), mask.documents)),
        k_tiles(tile_ranges_host(k_tokens, k.dim(1), mask.documents)) {
    p.q = view4<const T>(q), p.k = view4<const T>(k), p.v = view4<const T>(v);
    if (!dout.empty()) p.dout = view4<const T>(dout);
    p.q_pos = q_tokens.positions.data(), p.k_pos = k_tokens.positions.data();
    p.q_doc = q_tokens.documents.data(), p.k_doc = k_tokens.documents.data();
    p.q_tiles = q_tiles.data(), p.k_tiles = k_tiles.data();
    p.mask = mask;
    p.batch = q.dim(0), p.tq = q.dim(1), p.hq = q.dim(2), p.d = q.dim(3);
    p.tk = k.dim(1), p.hkv = k.dim(2), p.group = p.hq / p.hkv;
    p.scale = scale != 0 ? scale : 1.0f / std::sqrt(float(p.d));
  }
  HostProblem(const HostProblem&) = delete;
};

// kernel.h's attention_forward_block (no argument checks: the caller's are the CPU kernel's).
// Returns the (row, key tile) pairs computed.
template <class T>
int64_t forward_host(const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                     const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                     ForwardState& state, float scale = 0) {
  const HostProblem<T> hp(q, q_tokens, k, v, k_tokens, mask, scale);
  const Problem<T>& p = hp.p;
  std::vector<float> qrow(p.d);
  int64_t computed = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.hq; ++h)
      for (int64_t i = 0; i < p.tq; ++i) {
        const int64_t row = (b * p.hq + h) * p.tq + i;
        const StateRow st{state.acc().ptr<float>() + ((b * p.tq + i) * p.hq + h) * p.d,
                          state.m().ptr<float>() + row, state.l().ptr<float>() + row};
        computed += forward_row(p, b, h, i, st, qrow.data());
      }
  return computed;
}

// kernel.h's attention_forward_finalize; out in T (contiguous), lse [B, Hq, Tq].
template <class T>
void finalize_host(const ForwardState& state, const TensorView& out, const TensorView& lse) {
  const int64_t b = state.batch(), t = state.tokens(), h = state.heads(), d = state.head_dim();
  const Rows3<float> l3 = rows3<float>(lse);
  for (int64_t r = 0; r < b * t * h; ++r) {
    const int64_t hi = r % h, ti = (r / h) % t, bi = r / (h * t);
    const int64_t stat = (bi * h + hi) * t + ti;
    finalize_row(state.acc().ptr<const float>() + r * d, state.m().ptr<const float>()[stat],
                 state.l().ptr<const float>()[stat], d, view4<T>(out).row(bi, ti, hi),
                 &l3.at(bi, hi, ti));
  }
}

// kernel.h's attention_backward_delta.
template <class T>
void delta_host(const TensorView& out, const TensorView& dout, const TensorView& delta) {
  const int64_t b = out.dim(0), t = out.dim(1), h = out.dim(2), d = out.dim(3);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t ti = 0; ti < t; ++ti)
      for (int64_t hi = 0; hi < h; ++hi)
        rows3<float>(delta).at(bi, hi, ti) =
            delta_row(view4<const T>(out).row(bi, ti, hi), view4<const T>(dout).row(bi, ti, hi), d);
}

// kernel.h's attention_backward_block: the dQ pass (every query row), then the dK/dV pass
// (every key row), as the GPU runs them.
template <class T>
void backward_host(const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                   const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                   const TensorView& dout, const TensorView& lse, const TensorView& delta,
                   const TensorView& dq, const TensorView& dk, const TensorView& dv,
                   float scale = 0) {
  const HostProblem<T> hp(q, q_tokens, k, v, k_tokens, mask, scale, dout);
  const Problem<T>& p = hp.p;
  const BackwardRows r{rows3<const float>(lse), rows3<const float>(delta), view4<float>(dq),
                       view4<float>(dk), view4<float>(dv)};
  std::vector<float> a(p.d), g(p.d);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.hq; ++h)
      for (int64_t i = 0; i < p.tq; ++i) backward_dq_row(p, r, b, h, i, a.data(), g.data());
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t hk = 0; hk < p.hkv; ++hk)
      for (int64_t j = 0; j < p.tk; ++j) backward_dkdv_row(p, r, b, hk, j, a.data(), g.data());
}

// kernel.h's merge (contiguous fp32 o [B, T, H, D], lse [B, H, T]).
inline void merge_host(const TensorView& o_a, const TensorView& lse_a, const TensorView& o_b,
                       const TensorView& lse_b) {
  const int64_t b = o_a.dim(0), t = o_a.dim(1), h = o_a.dim(2), d = o_a.dim(3);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t ti = 0; ti < t; ++ti)
      for (int64_t hi = 0; hi < h; ++hi)
        merge_row(view4<float>(o_a).row(bi, ti, hi), &rows3<float>(lse_a).at(bi, hi, ti),
                  view4<const float>(o_b).row(bi, ti, hi), rows3<const float>(lse_b).at(bi, hi, ti),
                  d);
}

}  // namespace ctxpar::cuda

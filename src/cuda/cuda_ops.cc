// The cuda device's kernel operations (cuda_device.h): each places its views on the device
// (Scope), orders its stream after the allocations it touches, and enqueues the fallback
// kernel's launchers or the small kernels of api.h. Argument checks are the CPU kernel's that
// read no data (shapes, dtypes, token counts); finiteness is not checked on the device.
#include <cmath>

#include "ctxpar/error.h"
#include "cuda/cuda_device_impl.h"
#include "cuda/tile_host.h"
#include "kernel/problem.h"

namespace ctxpar::cuda {
namespace {

template <class T>
View4<const T> in4(const TensorView& t) {
  return {static_cast<const T*>(t.data()), t.stride(0), t.stride(1), t.stride(2)};
}

void check_block(const TensorView& q, const Tokens& qt, const TensorView& k, const TensorView& v,
                 const Tokens& kt, const Mask& mask) {
  kernel::check_activation("q", q, true);
  kernel::check_activation("k", k, true);
  kernel::check_activation("v", v, true);
  CTXPAR_CHECK(q.dtype() == k.dtype() && k.dtype() == v.dtype(),
               "cuda device: q, k, v must share one dtype");
  CTXPAR_CHECK(k.shape() == v.shape() && q.dim(0) == k.dim(0) && q.dim(3) == k.dim(3) &&
                   k.dim(2) > 0 && q.dim(2) % k.dim(2) == 0,
               "cuda device: q ", shape_str(q.shape()), " and k/v ", shape_str(k.shape()),
               " do not form an attention block");
  CTXPAR_CHECK(q.dim(3) <= kMaxHeadDim, "cuda device: head dim ", q.dim(3), " > ", kMaxHeadDim);
  CTXPAR_CHECK(int64_t(qt.positions.size()) == q.dim(1) && int64_t(kt.positions.size()) == k.dim(1),
               "cuda device: token positions do not match q / k's token counts");
  if (mask.documents)
    CTXPAR_CHECK(
        int64_t(qt.documents.size()) == q.dim(1) && int64_t(kt.documents.size()) == k.dim(1),
        "cuda device: the mask uses documents: one document id per token needed");
  CTXPAR_CHECK(!mask.sliced || (mask.slices != nullptr && mask.slice_count > 0),
               "cuda device: a slice mask (", mask.describe(), ") without its slice list");
}

kernel::Problem sizes(const TensorView& q, const TensorView& k) {
  kernel::Problem p;
  p.batch = q.dim(0), p.tq = q.dim(1), p.hq = q.dim(2), p.d = q.dim(3);
  p.tk = k.dim(1), p.hkv = k.dim(2), p.group = p.hq / p.hkv;
  return p;
}

}  // namespace

void CudaDevice::host_block(Stream s, const TensorView& q, const Tokens& qt, const TensorView& k,
                            const Tokens& kt, const Mask& mask, double factor, HostBlock& hb) {
  hb.q = host_tokens(s, qt, q.dim(1), mask.documents, hb.qp, hb.qd);
  hb.k = host_tokens(s, kt, k.dim(1), mask.documents, hb.kp, hb.kd);
  counters_.flops +=
      kernel::count_tiles(sizes(q, k), mask,
                          kernel::tile_ranges(hb.q, q.dim(1), kTile, mask.documents),
                          kernel::tile_ranges(hb.k, k.dim(1), kTile, mask.documents), factor)
          .flops;
}

template <>
void CudaDevice::enqueue(Stream s, const op::ForwardReset& a) {
  const ForwardStateView& state = a.state;
  before(s, {state.acc().data(), state.m().data(), state.l().data()});
  Scope sc(*this, s);
  const TensorView acc = sc.place(state.acc(), true), m = sc.contiguous(state.m(), false, true),
                   l = sc.place(state.l(), true);
  if (!acc.empty()) api_->zero(strided(acc), stream(s));
  if (!l.empty()) api_->zero(strided(l), stream(s));
  if (!m.empty()) api_->fill_f32(static_cast<float*>(m.data()), m.numel(), -INFINITY, stream(s));
  sc.finish();
}

// The fallback kernel's problem: views, positions and tile ranges on the device.
template <class T>
Problem<T> CudaDevice::problem(Scope& sc, const TensorView& q, const Tokens& qt,
                               const TensorView& k, const TensorView& v, const Tokens& kt,
                               const Mask& mask, float scale) {
  Problem<T> p;
  p.q = in4<T>(q), p.k = in4<T>(k), p.v = in4<T>(v);
  p.batch = q.dim(0), p.tq = q.dim(1), p.hq = q.dim(2), p.d = q.dim(3);
  p.tk = k.dim(1), p.hkv = k.dim(2), p.group = p.hq / p.hkv;
  p.scale = scale;
  p.mask = mask;
  // The slice list is host memory (Mask keeps it): the kernel reads a device copy
  // (mask_rules.h's rules run on the GPU as they are).
  if (mask.sliced)
    p.mask.slices = static_cast<const MaskSlice*>(
        sc.on_device(mask.slices, mask.slice_count, sizeof(MaskSlice)));
  p.q_pos = sc.positions(qt, p.tq), p.k_pos = sc.positions(kt, p.tk);
  p.q_doc = sc.documents(qt, p.tq, mask.documents),
  p.k_doc = sc.documents(kt, p.tk, mask.documents);
  p.q_tiles = sc.tiles(p.q_pos, p.q_doc, p.tq, mask.documents);
  p.k_tiles = sc.tiles(p.k_pos, p.k_doc, p.tk, mask.documents);
  before(sc.stream(),
         {p.q_pos, p.k_pos, p.q_doc, p.k_doc, p.mask.sliced ? p.mask.slices : nullptr});
  ++fallback_blocks_;
  return p;
}

template <class T>
void CudaDevice::forward_fallback(Stream s, Scope& sc, const TensorView& q, const Tokens& qt,
                                  const TensorView& k, const TensorView& v, const Tokens& kt,
                                  const Mask& mask, const DeviceState& st, float scale) {
  api_->forward(problem<T>(sc, q, qt, k, v, kt, mask, scale), st, stream(s));
}

template <>
void CudaDevice::enqueue(Stream s, const op::ForwardBlock& a) {
  const TensorView &q = a.q, &k = a.k, &v = a.v;
  const Tokens &qt = a.q_tokens, &kt = a.k_tokens;
  const Mask& mask = a.mask;
  const ForwardStateView& state = a.state;
  check_block(q, qt, k, v, kt, mask);
  before(s, {q.data(), k.data(), v.data(), state.acc().data(), state.m().data(), state.l().data()});
  HostBlock hb;
  host_block(s, q, qt, k, kt, mask, 1.0, hb);
  const Tokens &hq = hb.q, &hk = hb.k;
  if (q.dim(1) == 0 || k.dim(1) == 0) return;
  Scope sc(*this, s);
  const TensorView qd_ = sc.rows(q, false), kd_ = sc.rows(k, false), vd_ = sc.rows(v, false);
  const DeviceState st{static_cast<float*>(sc.contiguous(state.acc(), true, true).data()),
                       static_cast<float*>(sc.contiguous(state.m(), true, true).data()),
                       static_cast<float*>(sc.contiguous(state.l(), true, true).data())};
  const float scale = a.config.scale != 0 ? a.config.scale : 1.0f / std::sqrt(float(q.dim(3)));
  timed(s, [&] {
    if (cudnn_forward(s, sc, qd_, hq, kd_, vd_, hk, mask, st, scale)) return;
    if (q.dtype() == DType::bf16)
      forward_fallback<Bf16>(s, sc, qd_, qt, kd_, vd_, kt, mask, st, scale);
    else
      forward_fallback<float>(s, sc, qd_, qt, kd_, vd_, kt, mask, st, scale);
  });
  sc.finish();
}

template <>
void CudaDevice::enqueue(Stream s, const op::ForwardFinalize& a) {
  const ForwardStateView& state = a.state;
  const TensorView &out = a.out, &lse = a.lse;
  kernel::check_activation("out", out, true);
  before(s, {state.acc().data(), state.m().data(), state.l().data(), out.data(), lse.data()});
  Scope sc(*this, s);
  const DeviceState st{static_cast<float*>(sc.contiguous(state.acc(), true, false).data()),
                       static_cast<float*>(sc.contiguous(state.m(), true, false).data()),
                       static_cast<float*>(sc.contiguous(state.l(), true, false).data())};
  const TensorView o = sc.contiguous(out, false, true), l = sc.contiguous(lse, false, true);
  timed(s, [&] {
    api_->finalize(st, out.dim(0), out.dim(1), out.dim(2), out.dim(3), o.data(),
                   out.dtype() == DType::bf16, static_cast<float*>(l.data()), stream(s));
  });
  sc.finish();
}

// Not offered (caps().whole_forward is false): Device::forward_whole runs a block into a state
// and its finalize here instead.
template <>
void CudaDevice::enqueue(Stream, const op::Forward&) {
  throw Error(
      "forward: the cuda device runs a block into a state and its finalize, not the whole "
      "forward in one operation (caps().whole_forward is false; call Device::forward_whole)");
}

template <>
void CudaDevice::enqueue(Stream s, const op::BackwardDelta& a) {
  const TensorView &out = a.out, &dout = a.dout, &delta = a.delta;
  kernel::check_activation("out", out, true);
  CTXPAR_CHECK(out.shape() == dout.shape(), "backward_delta: out and dout must match");
  before(s, {out.data(), dout.data(), delta.data()});
  Scope sc(*this, s);
  const bool widen = out.dtype() != dout.dtype();  // as backward_block: both to fp32, exact
  const TensorView o = widen ? sc.widened(out) : sc.contiguous(out, true, false),
                   g = widen ? sc.widened(dout) : sc.contiguous(dout, true, false);
  const TensorView d = sc.contiguous(delta, false, true);
  timed(s, [&] {
    api_->delta(o.data(), g.data(), o.dtype() == DType::bf16, out.dim(0), out.dim(1), out.dim(2),
                out.dim(3), static_cast<float*>(d.data()), stream(s));
  });
  sc.finish();
  if (cudnn_ && out.dtype() == DType::bf16 && dout.dtype() == DType::bf16) {
    DeviceBuffer keep = alloc(size_t(out.numel()) * 2);
    const TensorView o_copy = keep.view(DType::bf16, out.shape());
    copy(s, out, o_copy);
    delta_out_[delta.data()] = {std::move(keep), o_copy};
  }
}

template <class T>
void CudaDevice::backward_fallback(Stream s, Scope& sc, const TensorView& q, const Tokens& qt,
                                   const TensorView& k, const TensorView& v, const Tokens& kt,
                                   const Mask& mask, const TensorView& dout,
                                   const BackwardRows& rows, float scale) {
  Problem<T> p = problem<T>(sc, q, qt, k, v, kt, mask, scale);
  p.dout = in4<T>(dout);
  api_->backward(p, rows, stream(s));
}

template <>
void CudaDevice::enqueue(Stream s, const op::BackwardBlock& a) {
  const TensorView &q = a.q, &k = a.k, &v = a.v, &dout = a.dout, &lse = a.lse, &delta = a.delta,
                   &dq = a.dq, &dk = a.dk, &dv = a.dv;
  const Tokens &qt = a.q_tokens, &kt = a.k_tokens;
  const Mask& mask = a.mask;
  check_block(q, qt, k, v, kt, mask);
  kernel::check_activation("dout", dout, true);
  kernel::check_rows_f32("lse", lse, q.dim(0), q.dim(2), q.dim(1));
  kernel::check_rows_f32("delta", delta, q.dim(0), q.dim(2), q.dim(1));
  for (auto [name, t, ref] : {std::tuple{"dq", &dq, &q}, {"dk", &dk, &k}, {"dv", &dv, &v}})
    CTXPAR_CHECK(t->dtype() == DType::f32 && t->shape() == ref->shape(), "backward_block: ", name,
                 " must be fp32 of shape ", shape_str(ref->shape()));
  before(s, {q.data(), k.data(), v.data(), dout.data(), lse.data(), delta.data(), dq.data(),
             dk.data(), dv.data()});
  HostBlock hb;
  host_block(s, q, qt, k, kt, mask, 2.5, hb);
  const Tokens &hq = hb.q, &hk = hb.k;
  if (q.dim(1) == 0 || k.dim(1) == 0) return;
  Scope sc(*this, s);
  // dout in another dtype than q, k, v (fp32 gradients of bf16 inputs): the kernel takes one
  // storage type, so all four are widened to fp32 (exact) and the fp32 kernel runs.
  const bool widen = dout.dtype() != q.dtype();
  const TensorView qd_ = widen ? sc.widened(q) : sc.rows(q, false),
                   kd_ = widen ? sc.widened(k) : sc.rows(k, false),
                   vd_ = widen ? sc.widened(v) : sc.rows(v, false),
                   gd_ = widen ? sc.widened(dout) : sc.rows(dout, false),
                   ld_ = sc.place(lse, false), dd_ = sc.place(delta, false),
                   dqd = sc.rows(dq, true), dkd = sc.rows(dk, true), dvd = sc.rows(dv, true);
  const float scale = a.config.scale != 0 ? a.config.scale : 1.0f / std::sqrt(float(q.dim(3)));
  timed(s, [&] {
    if (cudnn_backward(s, sc, qd_, hq, kd_, vd_, hk, mask, gd_, ld_, delta, dqd, dkd, dvd, scale))
      return;
    const BackwardRows rows{rows3<const float>(ld_), rows3<const float>(dd_), view4<float>(dqd),
                            view4<float>(dkd), view4<float>(dvd)};
    if (qd_.dtype() == DType::bf16)
      backward_fallback<Bf16>(s, sc, qd_, qt, kd_, vd_, kt, mask, gd_, rows, scale);
    else
      backward_fallback<float>(s, sc, qd_, qt, kd_, vd_, kt, mask, gd_, rows, scale);
  });
  sc.finish();
}

template <>
void CudaDevice::enqueue(Stream s, const op::Merge& m) {
  const TensorView &o_a = m.o_a, &lse_a = m.lse_a, &o_b = m.o_b, &lse_b = m.lse_b;
  CTXPAR_CHECK(o_a.dtype() == DType::f32 && o_b.dtype() == DType::f32 && o_a.ndim() == 4 &&
                   o_a.shape() == o_b.shape() && lse_a.shape() == lse_b.shape(),
               "merge: fp32 [B, T, H, D] partials of one shape");
  before(s, {o_a.data(), lse_a.data(), o_b.data(), lse_b.data()});
  Scope sc(*this, s);
  const TensorView a = sc.contiguous(o_a, true, true), la = sc.contiguous(lse_a, true, true);
  const TensorView b = sc.contiguous(o_b, true, false), lb = sc.contiguous(lse_b, true, false);
  api_->merge(static_cast<float*>(a.data()), static_cast<float*>(la.data()),
              static_cast<const float*>(b.data()), static_cast<const float*>(lb.data()), o_a.dim(0),
              o_a.dim(1), o_a.dim(2), o_a.dim(3), stream(s));
  sc.finish();
}

template <>
void CudaDevice::enqueue(Stream s, const op::Add& a) {
  const TensorView &x = a.x, &y = a.y;
  CTXPAR_CHECK(x.dtype() == DType::f32 && y.dtype() == DType::f32 && x.shape() == y.shape(),
               "add: fp32 views of one shape");
  elementwise(s, x, y, &CudaApi::add);
}

// y = op(x, y) element by element: x read, y written, each placed on the device.
void CudaDevice::elementwise(Stream s, const TensorView& x, const TensorView& y,
                             void (CudaApi::*op)(const Strided4&, const Strided4&, StreamHandle)) {
  before(s, {x.data(), y.data()});
  Scope sc(*this, s);
  const TensorView a = sc.place(x, false), b = sc.place(y, true);
  if (x.numel()) ((*api_).*op)(strided(a), strided(b), stream(s));
  sc.finish();
}

template <>
void CudaDevice::enqueue(Stream s, const op::Copy& a) {
  const TensorView &src = a.src, &dst = a.dst;
  CTXPAR_CHECK(src.shape() == dst.shape(), "copy: shape ", shape_str(src.shape()),
               " does not match ", shape_str(dst.shape()));
  CTXPAR_CHECK(
      src.dtype() == dst.dtype() || ((src.dtype() == DType::f32 || src.dtype() == DType::bf16) &&
                                     (dst.dtype() == DType::f32 || dst.dtype() == DType::bf16)),
      "copy: converts between fp32 and bf16 only");
  elementwise(s, src, dst, &CudaApi::copy);
}

template <>
void CudaDevice::enqueue(Stream s, const op::FillZero& z) {
  const TensorView& t = z.t;
  before(s, {t.data()});
  Scope sc(*this, s);
  const TensorView a = sc.place(t, true);
  if (t.numel()) api_->zero(strided(a), stream(s));
  sc.finish();
}

template <>
void CudaDevice::enqueue(Stream s, const op::PackKv& a) {
  const TensorView &k = a.k, &v = a.v;
  const Tokens& tokens = a.tokens;
  const bool documents = a.documents;
  std::byte* bt = a.block_tokens;
  enqueue(s, op::Copy{k, a.block_k});
  enqueue(s, op::Copy{v, a.block_v});
  const int64_t t = k.dim(1);
  if (t == 0) return;
  CTXPAR_CHECK(on_device(bt), "pack_kv: the block's tokens must be device memory");
  before(s, {bt, tokens.positions.data(), documents ? tokens.documents.data() : nullptr});
  auto kind = [&](const void* p) {
    return on_device(p) ? CopyKind::device_to_device : CopyKind::host_to_device;
  };
  api_->memcpy_async(bt, tokens.positions.data(), size_t(t) * 8, kind(tokens.positions.data()),
                     stream(s));
  if (documents)
    api_->memcpy_async(bt + t * 8, tokens.documents.data(), size_t(t) * 4,
                       kind(tokens.documents.data()), stream(s));
}

// Rows along the token axis of a contiguous [B, T, H, D] (rows of H*D elements) or [B, H, T]
// (rows of one element), as host_ops.cc's TokenRows.
namespace {
struct TokenRows {
  int64_t outer, tokens, row;
  explicit TokenRows(const TensorView& t) {
    CTXPAR_CHECK(t.ndim() == 4 || t.ndim() == 3, "token permutation: 3-d or 4-d views");
    const int64_t es = int64_t(dtype_size(t.dtype()));
    if (t.ndim() == 4)
      outer = t.dim(0), tokens = t.dim(1), row = t.dim(2) * t.dim(3) * es;
    else
      outer = t.dim(0) * t.dim(1), tokens = t.dim(2), row = es;
  }
};
}  // namespace

void CudaDevice::permute(Stream s, const TensorView& src, const TensorView& dst,
                         const TensorView& index, bool scatter) {
  const TokenRows a(src), b(dst);
  CTXPAR_CHECK(a.outer == b.outer && a.row == b.row && index.dtype() == DType::i64 &&
                   index.numel() == (scatter ? a.tokens : b.tokens),
               "token permutation: views and index do not agree");
  before(s, {src.data(), dst.data(), index.data()});
  Scope sc(*this, s);
  const TensorView x = sc.contiguous(src, true, false), y = sc.contiguous(dst, true, true);
  const TensorView i = sc.contiguous(index, true, false);
  if (index.numel() && a.outer && a.row)
    api_->permute(static_cast<const std::byte*>(x.data()), static_cast<std::byte*>(y.data()),
                  a.outer, a.tokens, b.tokens, a.row, static_cast<const int64_t*>(i.data()),
                  scatter, stream(s));
  sc.finish();
}

template <>
void CudaDevice::enqueue(Stream s, const op::ScatterTokens& a) {
  permute(s, a.src, a.dst, a.index, true);
}
template <>
void CudaDevice::enqueue(Stream s, const op::GatherTokens& a) {
  permute(s, a.src, a.dst, a.index, false);
}

// After every specialisation of enqueue: they are what it instantiates.
void CudaDevice::run(Stream s, const Op& op) {
  std::visit([&](const auto& a) { enqueue(s, a); }, op.args);
}

}  // namespace ctxpar::cuda

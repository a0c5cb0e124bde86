// The cuda device's cuDNN path (cuda_device.h): a bf16 block pair whose shape the
// CudnnAttention supports is cut into fused calls (fused_calls.h), each run by cuDNN with fp32
// outputs; the forward's partial (O, LSE) of each call is absorbed into the block's fp32
// ForwardState, the backward's partial dQ, dK, dV added into the fp32 accumulators. Partials
// are never merged in bf16. Where the shape is not supported, cuDNN refuses one of the block's
// graphs (counted), no CudnnAttention was given, or the build has no CUDA headers, the caller
// runs the fallback kernel.
#include <cmath>

#include "ctxpar/error.h"
#include "cuda/cuda_device_impl.h"
#ifdef CTXPAR_CUDA_HEADERS
#include "cuda/cudnn_attention.h"
#include "cuda/cudnn_use.h"
#define CTXPAR_CUDA_CUDNN_PATH 1
#endif

namespace ctxpar::cuda {

#ifdef CTXPAR_CUDA_CUDNN_PATH
namespace {

SdpaTensor sdpa(const TensorView& t) { return {t.data(), t.stride(0), t.stride(1), t.stride(2)}; }
SdpaRows sdpa_rows(const TensorView& t) {
  return {static_cast<float*>(t.data()), t.stride(0), t.stride(1), t.stride(2)};
}
SdpaShape shape_of(const TensorView& q, const TensorView& k, float scale) {
  SdpaShape s;
  s.dtype = q.dtype();
  s.batch = q.dim(0), s.hq = q.dim(2), s.hkv = k.dim(2), s.d = q.dim(3);
  s.scale = scale;
  return s;
}

}  // namespace

// Every call's graph is built (or found) before anything of the block is enqueued, so that a
// graph cuDNN refuses sends the whole block to the fallback kernel with nothing absorbed yet.
bool CudaDevice::cudnn_refused(const CudnnRefused& r) {
  if (cudnn_required_)
    throw Error(std::string("CTXPAR_CUDNN=require: ") + r.what() +
                "; unset CTXPAR_CUDNN to run such blocks on the fallback kernel");
  ++cudnn_refused_;
  note_once("cudnn refused",
            std::string("cuDNN refused a graph; its blocks run on the fallback "
                        "kernel (exact), counted in --json's cudnn.refused_blocks: ") +
                r.what());
  return false;
}

bool CudaDevice::cudnn_forward(Stream s, Scope& sc, const TensorView& q, const Tokens& qt,
                               const TensorView& k, const TensorView& v, const Tokens& kt,
                               const Mask& mask, const DeviceState& st, float scale) {
  // cuDNN's masks are bands per fused call (fused_calls.h): a slice mask takes the exact kernel.
  if (!cudnn_ || q.dtype() != DType::bf16 || mask.sliced) return false;
  const SdpaShape shape = shape_of(q, k, scale);
  if (!cudnn_->supports(shape)) return false;
  const int64_t b = q.dim(0), tq = q.dim(1), hq = q.dim(2), d = q.dim(3);
  // The call's tensors: whole q, k, v; its O [B, rows, Hq, D] and LSE [B, Hq, rows] dense.
  auto tensors = [&](const fused::Call& call, float* o, float* lse) {
    const int64_t rows = call.rows();
    SdpaForward t;
    t.q = sdpa(q), t.k = sdpa(k), t.v = sdpa(v);
    t.o = {o, rows * hq * d, hq * d, d};
    t.lse = {lse, hq * rows, rows, 1};
    return t;
  };
  const std::vector<fused::Call> calls = fused::decompose(qt, kt, mask);
  std::vector<size_t> ws(calls.size());
  try {
    for (size_t i = 0; i < calls.size(); ++i) {
      cudnn_->prepare(shape, calls[i], tensors(calls[i], nullptr, nullptr));
      ws[i] = cudnn_->workspace_bytes(shape, calls[i], false);
    }
  } catch (const CudnnRefused& r) {
    return cudnn_refused(r);
  }
  auto* native = static_cast<cudaStream_t>(api_->native_stream(stream(s)));
  for (size_t i = 0; i < calls.size(); ++i) {
    const fused::Call& call = calls[i];
    const int64_t rows = call.rows();
    auto* o = reinterpret_cast<float*>(sc.scratch(size_t(b * rows * hq * d) * 4));
    auto* lse = reinterpret_cast<float*>(sc.scratch(size_t(b * hq * rows) * 4));
    void* workspace = ws[i] ? sc.scratch(ws[i]) : nullptr;
    before(s, {o, lse, workspace});
    cudnn_->forward(shape, call, tensors(call, o, lse), workspace, native);
    api_->absorb_partial(st, b, tq, hq, d, call.q_begin, rows, o, lse, stream(s));
    ++cudnn_calls_;
  }
  ++cudnn_blocks_;
  return true;
}

bool CudaDevice::cudnn_backward(Stream s, Scope& sc, const TensorView& q, const Tokens& qt,
                                const TensorView& k, const TensorView& v, const Tokens& kt,
                                const Mask& mask, const TensorView& dout, const TensorView& lse,
                                const TensorView& delta, const TensorView& dq, const TensorView& dk,
                                const TensorView& dv, float scale) {
  // cuDNN's masks are bands per fused call (fused_calls.h): a slice mask takes the exact kernel.
  if (!cudnn_ || q.dtype() != DType::bf16 || mask.sliced) return false;
  const SdpaShape shape = shape_of(q, k, scale);
  if (!cudnn_->supports(shape)) return false;
  // cuDNN's backward takes O (it forms delta itself): backward_delta's, found by delta.
  auto found = delta_out_.find(delta.data());
  if (found == delta_out_.end()) return false;
  const TensorView out = found->second.second;
  const int64_t b = q.dim(0), hq = q.dim(2), hkv = k.dim(2), d = q.dim(3);
  // The call's tensors: whole q, k, v, O, dO, LSE; its dQ, dK, dV dense and call-local.
  auto tensors = [&](const fused::Call& call, float* gq, float* gk, float* gv) {
    const int64_t rows = call.rows(), keys = call.keys();
    SdpaBackward t;
    t.q = sdpa(q), t.k = sdpa(k), t.v = sdpa(v), t.out = sdpa(out), t.dout = sdpa(dout);
    t.lse = sdpa_rows(lse);
    t.dq = {gq, rows * hq * d, hq * d, d};
    t.dk = {gk, keys * hkv * d, hkv * d, d};
    t.dv = {gv, keys * hkv * d, hkv * d, d};
    return t;
  };
  const std::vector<fused::Call> calls = fused::decompose(qt, kt, mask);
  std::vector<size_t> ws(calls.size());
  try {
    for (size_t i = 0; i < calls.size(); ++i) {
      cudnn_->prepare(shape, calls[i], tensors(calls[i], nullptr, nullptr, nullptr));
      ws[i] = cudnn_->workspace_bytes(shape, calls[i], true);
    }
  } catch (const CudnnRefused& r) {
    return cudnn_refused(r);
  }
  before(s, {out.data()});
  auto* native = static_cast<cudaStream_t>(api_->native_stream(stream(s)));
  for (size_t i = 0; i < calls.size(); ++i) {
    const fused::Call& call = calls[i];
    const int64_t rows = call.rows(), keys = call.keys();
    auto* gq = reinterpret_cast<float*>(sc.scratch(size_t(b * rows * hq * d) * 4));
    auto* gk = reinterpret_cast<float*>(sc.scratch(size_t(b * keys * hkv * d) * 4));
    auto* gv = reinterpret_cast<float*>(sc.scratch(size_t(b * keys * hkv * d) * 4));
    void* workspace = ws[i] ? sc.scratch(ws[i]) : nullptr;
    before(s, {gq, gk, gv, workspace, out.data()});
    cudnn_->backward(shape, call, tensors(call, gq, gk, gv), workspace, native);
    const TensorView pq(gq, DType::f32, {b, rows, hq, d});
    const TensorView pk(gk, DType::f32, {b, keys, hkv, d}), pv(gv, DType::f32, {b, keys, hkv, d});
    api_->add(strided(pq), strided(dq.slice(1, call.q_begin, call.q_end)), stream(s));
    api_->add(strided(pk), strided(dk.slice(1, call.k_begin, call.k_end)), stream(s));
    api_->add(strided(pv), strided(dv.slice(1, call.k_begin, call.k_end)), stream(s));
    ++cudnn_calls_;
  }
  ++cudnn_blocks_;
  return true;
}

#else

bool CudaDevice::cudnn_forward(Stream, Scope&, const TensorView&, const Tokens&, const TensorView&,
                               const TensorView&, const Tokens&, const Mask&, const DeviceState&,
                               float) {
  return false;
}
bool CudaDevice::cudnn_backward(Stream, Scope&, const TensorView&, const Tokens&, const TensorView&,
                                const TensorView&, const Tokens&, const Mask&, const TensorView&,
                                const TensorView&, const TensorView&, const TensorView&,
                                const TensorView&, const TensorView&, float) {
  return false;
}

#endif

}  // namespace ctxpar::cuda

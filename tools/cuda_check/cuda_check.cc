// ctxpar-cuda-check: the fallback kernel (src/cuda/kernels.cu) on a GPU against the host run of
// the same tile mathematics (src/cuda/tile_host.h) and against the fp64 reference under the
// accuracy rule, on small problems: forward (two K/V blocks absorbed into one state), finalize,
// delta, backward, merge and the fp32 -> bf16 copy. Run by scripts/gpu_check.sh (ctest -L gpu).
// Without a GPU it says what it found and exits 77 (ctest: skipped); 0 when every check
// passes, 1 otherwise. Not run on any GPU yet (docs/cuda.md).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ctxpar/kernel.h"
#include "ctxpar/reference.h"
#include "cuda/cuda_check.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"
#include "cuda/tile_host.h"

namespace ctxpar::cuda {
namespace {

// One device allocation holding a copy of host bytes (or zeros).
class DeviceArray {
 public:
  explicit DeviceArray(size_t bytes, const void* host = nullptr) : bytes_(bytes) {
    CTXPAR_CUDA_CHECK(cudaMalloc(&ptr_, bytes ? bytes : 1));
    if (host)
      CTXPAR_CUDA_CHECK(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice));
    else
      CTXPAR_CUDA_CHECK(cudaMemset(ptr_, 0, bytes));
  }
  explicit DeviceArray(const Tensor& t) : DeviceArray(t.bytes(), t.data()) {}
  DeviceArray(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(ptr_); }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  void download(const Tensor& t) const {
    CTXPAR_CUDA_CHECK(cudaMemcpy(t.data(), ptr_, t.bytes(), cudaMemcpyDeviceToHost));
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

struct Case {
  const char* name;
  int64_t tq, tk, hq, hkv, d;
  DType dtype;
  const char* mask;
  int64_t q_stride;  // positions: q i -> q_stride * i (+ shuffled when `shuffle`)
  bool shuffle, padding;
};

double max_diff(const Tensor& a, const Tensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const float x = a.ptr<float>()[i], y = b.ptr<float>()[i];
    if (std::isinf(x) || std::isinf(y)) {
      if (x != y) return INFINITY;
      continue;
    }
    m = std::max(m, std::fabs(double(x) - y));
  }
  return m;
}
double max_err(const Tensor& t, const std::vector<double>& ref) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double x = t.ptr<float>()[i];
    if (std::isinf(x) || std::isinf(ref[i])) {
      if (x != ref[i]) return INFINITY;
      continue;
    }
    m = std::max(m, std::fabs(x - ref[i]));
  }
  return m;
}
double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v)
    if (std::isfinite(x)) m = std::max(m, std::fabs(x));
  return m;
}

template <class T>
bool run_case(const Case& c) {
  const int64_t b = 1;
  Tensor q(c.dtype, {b, c.tq, c.hq, c.d}), k(c.dtype, {b, c.tk, c.hkv, c.d});
  Tensor v(c.dtype, {b, c.tk, c.hkv, c.d}), dout(c.dtype, {b, c.tq, c.hq, c.d});
  int seed = 1;
  for (Tensor* t : {&q, &k, &v, &dout}) {
    Tensor f(DType::f32, t->shape());
    fill_normal(f, seed++);
    copy_into(f, *t);
  }
  std::vector<int64_t> qp(c.tq), kp(c.tk);
  std::vector<int32_t> qd(c.tq), kd(c.tk);
  for (int64_t i = 0; i < c.tq; ++i) qp[i] = c.q_stride * i, qd[i] = int32_t(qp[i] / 37);
  for (int64_t j = 0; j < c.tk; ++j) kp[j] = j, kd[j] = int32_t(j / 37);
  if (c.shuffle)
    for (int64_t i = c.tq - 1; i > 0; --i) std::swap(qp[i], qp[(i * 7919) % (i + 1)]);
  if (c.padding) qp[c.tq - 1] = qp[c.tq - 2] = kPaddingPosition;
  const Mask mask = parse_mask(c.mask);
  const Tokens qt{qp, qd}, kt{kp, kd};
  const int64_t half = c.tk / 2;
  const Tokens kt0{std::span<const int64_t>(kp).subspan(0, half),
                   std::span<const int32_t>(kd).subspan(0, half)};
  const Tokens kt1{std::span<const int64_t>(kp).subspan(half),
                   std::span<const int32_t>(kd).subspan(half)};

  // The host run of the tile math: two K/V blocks into one state, then the backward per block.
  ForwardState hs(b, c.tq, c.hq, c.d);
  forward_host<T>(q, qt, k.view().slice(1, 0, half), v.view().slice(1, 0, half), kt0, mask, hs);
  forward_host<T>(q, qt, k.view().slice(1, half, c.tk), v.view().slice(1, half, c.tk), kt1, mask,
                  hs);
  Tensor ho(DType::f32, {b, c.tq, c.hq, c.d}), hl(DType::f32, {b, c.hq, c.tq});
  finalize_host<float>(hs, ho, hl);
  Tensor hdelta(DType::f32, {b, c.hq, c.tq});
  delta_host<float>(ho, Tensor::copy_of(dout, DType::f32), hdelta);
  Tensor hdq(DType::f32, q.shape()), hdk(DType::f32, k.shape()), hdv(DType::f32, k.shape());
  backward_host<T>(q, qt, k, v, kt, mask, dout, hl, hdelta, hdq, hdk, hdv);

  // The same on the GPU.
  DeviceArray dq_in(q), dk_in(k), dv_in(v), ddo(dout), dqp(qp.size() * 8, qp.data()),
      dkp(kp.size() * 8, kp.data()), dqd(qd.size() * 4, qd.data()), dkd(kd.size() * 4, kd.data());
  const int64_t qtiles = (c.tq + kTile - 1) / kTile, ktiles = (c.tk + kTile - 1) / kTile;
  DeviceArray dqt(qtiles * sizeof(TileRange)), dkt(ktiles * sizeof(TileRange));
  launch_tile_ranges(dqp.as<int64_t>(), dqd.as<int32_t>(), c.tq, mask.documents,
                     dqt.as<TileRange>(), 0);
  launch_tile_ranges(dkp.as<int64_t>(), dkd.as<int32_t>(), c.tk, mask.documents,
                     dkt.as<TileRange>(), 0);
  auto problem = [&](int64_t k0, int64_t k1) {
    Problem<T> p;
    const int64_t ks = c.hkv * c.d, qs = c.hq * c.d;
    p.q = {dq_in.as<const T>(), c.tq * qs, qs, c.d};
    p.dout = {ddo.as<const T>(), c.tq * qs, qs, c.d};
    p.k = {dk_in.as<const T>() + k0 * ks, c.tk * ks, ks, c.d};
    p.v = {dv_in.as<const T>() + k0 * ks, c.tk * ks, ks, c.d};
    p.q_pos = dqp.as<int64_t>(), p.q_doc = dqd.as<int32_t>(), p.q_tiles = dqt.as<TileRange>();
    p.k_pos = dkp.as<int64_t>() + k0, p.k_doc = dkd.as<int32_t>() + k0;
    p.mask = mask;
    p.batch = b, p.tq = c.tq, p.tk = k1 - k0, p.hq = c.hq, p.hkv = c.hkv, p.d = c.d;
    p.group = c.hq / c.hkv, p.scale = 1.0f / std::sqrt(float(c.d));
    return p;
  };
  // Tile ranges of a key block start at its first key: K/V blocks of the ring each have their own.
  DeviceArray dkt0(ktiles * sizeof(TileRange)), dkt1(ktiles * sizeof(TileRange));
  launch_tile_ranges(dkp.as<int64_t>(), dkd.as<int32_t>(), half, mask.documents,
                     dkt0.as<TileRange>(), 0);
  launch_tile_ranges(dkp.as<int64_t>() + half, dkd.as<int32_t>() + half, c.tk - half,
                     mask.documents, dkt1.as<TileRange>(), 0);
  Tensor m0(DType::f32, {b, c.hq, c.tq});
  for (int64_t i = 0; i < m0.numel(); ++i) m0.ptr<float>()[i] = -INFINITY;
  DeviceArray acc(size_t(b * c.tq * c.hq * c.d) * 4), m(m0), l(m0.bytes());
  const DeviceState st{acc.as<float>(), m.as<float>(), l.as<float>()};
  Problem<T> p0 = problem(0, half), p1 = problem(half, c.tk);
  p0.k_tiles = dkt0.as<TileRange>(), p1.k_tiles = dkt1.as<TileRange>();
  launch_forward(p0, st, 0);
  launch_forward(p1, st, 0);
  DeviceArray go(ho.bytes()), gl(hl.bytes()), gdelta(hdelta.bytes());
  launch_finalize<float>(st, b, c.tq, c.hq, c.d, go.as<float>(), gl.as<float>(), 0);
  Tensor dout32 = Tensor::copy_of(dout, DType::f32);
  DeviceArray gdo32(dout32);
  launch_delta<float>(go.as<float>(), gdo32.as<float>(), b, c.tq, c.hq, c.d, gdelta.as<float>(), 0);
  DeviceArray gdq(hdq.bytes()), gdk(hdk.bytes()), gdv(hdv.bytes());
  Problem<T> pb = problem(0, c.tk);
  pb.k_tiles = dkt.as<TileRange>();
  const int64_t qs = c.hq * c.d, ks = c.hkv * c.d;
  const BackwardRows rows{{gl.as<float>(), c.hq * c.tq, c.tq, 1},
                          {gdelta.as<float>(), c.hq * c.tq, c.tq, 1},
                          {gdq.as<float>(), c.tq * qs, qs, c.d},
                          {gdk.as<float>(), c.tk * ks, ks, c.d},
                          {gdv.as<float>(), c.tk * ks, ks, c.d}};
  launch_backward(pb, rows, 0);
  CTXPAR_CUDA_CHECK(cudaDeviceSynchronize());
  Tensor o(DType::f32, ho.shape()), lse(DType::f32, hl.shape()), dq(DType::f32, hdq.shape()),
      dk(DType::f32, hdk.shape()), dv(DType::f32, hdv.shape());
  go.download(o), gl.download(lse), gdq.download(dq), gdk.download(dk), gdv.download(dv);

  // GPU against the host tile math (same operations; expf / logf may differ in the last
  // bits), and against the fp64 reference by the accuracy rule.
  const reference::Result r64 = reference::attention_f64(q, qt, k, v, kt, mask, dout);
  const reference::Result n32 = reference::attention_naive_f32(q, qt, k, v, kt, mask, dout);
  bool ok = true;
  auto report = [&](const char* what, const Tensor& gpu, const Tensor& host,
                    const std::vector<double>& ref, const std::vector<double>& naive) {
    const double vs_host = max_diff(gpu, host), err = max_err(gpu, ref);
    double naive_err = 0;  // the rule's yardstick: max |naive32 - ref64| over finite entries
    for (size_t i = 0; i < ref.size(); ++i)
      if (std::isfinite(naive[i]) && std::isfinite(ref[i]))
        naive_err = std::max(naive_err, std::fabs(naive[i] - ref[i]));
    const double bound = reference::accuracy_tolerance(naive_err, max_abs(ref));
    const bool pass = err <= bound && vs_host <= 1e-4 * std::max(1.0, max_abs(ref));
    ok = ok && pass;
    std::printf("  %-4s %-3s |gpu-host| %.3g  |gpu-ref64| %.3g (bound %.3g)\n",
                pass ? "ok" : "FAIL", what, vs_host, err, bound);
  };
  std::printf("%s\n", c.name);
  report("o", o, ho, r64.o, n32.o);
  report("lse", lse, hl, r64.lse, n32.lse);
  report("dq", dq, hdq, r64.dq, n32.dq);
  report("dk", dk, hdk, r64.dk, n32.dk);
  report("dv", dv, hdv, r64.dv, n32.dv);
  return ok;
}

// merge and the fp32 -> bf16 copy against their host runs (bitwise up to expf / log1pf).
bool run_elementwise() {
  const int64_t b = 1, t = 100, h = 4, d = 40;
  Tensor oa(DType::f32, {b, t, h, d}), ob(DType::f32, {b, t, h, d}), la(DType::f32, {b, h, t}),
      lb(DType::f32, {b, h, t});
  fill_normal(oa, 11), fill_normal(ob, 12), fill_normal(la, 13, 10), fill_normal(lb, 14, 10);
  for (int64_t r = 0; r < b * h * t; r += 5) la.ptr<float>()[r] = -INFINITY;
  for (int64_t r = 0; r < b * h * t; r += 7) lb.ptr<float>()[r] = -INFINITY;
  DeviceArray goa(oa), gob(ob), gla(la), glb(lb), gbf(size_t(oa.numel()) * 2);
  launch_merge(goa.as<float>(), gla.as<float>(), gob.as<float>(), glb.as<float>(), b, t, h, d, 0);
  launch_copy<float, Bf16>({goa.as<const float>(), t * h * d, h * d, d}, gbf.as<Bf16>(), b, t, h, d,
                           0);
  CTXPAR_CUDA_CHECK(cudaDeviceSynchronize());
  merge_host(oa, la, ob, lb);
  Tensor go(DType::f32, oa.shape()), gl(DType::f32, la.shape()), bf(DType::bf16, oa.shape());
  goa.download(go), gla.download(gl), gbf.download(bf);
  Tensor want_bf = Tensor::copy_of(go, DType::bf16);
  const double dm = std::max(max_diff(go, oa), max_diff(gl, la));
  const bool cast_ok = std::memcmp(bf.data(), want_bf.data(), bf.bytes()) == 0;
  std::printf("merge: |gpu-host| %.3g; fp32 -> bf16 copy: %s\n", dm,
              cast_ok ? "bitwise" : "DIFFERS");
  return dm <= 1e-5 && cast_ok;
}

}  // namespace
}  // namespace ctxpar::cuda

int main() {
  using namespace ctxpar;
  const cuda::DeviceProbe probe = cuda::probe_devices();
  if (probe.count == 0) {
    std::printf("ctxpar-cuda-check: %s\n", cuda::no_device_message(probe).c_str());
    return 77;
  }
  std::printf("ctxpar-cuda-check on %s (sm_%d)\n", probe.first_name.c_str(), probe.first_sm);
  const cuda::Case cases[] = {
      {"D=40 fp32 causal, shuffled strided queries, padding", 150, 200, 4, 2, 40, DType::f32,
       "causal", 2, true, true},
      {"D=64 bf16 causal+window:50,0+documents", 130, 130, 4, 1, 64, DType::bf16,
       "causal+window:50,0+documents", 1, false, false},
      {"D=128 fp32 none, GQA 8/2", 96, 160, 8, 2, 128, DType::f32, "none", 1, false, false},
      {"D=24 fp32 window:0,0 (rows that see nothing)", 70, 70, 2, 2, 24, DType::f32, "window:0,0",
       2, false, true},
  };
  bool ok = true;
  try {
    for (const cuda::Case& c : cases)
      ok =
          (c.dtype == DType::bf16 ? cuda::run_case<cuda::Bf16>(c) : cuda::run_case<float>(c)) && ok;
    ok = cuda::run_elementwise() && ok;
  } catch (const std::exception& e) {
    std::printf("ctxpar-cuda-check: failed: %s\n", e.what());
    return 1;
  }
  std::printf("%s\n", ok ? "all checks passed" : "SOME CHECKS FAILED");
  return ok ? 0 : 1;
}

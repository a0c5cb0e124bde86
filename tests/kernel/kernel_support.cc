#include "kernel/kernel_support.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <numeric>
#include <sstream>

namespace ctxpar::test {

namespace {
// Every test of the binary runs on the SIMD target CTXPAR_SIMD names (one ctest entry per
// target): where this CPU or binary lacks it, the whole binary skips with the reason.
class SimdTargetEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    const SimdTargets t = simd_targets();
    // (Also CTXPAR_FP32_PRODUCTS=parts, the kernel_fp32_parts entry, where this machine
    // refuses it: simd_targets().error says why.)
    if (!t.error.empty()) {
      std::printf("kernel tests skipped: %s\n", t.error.c_str());
      GTEST_SKIP() << t.error;
    }
    std::printf("kernel SIMD target: %s\n", t.chosen.c_str());
  }
};
[[maybe_unused]] ::testing::Environment* const kSimdEnvironment =
    ::testing::AddGlobalTestEnvironment(new SimdTargetEnvironment);
}  // namespace

std::string Case::name() const {
  std::ostringstream s;
  s << "B" << batch << " Tq" << tq << " Tk" << tk << " Hq" << hq << " Hkv" << hkv << " D" << d
    << " " << dtype_name(dtype) << " mask=" << mask.describe() << " qpos=" << q_offset << "+"
    << q_stride << "i kpos=" << k_offset << "+" << k_stride << "j doc_len=" << doc_len
    << (shuffle ? " shuffled" : "")
    << (qk_scale != 1 ? " qk_scale=" + std::to_string(qk_scale) : "")
    << (qk_common != 0 ? " qk_common=" + std::to_string(qk_common) : "")
    << (k_rise != 0 ? " k_rise=" + std::to_string(k_rise) : "") << " threads=" << threads
    << (products != Bf16Products::automatic
            ? std::string(" products=") + bf16_products_name(products)
            : "")
    << (fp32 != Fp32Products::automatic ? std::string(" fp32=") + fp32_products_name(fp32) : "");
  return s.str();
}

Inputs make_inputs(const Case& c) {
  Inputs in;
  // rise: element 1 of token i's every head is rise(i) (k_rise; d >= 2).
  auto make = [&](int64_t t, int64_t h, uint64_t seed, float mul = 1, float common = 0,
                  float (*rise)(const Case&, int64_t) = nullptr) {
    Tensor f(DType::f32, {c.batch, t, h, c.d});
    fill_normal(f.view(), seed, mul);
    if (common != 0)
      for (int64_t i = 0; i < f.numel(); i += c.d) f.ptr<float>()[i] = common;
    if (rise != nullptr)
      for (int64_t i = 0; i < f.numel(); i += c.d) f.ptr<float>()[i + 1] = rise(c, i / c.d / h % t);
    return Tensor::copy_of(f.view(), c.dtype);
  };
  const bool rising = c.k_rise != 0;
  in.q = make(c.tq, c.hq, c.seed * 4 + 0, c.qk_scale, c.qk_common,
              rising ? +[](const Case&, int64_t) { return 1.0f; } : nullptr);
  in.k = make(c.tk, c.hkv, c.seed * 4 + 1, c.qk_scale, c.qk_common,
              rising ? +[](const Case& cs, int64_t j) { return cs.k_rise * static_cast<float>(j); }
                     : nullptr);
  in.v = make(c.tk, c.hkv, c.seed * 4 + 2);
  in.dout = make(c.tq, c.hq, c.seed * 4 + 3);
  // offset + stride * i wraps on purpose for the extreme cases (stride 2^57, i >= 64 walks the
  // whole int64 range): computed in uint64 (defined wrap-around), then read back as int64 (two's
  // complement, C++20), which gives the positions the signed expression meant without its UB.
  auto wrapped = [](int64_t offset, int64_t stride, int64_t i) {
    return static_cast<int64_t>(static_cast<uint64_t>(offset) +
                                static_cast<uint64_t>(stride) * static_cast<uint64_t>(i));
  };
  for (int64_t i = 0; i < c.tq; ++i) in.q_pos.push_back(wrapped(c.q_offset, c.q_stride, i));
  for (int64_t j = 0; j < c.tk; ++j) in.k_pos.push_back(wrapped(c.k_offset, c.k_stride, j));
  if (c.shuffle) {  // a fixed pseudo-random permutation (LCG-driven Fisher-Yates)
    uint64_t st = c.seed * 77 + 5;
    auto perm = [&st](std::vector<int64_t>& v) {
      for (size_t i = v.size(); i > 1; --i) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        std::swap(v[i - 1], v[(st >> 33) % i]);
      }
    };
    perm(in.q_pos);
    perm(in.k_pos);
  }
  auto doc = [&](int64_t pos) { return static_cast<int32_t>(c.doc_len > 0 ? pos / c.doc_len : 0); };
  if (c.mask.documents) {
    for (int64_t p : in.q_pos) in.q_doc.push_back(doc(p));
    for (int64_t p : in.k_pos) in.k_doc.push_back(doc(p));
  }
  return in;
}

TensorView kv_block(const TensorView& t, int j, int blocks) {
  const int64_t tk = t.dim(1);
  return t.slice(1, tk * j / blocks, tk * (j + 1) / blocks);
}

Tokens kv_tokens(const Inputs& in, int j, int blocks) {
  const int64_t tk = in.k.dim(1), a = tk * j / blocks, e = tk * (j + 1) / blocks;
  Tokens t;
  t.positions = std::span<const int64_t>(in.k_pos).subspan(a, e - a);
  if (!in.k_doc.empty()) t.documents = std::span<const int32_t>(in.k_doc).subspan(a, e - a);
  return t;
}

Outputs run_fast(const Inputs& in, const Mask& mask, int threads, bool backward, int kv_blocks,
                 std::vector<int> order, KernelConfig cfg) {
  const int64_t b = in.q.dim(0), tq = in.q.dim(1), hq = in.q.dim(2), d = in.q.dim(3);
  const int64_t tk = in.k.dim(1), hkv = in.k.dim(2);
  cfg.threads = threads;
  if (order.empty()) {
    order.resize(kv_blocks);
    std::iota(order.begin(), order.end(), 0);
  }
  auto block = [&](int j, const TensorView& t) { return kv_block(t, j, kv_blocks); };
  auto tokens = [&](int j) { return kv_tokens(in, j, kv_blocks); };
  Outputs out;
  ForwardState state(b, tq, hq, d);
  for (int j : order)
    out.fwd += attention_forward_block(in.q, in.q_tokens(), block(j, in.k), block(j, in.v),
                                       tokens(j), mask, state, cfg);
  out.o = Tensor(DType::f32, {b, tq, hq, d});
  out.lse = Tensor(DType::f32, {b, hq, tq});
  attention_forward_finalize(state, out.o, out.lse, cfg);
  if (!backward) return out;
  Tensor delta(DType::f32, {b, hq, tq});
  attention_backward_delta(out.o, in.dout, delta, cfg);
  out.dq = Tensor(DType::f32, {b, tq, hq, d});
  out.dk = Tensor(DType::f32, {b, tk, hkv, d});
  out.dv = Tensor(DType::f32, {b, tk, hkv, d});
  for (int j : order)
    out.bwd += attention_backward_block(in.q, in.q_tokens(), block(j, in.k), block(j, in.v),
                                        tokens(j), mask, in.dout, out.lse, delta, out.dq,
                                        block(j, out.dk.view()), block(j, out.dv.view()), cfg);
  return out;
}

double max_abs(const std::vector<double>& ref) {
  double m = 0;
  for (double x : ref)
    if (std::isfinite(x)) m = std::max(m, std::fabs(x));
  return m;
}

double max_err(const std::vector<double>& a, const std::vector<double>& ref) {
  if (a.size() != ref.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i])) return INFINITY;
    if (std::isinf(a[i]) || std::isinf(ref[i])) {
      if (a[i] != ref[i]) return INFINITY;
      continue;
    }
    m = std::max(m, std::fabs(a[i] - ref[i]));
  }
  return m;
}

double max_err(const Tensor& t, const std::vector<double>& ref) {
  std::vector<double> a(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i)
    a[i] = t.dtype() == DType::f32 ? t.ptr<float>()[i] : bf16_to_f32(t.ptr<uint16_t>()[i]);
  return max_err(a, ref);
}

References references_of(const Inputs& in, const Mask& mask, bool backward) {
  const TensorView dout = backward ? in.dout.view() : TensorView();
  return {
      reference::attention_f64(in.q, in.q_tokens(), in.k, in.v, in.k_tokens(), mask, dout),
      reference::attention_naive_f32(in.q, in.q_tokens(), in.k, in.v, in.k_tokens(), mask, dout)};
}

std::string rule_violations(const Outputs& fast, const References& refs, bool backward) {
  std::ostringstream fail;
  auto check = [&](const char* what, const Tensor& t, const std::vector<double>& n,
                   const std::vector<double>& r) {
    const double naive_err = max_err(n, r), fast_err = max_err(t, r);
    const double bound = reference::accuracy_tolerance(naive_err, max_abs(r));
    if (!(fast_err <= bound))
      fail << what << ": max|fast-ref64| = " << fast_err << " > 2 * max|naive32-ref64| ("
           << naive_err << ") + floor = " << bound << "; ";
  };
  check("o", fast.o, refs.naive32.o, refs.ref64.o);
  check("lse", fast.lse, refs.naive32.lse, refs.ref64.lse);
  if (backward) {
    check("dq", fast.dq, refs.naive32.dq, refs.ref64.dq);
    check("dk", fast.dk, refs.naive32.dk, refs.ref64.dk);
    check("dv", fast.dv, refs.naive32.dv, refs.ref64.dv);
  }
  return fail.str();
}

std::string check_case(const Case& c, bool backward) {
  const Inputs in = make_inputs(c);
  KernelConfig config;
  config.bf16_products = c.products;
  config.fp32_products = c.fp32;
  const std::string fail = rule_violations(run_fast(in, c.mask, c.threads, backward, 1, {}, config),
                                           references_of(in, c.mask, backward), backward);
  return fail.empty() ? "" : c.name() + ": " + fail;
}

}  // namespace ctxpar::test

// The public kernel calls: argument checks, then the fast SIMD path on the chosen target (or
// the readable scalar one with CTXPAR_SIMD=scalar or CTXPAR_KERNEL=scalar, for debugging and
// for the lab; see dispatch.cc).
// Also the cheap per-row steps: ForwardState, finalize and the backward delta.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "ctxpar/kernel.h"
#include "kernel/problem.h"
#include "kernel/simd_bf16.h"

namespace ctxpar {

using kernel::kNegInf;

ForwardState::ForwardState(int64_t batch, int64_t tq, int64_t hq, int64_t d)
    : acc_(DType::f32, {batch, tq, hq, d}),
      m_(DType::f32, {batch, hq, tq}),
      l_(DType::f32, {batch, hq, tq}) {
  reset();
}

void ForwardState::reset() {
  acc_.fill_zero();
  l_.fill_zero();
  float* m = m_.ptr<float>();
  for (int64_t i = 0; i < m_.numel(); ++i) m[i] = kNegInf;
}

KernelStats attention_forward_block(const TensorView& q, const Tokens& q_tokens,
                                    const TensorView& k, const TensorView& v,
                                    const Tokens& k_tokens, const Mask& mask, ForwardState& state,
                                    const KernelConfig& config) {
  return attention_forward_block(q, q_tokens, k, v, k_tokens, mask, state.view(), config);
}

void attention_forward_finalize(const ForwardState& state, const TensorView& out,
                                const TensorView& lse, const KernelConfig& config) {
  attention_forward_finalize(state.view(), out, lse, config);
}

namespace kernel {
float row_lse(float m, float l) {
  if (m == kNegInf) return kNegInf;
  return l > 0 && m < std::numeric_limits<float>::infinity()
             ? static_cast<float>(static_cast<double>(m) + std::log(static_cast<double>(l)))
             : std::numeric_limits<float>::infinity();
}

float finalize_row(const float* acc, float m, float l, int64_t d, float* row, const TensorView& out,
                   int64_t off) {
  if (m == kNegInf) {  // no visible key: O = 0
    std::fill_n(row, d, 0.0f);
  } else {
    const float inv = 1.0f / l;
    for (int64_t c = 0; c < d; ++c) row[c] = acc[c] * inv;
  }
  store_row(out, off, d, row);
  return row_lse(m, l);
}
}  // namespace kernel

namespace {
// Whether a product of a and b takes exact bf16 products (kernel/simd_bf16.h): both bf16, and
// bf16 products chosen by `config` for this CPU and SIMD target (the probe is run only for bf16
// inputs).
bool both_bf16(const TensorView& a, const TensorView& b, const KernelConfig& config) {
  return a.dtype() == DType::bf16 && b.dtype() == DType::bf16 && !kernel::use_scalar_path() &&
         kernel::bf16_products_on(config) > 0;
}
// Whether those products run through AMX tiles (kernel/amx_bf16.cc).
bool amx_products(const KernelConfig& config) {
  return kernel::bf16_products_on(config) == kernel::kBf16Amx;
}

// KernelConfig::fp32_products = parts with fp32 q, k, v on the SIMD path: S (and the forward's
// P V) through AMX on three bf16 parts (Note [fp32 through three bf16 parts], amx_bf16.cc), in
// the forward and in the backward's recomputed S alike; refused (naming why) where this machine
// cannot take it.
void take_fp32_parts(kernel::Problem& p, const TensorView& q, const TensorView& k,
                     const TensorView& v, const KernelConfig& config) {
  if (kernel::fp32_products_of(config) != Fp32Products::parts || q.dtype() != DType::f32 ||
      k.dtype() != DType::f32 || v.dtype() != DType::f32 || kernel::use_scalar_path())
    return;
  const std::string refused = kernel::fp32_parts_refusal();
  CTXPAR_CHECK(refused.empty(), refused);
  p.fp32_parts = p.amx = true;
}

// check_forward_args' Problem with the product paths `config` takes for these inputs: exact bf16
// products (and whether through AMX tiles), and the fast tier's rounding of P and dS.
kernel::Problem forward_problem(const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                                const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                                const KernelConfig& config) {
  kernel::Problem p = kernel::check_forward_args(q, q_tokens, k, v, k_tokens, mask, config);
  p.bf16_scores = both_bf16(q, k, config);
  p.amx = p.bf16_scores && amx_products(config);
  p.round_p = config.bf16_tier == Bf16Tier::fast && q.dtype() == DType::bf16;
  take_fp32_parts(p, q, k, v, config);
  return p;
}

// A state given as views must be laid out as a ForwardState's own tensors.
void check_state_memory(const ForwardStateView& state) {
  const int64_t b = state.acc().dim(0), t = state.acc().dim(1), h = state.acc().dim(2);
  CTXPAR_CHECK(
      state.acc().dtype() == DType::f32 && state.acc().ndim() == 4 && state.acc().contiguous(),
      "state: acc must be a contiguous fp32 [B, Tq, Hq, D] view");
  kernel::check_rows_f32("state.m", state.m(), b, h, t);
  kernel::check_rows_f32("state.l", state.l(), b, h, t);
  CTXPAR_CHECK(state.m().contiguous() && state.l().contiguous(),
               "state: m and l must be contiguous");
}
}  // namespace

KernelStats attention_forward_block(const TensorView& q, const Tokens& q_tokens,
                                    const TensorView& k, const TensorView& v,
                                    const Tokens& k_tokens, const Mask& mask,
                                    const ForwardStateView& state, const KernelConfig& config) {
  const kernel::Problem p = forward_problem(q, q_tokens, k, v, k_tokens, mask, config);
  const TensorView& acc = state.acc();
  CTXPAR_CHECK(!acc.empty() && acc.ndim() == 4 && acc.dim(0) == p.batch && acc.dim(1) == p.tq &&
                   acc.dim(2) == p.hq && acc.dim(3) == p.d,
               "state: expected a ForwardState for q's [B, Tq, Hq, D] = ",
               shape_str({p.batch, p.tq, p.hq, p.d}), ", got ",
               acc.empty() ? std::string("an empty state") : shape_str(acc.shape()));
  check_state_memory(state);
  if (p.tq == 0 || p.tk == 0 || p.batch == 0) return {};
  if (kernel::use_scalar_path())  // also applies CTXPAR_SIMD, or throws naming what is wrong
    return kernel::forward_scalar(p, q, q_tokens, k, v, k_tokens, mask, state);
  return kernel::forward_simd(p, q, q_tokens, k, v, k_tokens, mask, state);
}

void attention_forward_finalize(const ForwardStateView& state, const TensorView& out,
                                const TensorView& lse, const KernelConfig& config) {
  CTXPAR_CHECK(!state.acc().empty(), "state: empty ForwardState (construct it with the q shape)");
  check_state_memory(state);
  const int64_t b = state.acc().dim(0), t = state.acc().dim(1), h = state.acc().dim(2),
                d = state.acc().dim(3);
  kernel::check_activation("out", out, true);
  CTXPAR_CHECK(out.shape() == Shape({b, t, h, d}),
               "out: expected shape [B, Tq, Hq, D] = ", shape_str({b, t, h, d}),
               " (the state's), got ", shape_str(out.shape()));
  kernel::check_rows_f32("lse", lse, b, h, t);
  CTXPAR_CHECK(config.threads >= 1, "config.threads: expected >= 1, got ", config.threads);
  const float* acc = state.acc().ptr<const float>();
  const float* m = state.m().ptr<const float>();
  const float* l = state.l().ptr<const float>();
#pragma omp parallel num_threads(config.threads)
  {
    std::vector<float> row(d);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < b * t * h; ++r) {
      const int64_t hi = r % h, ti = (r / h) % t, bi = r / (h * t);
      const int64_t stat = (bi * h + hi) * t + ti;
      lse.ptr<float>()[lse.offset(bi, hi, ti)] = kernel::finalize_row(
          acc + r * d, m[stat], l[stat], d, row.data(), out, out.offset(bi, ti, hi));
    }
  }
}

KernelStats attention_forward(const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                              const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                              const TensorView& out, const TensorView& lse,
                              const KernelConfig& config) {
  const kernel::Problem p = forward_problem(q, q_tokens, k, v, k_tokens, mask, config);
  kernel::check_activation("out", out, true);
  CTXPAR_CHECK(out.shape() == q.shape(),
               "out: expected q's shape [B, Tq, Hq, D] = ", shape_str(q.shape()), ", got ",
               shape_str(out.shape()));
  kernel::check_rows_f32("lse", lse, p.batch, p.hq, p.tq);
  for (const auto& [name, in] :
       {std::pair<const char*, const TensorView&>{"q", q}, {"k", k}, {"v", v}, {"lse", lse}})
    kernel::check_apart("out", out, name, in);
  for (const auto& [name, in] :
       {std::pair<const char*, const TensorView&>{"q", q}, {"k", k}, {"v", v}})
    kernel::check_apart("lse", lse, name, in);
  // Nothing to compute (an empty K/V block still writes O = 0 and LSE = -inf), and the scalar
  // path: through a fresh state and its finalize, the definition.
  const bool empty = p.tq == 0 || p.tk == 0 || p.batch == 0;
  if (empty || kernel::use_scalar_path()) {
    ForwardState state(p.batch, p.tq, p.hq, p.d);
    const KernelStats stats =
        empty ? KernelStats{}
              : kernel::forward_scalar(p, q, q_tokens, k, v, k_tokens, mask, state.view());
    attention_forward_finalize(state, out, lse, config);
    return stats;
  }
  return kernel::forward_simd_whole(p, q, q_tokens, k, v, k_tokens, mask, out, lse);
}

void attention_backward_delta(const TensorView& out, const TensorView& dout,
                              const TensorView& delta, const KernelConfig& config) {
  kernel::check_activation("out", out, true);
  kernel::check_activation("dout", dout, true);
  CTXPAR_CHECK(dout.shape() == out.shape(), "dout: expected out's shape ", shape_str(out.shape()),
               ", got ", shape_str(dout.shape()));
  const int64_t b = out.dim(0), t = out.dim(1), h = out.dim(2), d = out.dim(3);
  kernel::check_rows_f32("delta", delta, b, h, t);
  CTXPAR_CHECK(config.threads >= 1, "config.threads: expected >= 1, got ", config.threads);
  const bool fused = kernel::use_scalar_path() || kernel::simd_fused_multiply_add();
  // A bf16 dout meets bf16 V in the backward's dP products: add in their order (when V is fp32
  // too, dP takes fp32 products and a one-hot row's dS is not promised to be exactly 0).
  const bool pairs = dout.dtype() == DType::bf16 && !kernel::use_scalar_path() &&
                     kernel::bf16_products_on(config) > 0;
  const bool amx = pairs && amx_products(config);
#pragma omp parallel num_threads(config.threads)
  {
    std::vector<float> o(d), g(d);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < b * t * h; ++r) {
      const int64_t hi = r % h, ti = (r / h) % t, bi = r / (h * t);
      kernel::load_row(out, out.offset(bi, ti, hi), d, o.data());
      kernel::load_row(dout, dout.offset(bi, ti, hi), d, g.data());
      // Multiply-adds in order c = 0, 1, ..., rounded exactly as the backward computes each
      // dP = dO . V: fused on the scalar path (std::fma) and on SIMD targets with FMA, a
      // multiply then an add on those without (SSE4, SSSE3). Where a row's softmax is one-hot,
      // O is that key's V, and dS = P (dP - delta) must come out exactly 0 (the truth): any
      // rounding difference here would be amplified by |K| into dQ.
      float sum = 0;
      if (pairs)  // the order of the backward's bf16 dP (kernel/simd_bf16.h)
        sum = kernel::bf16::delta_dot(o.data(), g.data(), d, amx);
      else if (fused)
        for (int64_t c = 0; c < d; ++c) sum = std::fma(o[c], g[c], sum);
      else
        for (int64_t c = 0; c < d; ++c) sum = sum + o[c] * g[c];  // -ffp-contract=off: not fused
      delta.ptr<float>()[delta.offset(bi, hi, ti)] = sum;
    }
  }
}

KernelStats attention_backward_block(const TensorView& q, const Tokens& q_tokens,
                                     const TensorView& k, const TensorView& v,
                                     const Tokens& k_tokens, const Mask& mask,
                                     const TensorView& dout, const TensorView& lse,
                                     const TensorView& delta, const TensorView& dq,
                                     const TensorView& dk, const TensorView& dv,
                                     const KernelConfig& config) {
  kernel::Problem p = kernel::check_backward_args(q, q_tokens, k, v, k_tokens, mask, dout, lse,
                                                  delta, dq, dk, dv, config);
  p.bf16_scores = both_bf16(q, k, config), p.bf16_dp = both_bf16(dout, v, config);
  p.amx = (p.bf16_scores || p.bf16_dp) && amx_products(config);
  p.round_p = config.bf16_tier == Bf16Tier::fast && q.dtype() == DType::bf16;
  take_fp32_parts(p, q, k, v, config);  // S as the forward made it (Note [P at most one])
  if (p.tq == 0 || p.tk == 0 || p.batch == 0) return {};
  if (kernel::use_scalar_path())
    return kernel::backward_scalar(p, q, q_tokens, k, v, k_tokens, mask, dout, lse, delta, dq, dk,
                                   dv);
  return kernel::backward_simd(p, q, q_tokens, k, v, k_tokens, mask, dout, lse, delta, dq, dk, dv);
}

}  // namespace ctxpar

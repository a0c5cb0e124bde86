// Argument checks of the kernel calls. Every check names the argument and what was expected,
// so a strategy author can act on the message without reading this file.
#include <algorithm>
#include <cmath>
#include <utility>

#include "kernel/finite.h"
#include "kernel/problem.h"

namespace ctxpar::kernel {

std::string activation_verdict(const char* name, const TensorView& t, bool allow_bf16,
                               const Shape& want, const char* what) {
  const bool any_shape = want.empty();
  int64_t elements = 1;
  for (int64_t x : want) elements *= x;
  if (t.empty() && (any_shape || elements != 0))
    return detail::concat(name, ": tensor is empty, expected ", what);
  if (any_shape && t.ndim() != 4)
    return detail::concat(name, ": expected 4 dimensions ", what, ", got shape ",
                          shape_str(t.shape()));
  if (!any_shape && t.shape() != want)
    return detail::concat(name, ": expected shape ", what, " = ", shape_str(want), ", got ",
                          shape_str(t.shape()));
  if (!(t.dtype() == DType::f32 || (allow_bf16 && t.dtype() == DType::bf16)))
    return detail::concat(name, ": expected dtype ", allow_bf16 ? "fp32 or bf16" : "fp32", ", got ",
                          dtype_name(t.dtype()));
  if (t.ndim() == 4 && t.dim(3) > 1 && t.stride(3) != 1)
    return detail::concat(name, ": the last dimension must be contiguous (stride 1), got stride ",
                          t.stride(3));
  return "";
}

void check_activation(const char* name, const TensorView& t, bool allow_bf16, const Shape& want,
                      const char* what) {
  const std::string e = activation_verdict(name, t, allow_bf16, want, what);
  if (!e.empty()) throw Error(e);
}

namespace {
// [first byte, one past the last byte] of a view's elements.
std::pair<const char*, const char*> byte_span(const TensorView& t) {
  const int64_t es = dtype_size(t.dtype());
  int64_t lo = 0, hi = 0;
  for (int i = 0; i < t.ndim(); ++i) {
    const int64_t reach = t.stride(i) * (t.dim(i) - 1);
    (reach < 0 ? lo : hi) += reach;
  }
  const char* base = static_cast<const char*>(t.data());
  return {base + lo * es, base + (hi + 1) * es};
}
}  // namespace

void check_apart(const char* out_name, const TensorView& out, const char* in_name,
                 const TensorView& in) {
  if (out.numel() == 0 || in.numel() == 0) return;
  const auto [a0, a1] = byte_span(out);
  const auto [b0, b1] = byte_span(in);
  CTXPAR_CHECK(a1 <= b0 || b1 <= a0, out_name, ": its memory overlaps ", in_name,
               "'s (the call writes ", out_name, " while it may still read ", in_name, "); give ",
               out_name, " memory of its own");
}

void check_rows_f32(const char* name, const TensorView& t, int64_t b, int64_t h, int64_t tokens) {
  CTXPAR_CHECK(!t.empty(), name,
               ": tensor is empty, expected [B, H, T] = ", shape_str({b, h, tokens}), " fp32");
  CTXPAR_CHECK(t.dtype() == DType::f32, name, ": expected dtype fp32, got ", dtype_name(t.dtype()));
  CTXPAR_CHECK(t.shape() == Shape({b, h, tokens}), name,
               ": expected shape [B, H, T] = ", shape_str({b, h, tokens}), ", got ",
               shape_str(t.shape()));
}

const char* const kNonFiniteHint =
    "attention would silently treat the row as masked; find where the NaN/Inf comes from "
    "(inputs, a diverging step, an uninitialised buffer)";

NonFinite find_non_finite(const TensorView& t, int threads) {
  // One pass over the block costs O(T H D) against the O(Tq Tk H D) of the attention it guards;
  // a row is re-read element by element only when its vector test (any_non_finite) fails. A
  // tensor that is one run in memory is tested whole first: most are, and most are finite.
  // That test takes the call's threads, in equal chunks, from kParallelScan elements on: with
  // two threads one of them had waited while the other scanned (1.5 % of an fp32 forward's CPU
  // samples; docs/kernel.md, "Argument checks").
  // One run in any order of the dimensions counts: the [B, T, H, D] views of [B, H, T, D]
  // storage that the torch layer passes (SDPA's tensors transposed) are one run too.
  const int64_t b = t.dim(0), n = t.dim(1), h = t.dim(2), d = t.dim(3);
  const int64_t total = b * n * h * d;
  if (total == 0) return {};
  if (t.dense()) {
    const int64_t start = t.offset(0, 0, 0, 0);
    const int64_t chunks = total >= kParallelScan ? std::max(1, threads) : 1;
    const int team = static_cast<int>(chunks);
    int bad = 0;  // chunks with a bad element
#pragma omp parallel for num_threads(team) reduction(+ : bad) if (chunks > 1)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t lo = total * c / chunks, hi = total * (c + 1) / chunks;
      bad += any_non_finite(t, start + lo, hi - lo);
    }
    if (bad == 0) return {};
  }
  for (int64_t ib = 0; ib < b; ++ib)
    for (int64_t it = 0; it < n; ++it)
      for (int64_t ih = 0; ih < h; ++ih) {
        if (!any_non_finite(t, t.offset(ib, it, ih, 0), d)) continue;
        for (int64_t i = 0; i < d; ++i) {
          const float x = t.get(ib, it, ih, i);
          if (!std::isfinite(x)) return {ib, it, ih, i, x};
        }
      }
  return {};
}

void check_finite(const char* name, const TensorView& t, int threads) {
  // A NaN or Inf input would not fail loudly: the running max drops NaN, so a poisoned row
  // comes out as "fully masked" (O = 0, LSE = -inf) -- a silently wrong answer.
  const NonFinite f = find_non_finite(t, threads);
  CTXPAR_CHECK(!f.found(), name, ": non-finite value (", f.value, ") at [", f.b, ", ", f.t, ", ",
               f.h, ", ", f.d, "]: ", kNonFiniteHint);
}

namespace {
void check_tokens(const char* name, const Tokens& tokens, int64_t n, const Mask& mask) {
  CTXPAR_CHECK(static_cast<int64_t>(tokens.positions.size()) == n, name,
               ".positions: expected one position per token (", n, "), got ",
               tokens.positions.size());
  if (mask.documents)
    CTXPAR_CHECK(static_cast<int64_t>(tokens.documents.size()) == n, name,
                 ".documents: the mask uses documents, expected one document id per token (", n,
                 "), got ", tokens.documents.size());
}

void check_same(const char* name, const TensorView& t, const Shape& want, const char* what) {
  CTXPAR_CHECK(t.shape() == want, name, ": expected shape ", what, " = ", shape_str(want), ", got ",
               shape_str(t.shape()));
}
}  // namespace

Problem check_forward_args(const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                           const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                           const KernelConfig& config) {
  check_activation("q", q, true);
  check_activation("k", k, true);
  check_activation("v", v, true);
  Problem p;
  p.batch = q.dim(0), p.tq = q.dim(1), p.hq = q.dim(2), p.d = q.dim(3);
  p.tk = k.dim(1), p.hkv = k.dim(2);
  CTXPAR_CHECK(p.d >= 16 && p.d <= 256, "q: head dim D must be in 16..256, got ", p.d);
  CTXPAR_CHECK(k.dim(0) == p.batch, "k: batch ", k.dim(0), " does not match q's batch ", p.batch);
  CTXPAR_CHECK(k.dim(3) == p.d, "k: head dim ", k.dim(3), " does not match q's head dim ", p.d);
  check_same("v", v, k.shape(), "k's [B, Tk, Hkv, D]");
  CTXPAR_CHECK(p.hkv > 0 && p.hq % p.hkv == 0, "k: kv heads (", p.hkv, ") must divide q's heads (",
               p.hq, "): Hq % Hkv == 0 (GQA/MQA)");
  p.group = p.hq / p.hkv;
  check_tokens("q_tokens", q_tokens, p.tq, mask);
  check_tokens("k_tokens", k_tokens, p.tk, mask);
  CTXPAR_CHECK(config.threads >= 1, "config.threads: expected >= 1, got ", config.threads);
  CTXPAR_CHECK(std::isfinite(config.scale) && config.scale >= 0,
               "config.scale: expected a finite "
               "value >= 0 (0 = 1/sqrt(D)), got ",
               config.scale);
  p.scale = config.scale > 0 ? config.scale : 1.0f / std::sqrt(static_cast<float>(p.d));
  p.threads = config.threads;
  CTXPAR_CHECK(config.l1d_bytes == 0 ||
                   (config.l1d_bytes >= kMinL1dBytes && config.l1d_bytes <= kMaxL1dBytes),
               "config.l1d_bytes: expected 0 (this machine's) or 1024 to 2^30 bytes, got ",
               config.l1d_bytes);
  p.l1d_bytes = config.l1d_bytes;
  check_finite("q", q, p.threads);
  if (!config.kv_checked) {
    check_finite("k", k, p.threads);
    check_finite("v", v, p.threads);
  }
  return p;
}

Problem check_backward_args(const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                            const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                            const TensorView& dout, const TensorView& lse, const TensorView& delta,
                            const TensorView& dq, const TensorView& dk, const TensorView& dv,
                            const KernelConfig& config) {
  Problem p = check_forward_args(q, q_tokens, k, v, k_tokens, mask, config);
  check_activation("dout", dout, true);
  check_same("dout", dout, q.shape(), "q's [B, Tq, Hq, D]");
  check_finite("dout", dout, p.threads);
  check_rows_f32("lse", lse, p.batch, p.hq, p.tq);
  check_rows_f32("delta", delta, p.batch, p.hq, p.tq);
  check_activation("dq", dq, false);
  check_same("dq", dq, q.shape(), "q's [B, Tq, Hq, D]");
  check_activation("dk", dk, false);
  check_same("dk", dk, k.shape(), "k's [B, Tk, Hkv, D]");
  check_activation("dv", dv, false);
  check_same("dv", dv, k.shape(), "k's [B, Tk, Hkv, D]");
  return p;
}

TileRanges tile_ranges(const Tokens& tokens, int64_t n, int64_t tile, bool documents) {
  TileRanges r;
  r.tile = tile;
  const int64_t count = (n + tile - 1) / tile;
  r.pos_lo.assign(count, 0), r.pos_hi.assign(count, 0);
  r.doc_lo.assign(count, 0), r.doc_hi.assign(count, 0);
  r.padding.assign(count, TileRanges::none);
  for (int64_t t = 0; t < count; ++t) {
    const int64_t a = t * tile, b = std::min(n, a + tile);
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::min();
    int32_t dl = std::numeric_limits<int32_t>::max(), dh = std::numeric_limits<int32_t>::min();
    int64_t real = 0;
    for (int64_t i = a; i < b; ++i) {
      const int64_t pos = tokens.positions[i];
      if (pos == kPaddingPosition) continue;
      ++real;
      lo = std::min(lo, pos), hi = std::max(hi, pos);
      if (documents) dl = std::min(dl, tokens.documents[i]), dh = std::max(dh, tokens.documents[i]);
    }
    r.padding[t] = real == b - a ? TileRanges::none
                   : real == 0   ? TileRanges::all
                                 : TileRanges::some;
    if (real == 0) continue;  // all padding: classify() skips it, the ranges are never read
    r.pos_lo[t] = lo, r.pos_hi[t] = hi;
    if (documents) r.doc_lo[t] = dl, r.doc_hi[t] = dh;
  }
  return r;
}

KernelStats count_tiles(const Problem& p, const Mask& mask, const TileRanges& qr,
                        const TileRanges& kr, double factor) {
  KernelStats st;
  const int64_t heads = p.batch * p.hq;
  for (int64_t qt = 0; qt < qr.count(); ++qt)
    for (int64_t kt = 0; kt < kr.count(); ++kt) {
      if (classify(mask, qr, qt, kr, kt) == TileKind::skip) {
        st.tiles_skipped += heads;
        continue;
      }
      const int64_t rows = std::min(p.tq, (qt + 1) * qr.tile) - qt * qr.tile;
      const int64_t cols = std::min(p.tk, (kt + 1) * kr.tile) - kt * kr.tile;
      st.tiles_computed += heads;
      st.flops += factor * 4.0 * static_cast<double>(p.d) * rows * cols * heads;
    }
  return st;
}

}  // namespace ctxpar::kernel

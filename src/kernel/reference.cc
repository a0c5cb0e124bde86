// The plain references: scores materialised per (batch, head), softmax, products, in fp64 (the
// truth every test compares against) and in fp32 (naive32, which sets the tolerance). One
// template, instantiated for both, so the two differ only in precision.
#include "ctxpar/reference.h"

#include <cmath>
#include <limits>

#include "kernel/problem.h"

namespace ctxpar::reference {

namespace {

// The mask rules of mask.h as written there (pos_q - pos_k against the bounds), in 128-bit
// arithmetic: exact for any int64 positions, and independent of Mask::visible, whose
// saturating form the kernel uses (a shared bug would otherwise pass its own test).
bool visible_exact(const Mask& m, const Tokens& qt, int64_t i, const Tokens& kt, int64_t j) {
  // Padding (mask.h): seen by nobody, sees nothing, whatever the rules.
  if (qt.positions[i] == kPaddingPosition || kt.positions[j] == kPaddingPosition) return false;
  const __int128 diff = static_cast<__int128>(qt.positions[i]) - kt.positions[j];
  if (m.causal && diff < 0) return false;
  if (m.window_left >= 0 && diff > m.window_left) return false;
  if (m.window_right >= 0 && -diff > m.window_right) return false;
  if (m.documents && qt.documents[i] != kt.documents[j]) return false;
  if (m.sliced) {  // the slices' definition (k - k_hi <= q - q_hi), not MaskSlice's key_hi
    const __int128 pq = qt.positions[i], pk = kt.positions[j];
    for (const MaskSlice& s : m.slice_list())
      if (pq >= s.q_lo && pq < s.q_hi && pk >= s.k_lo && pk < s.k_hi &&
          (!s.causal || pk - s.k_hi <= pq - s.q_hi))
        return true;
    return false;
  }
  return true;
}

template <typename T>
Result attention(const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                 const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                 const TensorView& dout, float scale_arg) {
  // q, dout [B, Tq, Hq, D]; k, v [B, Tk, Hkv, D] -> o [B, Tq, Hq, D], lse [B, Hq, Tq],
  // dq like q, dk / dv like k.
  KernelConfig config;
  config.scale = scale_arg;
  const kernel::Problem p = kernel::check_forward_args(q, q_tokens, k, v, k_tokens, mask, config);
  const bool backward = !dout.empty();
  if (backward) {
    kernel::check_activation("dout", dout, true);
    CTXPAR_CHECK(dout.shape() == q.shape(), "dout: expected q's shape ", shape_str(q.shape()),
                 ", got ", shape_str(dout.shape()));
  }
  const int64_t B = p.batch, Tq = p.tq, Tk = p.tk, Hq = p.hq, D = p.d;
  const T scale = static_cast<T>(p.scale);
  const T neg_inf = -std::numeric_limits<T>::infinity();
  auto qi = [&](int64_t b, int64_t i, int64_t h) { return ((b * Tq + i) * Hq + h) * D; };
  auto kj = [&](int64_t b, int64_t j, int64_t h) { return ((b * Tk + j) * p.hkv + h) * D; };

  // The operands as contiguous T arrays, each element read once (TensorView::get is a call per
  // element, which made the loops below several times slower): the values, and so every result
  // bit, are those of reading them in place.
  auto load = [](const TensorView& t) {
    std::vector<T> out(static_cast<size_t>(t.numel()));
    size_t n = 0;
    for (int64_t b = 0; b < t.dim(0); ++b)
      for (int64_t i = 0; i < t.dim(1); ++i)
        for (int64_t h = 0; h < t.dim(2); ++h)
          for (int64_t c = 0; c < t.dim(3); ++c) out[n++] = static_cast<T>(t.get(b, i, h, c));
    return out;
  };
  const std::vector<T> qv = load(q), kv = load(k), vv = load(v);
  const std::vector<T> dov = backward ? load(dout) : std::vector<T>();
  // Which keys each query sees: the same for every batch and head.
  std::vector<char> seen(static_cast<size_t>(Tq * Tk));
  for (int64_t i = 0; i < Tq; ++i)
    for (int64_t j = 0; j < Tk; ++j)
      seen[i * Tk + j] = visible_exact(mask, q_tokens, i, k_tokens, j);

  Result r;
  std::vector<T> o(B * Tq * Hq * D, 0), lse(B * Hq * Tq, neg_inf);
  std::vector<T> dq, dk, dv;
  if (backward) dq.assign(o.size(), 0), dk.assign(B * Tk * p.hkv * D, 0), dv = dk;
  std::vector<T> P(Tq * Tk), dP(Tq * Tk);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / p.group;
      // S = scale * Q K^T with masked entries at -inf; P = softmax(S) per row.
      for (int64_t i = 0; i < Tq; ++i) {
        const T* qr = &qv[qi(b, i, h)];
        T mx = neg_inf;
        for (int64_t j = 0; j < Tk; ++j) {
          T s = neg_inf;
          if (seen[i * Tk + j]) {
            const T* kr = &kv[kj(b, j, hk)];
            s = 0;
            for (int64_t c = 0; c < D; ++c) s += qr[c] * kr[c];
            s *= scale;
          }
          P[i * Tk + j] = s;
          mx = std::max(mx, s);
        }
        if (mx == neg_inf) {  // fully masked row: O = 0, LSE = -inf, P = 0
          for (int64_t j = 0; j < Tk; ++j) P[i * Tk + j] = 0;
          continue;
        }
        T sum = 0;
        for (int64_t j = 0; j < Tk; ++j) sum += (P[i * Tk + j] = std::exp(P[i * Tk + j] - mx));
        for (int64_t j = 0; j < Tk; ++j) P[i * Tk + j] /= sum;
        lse[(b * Hq + h) * Tq + i] = mx + std::log(sum);
        T* orow = &o[qi(b, i, h)];
        for (int64_t j = 0; j < Tk; ++j) {
          const T pij = P[i * Tk + j];
          const T* vr = &vv[kj(b, j, hk)];
          for (int64_t c = 0; c < D; ++c) orow[c] += pij * vr[c];
        }
      }
      if (!backward) continue;
      // dP = dO V^T; dS = P * (dP - rowsum(P * dP)); dQ = scale dS K; dK = scale dS^T Q;
      // dV = P^T dO.
      for (int64_t i = 0; i < Tq; ++i) {
        const T* qr = &qv[qi(b, i, h)];
        const T* dor = &dov[qi(b, i, h)];
        T row = 0;
        for (int64_t j = 0; j < Tk; ++j) {
          const T* vr = &vv[kj(b, j, hk)];
          T s = 0;
          for (int64_t c = 0; c < D; ++c) s += dor[c] * vr[c];
          dP[i * Tk + j] = s;
          row += P[i * Tk + j] * s;
        }
        T* dqr = &dq[qi(b, i, h)];
        for (int64_t j = 0; j < Tk; ++j) {
          const T pij = P[i * Tk + j];
          if (pij == 0) continue;
          const T ds = pij * (dP[i * Tk + j] - row) * scale;
          const T* kr = &kv[kj(b, j, hk)];
          T* dkr = &dk[kj(b, j, hk)];
          T* dvr = &dv[kj(b, j, hk)];
          for (int64_t c = 0; c < D; ++c) {
            dqr[c] += ds * kr[c];
            dkr[c] += ds * qr[c];
            dvr[c] += pij * dor[c];
          }
        }
      }
    }
  r.o.assign(o.begin(), o.end());
  r.lse.assign(lse.begin(), lse.end());
  r.dq.assign(dq.begin(), dq.end());
  r.dk.assign(dk.begin(), dk.end());
  r.dv.assign(dv.begin(), dv.end());
  return r;
}

}  // namespace

Result attention_f64(const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                     const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                     const TensorView& dout, float scale) {
  return attention<double>(q, q_tokens, k, v, k_tokens, mask, dout, scale);
}

Result attention_naive_f32(const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                           const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                           const TensorView& dout, float scale) {
  return attention<float>(q, q_tokens, k, v, k_tokens, mask, dout, scale);
}

}  // namespace ctxpar::reference

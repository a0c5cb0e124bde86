// The exact fallback kernel of the CUDA device, as __host__ __device__ functions: the mask
// rules, tile ranges and tile classification, the per-row flash-attention forward (online
// softmax over 64-key tiles, fp32 state), finalize, the FA2 delta, the two deterministic
// backward passes (dQ per query row over key tiles; dK/dV per key row over query tiles), the
// fp32 merge, casts and the copies behind pack / unpack. kernels.cu launches them on a GPU;
// tests/cuda runs the very same functions on the host (g++ compiles this header with the CUDA
// qualifiers defined away) against the fp64 reference. See docs/cuda.md, "The fallback kernel".
//
// Where the GPU's fallback path is taken (docs/cuda.md): fp32 storage, head dims that are not
// a multiple of 8, positions no fused call can express. It mirrors the CPU's scalar path
// (src/kernel/scalar_*.cc): same 64 x 64 tiles, the same skip / full / partial classification
// (mask_rules.h, the one home of the mask's rules, which the CPU kernel uses too), same order of
// additions.
#pragma once
#include <math.h>
#include <stdint.h>

#include "ctxpar/mask_rules.h"  // MaskRules, TileRange, classify; CTXPAR_HD

namespace ctxpar::cuda {

using ::ctxpar::classify;
using ::ctxpar::MaskRules;
using ::ctxpar::TileKind;
using ::ctxpar::TileRange;

constexpr int64_t kTile = 64;         // = kKernelTile of kernel.h (asserted in kernels.h)
constexpr int64_t kMaxHeadDim = 256;  // rows are held in fixed arrays of this size

CTXPAR_HD float neg_inf() { return -INFINITY; }
CTXPAR_HD float min_f(float a, float b) { return a < b ? a : b; }
CTXPAR_HD float max_f(float a, float b) { return a > b ? a : b; }

// ---- storage types ---------------------------------------------------------------------
// bf16 is the upper half of an fp32 (tensor.h): widening is exact; narrowing rounds to
// nearest even and keeps NaN a NaN.
struct Bf16 {
  uint16_t bits;
};
CTXPAR_HD uint32_t f32_bits(float f) {
  union {
    float f;
    uint32_t u;
  } x;
  x.f = f;
  return x.u;
}
CTXPAR_HD float f32_of_bits(uint32_t u) {
  union {
    float f;
    uint32_t u;
  } x;
  x.u = u;
  return x.f;
}
CTXPAR_HD float to_f32(float f) { return f; }
CTXPAR_HD float to_f32(Bf16 b) { return f32_of_bits(uint32_t(b.bits) << 16); }
CTXPAR_HD uint16_t bf16_bits_of(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
CTXPAR_HD void store_f32(float* dst, float f) { *dst = f; }
CTXPAR_HD void store_f32(Bf16* dst, float f) { dst->bits = bf16_bits_of(f); }

// ---- views ------------------------------------------------------------------------------
// [B, T, H, D] with element strides s0, s1, s2 and a contiguous last dim.
template <class T>
struct View4 {
  T* ptr = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0;
  CTXPAR_HD T* row(int64_t b, int64_t t, int64_t h) const { return ptr + b * s0 + t * s1 + h * s2; }
};
// [B, H, T] fp32 rows (LSE, delta, the state's m and l).
template <class T>
struct Rows3 {
  T* ptr = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0;
  CTXPAR_HD T& at(int64_t b, int64_t h, int64_t t) const { return ptr[b * s0 + h * s1 + t * s2]; }
};

// ---- tiles ------------------------------------------------------------------------------
// The position / document range of tokens [begin, end) (problem.h's tile_ranges, one entry).
CTXPAR_HD TileRange tile_range_of(const int64_t* pos, const int32_t* doc, int64_t begin,
                                  int64_t end, bool documents) {
  TileRange r;
  int64_t lo = kInt64Max, hi = kInt64Min, real = 0;
  int32_t dl = 2147483647, dh = -2147483647 - 1;
  for (int64_t i = begin; i < end; ++i) {
    if (pos[i] == kPaddingPosition) continue;
    ++real;
    lo = pos[i] < lo ? pos[i] : lo;
    hi = pos[i] > hi ? pos[i] : hi;
    if (documents) dl = doc[i] < dl ? doc[i] : dl, dh = doc[i] > dh ? doc[i] : dh;
  }
  r.padding = real == end - begin ? TileRange::none : real == 0 ? TileRange::all : TileRange::some;
  if (real == 0) return r;
  r.pos_lo = lo, r.pos_hi = hi;
  if (documents) r.doc_lo = dl, r.doc_hi = dh;
  return r;
}

// ---- one attention problem (one Q block against one K/V block) ----------------------------
// q, dout [B, Tq, Hq, D]; k, v [B, Tk, Hkv, D] in storage T (float or Bf16); query head h
// reads kv head h / group. Tiles: q_tiles[ceil(Tq / 64)], k_tiles[ceil(Tk / 64)].
template <class T>
struct Problem {
  View4<const T> q, k, v, dout;
  const int64_t *q_pos = nullptr, *k_pos = nullptr;
  const int32_t *q_doc = nullptr, *k_doc = nullptr;  // used when mask.documents
  const TileRange *q_tiles = nullptr, *k_tiles = nullptr;
  MaskRules mask;
  int64_t batch = 0, tq = 0, tk = 0, hq = 0, hkv = 0, d = 0, group = 1;
  float scale = 0;
  CTXPAR_HD int64_t q_tile_count() const { return (tq + kTile - 1) / kTile; }
  CTXPAR_HD int64_t k_tile_count() const { return (tk + kTile - 1) / kTile; }
  CTXPAR_HD bool visible(int64_t i, int64_t j) const {
    return mask.visible(q_pos[i], k_pos[j], mask.documents ? q_doc[i] : 0,
                        mask.documents ? k_doc[j] : 0);
  }
};

template <class T>
CTXPAR_HD void load_row(const T* src, int64_t d, float* out) {
  for (int64_t c = 0; c < d; ++c) out[c] = to_f32(src[c]);
}
// q . k in order c = 0, 1, ...: a multiply then an add, as the CPU's scalar path (built with
// -ffp-contract=off; kernels.cu with --fmad=false), so forward and backward round S alike.
template <class T>
CTXPAR_HD float dot_row(const float* a, const T* b, int64_t d) {
  float s = 0;
  for (int64_t c = 0; c < d; ++c) s = s + a[c] * to_f32(b[c]);
  return s;
}

// ---- forward ------------------------------------------------------------------------------
// The online-softmax state of one query row: m and l ([B, Hq, Tq]) and acc (contiguous
// [B, Tq, Hq, D]) of a ForwardState.
struct StateRow {
  float* acc;
  float* m;
  float* l;
};

// Absorbs every key tile of the problem into query row (b, h, i)'s state, tile by tile:
// scores of the tile, its max, one rescale of the old state (Note [Online softmax] of
// docs/kernel.md). qrow: scratch of D floats. Returns the tiles computed.
template <class T>
CTXPAR_HD int64_t forward_row(const Problem<T>& p, int64_t b, int64_t h, int64_t i, StateRow st,
                              float* qrow) {
  const int64_t qt = i / kTile, hk = h / p.group, d = p.d;
  float s[kTile];
  int64_t computed = 0;
  load_row(p.q.row(b, i, h), d, qrow);
  for (int64_t kt = 0; kt < p.k_tile_count(); ++kt) {
    const TileKind kind = classify(p.mask, p.q_tiles[qt], p.k_tiles[kt]);
    if (kind == TileKind::skip) continue;
    ++computed;
    const int64_t j0 = kt * kTile, j1 = j0 + kTile < p.tk ? j0 + kTile : p.tk;
    float row_max = neg_inf();
    for (int64_t j = j0; j < j1; ++j) {
      const float dot = dot_row(qrow, p.k.row(b, j, hk), d);
      const bool seen = kind == TileKind::full || p.visible(i, j);
      s[j - j0] = seen ? dot * p.scale : neg_inf();
      row_max = max_f(row_max, s[j - j0]);
    }
    const float m_new = max_f(*st.m, row_max);
    if (m_new == neg_inf()) continue;  // nothing visible to this row yet
    // m = -inf gives alpha = exp(-inf) = 0: the (empty) old state is dropped.
    const float alpha = expf(*st.m - m_new);
    float sum = 0;
    for (int64_t c = 0; c < d; ++c) st.acc[c] *= alpha;
    for (int64_t j = j0; j < j1; ++j) {
      const float pj = expf(s[j - j0] - m_new);  // masked: exp(-inf) = 0
      sum += pj;
      if (pj == 0) continue;
      const T* vj = p.v.row(b, j, hk);
      for (int64_t c = 0; c < d; ++c) st.acc[c] += pj * to_f32(vj[c]);
    }
    *st.l = *st.l * alpha + sum;
    *st.m = m_new;
  }
  return computed;
}

// O = acc / l, LSE = m + log(l); a row that saw no key: O = 0, LSE = -inf; a score beyond
// fp32 or a NaN in the sums: LSE = +inf (kernel.h's finalize, the same rule).
template <class T>
CTXPAR_HD void finalize_row(const float* acc, float m, float l, int64_t d, T* out, float* lse) {
  if (m == neg_inf()) {
    for (int64_t c = 0; c < d; ++c) store_f32(out + c, 0.0f);
    *lse = neg_inf();
    return;
  }
  const float inv = 1.0f / l;
  for (int64_t c = 0; c < d; ++c) store_f32(out + c, acc[c] * inv);
  // The device copy of kernel::row_lse (kernel/problem.h): in double, rounded once, its bits.
  *lse = l > 0 && m < INFINITY
             ? static_cast<float>(static_cast<double>(m) + log(static_cast<double>(l)))
             : INFINITY;
}

// ---- backward (FA2) ---------------------------------------------------------------------------
// delta = sum_c dO[c] * O[c], fused multiply-adds in order c = 0, 1, ... (api.cc: rounded as
// each dP = dO . V is, so a one-hot row gives dS = 0 exactly).
template <class T>
CTXPAR_HD float delta_row(const T* o, const T* dout, int64_t d) {
  float sum = 0;
  for (int64_t c = 0; c < d; ++c) sum = fmaf(to_f32(o[c]), to_f32(dout[c]), sum);
  return sum;
}

// The two per-pair terms of the backward, from the forward's S rounding: P = exp(S*scale -
// lse) (at most 1, Note [P at most one]) and dS = P (dP - delta) scale.
struct PairTerms {
  float p, ds;
};
template <class T>
CTXPAR_HD PairTerms pair_terms(float s, const float* dorow, const T* vj, int64_t d, float lse,
                               float delta, float scale) {
  float dp = 0;
  for (int64_t c = 0; c < d; ++c) dp = fmaf(dorow[c], to_f32(vj[c]), dp);
  const float p = expf(min_f(s * scale - lse, 0.0f));
  return {p, p * (dp - delta) * scale};
}

struct BackwardRows {
  Rows3<const float> lse, delta;  // [B, Hq, Tq], final
  View4<float> dq, dk, dv;        // fp32 accumulators
};

// dQ of query row (b, h, i), over the key tiles in order: one thread owns the row, so the
// order of additions is fixed (no atomics). qrow, dorow: scratch of D floats.
template <class T>
CTXPAR_HD int64_t backward_dq_row(const Problem<T>& p, const BackwardRows& r, int64_t b, int64_t h,
                                  int64_t i, float* qrow, float* dorow) {
  const float lse = r.lse.at(b, h, i);
  if (lse == neg_inf()) return 0;  // the row saw no key anywhere: P = 0
  const float delta = r.delta.at(b, h, i);
  const int64_t qt = i / kTile, hk = h / p.group, d = p.d;
  load_row(p.q.row(b, i, h), d, qrow);
  load_row(p.dout.row(b, i, h), d, dorow);
  float* dq = r.dq.row(b, i, h);
  int64_t computed = 0;
  for (int64_t kt = 0; kt < p.k_tile_count(); ++kt) {
    const TileKind kind = classify(p.mask, p.q_tiles[qt], p.k_tiles[kt]);
    if (kind == TileKind::skip) continue;
    ++computed;
    const int64_t j0 = kt * kTile, j1 = j0 + kTile < p.tk ? j0 + kTile : p.tk;
    for (int64_t j = j0; j < j1; ++j) {
      if (kind == TileKind::partial && !p.visible(i, j)) continue;
      const T* kj = p.k.row(b, j, hk);
      const PairTerms t =
          pair_terms(dot_row(qrow, kj, d), dorow, p.v.row(b, j, hk), d, lse, delta, p.scale);
      for (int64_t c = 0; c < d; ++c) dq[c] += t.ds * to_f32(kj[c]);
    }
  }
  return computed;
}

// dK and dV of key row (b, hk, j), over the query heads of its group and the query tiles in
// order: one thread owns the row (deterministic, no atomics). krow, dorow: scratch of D floats.
template <class T>
CTXPAR_HD int64_t backward_dkdv_row(const Problem<T>& p, const BackwardRows& r, int64_t b,
                                    int64_t hk, int64_t j, float* krow, float* dorow) {
  const int64_t kt = j / kTile, d = p.d;
  load_row(p.k.row(b, j, hk), d, krow);
  const T* vj = p.v.row(b, j, hk);
  float* dk = r.dk.row(b, j, hk);
  float* dv = r.dv.row(b, j, hk);
  int64_t computed = 0;
  for (int64_t h = hk * p.group; h < (hk + 1) * p.group; ++h)
    for (int64_t qt = 0; qt < p.q_tile_count(); ++qt) {
      const TileKind kind = classify(p.mask, p.q_tiles[qt], p.k_tiles[kt]);
      if (kind == TileKind::skip) continue;
      ++computed;
      const int64_t i0 = qt * kTile, i1 = i0 + kTile < p.tq ? i0 + kTile : p.tq;
      for (int64_t i = i0; i < i1; ++i) {
        const float lse = r.lse.at(b, h, i);
        if (lse == neg_inf()) continue;
        if (kind == TileKind::partial && !p.visible(i, j)) continue;
        const T* qi = p.q.row(b, i, h);
        load_row(p.dout.row(b, i, h), d, dorow);
        // S = q . k in q's order, as the forward and the dQ pass round it.
        float s = 0;
        for (int64_t c = 0; c < d; ++c) s = s + to_f32(qi[c]) * krow[c];
        const PairTerms t = pair_terms(s, dorow, vj, d, lse, r.delta.at(b, h, i), p.scale);
        for (int64_t c = 0; c < d; ++c) {
          dv[c] += t.p * dorow[c];
          dk[c] += t.ds * to_f32(qi[c]);
        }
      }
    }
  return computed;
}

// ---- merge (fp32) ---------------------------------------------------------------------------
// Two partial results of one query row over disjoint key sets, into (oa, la) (kernel.h's
// merge): a side with LSE = -inf saw nothing; both -inf stays O = 0, LSE = -inf, never NaN.
CTXPAR_HD void merge_row(float* oa, float* la, const float* ob, float lb, int64_t d) {
  if (lb == neg_inf()) return;
  if (*la == neg_inf()) {
    for (int64_t c = 0; c < d; ++c) oa[c] = ob[c];
    *la = lb;
    return;
  }
  // With mx the larger, exp(mn - mx) <= 1 cannot overflow; log1p keeps the small side.
  const float mx = max_f(*la, lb), mn = min_f(*la, lb);
  const float lse = mx + log1pf(expf(mn - mx));
  const float wa = expf(*la - lse), wb = expf(lb - lse);
  for (int64_t c = 0; c < d; ++c) oa[c] = wa * oa[c] + wb * ob[c];
  *la = lse;
}

// ---- copies: pack / unpack, casts ------------------------------------------------------------
// Element n (row-major over [B, T, H, D]) of a strided view into a contiguous one, converting
// the storage type (pack_kv's k and v; copy; fp32 -> bf16 casts).
template <class S, class D>
CTXPAR_HD void copy_element(const View4<const S>& src, D* dst, int64_t t, int64_t h, int64_t d,
                            int64_t n) {
  const int64_t c = n % d, hh = (n / d) % h, tt = (n / (d * h)) % t, bb = n / (d * h * t);
  store_f32(dst + n, to_f32(src.row(bb, tt, hh)[c]));
}
// Token permutation of contiguous rows (host_ops.cc's TokenRows: `outer` blocks of `tokens`
// rows of `row` bytes): for byte n of the destination, the byte of the source it comes from.
//   scatter: dst[.., index[i], ..] = src[.., i, ..]    (n indexes src's bytes)
//   gather:  dst[.., i, ..] = src[.., index[i], ..]    (n indexes dst's bytes)
// Returns {source byte, destination byte}.
struct BytePair {
  int64_t src, dst;
};
CTXPAR_HD BytePair permute_byte(int64_t n, int64_t tokens, int64_t row, const int64_t* index,
                                bool scatter) {
  const int64_t byte = n % row, token = (n / row) % tokens, outer = n / (row * tokens);
  const int64_t moved = (outer * tokens + index[token]) * row + byte;
  return scatter ? BytePair{n, moved} : BytePair{moved, n};
}

// ---- the cuda device's small kernels: state, strided element-wise ops, partial merges --------
// A ForwardState on the device, contiguous: acc [B, Tq, Hq, D], m and l [B, Hq, Tq].
struct DeviceState {
  float* acc = nullptr;
  float* m = nullptr;
  float* l = nullptr;
};

// A view of up to 4 dims as plain data: shape right-aligned to 4 (leading 1s), element
// strides, element bytes and kind (kF32 / kBf16 convert on copy; kRaw copies es bytes).
enum ElementKind : int { kRaw = 0, kF32 = 1, kBf16 = 2 };
struct Strided4 {
  unsigned char* ptr = nullptr;
  int64_t n[4] = {1, 1, 1, 1};
  int64_t s[4] = {0, 0, 0, 0};
  int64_t es = 4;
  int kind = kF32;
  CTXPAR_HD int64_t count() const { return n[0] * n[1] * n[2] * n[3]; }
  // Byte offset of element e (row-major over n).
  CTXPAR_HD int64_t byte_of(int64_t e) const {
    const int64_t i3 = e % n[3], i2 = (e / n[3]) % n[2], i1 = (e / (n[3] * n[2])) % n[1],
                  i0 = e / (n[3] * n[2] * n[1]);
    return (i0 * s[0] + i1 * s[1] + i2 * s[2] + i3 * s[3]) * es;
  }
  CTXPAR_HD float load(int64_t e) const {
    const unsigned char* p = ptr + byte_of(e);
    if (kind == kBf16) {
      Bf16 b;
      b.bits = uint16_t(p[0] | (uint16_t(p[1]) << 8));
      return to_f32(b);
    }
    uint32_t u = uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
    return f32_of_bits(u);
  }
  CTXPAR_HD void store(int64_t e, float f) const {
    unsigned char* p = ptr + byte_of(e);
    if (kind == kBf16) {
      const uint16_t b = bf16_bits_of(f);
      p[0] = uint8_t(b), p[1] = uint8_t(b >> 8);
      return;
    }
    const uint32_t u = f32_bits(f);
    p[0] = uint8_t(u), p[1] = uint8_t(u >> 8), p[2] = uint8_t(u >> 16), p[3] = uint8_t(u >> 24);
  }
};
// copy_into's element e: the same bytes where the kinds agree, else through fp32 (bf16 rounds
// to nearest even, as f32_to_bf16).
CTXPAR_HD void copy_strided_element(const Strided4& src, const Strided4& dst, int64_t e) {
  if (src.kind == dst.kind) {
    const unsigned char* a = src.ptr + src.byte_of(e);
    unsigned char* b = dst.ptr + dst.byte_of(e);
    for (int64_t c = 0; c < src.es; ++c) b[c] = a[c];
    return;
  }
  dst.store(e, src.load(e));
}
// device.h's add: y[e] += x[e] (fp32), one owner per element.
CTXPAR_HD void add_strided_element(const Strided4& x, const Strided4& y, int64_t e) {
  y.store(e, y.load(e) + x.load(e));
}
CTXPAR_HD void zero_strided_element(const Strided4& t, int64_t e) {
  unsigned char* p = t.ptr + t.byte_of(e);
  for (int64_t c = 0; c < t.es; ++c) p[c] = 0;
}
// A normalised partial (o, lse) of one query row over keys the state has not seen, absorbed
// into the state's (acc, m, l): the partial is the state (acc = o, m = lse, l = 1), merged by
// the online-softmax rescale. lse = -inf (no key seen) leaves the state as it is.
CTXPAR_HD void absorb_partial_row(StateRow st, const float* o, float lse, int64_t d) {
  if (lse == neg_inf()) return;
  const float m_new = max_f(*st.m, lse);
  const float alpha = expf(*st.m - m_new), beta = expf(lse - m_new);
  for (int64_t c = 0; c < d; ++c) st.acc[c] = st.acc[c] * alpha + o[c] * beta;
  *st.l = *st.l * alpha + beta;
  *st.m = m_new;
}

// Token permutation between contiguous rows of different token counts (device.h's
// scatter_tokens / gather_tokens: `outer` blocks of src_tokens / dst_tokens rows of `row`
// bytes). n runs over src's bytes (scatter) or dst's (gather).
CTXPAR_HD BytePair permute_rows_byte(int64_t n, int64_t src_tokens, int64_t dst_tokens, int64_t row,
                                     const int64_t* index, bool scatter) {
  const int64_t tokens = scatter ? src_tokens : dst_tokens;
  const int64_t byte = n % row, token = (n / row) % tokens, outer = n / (row * tokens);
  const int64_t moved = (outer * (scatter ? dst_tokens : src_tokens) + index[token]) * row + byte;
  return scatter ? BytePair{n, moved} : BytePair{moved, n};
}

}  // namespace ctxpar::cuda

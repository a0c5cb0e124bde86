// Decode's attention over a KV cache shard read in place (kernel/decode.h). One new token has
// Hq query rows against the whole cache; the g = Hq / Hkv rows of a KV head share every K and V
// row read. Decode is bound by that stream, so the kernel reads the cache's own rows where
// they lie -- the tile kernel (simd_forward.cc) packs K transposed and V into tiles first,
// which for one query row costs a copy of the shard per token -- and does nothing per key but
// the g dot products, the exponentials and the g updates of O.
//
// Note [Decode splits the context in fixed blocks] (flash-decoding): the visible keys of a
// token are cut at multiples of kDecodeSplit local rows; each (token, KV head, block) is one
// task with its own online-softmax partial (m, l, acc) for the g rows, and the threads share
// the tasks. The partials are then merged per row in block order, the one merge rule of
// merge() (kernel.h). The blocks' bounds depend on local indices only, so the bits depend
// neither on the thread count nor on how the tokens were cut into prefill and decode calls.
//
// Note [Scores in natural units, exponents in base 2] (simd_forward.cc) holds here too: S and
// m are natural; only S - m is scaled by log2(e) for the exponential.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernel/simd_decode.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#include <type_traits>

#include "ctxpar/error.h"
#include "kernel/decode.h"
#include "kernel/problem.h"
#include "kernel/simd_tile.h"

HWY_BEFORE_NAMESPACE();
namespace ctxpar::kernel::HWY_NAMESPACE {
namespace {

// One task: keys [j0, j1) of token t (one split of its context, `block` counting the
// splits of every token) for KV heads [h0, h1).
constexpr int64_t kVChunk = 16;  // keys of V read for all heads before the products

struct DecodeTask {
  int64_t t, block, j0, j1, h0, h1;
};

// Asks for the rows of `count` keys from key j (KV heads [h0, h1)) ahead of their use: the
// work between two rows is long enough that the hardware's prefetcher alone kept too few lines
// in flight (measured, 128K context, one thread, alternating: fp32 30-31 ms a token with it,
// 35 without; bf16 19-20 against 22).
// Level 3 asks for L1, 2 for L2 (__builtin_prefetch's locality).
template <int Level = 3>
HWY_INLINE void prefetch_keys(const TensorView& x, int64_t j, int64_t count, int64_t h0, int64_t h1,
                              int64_t d) {
  if (count <= 0) return;
  const int64_t es = int64_t(dtype_size(x.dtype()));
  const std::byte* a = static_cast<const std::byte*>(x.data()) + x.offset(0, j, h0) * es;
  const int64_t bytes = ((count - 1) * x.stride(1) + (h1 - h0) * d) * es;
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(a + o, 0, Level);
}
constexpr int64_t kPrefetchKeys = 16;  // how far ahead the scores' loop asks for K rows

// Where a row of the shard lies: its page (DecodeShard::k_pages / v_pages) and the row in it,
// stepped along the keys without a division per key.
struct PageRow {
  int64_t page, row;
  PageRow plus(int64_t x, int64_t page_rows) const {
    PageRow at{page, row + x};
    for (; at.row >= page_rows; at.row -= page_rows) ++at.page;
    return at;
  }
};

// K's elements as fp32 vectors: an fp32 row where it lies, a bf16 row widened in registers (a
// bf16 value is the top half of its fp32).
HWY_INLINE VF load_f32(DF df, const float* HWY_RESTRICT p) { return hn::LoadU(df, p); }
HWY_INLINE VF load_f32(DF df, const uint16_t* HWY_RESTRICT p) {
  const hn::RebindToUnsigned<DF> du32;
  const hn::Rebind<uint16_t, DF> du16;
  return hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(du16, p))));
}
HWY_INLINE float to_f32(float x) { return x; }
HWY_INLINE float to_f32(uint16_t x) { return bf16_to_f32(x); }

// Halves v down to one 128-bit block, adding the halves.
template <class D>
HWY_INLINE auto fold_blocks(D d, hn::Vec<D> v) {
  if constexpr (hn::MaxLanes(D()) <= 4) {
    (void)d;
    return v;
  } else {
    const hn::Half<D> dh;
    return fold_blocks(dh, hn::Add(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)));
  }
}

// The sums of the lanes of a, b, c, e in lanes 0..3 of one 128-bit vector: a transposing tree
// (pairs of lanes, then pairs of pairs, then blocks), 13 operations on AVX-512 against 4 x 8 for
// four SumOfLanes.
HWY_INLINE hn::Vec<hn::Full128<float>> sums4(DF df, VF a, VF b, VF c, VF e) {
  const hn::Repartition<uint64_t, DF> d64;
  const VF ab = hn::Add(hn::InterleaveLower(df, a, b), hn::InterleaveUpper(df, a, b));
  const VF ce = hn::Add(hn::InterleaveLower(df, c, e), hn::InterleaveUpper(df, c, e));
  const auto ab64 = hn::BitCast(d64, ab), ce64 = hn::BitCast(d64, ce);
  const VF x = hn::BitCast(df, hn::InterleaveLower(d64, ab64, ce64));
  const VF y = hn::BitCast(df, hn::InterleaveUpper(d64, ab64, ce64));
  return fold_blocks(df, hn::Add(x, y));
}

// Note [Decode's products share their loads]: the scores of G query rows against J keys at
// once, J x G accumulators, so that each K vector loaded serves G rows and each query vector J
// keys (one row at a time loaded two vectors per FMA: the loads, not the FMAs, bound it). A
// bf16 K is widened in registers. The J x G sums of lanes go four at a time through sums4
// where the vectors have four lanes or more.
// out[j * ldo + r] = scale * (q_r . k_j); q rows `d` apart.
template <int G, int J, typename T>
HWY_INLINE void dots(const float* HWY_RESTRICT q, const T* const* k, int64_t d, float scale,
                     float* HWY_RESTRICT out, int64_t ldo) {
  const DF df;
  const int64_t n = lanes(), dv = d / n * n;
  VF acc[J][G];
  for (int j = 0; j < J; ++j)
    for (int r = 0; r < G; ++r) acc[j][r] = hn::Zero(df);
  for (int64_t c = 0; c < dv; c += n) {
    VF kv[J];
    for (int j = 0; j < J; ++j) kv[j] = load_f32(df, k[j] + c);
    for (int r = 0; r < G; ++r) {
      const VF qv = hn::LoadU(df, q + r * d + c);
      for (int j = 0; j < J; ++j) acc[j][r] = hn::MulAdd(qv, kv[j], acc[j][r]);
    }
  }
  float sums[J][G];
  if constexpr (G % 4 == 0 && hn::MaxLanes(DF()) >= 4) {
    const hn::Full128<float> d4;
    for (int j = 0; j < J; ++j)
      for (int r = 0; r < G; r += 4)
        hn::StoreU(sums4(df, acc[j][r], acc[j][r + 1], acc[j][r + 2], acc[j][r + 3]), d4,
                   &sums[j][r]);
  } else {
    for (int j = 0; j < J; ++j)
      for (int r = 0; r < G; ++r) sums[j][r] = hn::GetLane(hn::SumOfLanes(df, acc[j][r]));
  }
  for (int j = 0; j < J; ++j)
    for (int r = 0; r < G; ++r) {
      float x = sums[j][r];
      for (int64_t c = dv; c < d; ++c) x += q[r * d + c] * to_f32(k[j][c]);
      out[r * ldo + j] = x * scale;
    }
}

// The g rows' scores against keys k[0..J) (J = 2, or 1 for the last of an odd count), through
// dots<G, J> where g is one of the G it is made for, else one row at a time.
template <int J, typename T>
HWY_INLINE void scores_of(int64_t g, const float* HWY_RESTRICT q, const T* const* k, int64_t d,
                          float scale, float* HWY_RESTRICT out, int64_t ldo) {
  switch (g) {
    case 1:
      return dots<1, J>(q, k, d, scale, out, ldo);
    case 2:
      return dots<2, J>(q, k, d, scale, out, ldo);
    case 4:
      return dots<4, J>(q, k, d, scale, out, ldo);
    case 8:  // two of 4: 2 x 8 accumulators would not stay in AVX2's 16 registers
      dots<4, J>(q, k, d, scale, out, ldo);
      return dots<4, J>(q + 4 * d, k, d, scale, out + 4 * ldo, ldo);
    default:
      for (int64_t r = 0; r < g; ++r) dots<1, J>(q + r * d, k, d, scale, out + r * ldo, ldo);
  }
}

// O += P V for G rows over kk keys of a bf16 V read where it lies, widened in registers:
// acc[r lda + c] += sum_x p[r ldp + x] v[x ldv + c], NC vectors of columns at a time, the G x NC
// accumulators in registers over the keys. Each element is one MulAdd per key in key order,
// as axpy's and gemm_rows' (the same bits as widening V into a buffer first).
template <int G, int NC>
HWY_INLINE void pv_bf16_cols(int64_t c0, int64_t kk, const float* HWY_RESTRICT p, int64_t ldp,
                             const uint16_t* HWY_RESTRICT v, int64_t ldv, float* HWY_RESTRICT acc,
                             int64_t lda) {
  const DF df;
  const int64_t n = lanes();
  VF a[G][NC];
  for (int r = 0; r < G; ++r)
    for (int i = 0; i < NC; ++i) a[r][i] = hn::LoadU(df, acc + r * lda + c0 + i * n);
  for (int64_t x = 0; x < kk; ++x) {
    VF vv[NC];
    for (int i = 0; i < NC; ++i) vv[i] = load_f32(df, v + x * ldv + c0 + i * n);
    for (int r = 0; r < G; ++r) {
      const VF pr = hn::Set(df, p[r * ldp + x]);
      for (int i = 0; i < NC; ++i) a[r][i] = hn::MulAdd(pr, vv[i], a[r][i]);
    }
  }
  for (int r = 0; r < G; ++r)
    for (int i = 0; i < NC; ++i) hn::StoreU(a[r][i], df, acc + r * lda + c0 + i * n);
}

template <int G>
HWY_INLINE void pv_bf16(int64_t d, int64_t kk, const float* HWY_RESTRICT p, int64_t ldp,
                        const uint16_t* HWY_RESTRICT v, int64_t ldv, float* HWY_RESTRICT acc,
                        int64_t lda) {
  // Column blocks that keep G x NC accumulators, NC widened rows and a broadcast in registers
  // (32 on AVX-512, 16 on AVX2).
  constexpr int kMax = HWY_MAX_BYTES >= 64 ? (G <= 4 ? 4 : 2) : (G <= 2 ? 4 : 2);
  const int64_t n = lanes(), nvec = d / n;
  int64_t c = 0;
  for (; c + kMax <= nvec; c += kMax) pv_bf16_cols<G, kMax>(c * n, kk, p, ldp, v, ldv, acc, lda);
  for (; c < nvec; ++c) pv_bf16_cols<G, 1>(c * n, kk, p, ldp, v, ldv, acc, lda);
  for (int64_t col = nvec * n; col < d; ++col)  // D not a multiple of the lanes
    for (int r = 0; r < G; ++r)
      for (int64_t x = 0; x < kk; ++x)
        acc[r * lda + col] += p[r * ldp + x] * bf16_to_f32(v[x * ldv + col]);
}

// acc[0..d) += p * v
HWY_INLINE void axpy(float p, const float* HWY_RESTRICT v, float* HWY_RESTRICT acc, int64_t d) {
  const DF df;
  const int64_t n = lanes(), dv = d / n * n;
  const VF vp = hn::Set(df, p);
  for (int64_t c = 0; c < dv; c += n)
    hn::StoreU(hn::MulAdd(vp, hn::LoadU(df, v + c), hn::LoadU(df, acc + c)), df, acc + c);
  for (int64_t c = dv; c < d; ++c) acc[c] += p * v[c];
}

// The task's partials: for KV head h of [h0, h1) and row r of its g, into m[(h - h0) g + r],
// l[...], acc[((h - h0) g + r) d ...]. qf: the token's Hq query rows, fp32. Note [Decode reads
// a token's heads together]: the loops run over keys outside and heads inside, so a token's K
// (then V) rows of all the task's heads -- contiguous in the cache -- are read as one stream.
// KT: the cache's element (float, or uint16_t for bf16).
template <typename KT>
void run_task(const DecodeShard& p, const DecodeTask& task, int64_t g, int64_t d, float scale,
              const float* HWY_RESTRICT qf, float* HWY_RESTRICT scores, float* HWY_RESTRICT m,
              float* HWY_RESTRICT l, float* HWY_RESTRICT acc) {
  const int64_t nk = task.j1 - task.j0, rows = (task.h1 - task.h0) * g;
  const PageRow first{task.j0 / p.page_rows, task.j0 % p.page_rows};
  // S = Q K^T: each K row read once for its g rows, two keys at a time within a page (each
  // score is its own sum: how keys are paired does not change its bits).
  PageRow key = first;  // key j's
  for (int64_t j = 0; j < nk;) {
    const TensorView& page = p.k_pages[size_t(key.page)];
    const TensorView& vpage = p.v_pages[size_t(key.page)];
    const int64_t seg = std::min(nk - j, p.page_rows - key.row);  // the keys in this page
    for (int64_t x = 0; x < seg; x += 2) {
      const bool two = x + 1 < seg;
      // Rows kPrefetchKeys ahead: in this page, or at the start of the next one.
      const int64_t ahead = x + kPrefetchKeys, count = std::min<int64_t>(2, nk - j - ahead);
      if (ahead < seg)
        prefetch_keys(page, key.row + ahead, std::min(count, seg - ahead), task.h0, task.h1, d);
      else if (count > 0 && ahead - seg + count <= p.page_rows)
        prefetch_keys(p.k_pages[size_t(key.page + 1)], ahead - seg, count, task.h0, task.h1, d);
      // The same keys' V rows into L2, for the P V pass after the split's scores: asked for
      // here, spread over the pass, rather than a chunk's lines at once before its products.
      prefetch_keys<2>(vpage, key.row + x, std::min<int64_t>(2, seg - x), task.h0, task.h1, d);
      const KT* base = page.ptr<const KT>();
      for (int64_t h = task.h0; h < task.h1; ++h) {
        const KT* k[2] = {base + page.offset(0, key.row + x, h),
                          two ? base + page.offset(0, key.row + x + 1, h) : nullptr};
        float* out = scores + (h - task.h0) * g * kDecodeSplit + j + x;
        if (two)
          scores_of<2>(g, qf + h * g * d, k, d, scale, out, kDecodeSplit);
        else
          scores_of<1>(g, qf + h * g * d, k, d, scale, out, kDecodeSplit);
      }
    }
    j += seg;
    key = {key.page + 1, 0};
  }
  const DF df;
  const int64_t n = lanes();
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * kDecodeSplit;
    // Max and sum by vectors, the last partial vector's keys one by one (a scalar max and sum
    // over a split's 512 scores were two dependency chains of 512 steps a row: 12 % of decode's
    // time in cache).
    const int64_t nv = nk / n * n;
    VF vmx = hn::Set(df, kNegInf);
    for (int64_t j = 0; j < nv; j += n) vmx = hn::Max(vmx, hn::LoadU(df, s + j));
    float mx = hn::GetLane(hn::MaxOfLanes(df, vmx));
    for (int64_t j = nv; j < nk; ++j) mx = std::max(mx, s[j]);
    const VF vm = hn::Set(df, mx), vl = hn::Set(df, kLog2e);
    // The last vector may run past nk within the row (kDecodeSplit is a multiple of every
    // target's lanes): those lanes are never read.
    VF vsum = hn::Zero(df);
    for (int64_t j = 0; j < nk; j += n) {
      const VF e = exp2_neg(df, hn::Mul(hn::Sub(hn::LoadU(df, s + j), vm), vl));
      hn::StoreU(e, df, s + j);
      if (j < nv) vsum = hn::Add(vsum, e);
    }
    float sum = hn::GetLane(hn::SumOfLanes(df, vsum));
    for (int64_t j = nv; j < nk; ++j) sum += s[j];
    if (p.round_p)
      for (int64_t j = 0; j < nk; ++j) s[j] = round_to_bf16(s[j]);
    m[r] = mx;
    l[r] = sum;
    std::fill(acc + r * d, acc + (r + 1) * d, 0.0f);
  }
  // O += P V: the keys in chunks of kVChunk, all the task's heads of a chunk (contiguous in the
  // cache) read once from memory; each head's g rows then through gemm_rows (simd_tile.h: P
  // broadcast, V rows as vectors, the g x D accumulators in registers per chunk), whose FMAs
  // run in key order as axpy's (the same bits). A bf16 V goes through pv_bf16, which widens
  // its rows in registers (widening them into a buffer first cost a fifth of decode's time). A
  // chunk also ends at its page's end (its rows one stride apart): the FMAs still run in key
  // order from the stored accumulators, so the bits do not depend on the pages' size.
  const bool gemm = d % n == 0 && (g == 1 || g % 2 == 0);
  const int64_t nh = task.h1 - task.h0;
  // Keys of V from key x (at `at`) of the task: at most kVChunk, within one page.
  auto chunk_at = [&](int64_t x, const PageRow& at) {
    return std::min({kVChunk, nk - x, p.page_rows - at.row});
  };
  PageRow at = first;
  for (int64_t x0 = 0, kk = 0; x0 < nk; x0 += kk, at = at.plus(kk, p.page_rows)) {
    kk = chunk_at(x0, at);
    const TensorView& pv = p.v_pages[size_t(at.page)];
    if constexpr (std::is_same_v<KT, uint16_t>) {
      // bf16: widened in registers (pv_bf16), g rows at a time where g is 1, 2, 4 or 8.
      const uint16_t* vrows = pv.ptr<const uint16_t>() + pv.offset(0, at.row, task.h0);
      const int64_t ldv = pv.stride(1);
      for (int64_t h = 0; h < nh; ++h) {
        const float* sp = scores + h * g * kDecodeSplit + x0;
        float* ap = acc + h * g * d;
        const uint16_t* vp = vrows + h * d;
        switch (g) {
          case 1:
            pv_bf16<1>(d, kk, sp, kDecodeSplit, vp, ldv, ap, d);
            break;
          case 2:
            pv_bf16<2>(d, kk, sp, kDecodeSplit, vp, ldv, ap, d);
            break;
          case 4:
            pv_bf16<4>(d, kk, sp, kDecodeSplit, vp, ldv, ap, d);
            break;
          case 8:
            pv_bf16<4>(d, kk, sp, kDecodeSplit, vp, ldv, ap, d);
            pv_bf16<4>(d, kk, sp + 4 * kDecodeSplit, kDecodeSplit, vp, ldv, ap + 4 * d, d);
            break;
          default:
            for (int64_t r = 0; r < g; ++r)
              pv_bf16<1>(d, kk, sp + r * kDecodeSplit, kDecodeSplit, vp, ldv, ap + r * d, d);
        }
      }
      continue;
    }
    const float* vrows = pv.ptr<const float>() + pv.offset(0, at.row, task.h0);
    const int64_t ldv = pv.stride(1);
    for (int64_t h = 0; h < nh; ++h) {
      const float* sp = scores + h * g * kDecodeSplit + x0;
      float* ap = acc + h * g * d;
      const float* vp = vrows + h * d;
      if (gemm && g == 1)
        row_block<1, HWY_MAX_BYTES >= 64 ? 4 : 2>(d, kk, sp, kDecodeSplit, vp, ldv, ap, d, true);
      else if (gemm)
        gemm_rows(g, d, kk, sp, kDecodeSplit, vp, ldv, ap, d, true);
      else
        for (int64_t x = 0; x < kk; ++x)
          for (int64_t r = 0; r < g; ++r)
            axpy(sp[r * kDecodeSplit + x], vp + x * ldv, ap + r * d, d);
    }
  }
}

// The rows of [a, e) whose document is dq, as one run [a, e); false where they are not one run
// (the id is used again apart from it). Scanned from the end: the query's document is usually
// the last one appended, so the first loop stops at once and the run ends at e.
bool document_run(std::span<const int32_t> docs, int32_t dq, int64_t& a, int64_t& e) {
  const int32_t* d = docs.data();
  int64_t hi = e;
  while (hi > a && d[hi - 1] != dq) --hi;
  int64_t lo = hi;
  while (lo > a && d[lo - 1] == dq) --lo;
  bool apart = false;  // no early exit: the compiler vectorises the test
  for (int64_t j = a; j < lo; ++j) apart |= d[j] == dq;
  if (apart) return false;
  a = lo, e = hi;  // lo == hi: no key of the document (O = 0, LSE = -inf)
  return true;
}

}  // namespace

bool DecodeInPlace(const DecodeShard& p) {
  // Hkv from out: a rank holding none of the sequence may be handed an empty shard view.
  const int64_t tn = p.q.dim(1), hq = p.q.dim(2), d = p.q.dim(3), hkv = p.out.dim(2);
  const int64_t g = hq / hkv;
  const auto kp = p.k_positions;
  CTXPAR_CHECK(!p.mask.sliced, "decode_in_place: the mask must hide keys by position through ",
               "one range per query (slices take the tile kernel)");
  CTXPAR_CHECK(!p.mask.documents ||
                   (int64_t(p.q_documents.size()) == tn && p.k_documents.size() == kp.size()),
               "decode_in_place: a documents mask needs a document id per query (", tn,
               ") and per key (", kp.size(), "); got ", p.q_documents.size(), " and ",
               p.k_documents.size());
  // Each token's visible keys: a run [a, e) of the shard's rows (positions increase; with
  // documents, the rows of its document within it), decided for every token before any work.
  std::vector<int64_t> runs(size_t(2 * tn));
  for (int64_t t = 0; t < tn; ++t) {
    const Mask::KeyRange kr = p.mask.key_range(p.q_positions[t]);
    int64_t a = std::lower_bound(kp.begin(), kp.end(), kr.lo) - kp.begin();
    int64_t e = std::upper_bound(kp.begin(), kp.end(), kr.hi) - kp.begin();
    if (p.mask.documents && !document_run(p.k_documents, p.q_documents[t], a, e)) return false;
    runs[2 * t] = a, runs[2 * t + 1] = e;
  }
  const float scale =
      p.scale > 0 ? p.scale : 1.0f / std::sqrt(static_cast<float>(d));  // checks.cc's
  // The queries, fp32, [Tn, Hq, D] (head h g + r of token t: KV head h's row r).
  std::vector<float> qf(size_t(tn * hq * d));
  for (int64_t t = 0; t < tn; ++t)
    for (int64_t h = 0; h < hq; ++h)
      load_row(p.q, p.q.offset(0, t, h), d, qf.data() + (t * hq + h) * d);
  // Each run cut into splits (Note [Decode splits the context in fixed blocks]).
  struct Split {
    int64_t t, j0, j1;
  };
  std::vector<Split> splits;
  std::vector<int64_t> first_split(size_t(tn + 1));
  for (int64_t t = 0; t < tn; ++t) {
    first_split[t] = int64_t(splits.size());
    const int64_t a = runs[2 * t], e = runs[2 * t + 1];
    for (int64_t j0 = a / kDecodeSplit * kDecodeSplit; j0 < e; j0 += kDecodeSplit)
      splits.push_back({t, std::max(a, j0), std::min(e, j0 + kDecodeSplit)});
  }
  first_split[tn] = int64_t(splits.size());
  // The heads are split too only where the splits are fewer than the threads (a short
  // context): each head's bits are the same whichever heads share its task.
  const int64_t ns = int64_t(splits.size());
  const int64_t groups =
      std::min<int64_t>(hkv, (p.threads + std::max<int64_t>(ns, 1) - 1) / std::max<int64_t>(ns, 1));
  std::vector<DecodeTask> tasks;
  for (int64_t i = 0; i < ns; ++i)
    for (int64_t x = 0; x < groups; ++x)
      tasks.push_back(
          {splits[i].t, i, splits[i].j0, splits[i].j1, hkv * x / groups, hkv * (x + 1) / groups});
  // Partials of split i, KV head h, row r: ml[((i hkv + h) g + r) 2 + {0: m, 1: l}], acc.
  std::vector<float> ml(size_t(ns * hkv * g * 2)), accs(size_t(ns * hkv * g * d));
  const int64_t nt = int64_t(tasks.size());
  // The cache's element type (no page: no task reads one).
  const bool f32 = p.k_pages.empty() || p.k_pages[0].dtype() == DType::f32;
#pragma omp parallel num_threads(p.threads)
  {
    std::vector<float> scores(size_t(hkv * g * kDecodeSplit), 0.0f), m(size_t(hkv * g)),
        l(size_t(hkv * g));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < nt; ++i) {
      const DecodeTask& task = tasks[i];
      const int64_t at = task.block * hkv + task.h0;  // the first head's partials
      if (f32)
        run_task<float>(p, task, g, d, scale, qf.data() + task.t * hq * d, scores.data(), m.data(),
                        l.data(), accs.data() + at * g * d);
      else
        run_task<uint16_t>(p, task, g, d, scale, qf.data() + task.t * hq * d, scores.data(),
                           m.data(), l.data(), accs.data() + at * g * d);
      for (int64_t r = 0; r < (task.h1 - task.h0) * g; ++r) {
        ml[(at * g + r) * 2] = m[r];
        ml[(at * g + r) * 2 + 1] = l[r];
      }
    }
  }
  // Merge each row's partials in split order, then O = acc / l, LSE = m + log(l) -- forward_finalize's rule, empty rows too.
  float* out = p.out.ptr<float>();
  float* lse = p.lse.ptr<float>();
  for (int64_t t = 0; t < tn; ++t)
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t r = 0; r < g; ++r) {
        float M = kNegInf, L = 0;
        float* o = out + p.out.offset(0, t * g + r, h);
        std::fill(o, o + d, 0.0f);
        for (int64_t i = first_split[t]; i < first_split[t + 1]; ++i) {
          const int64_t at = (i * hkv + h) * g + r;
          const float mb = ml[at * 2], lb = ml[at * 2 + 1];
          if (mb == kNegInf) continue;
          const float* ab = accs.data() + at * d;
          const float mn = std::max(M, mb);
          const float sa = M == kNegInf ? 0.0f : std::exp2((M - mn) * kLog2e);
          const float sb = std::exp2((mb - mn) * kLog2e);
          L = L * sa + lb * sb;
          for (int64_t c = 0; c < d; ++c) o[c] = o[c] * sa + ab[c] * sb;
          M = mn;
        }
        lse[p.lse.offset(0, h, t * g + r)] = row_lse(M, L);
        if (M == kNegInf) continue;
        const float inv = 1.0f / L;
        for (int64_t c = 0; c < d; ++c) o[c] *= inv;
      }
  return true;
}

}  // namespace ctxpar::kernel::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ctxpar::kernel {

HWY_EXPORT(DecodeInPlace);

bool decode_in_place(const DecodeShard& p) {
  select_simd_target();
  return HWY_DYNAMIC_DISPATCH(DecodeInPlace)(p);
}

}  // namespace ctxpar::kernel
#endif  // HWY_ONCE

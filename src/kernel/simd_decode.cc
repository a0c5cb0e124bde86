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

#include "ctxpar/error.h"
#include "kernel/decode.h"
#include "kernel/problem.h"
#include "kernel/simd_tile.h"

HWY_BEFORE_NAMESPACE();
namespace ctxpar::kernel::HWY_NAMESPACE {
namespace {

// One task: keys [j0, j1) of token t (one split of its context, `block` counting the
// splits of every token) for KV heads [h0, h1).
struct DecodeTask {
  int64_t t, block, j0, j1, h0, h1;
};

// Row j of head h of a [1, n, H, D] view, widened to fp32 in `buf` when it is bf16 (the fp32
// cache is read where it lies).
HWY_INLINE const float* row_f32(const TensorView& x, int64_t j, int64_t h, int64_t d,
                                float* HWY_RESTRICT buf) {
  const int64_t o = x.offset(0, j, h);
  if (x.dtype() == DType::f32) return x.ptr<const float>() + o;
  const uint16_t* src = x.ptr<const uint16_t>() + o;
  const DF df;
  const hn::RebindToUnsigned<DF> du32;
  const hn::Rebind<uint16_t, DF> du16;
  const int64_t n = lanes(), dv = d / n * n;
  for (int64_t c = 0; c < dv; c += n)
    hn::StoreU(hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(du16, src + c)))),
               df, buf + c);
  for (int64_t c = dv; c < d; ++c) buf[c] = bf16_to_f32(src[c]);
  return buf;
}

HWY_INLINE float dot(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b, int64_t d) {
  const DF df;
  const int64_t n = lanes(), dv = d / n * n;
  VF s0 = hn::Zero(df), s1 = hn::Zero(df);
  int64_t c = 0;
  for (; c + 2 * n <= dv; c += 2 * n) {  // two chains: the FMA latency, not its throughput
    s0 = hn::MulAdd(hn::LoadU(df, a + c), hn::LoadU(df, b + c), s0);
    s1 = hn::MulAdd(hn::LoadU(df, a + c + n), hn::LoadU(df, b + c + n), s1);
  }
  for (; c < dv; c += n) s0 = hn::MulAdd(hn::LoadU(df, a + c), hn::LoadU(df, b + c), s0);
  float s = hn::GetLane(hn::SumOfLanes(df, hn::Add(s0, s1)));
  for (; c < d; ++c) s += a[c] * b[c];
  return s;
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
void run_task(const DecodeShard& p, const DecodeTask& task, int64_t g, int64_t d, float scale,
              const float* HWY_RESTRICT qf, float* HWY_RESTRICT scores, float* HWY_RESTRICT buf,
              float* HWY_RESTRICT m, float* HWY_RESTRICT l, float* HWY_RESTRICT acc) {
  const int64_t nk = task.j1 - task.j0, rows = (task.h1 - task.h0) * g;
  for (int64_t j = 0; j < nk; ++j)  // S = Q K^T: each K row read once for its g rows
    for (int64_t h = task.h0; h < task.h1; ++h) {
      const float* kr = row_f32(p.k, task.j0 + j, h, d, buf);
      for (int64_t r = 0; r < g; ++r)
        scores[((h - task.h0) * g + r) * kDecodeSplit + j] =
            dot(qf + (h * g + r) * d, kr, d) * scale;
    }
  const DF df;
  const int64_t n = lanes();
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * kDecodeSplit;
    float mx = kNegInf;
    for (int64_t j = 0; j < nk; ++j) mx = std::max(mx, s[j]);
    const VF vm = hn::Set(df, mx), vl = hn::Set(df, kLog2e);
    // The last vector may run past nk within the row (kDecodeSplit is a multiple of every
    // target's lanes): those lanes are never read.
    for (int64_t j = 0; j < nk; j += n)
      hn::StoreU(exp2_neg(df, hn::Mul(hn::Sub(hn::LoadU(df, s + j), vm), vl)), df, s + j);
    float sum = 0;
    for (int64_t j = 0; j < nk; ++j) sum += s[j];
    m[r] = mx;
    l[r] = sum;
    std::fill(acc + r * d, acc + (r + 1) * d, 0.0f);
  }
  for (int64_t j = 0; j < nk; ++j)  // O += P V: each V row read once for its g rows
    for (int64_t h = task.h0; h < task.h1; ++h) {
      const float* vr = row_f32(p.v, task.j0 + j, h, d, buf);
      for (int64_t r = 0; r < g; ++r) {
        const int64_t row = (h - task.h0) * g + r;
        axpy(scores[row * kDecodeSplit + j], vr, acc + row * d, d);
      }
    }
}

}  // namespace

void DecodeInPlace(const DecodeShard& p) {
  // Hkv from out: a rank holding none of the sequence may be handed an empty shard view.
  const int64_t tn = p.q.dim(1), hq = p.q.dim(2), d = p.q.dim(3), hkv = p.out.dim(2);
  const int64_t g = hq / hkv;
  CTXPAR_CHECK(!p.mask.documents && !p.mask.sliced, "decode_in_place: the mask must hide keys ",
               "by position only (documents and slices take the tile kernel)");
  const float scale = p.scale > 0 ? p.scale : 1.0f / std::sqrt(static_cast<float>(d));  // checks.cc's
  // The queries, fp32, [Tn, Hq, D] (head h g + r of token t: KV head h's row r).
  std::vector<float> qf(size_t(tn * hq * d));
  for (int64_t t = 0; t < tn; ++t)
    for (int64_t h = 0; h < hq; ++h)
      load_row(p.q, p.q.offset(0, t, h), d, qf.data() + (t * hq + h) * d);
  // Each token's visible keys: a run [a, e) of the shard's rows (positions increase), cut
  // into splits (Note [Decode splits the context in fixed blocks]).
  struct Split {
    int64_t t, j0, j1;
  };
  std::vector<Split> splits;
  std::vector<int64_t> first_split(size_t(tn + 1));
  const auto kp = p.k_positions;
  for (int64_t t = 0; t < tn; ++t) {
    first_split[t] = int64_t(splits.size());
    const Mask::KeyRange kr = p.mask.key_range(p.q_positions[t]);
    const int64_t a = std::lower_bound(kp.begin(), kp.end(), kr.lo) - kp.begin();
    const int64_t e = std::upper_bound(kp.begin(), kp.end(), kr.hi) - kp.begin();
    for (int64_t j0 = a / kDecodeSplit * kDecodeSplit; j0 < e; j0 += kDecodeSplit)
      splits.push_back({t, std::max(a, j0), std::min(e, j0 + kDecodeSplit)});
  }
  first_split[tn] = int64_t(splits.size());
  // The heads are split too only where the splits are fewer than the threads (a short
  // context): each head's bits are the same whichever heads share its task.
  const int64_t ns = int64_t(splits.size());
  const int64_t groups = std::min<int64_t>(hkv, (p.threads + std::max<int64_t>(ns, 1) - 1) /
                                                    std::max<int64_t>(ns, 1));
  std::vector<DecodeTask> tasks;
  for (int64_t i = 0; i < ns; ++i)
    for (int64_t x = 0; x < groups; ++x)
      tasks.push_back({splits[i].t, i, splits[i].j0, splits[i].j1, hkv * x / groups,
                       hkv * (x + 1) / groups});
  // Partials of split i, KV head h, row r: ml[((i hkv + h) g + r) 2 + {0: m, 1: l}], acc.
  std::vector<float> ml(size_t(ns * hkv * g * 2)), accs(size_t(ns * hkv * g * d));
  const int64_t nt = int64_t(tasks.size());
#pragma omp parallel num_threads(p.threads)
  {
    std::vector<float> scores(size_t(hkv * g * kDecodeSplit), 0.0f), buf(size_t(d), 0.0f),
        m(size_t(hkv * g)), l(size_t(hkv * g));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < nt; ++i) {
      const DecodeTask& task = tasks[i];
      const int64_t at = task.block * hkv + task.h0;  // the first head's partials
      run_task(p, task, g, d, scale, qf.data() + task.t * hq * d, scores.data(), buf.data(),
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
        float& lse_out = lse[p.lse.offset(0, h, t * g + r)];
        if (M == kNegInf) {
          lse_out = kNegInf;
          continue;
        }
        const float inv = 1.0f / L;
        for (int64_t c = 0; c < d; ++c) o[c] *= inv;
        lse_out = L > 0 && M < std::numeric_limits<float>::infinity()
                      ? M + std::log(L)
                      : std::numeric_limits<float>::infinity();
      }
}

}  // namespace ctxpar::kernel::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ctxpar::kernel {

HWY_EXPORT(DecodeInPlace);

void decode_in_place(const DecodeShard& p) {
  select_simd_target();
  HWY_DYNAMIC_DISPATCH(DecodeInPlace)(p);
}

}  // namespace ctxpar::kernel
#endif  // HWY_ONCE

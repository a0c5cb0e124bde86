// The fast backward (flash-attention-2 form) on the micro-kernel of simd_tile.h.
//
// Note [Backward tasks]: a task is (batch, kv head, chunk of key tiles; chunk c of n takes key
// tiles c, c + n, c + 2n, ..., which balances causal masks). It owns the dK / dV
// rows of its key tiles (accumulated in a 64-row tile by a two-level sum over query tiles,
// Note [Blocked dK / dV] in simd_tile.h, added to the caller's dk / dv once) and writes the dQ
// of its query-head group into its own partial buffer; partials are summed in a
// fixed chunk order at the end. There is one chunk per (batch, kv head) unless there are fewer
// of those than threads, so the result is bitwise the same for a given thread count and no two
// threads ever write the same element.
//
// Per (query tile, key tile), in natural units as the forward (Note [Scores in natural units,
// exponents in base 2]):
//   S  = Qs K^T            Qs = Q * scale, rounded exactly as the forward rounded it
//   P  = 2^(min(S - lse, 0) log2(e))   masked and fully masked rows give P = 0; P <= 1 always
//   dP = dO V^T
//   dS = P * (dP - delta)
//   dV += P^T dO,  dQ += scale * dS K,  dK += dS^T Qs  (= scale * dS^T Q)
// Note [P at most one]: exp(S - lse) with lse = log sum exp(S) over the row can never exceed 1
// in exact arithmetic; in fp32, S - lse may come out a few ulps of |S| above 0 where S is the
// row's max (lse is rounded), and at |S| ~ 5e8 an ulp is 64: P = 2^64 made dq ~ 4e7 where the
// truth is 0. Clamping the exponent at 0 is exact for the true P and bounds the rounded one.
// Compiled once per SIMD target (hwy/foreach_target.h re-includes this file); backward_simd at
// the bottom dispatches to the chosen one.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernel/simd_backward.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <vector>

#include "kernel/problem.h"
#include "kernel/simd_backward_products.h"
#include "kernel/simd_bf16.h"
#include "kernel/simd_tile.h"

HWY_BEFORE_NAMESPACE();
namespace ctxpar::kernel::HWY_NAMESPACE {
namespace {

// One backward call's arguments: q, dout, dq [B, Tq, Hq, D]; k, v, dk, dv [B, Tk, Hkv, D];
// lse, delta [B, Hq, Tq].
struct BackwardArgs {
  const Problem& p;
  const TensorView &q, &k, &v, &dout, &lse, &delta, &dq, &dk, &dv;
  const Tokens &q_tokens, &k_tokens;
  const Mask& mask;
};

BackwardShape backward_shape(const BackwardArgs& a) {
  const Problem& p = a.p;
  BackwardShape sh;
  static_cast<CallTiles&>(sh) = call_tiles(p, a.q_tokens, a.k_tokens, a.mask);
  sh.heads = p.batch * p.hkv;
  sh.chunks = sh.heads >= p.threads ? 1 : std::min(sh.nkt, (p.threads + sh.heads - 1) / sh.heads);
  sh.tasks = sh.heads * sh.chunks;
  sh.q_block = p.group * sh.nqt * kTile * sh.ld;
  sh.np = bf16::stored_pairs(sh.d, p.amx), sh.ldw = bf16::row_words(sh.d, p.amx);
  sh.w_block = p.group * sh.nqt * kTile * sh.ldw;
  return sh;
}

// P = 2^(min(S - lse, 0) log2(e)) over s, and scale dS = scale P (dP - delta) over dpm, rows
// [0, kTile) of a tile with `rows` real rows; padding and fully masked rows give 0.
// kUnscaled: s holds Q K^T (the fp32 parts' products, ScoreProducts::unscaled), and S is its
// product with the scale, rounded once as the forward's softmax_row<true> rounds it.
template <bool kUnscaled>
void softmax_gradient(const Problem& p, float* s, float* dpm, int64_t rows, const float* lse_rows,
                      const float* dlt) {
  const DF df;
  const int64_t nl = lanes();
  for (int64_t r = 0; r < kTile; ++r) {
    float* sr = s + r * kTile;
    float* dr = dpm + r * kTile;
    if (r >= rows || lse_rows[r] == kNegInf) {  // padding or fully masked row
      std::fill(sr, sr + kTile, 0.0f);
      std::fill(dr, dr + kTile, 0.0f);
      continue;
    }
    const VF vl = hn::Set(df, lse_rows[r]), vd = hn::Set(df, dlt[r]);
    const VF vscale = hn::Set(df, p.scale), vlog2e = hn::Set(df, kLog2e);
    for (int64_t c = 0; c < kTile; c += nl) {
      // Note [P at most one]: the exponent is clamped at 0.
      VF sv = hn::LoadU(df, sr + c);
      if constexpr (kUnscaled) sv = hn::Mul(sv, vscale);
      const VF e = hn::Min(hn::Sub(sv, vl), hn::Zero(df));
      const VF pv = exp2_neg(df, hn::Mul(e, vlog2e));
      const VF ds = hn::Mul(pv, hn::Sub(hn::LoadU(df, dr + c), vd));
      hn::StoreU(pv, df, sr + c);                   // s <- P
      hn::StoreU(hn::Mul(ds, vscale), df, dr + c);  // dpm <- scale * dS
    }
  }
}

// One thread's share of the tasks (Note [Backward tasks]), with the gradient products
// `Gradients` (Fp32Gradients or PairGradients).
template <class Gradients>
class BackwardWorker {
 public:
  BackwardWorker(const BackwardArgs& a, const BackwardShape& sh, float* dq_partial)
      : a_(a),
        p_(a.p),
        sh_(sh),
        dq_partial_(dq_partial),
        grads_(a.p, sh),
        scores_(a.p, sh, a.p.bf16_scores, bf16::Buffer::q_rows, a.p.scale, a.p.fp32_parts),
        dps_(a.p, sh, a.p.bf16_dp, bf16::Buffer::do_rows, 1.0f),
        keys_(kPassTiles, KeyTile(sh.ld)),
        lse_rows_(p_.group * sh.nqt * kTile),
        dlt_(lse_rows_.size()),
        row_(sh.d),
        s_(kTile * kTile),
        dpm_(s_.size()),
        pt_(s_.size()),
        dst_(s_.size()) {}

  void run(int64_t task) {
    const int64_t chunk = task % sh_.chunks, bh = task / sh_.chunks;
    b_ = bh / p_.hkv, hk_ = bh % p_.hkv;
    dq_acc_ = dq_partial_ + task * sh_.q_block;
    std::fill(dq_acc_, dq_acc_ + sh_.q_block, 0.0f);
    pack_queries();
    // Chunks take every chunks-th key tile: under a causal mask early key tiles see more
    // query tiles, so contiguous ranges would give the first chunk most of the work.
    // Note [Key tiles a pass]: the task walks its key tiles a few at a time (pass_tiles: 4,
    // or 2 for the exact bf16 tier's pair products), and each query tile's packed Q and dO rows
    // serve them all before the next query tile is read, and its dQ rows are read and written
    // once for them all (the one-part tile products of dQ loaded and stored their C for every
    // 2 key tiles: 4 a pass made the fast tier's backward +6 %; the exact tier's 3 parts of
    // P^T, dS^T, dS for 4 key tiles crowd the L2: -5 %). Every element's additions keep their
    // order (dK / dV per key tile over query tiles as before; a dQ row gets key tile c, then
    // c + chunks, ...), so the bits are those of one tile a pass.
    const int pass = Gradients::pass_tiles(p_);
    for (int64_t kt0 = chunk; kt0 < sh_.nkt; kt0 += pass * sh_.chunks) {
      int nkeys = 1;
      while (nkeys < pass && kt0 + nkeys * sh_.chunks < sh_.nkt) ++nkeys;
      for (int u = 0; u < nkeys; ++u) keys_[u].start(kt0 + u * sh_.chunks, p_.tk);
      for (int64_t g = 0; g < p_.group; ++g)
        for (int64_t qi = 0; qi < sh_.nqt; ++qi) {
          for (int u = 0; u < nkeys; ++u) tile_pair(g, qi, u);
          grads_.end_query_tile((g * sh_.nqt + qi) * kTile, dq_acc_);
        }
      for (int u = 0; u < nkeys; ++u) add_key_tile(keys_[u], u);
    }
  }

 private:
  // The group's Q and dO tiles packed for the products, and their row statistics, once a task.
  void pack_queries() {
    for (int64_t g = 0; g < p_.group; ++g)
      for (int64_t qi = 0; qi < sh_.nqt; ++qi) {
        const int64_t h = hk_ * p_.group + g, i0 = qi * kTile;
        const int64_t rows = std::min(p_.tq, i0 + kTile) - i0, off = (g * sh_.nqt + qi) * kTile;
        grads_.pack_rows(a_.q, a_.dout, b_, h, i0, rows, off);
        scores_.pack_rows(a_.q, b_, h, i0, rows, off);
        dps_.pack_rows(a_.dout, b_, h, i0, rows, off);
        for (int64_t r = 0; r < kTile; ++r) {
          lse_rows_[off + r] =
              r < rows ? a_.lse.ptr<const float>()[a_.lse.offset(b_, h, i0 + r)] : kNegInf;
          dlt_[off + r] =
              r < rows ? a_.delta.ptr<const float>()[a_.delta.offset(b_, h, i0 + r)] : 0.0f;
        }
      }
  }

  // Query tile qi of group member g against key tile u.
  void tile_pair(int64_t g, int64_t qi, int u) {
    KeyTile& t = keys_[u];
    const TileKind kind = classify(a_.mask, sh_.qr, qi, sh_.kr, t.kt);
    if (kind == TileKind::skip) return;
    if (!t.packed) {  // pack this key tile only when some query tile sees it
      scores_.pack_key(a_.k, b_, hk_, t, u, row_.data());
      dps_.pack_key(a_.v, b_, hk_, t, u, row_.data());
      grads_.pack_key(a_.k, b_, hk_, t, u);
      t.packed = true;
    }
    const int64_t i0 = qi * kTile, rows = std::min(p_.tq, i0 + kTile) - i0;
    const int64_t mrows = round_up(rows, 4), off = (g * sh_.nqt + qi) * kTile;
    scores_.product(u, mrows, off, grads_.qs(off), s_.data());  // S = scale (Q K^T)
    dps_.product(u, mrows, off, grads_.dot(off), dpm_.data());  // dP = dO V^T
    if (kind == TileKind::partial || t.cols < kTile)
      mask_tile(s_.data(), rows, t.cols, kind == TileKind::partial, a_.mask, a_.q_tokens, i0,
                a_.k_tokens, t.j0);
    if (scores_.unscaled())
      softmax_gradient<true>(p_, s_.data(), dpm_.data(), rows, lse_rows_.data() + off,
                             dlt_.data() + off);
    else
      softmax_gradient<false>(p_, s_.data(), dpm_.data(), rows, lse_rows_.data() + off,
                              dlt_.data() + off);
    grads_.accumulate(t, u, s_.data(), dpm_.data(), pt_.data(), dst_.data(), off, mrows, dq_acc_);
    tile_progress();  // the MPI transport's progress calls, if installed
  }

  // The key tile's dK and dV added to the caller's, once.
  void add_key_tile(KeyTile& t, int u) {
    if (!t.packed) return;
    grads_.end_key_tile(t, u);
    t.flush();
    const float dk_mul = grads_.dk_mul();
    const int64_t ld = sh_.ld;
    for (int64_t j = 0; j < t.cols; ++j) {
      float* dkr = a_.dk.ptr<float>() + a_.dk.offset(b_, t.j0 + j, hk_);
      float* dvr = a_.dv.ptr<float>() + a_.dv.offset(b_, t.j0 + j, hk_);
      for (int64_t c = 0; c < sh_.d; ++c) {  // sum - comp: the running sum's lost part back
        dkr[c] += dk_mul * (t.dk_sum[j * ld + c] - t.dk_comp[j * ld + c]);
        dvr[c] += t.dv_sum[j * ld + c] - t.dv_comp[j * ld + c];
      }
    }
  }

  const BackwardArgs& a_;
  const Problem& p_;
  const BackwardShape& sh_;
  float* dq_partial_;
  Gradients grads_;
  ScoreProducts scores_, dps_;
  std::vector<KeyTile> keys_;
  LineVector<float> lse_rows_, dlt_, row_;
  // kTile x kTile: S / P, dP / scale dS, and their transposes for PairGradients' pairs
  LineVector<float> s_, dpm_, pt_, dst_;
  int64_t b_ = 0, hk_ = 0;
  float* dq_acc_ = nullptr;
};

// This thread's tasks. A task's result does not depend on the thread that runs it (Note
// [Backward tasks]), so dynamic scheduling is safe for determinism.
template <class Gradients>
void run_tasks(const BackwardArgs& a, const BackwardShape& sh, float* dq_partial) {
  BackwardWorker<Gradients> worker(a, sh, dq_partial);
#pragma omp for schedule(dynamic, 1)
  for (int64_t task = 0; task < sh.tasks; ++task) worker.run(task);
}

// dQ: the partials of each (batch, kv head) summed in chunk order into the caller's dq.
void reduce_dq(const BackwardArgs& a, const BackwardShape& sh, const float* dq_partial) {
  const Problem& p = a.p;
#pragma omp for schedule(static)
  for (int64_t bh = 0; bh < sh.heads; ++bh) {
    const int64_t b = bh / p.hkv, hk = bh % p.hkv;
    for (int64_t g = 0; g < p.group; ++g)
      for (int64_t i = 0; i < p.tq; ++i) {
        float* dqr = a.dq.ptr<float>() + a.dq.offset(b, i, hk * p.group + g);
        const int64_t off = ((g * sh.nqt) * kTile + i) * sh.ld;
        for (int64_t chunk = 0; chunk < sh.chunks; ++chunk) {
          const float* part = dq_partial + (bh * sh.chunks + chunk) * sh.q_block + off;
          for (int64_t c = 0; c < sh.d; ++c) dqr[c] += part[c];
        }
      }
  }
}

}  // namespace

KernelStats BackwardSimd(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                         const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                         const Mask& mask, const TensorView& dout, const TensorView& lse,
                         const TensorView& delta, const TensorView& dq, const TensorView& dk,
                         const TensorView& dv) {
  const BackwardArgs a{p, q, k, v, dout, lse, delta, dq, dk, dv, q_tokens, k_tokens, mask};
  const BackwardShape sh = backward_shape(a);
  float* dq_partial = scratch(Scratch::dq_partial, sh.tasks * sh.q_block);
  const bool pairs = PairGradients::serve(p, sh);
#pragma omp parallel num_threads(p.threads)
  {
    if (pairs)
      run_tasks<PairGradients>(a, sh, dq_partial);
    else
      run_tasks<Fp32Gradients>(a, sh, dq_partial);
    reduce_dq(a, sh, dq_partial);
  }
  return count_tiles(p, mask, sh.qr, sh.kr, 2.5);
}

}  // namespace ctxpar::kernel::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ctxpar::kernel {

HWY_EXPORT(BackwardSimd);

KernelStats backward_simd(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                          const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                          const Mask& mask, const TensorView& dout, const TensorView& lse,
                          const TensorView& delta, const TensorView& dq, const TensorView& dk,
                          const TensorView& dv) {
  return HWY_DYNAMIC_DISPATCH(BackwardSimd)(p, q, q_tokens, k, v, k_tokens, mask, dout, lse, delta,
                                            dq, dk, dv);
}

}  // namespace ctxpar::kernel
#endif  // HWY_ONCE

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

// The sizes a call works with (Note [Backward tasks]).
struct BackwardShape {
  TileRanges qr, kr;
  int64_t d = 0, dp = 0, nkt = 0, nqt = 0;
  int64_t ld = 0;  // row stride of the [rows][dp] tiles (Note [Padded rows])
  int64_t heads = 0, chunks = 0, tasks = 0;
  int64_t q_block = 0;  // one task's packed Q (or dO, or dQ)
  int64_t k_panel = 0;  // S and dP stream K^T, V^T in L1 panels
  // Exact bf16 score products (simd_bf16.h): pairs stored a row, words a packed row, one
  // task's packed Q (or dO) rows.
  int64_t np = 0, ldw = 0, w_block = 0;
};

BackwardShape backward_shape(const BackwardArgs& a) {
  const Problem& p = a.p;
  BackwardShape sh;
  sh.qr = tile_ranges(a.q_tokens, p.tq, kTile, a.mask.documents);
  sh.kr = tile_ranges(a.k_tokens, p.tk, kTile, a.mask.documents);
  sh.d = p.d, sh.dp = round_up(p.d, lanes()), sh.nkt = sh.kr.count(), sh.nqt = sh.qr.count();
  sh.ld = padded_ld(sh.dp);
  sh.heads = p.batch * p.hkv;
  sh.chunks = sh.heads >= p.threads ? 1 : std::min(sh.nkt, (p.threads + sh.heads - 1) / sh.heads);
  sh.tasks = sh.heads * sh.chunks;
  sh.q_block = p.group * sh.nqt * kTile * sh.ld;
  sh.k_panel = kernel_k_panel(kTile, sh.d, p.l1d_bytes);
  sh.np = bf16::stored_pairs(sh.d, p.amx), sh.ldw = bf16::row_words(sh.d, p.amx);
  sh.w_block = p.group * sh.nqt * kTile * sh.ldw;
  return sh;
}

// A key tile of the task's pass (Note [Two key tiles a pass]) and its dK / dV: dk / dv the
// block partials (Note [Blocked dK / dV]); *_sum, *_comp the compensated sum of the blocks;
// in_block the query tiles in the current block.
struct KeyTile {
  std::vector<float> dk, dv, dk_sum, dv_sum, dk_comp, dv_comp;
  int64_t kt = 0, j0 = 0, cols = 0, in_block = 0;
  bool packed = false;
  explicit KeyTile(int64_t ld) {
    for (std::vector<float>* x : {&dk, &dv, &dk_sum, &dv_sum, &dk_comp, &dv_comp})
      x->resize(kTile * ld);
  }
  void start(int64_t tile, int64_t tk) {
    kt = tile, j0 = kt * kTile, cols = std::min(tk, j0 + kTile) - j0;
    packed = false, in_block = 0;
    std::fill(dk_sum.begin(), dk_sum.end(), 0.0f);
    std::fill(dv_sum.begin(), dv_sum.end(), 0.0f);
    std::fill(dk_comp.begin(), dk_comp.end(), 0.0f);
    std::fill(dv_comp.begin(), dv_comp.end(), 0.0f);
  }
  void flush() {  // the block partial into the compensated sum
    if (in_block == 0) return;
    add_compensated(static_cast<int64_t>(dk.size()), dk.data(), dk_sum.data(), dk_comp.data());
    add_compensated(static_cast<int64_t>(dv.size()), dv.data(), dv_sum.data(), dv_comp.data());
    in_block = 0;
  }
};

// One side of the score products, S = scale (Q K^T) or dP = dO V^T: exact bf16 products
// (vdpbf16ps or AMX tiles, simd_bf16.h) of the rows as bf16 pairs where both operands are
// bf16, else fp32 FMAs of the gradient products' packed fp32 rows with K^T (V^T) packed here.
class ScoreProducts {
 public:
  ScoreProducts(const Problem& p, const BackwardShape& sh, bool pairs, bf16::Buffer rows,
                float scale)
      : p_(p), sh_(sh), pairs_(pairs), scale_(scale),
        rows_(pairs ? bf16::buffer(rows, sh.w_block) : nullptr) {
    for (int u = 0; u < 2; ++u) {
      key_pack_[u].resize(sh.d * kTile);
      key_pairs_[u].resize(pairs ? sh.np * kTile : 0);
    }
  }
  void pack_rows(const TensorView& x, int64_t b, int64_t h, int64_t i0, int64_t rows,
                 int64_t off) {
    if (pairs_) bf16::pack_rows(x, b, h, i0, rows, sh_.d, sh_.ldw, rows_ + off * sh_.ldw, kTile);
  }
  void pack_key(const TensorView& x, int64_t b, int64_t hk, const KeyTile& t, int u,
                float* row) {
    if (pairs_)
      bf16::pack_tile(x, b, hk, t.j0, t.cols, sh_.d, key_pairs_[u].data(), p_.amx);
    else
      pack_transposed(x, b, hk, t.j0, t.cols, sh_.d, key_pack_[u].data(), row);
  }
  // The products of query rows [off, off + mrows) with key tile u into out [kTile][kTile];
  // `fp32_rows`: the same rows packed in fp32, for the fp32 products.
  void product(int u, int64_t mrows, int64_t off, const float* fp32_rows, float* out) const {
    if (pairs_)
      bf16::scores(mrows, sh_.np, rows_ + off * sh_.ldw, sh_.ldw, key_pairs_[u].data(), out,
                   scale_, p_.amx);
    else
      gemm_rows(mrows, kTile, sh_.d, fp32_rows, sh_.ld, key_pack_[u].data(), kTile, out, kTile,
                false, sh_.k_panel);
  }

 private:
  const Problem& p_;
  const BackwardShape& sh_;
  bool pairs_;
  float scale_;
  uint32_t* rows_;
  std::vector<float> key_pack_[2];
  std::vector<uint32_t> key_pairs_[2];
};

// The gradient products in fp32 FMAs: dV += P^T dO, dK += (scale dS)^T Qs (times 1 / scale at
// the end), dQ += scale dS K, over packed rows; the fast tier rounds P and scale dS to bf16
// first. Its packed Qs and dO also serve the fp32 score products.
class Fp32Gradients {
 public:
  Fp32Gradients(const Problem& p, const BackwardShape& sh)
      : p_(p), sh_(sh), qpack_(scratch(Scratch::q_pack, sh.q_block)),
        dopack_(scratch(Scratch::do_pack, sh.q_block)) {
    for (std::vector<float>& r : k_rows_) r.resize(kTile * sh.ld);
  }
  float dk_mul() const { return 1.0f / p_.scale; }
  const float* qs(int64_t off) const { return qpack_ + off * sh_.ld; }
  const float* dot(int64_t off) const { return dopack_ + off * sh_.ld; }
  void pack_rows(const TensorView& q, const TensorView& dout, int64_t b, int64_t h, int64_t i0,
                 int64_t rows, int64_t off) {
    kernel::HWY_NAMESPACE::pack_rows(q, b, h, i0, rows, sh_.d, sh_.ld, qpack_ + off * sh_.ld,
                                     p_.scale);
    kernel::HWY_NAMESPACE::pack_rows(dout, b, h, i0, rows, sh_.d, sh_.ld, dopack_ + off * sh_.ld);
  }
  void pack_key(const TensorView& k, int64_t b, int64_t hk, const KeyTile& t, int u) {
    kernel::HWY_NAMESPACE::pack_rows(k, b, hk, t.j0, t.cols, sh_.d, sh_.ld, k_rows_[u].data());
  }
  // s holds P, dpm scale dS (kTile x kTile); pt, dst take their transposes.
  void accumulate(KeyTile& t, int u, float* s, float* dpm, float* pt, float* dst, int64_t off,
                  int64_t mrows, float* dq_acc) {
    if (p_.round_p) {  // the fast bf16 tier: P for dV, scale dS for dQ and dK
      round_bf16(s, kTile * kTile);
      round_bf16(dpm, kTile * kTile);
    }
    transpose_tile(s, pt);
    transpose_tile(dpm, dst);
    const bool fresh = t.in_block == 0;  // a block's first tile overwrites its partials
    const int64_t ld = sh_.ld, dp = sh_.dp;
    gemm_rows(kTile, dp, mrows, pt, kTile, dot(off), ld, t.dv.data(), ld, !fresh);
    gemm_rows(kTile, dp, mrows, dst, kTile, qs(off), ld, t.dk.data(), ld, !fresh);
    if (++t.in_block == kDkvBlock) t.flush();
    gemm_rows(mrows, dp, t.cols, dpm, kTile, k_rows_[u].data(), ld, dq_acc + off * ld, ld, true);
  }

 private:
  const Problem& p_;
  const BackwardShape& sh_;
  float* qpack_;
  float* dopack_;
  std::vector<float> k_rows_[2];
};

// The gradient products as bf16 pair products (Note [P V, dV, dK, dQ through AMX] in
// amx_bf16.cc; Note [The fast tier through vdpbf16ps] in simd_bf16.cc): P and dS split into 3
// bf16 parts (the exact tier, AMX) or rounded to one (the fast tier, AMX or vdpbf16ps), Q, dO
// and K as VNNI pair-rows (unscaled Q: dK needs no 1 / scale). They write columns up to d
// rounded to 16, which the accumulators' rows hold.
class PairGradients {
 public:
  PairGradients(const Problem& p, const BackwardShape& sh)
      : p_(p), sh_(sh), n16_(round_up(sh.d, 16)), ldv_(bf16::vnni_words(sh.d)),
        nsplit_(bf16::amx_parts(p.round_p)), split_words_(kTile * kHalf) {
    const int64_t v_block = p.group * sh.nqt * kHalf * ldv_;  // one task's Q (or dO) pair-rows
    qvnni_ = bf16::buffer(bf16::Buffer::q_vnni, v_block);
    dovnni_ = bf16::buffer(bf16::Buffer::do_vnni, v_block);
    for (std::vector<uint32_t>* x : {&ptp_, &dstp_, &dsp_}) x->resize(nsplit_ * split_words_);
    for (std::vector<uint32_t>& r : k_vnni_) r.resize(kHalf * ldv_);
  }
  // Whether these products serve a call: both score sides bf16, a pair path for its
  // products and tier, and the rows wide enough for their columns.
  static bool serve(const Problem& p, const BackwardShape& sh) {
    return bf16::pair_products(p.bf16_scores && p.bf16_dp, p.amx, p.round_p) &&
           round_up(sh.d, 16) <= sh.ld;
  }
  float dk_mul() const { return 1.0f; }
  const float* qs(int64_t) const { return nullptr; }  // the score products are pairs too
  const float* dot(int64_t) const { return nullptr; }
  void pack_rows(const TensorView& q, const TensorView& dout, int64_t b, int64_t h, int64_t i0,
                 int64_t rows, int64_t off) {
    bf16::pack_vnni(q, b, h, i0, rows, sh_.d, ldv_, qvnni_ + off / 2 * ldv_, kTile);
    bf16::pack_vnni(dout, b, h, i0, rows, sh_.d, ldv_, dovnni_ + off / 2 * ldv_, kTile);
  }
  void pack_key(const TensorView& k, int64_t b, int64_t hk, const KeyTile& t, int u) {
    bf16::pack_vnni(k, b, hk, t.j0, t.cols, sh_.d, ldv_, k_vnni_[u].data(), kTile);
  }
  // As Fp32Gradients::accumulate, over all 64 rows: those past the tile's are zero in P, dS.
  void accumulate(KeyTile& t, int u, float* s, float* dpm, float* pt, float* dst, int64_t off,
                  int64_t, float* dq_acc) {
    transpose_tile(s, pt);
    transpose_tile(dpm, dst);
    const bool fresh = t.in_block == 0;
    const int64_t ld = sh_.ld, voff = off / 2 * ldv_;
    pairs(pt, ptp_);
    pairs(dst, dstp_);
    pairs(dpm, dsp_);
    product(ptp_, dovnni_ + voff, t.dv.data(), !fresh);
    product(dstp_, qvnni_ + voff, t.dk.data(), !fresh);
    if (++t.in_block == kDkvBlock) t.flush();
    product(dsp_, k_vnni_[u].data(), dq_acc + off * ld, true);
  }

 private:
  static constexpr int64_t kHalf = kTile / 2;
  void pairs(const float* from, std::vector<uint32_t>& to) const {
    bf16::round_to_pairs(from, kTile, kTile, kHalf, to.data(), kHalf, nsplit_, split_words_);
  }
  void product(const std::vector<uint32_t>& a, const uint32_t* b, float* c, bool add) const {
    bf16::gemm_pairs(kTile, n16_, kHalf, a.data(), kHalf, b, ldv_, c, sh_.ld, add, p_.amx,
                     nsplit_, split_words_);
  }
  const Problem& p_;
  const BackwardShape& sh_;
  int64_t n16_, ldv_;
  int nsplit_;
  int64_t split_words_;  // one part of a 64 x 64 P or dS tile, as pairs
  uint32_t* qvnni_;
  uint32_t* dovnni_;
  std::vector<uint32_t> ptp_, dstp_, dsp_, k_vnni_[2];
};

// P = 2^(min(S - lse, 0) log2(e)) over s, and scale dS = scale P (dP - delta) over dpm, rows
// [0, kTile) of a tile with `rows` real rows; padding and fully masked rows give 0.
void softmax_gradient(const Problem& p, float* s, float* dpm, int64_t rows,
                      const float* lse_rows, const float* dlt) {
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
      const VF e = hn::Min(hn::Sub(hn::LoadU(df, sr + c), vl), hn::Zero(df));
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
      : a_(a), p_(a.p), sh_(sh), dq_partial_(dq_partial), grads_(a.p, sh),
        scores_(a.p, sh, a.p.bf16_scores, bf16::Buffer::q_rows, a.p.scale),
        dps_(a.p, sh, a.p.bf16_dp, bf16::Buffer::do_rows, 1.0f),
        keys_{KeyTile(sh.ld), KeyTile(sh.ld)},
        lse_rows_(p_.group * sh.nqt * kTile), dlt_(lse_rows_.size()), row_(sh.d),
        s_(kTile * kTile), dpm_(s_.size()), pt_(s_.size()), dst_(s_.size()) {}

  void run(int64_t task) {
    const int64_t chunk = task % sh_.chunks, bh = task / sh_.chunks;
    b_ = bh / p_.hkv, hk_ = bh % p_.hkv;
    dq_acc_ = dq_partial_ + task * sh_.q_block;
    std::fill(dq_acc_, dq_acc_ + sh_.q_block, 0.0f);
    pack_queries();
    // Chunks take every chunks-th key tile: under a causal mask early key tiles see more
    // query tiles, so contiguous ranges would give the first chunk most of the work.
    // Note [Two key tiles a pass]: the task walks its key tiles two at a time, and each query
    // tile's packed Q and dO rows serve both before the next query tile is read: half the
    // passes over the group's Q and dO. Every element's additions keep their order (dK / dV
    // per key tile over query tiles as before; a dQ row gets key tile c, then c + chunks,
    // ...), so the bits are those of one tile a pass.
    for (int64_t kt0 = chunk; kt0 < sh_.nkt; kt0 += 2 * sh_.chunks) {
      const int nkeys = kt0 + sh_.chunks < sh_.nkt ? 2 : 1;
      for (int u = 0; u < nkeys; ++u) keys_[u].start(kt0 + u * sh_.chunks, p_.tk);
      for (int64_t g = 0; g < p_.group; ++g)
        for (int64_t qi = 0; qi < sh_.nqt; ++qi)
          for (int u = 0; u < nkeys; ++u) tile_pair(g, qi, u);
      for (int u = 0; u < nkeys; ++u) add_key_tile(keys_[u]);
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
    softmax_gradient(p_, s_.data(), dpm_.data(), rows, lse_rows_.data() + off, dlt_.data() + off);
    grads_.accumulate(t, u, s_.data(), dpm_.data(), pt_.data(), dst_.data(), off, mrows, dq_acc_);
    tile_progress();  // the MPI transport's progress calls, if installed
  }

  // The key tile's dK and dV added to the caller's, once.
  void add_key_tile(KeyTile& t) {
    if (!t.packed) return;
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
  KeyTile keys_[2];
  std::vector<float> lse_rows_, dlt_, row_;
  std::vector<float> s_, dpm_, pt_, dst_;  // kTile x kTile: S / P, dP / scale dS, transposes
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
  return HWY_DYNAMIC_DISPATCH(BackwardSimd)(p, q, q_tokens, k, v, k_tokens, mask, dout, lse,
                                            delta, dq, dk, dv);
}

}  // namespace ctxpar::kernel
#endif  // HWY_ONCE

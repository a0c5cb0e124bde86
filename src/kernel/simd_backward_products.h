// The backward's products by path (simd_backward.cc): the score products of a side, S =
// scale (Q K^T) or dP = dO V^T (exact bf16 pairs or fp32 FMAs), and the gradient products,
// dV, dK and dQ (Fp32Gradients: fp32 FMAs, the fast tier rounding P and dS to bf16 first;
// PairGradients: bf16 pair products through AMX tiles or vdpbf16ps, in the exact tier's 3 parts
// or the fast tier's one). Compiled once per SIMD target, as simd_tile.h.
// Per-target include guard (Highway's idiom): re-opened for each target of foreach_target.h.
#if defined(CTXPAR_KERNEL_SIMD_BACKWARD_PRODUCTS_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef CTXPAR_KERNEL_SIMD_BACKWARD_PRODUCTS_H_
#undef CTXPAR_KERNEL_SIMD_BACKWARD_PRODUCTS_H_
#else
#define CTXPAR_KERNEL_SIMD_BACKWARD_PRODUCTS_H_
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernel/problem.h"
#include "kernel/simd_bf16.h"
#include "kernel/simd_tile.h"

HWY_BEFORE_NAMESPACE();
namespace ctxpar::kernel::HWY_NAMESPACE {

// The sizes a call works with (Note [Backward tasks]): its tiles (ld the row stride of the
// [rows][dp] tiles, Note [Padded rows]; S and dP stream K^T, V^T in L1 panels of k_panel rows)
// and its tasks.
struct BackwardShape : CallTiles {
  int64_t heads = 0, chunks = 0, tasks = 0;
  int64_t q_block = 0;  // one task's packed Q (or dO, or dQ)
  // Exact bf16 score products (simd_bf16.h): pairs stored a row, words a packed row, one
  // task's packed Q (or dO) rows.
  int64_t np = 0, ldw = 0, w_block = 0;
};

// The most key tiles a pass of the backward takes (Note [Key tiles a pass] in simd_backward.cc).
inline constexpr int kPassTiles = 4;

// A key tile of the task's pass (Note [Key tiles a pass]) and its dK / dV: dk / dv the
// block partials (Note [Blocked dK / dV]); *_sum, *_comp the compensated sum of the blocks;
// in_block the query tiles in the current block.

struct KeyTile {
  LineVector<float> dk, dv, dk_sum, dv_sum, dk_comp, dv_comp;
  int64_t kt = 0, j0 = 0, cols = 0, in_block = 0;
  bool packed = false;
  explicit KeyTile(int64_t ld) {
    for (LineVector<float>* x : {&dk, &dv, &dk_sum, &dv_sum, &dk_comp, &dv_comp})
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
// `parts` (S where the forward took fp32 parts, Problem::fp32_parts): the rows and key tiles as
// three bf16 parts and the forward's six part products through AMX (Note [fp32 through three
// bf16 parts] in amx_bf16.cc). Q K^T comes out unscaled (unscaled()): softmax_gradient<true>
// multiplies by the scale as the forward's softmax does, so S has the bits the forward rounded
// it to (Note [P at most one]: the backward's P = exp(S - LSE) must see the forward's S). dP and
// the gradient products stay fp32 FMAs: the tiles did not make them faster here, and dP through
// the parts no longer cancels against delta (rowsum dO o O, FMAs) where P is one-hot, which put
// dQ and dK 10x over the fp32 rule at extreme logits (docs/kernel.md).
class ScoreProducts {
 public:
  ScoreProducts(const Problem& p, const BackwardShape& sh, bool pairs, bf16::Buffer rows,
                float scale, bool parts = false)
      : p_(p),
        sh_(sh),
        pairs_(pairs || parts),
        parts_(parts ? 3 : 1),
        scale_(scale),
        rows_(pairs_ ? bf16::buffer(rows, sh.w_block * parts_) : nullptr) {
    for (int u = 0; u < kPassTiles; ++u) {
      key_pack_[u].resize(sh.d * kTile);
      key_pairs_[u].resize(pairs_ ? sh.np * kTile * parts_ : 0);
    }
    if (parts) tmp_.resize(kTile * 2 * sh.np), words_.resize(3 * kTile * sh.np);
  }
  void pack_rows(const TensorView& x, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t off) {
    if (parts_ == 3) {  // widened (zero past d and rows), then its 3 parts as pairs
      kernel::HWY_NAMESPACE::pack_rows(x, b, h, i0, rows, sh_.d, 2 * sh_.np, tmp_.data());
      bf16::round_to_pairs(tmp_.data(), 2 * sh_.np, kTile, sh_.np, rows_ + off * sh_.ldw, sh_.ldw,
                           3, sh_.w_block);
    } else if (pairs_)
      bf16::pack_rows(x, b, h, i0, rows, sh_.d, sh_.ldw, rows_ + off * sh_.ldw, kTile);
  }
  void pack_key(const TensorView& x, int64_t b, int64_t hk, const KeyTile& t, int u, float* row) {
    if (parts_ == 3) {
      kernel::HWY_NAMESPACE::pack_rows(x, b, hk, t.j0, t.cols, sh_.d, 2 * sh_.np, tmp_.data());
      bf16::split_key_tile(tmp_.data(), sh_.np, words_.data(), key_pairs_[u].data());
    } else if (pairs_)
      bf16::pack_tile(x, b, hk, t.j0, t.cols, sh_.d, key_pairs_[u].data(), p_.amx);
    else
      pack_transposed(x, b, hk, t.j0, t.cols, sh_.d, key_pack_[u].data(), row);
  }
  // Whether product() leaves the scale to the caller (the parts' S: softmax_gradient<true>).
  bool unscaled() const { return parts_ == 3 && scale_ != 1.0f; }
  // The products of query rows [off, off + mrows) with key tile u into out [kTile][kTile];
  // `fp32_rows`: the same rows packed in fp32, for the fp32 products.
  void product(int u, int64_t mrows, int64_t off, const float* fp32_rows, float* out) const {
    if (parts_ == 3) {  // as the forward's key step (rows to 16: padding rows of zero pairs)
      const uint32_t* kp = key_pairs_[u].data();
      bf16::gemm_amx_chunks(round_up(mrows, 16), kTile, 1, sh_.np, rows_ + off * sh_.ldw, sh_.ldw,
                            0, &kp, kTile, out, kTile, false, 3, sh_.w_block, 3, sh_.np * kTile);
    } else if (pairs_)
      bf16::scores(mrows, sh_.np, rows_ + off * sh_.ldw, sh_.ldw, key_pairs_[u].data(), out, scale_,
                   p_.amx);
    else
      gemm_rows(mrows, kTile, sh_.d, fp32_rows, sh_.ld, key_pack_[u].data(), kTile, out, kTile,
                false, sh_.k_panel);
  }

 private:
  const Problem& p_;
  const BackwardShape& sh_;
  bool pairs_;
  int parts_;
  float scale_;
  uint32_t* rows_;
  LineVector<float> key_pack_[kPassTiles];
  LineVector<uint32_t> key_pairs_[kPassTiles];
  LineVector<float> tmp_;       // parts: rows widened before the split
  LineVector<uint32_t> words_;  // parts: a key tile's pairs before the transpose
};

// The gradient products in fp32 FMAs: dV += P^T dO, dK += (scale dS)^T Qs (times 1 / scale at
// the end), dQ += scale dS K, over packed rows; the fast tier rounds P and scale dS to bf16
// first. Its packed Qs and dO also serve the fp32 score products.
class Fp32Gradients {
 public:
  Fp32Gradients(const Problem& p, const BackwardShape& sh)
      : p_(p),
        sh_(sh),
        qpack_(scratch(Scratch::q_pack, sh.q_block)),
        dopack_(scratch(Scratch::do_pack, sh.q_block)) {
    for (LineVector<float>& r : k_rows_) r.resize(kTile * sh.ld);
  }
  static int pass_tiles(const Problem&) { return kPassTiles; }
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
  // s holds P, dpm scale dS (kTile x kTile); dV and dK read them transposed where they are
  // (gemm_rows_at: the transposed copies cost 3-4 % of the backward, and their 32 KiB of L1).
  // A block's last tile adds its products to the partial and the partial to the compensated sum
  // in one pass (gemm_rows_at_compensated: the partial never stored and read back, +2 %); a
  // key tile's last block, if not full, is flushed by add_key_tile as before. Same bits.
  void accumulate(KeyTile& t, int u, float* s, float* dpm, float*, float*, int64_t off,
                  int64_t mrows, float* dq_acc) {
    if (p_.round_p) {  // the fast bf16 tier: P for dV, scale dS for dQ and dK
      round_bf16(s, kTile * kTile);
      round_bf16(dpm, kTile * kTile);
    }
    const bool fresh = t.in_block == 0;  // a block's first tile overwrites its partials
    const int64_t ld = sh_.ld, dp = sh_.dp;
    if (t.in_block + 1 == kDkvBlock) {  // the block's last tile: its flush in the same pass
      gemm_rows_at_compensated(kTile, dp, mrows, s, kTile, dot(off), ld, t.dv.data(), ld,
                               t.dv_sum.data(), t.dv_comp.data());
      gemm_rows_at_compensated(kTile, dp, mrows, dpm, kTile, qs(off), ld, t.dk.data(), ld,
                               t.dk_sum.data(), t.dk_comp.data());
      t.in_block = 0;
    } else {
      gemm_rows_at(kTile, dp, mrows, s, kTile, dot(off), ld, t.dv.data(), ld, !fresh);
      gemm_rows_at(kTile, dp, mrows, dpm, kTile, qs(off), ld, t.dk.data(), ld, !fresh);
      ++t.in_block;
    }
    gemm_rows(mrows, dp, t.cols, dpm, kTile, k_rows_[u].data(), ld, dq_acc + off * ld, ld, true);
  }
  void end_query_tile(int64_t, float*) {}  // every product is done in accumulate
  void end_key_tile(KeyTile&, int) {}

 private:
  const Problem& p_;
  const BackwardShape& sh_;
  float* qpack_;
  float* dopack_;
  LineVector<float> k_rows_[kPassTiles];
};

// The gradient products as bf16 pair products (Note [P V, dV, dK, dQ through AMX] in
// amx_bf16.cc; Note [The fast tier through vdpbf16ps] in simd_bf16.cc): P and dS split into 3
// bf16 parts (the exact tier, AMX) or rounded to one (the fast tier, AMX or vdpbf16ps), Q, dO
// and K as VNNI pair-rows (unscaled Q: dK needs no 1 / scale). They write columns up to d
// rounded to 16, which the accumulators' rows hold.
//
// Note [Deeper tile products]: a tile product of 64 rows x 32 pairs loads its C tiles and stores
// them for only 2 steps of 16 pairs, and those loads and stores stall the tiles (dev/08: the fast
// tier's dV + dK + dQ 4.3 -> 2.6 us a tile pair when deeper). So the products wait: dV and dK for
// the query tiles of a block (Note [Blocked dK / dV]: up to kDkvBlock, their P^T and dS^T pairs
// side by side) run as one product from a zeroed C when the block is full or the key tile ends;
// dQ for the pass's key tiles (Note [Key tiles a pass]) runs when the query tile ends.
// A tile's C is fp32 between tdpbf16ps steps whether it stays in the tile or goes through memory,
// and each element still adds its pairs (and parts) in the order of the one-tile products, so
// the bits are those of one product a tile pair.
class PairGradients {
 public:
  PairGradients(const Problem& p, const BackwardShape& sh)
      : p_(p),
        sh_(sh),
        n16_(round_up(sh.d, 16)),
        ldv_(bf16::vnni_words(sh.d)),
        nsplit_(bf16::amx_parts(p.round_p)) {
    const int64_t v_block = p.group * sh.nqt * kHalf * ldv_;  // one task's Q (or dO) pair-rows
    qvnni_ = bf16::buffer(bf16::Buffer::q_vnni, v_block);
    dovnni_ = bf16::buffer(bf16::Buffer::do_vnni, v_block);
    for (int u = 0; u < kPassTiles; ++u) {
      for (LineVector<uint32_t>* x : {&ptp_[u], &dstp_[u]}) x->resize(kDkvBlock * chunk_words());
      k_vnni_[u].resize(kHalf * ldv_);
    }
    dsp_.resize(kPassTiles * chunk_words());
  }
  // Whether these products serve a call: both score sides bf16, a pair path for its
  // products and tier, and the rows wide enough for their columns.
  static bool serve(const Problem& p, const BackwardShape& sh) {
    return bf16::pair_products(p.bf16_scores && p.bf16_dp, p.amx, p.round_p) &&
           round_up(sh.d, 16) <= sh.ld;
  }
  // The exact tier's 3 parts of P^T, dS^T and dS a key tile fill the L2 at 4 tiles a pass.
  static int pass_tiles(const Problem& p) {
    return bf16::amx_parts(p.round_p) > 1 ? 2 : kPassTiles;
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
  // P^T, dS^T and dS as pairs beside the block's and the pass's others (Note [Deeper tile
  // products]), over all 64 rows: those past the tile's are zero in P, dS.
  void accumulate(KeyTile& t, int u, float* s, float* dpm, float* pt, float* dst, int64_t off,
                  int64_t, float*) {
    transpose_tile(s, pt);
    transpose_tile(dpm, dst);
    const int64_t i = t.in_block, voff = off / 2 * ldv_;
    pairs(pt, ptp_[u].data() + i * chunk_words());
    pairs(dst, dstp_[u].data() + i * chunk_words());
    do_chunks_[u][i] = dovnni_ + voff;
    q_chunks_[u][i] = qvnni_ + voff;
    if (++t.in_block == kDkvBlock) block_products(t, u);
    pairs(dpm, dsp_.data() + pending_dq_ * chunk_words());
    k_chunks_[pending_dq_++] = k_vnni_[u].data();
  }
  // The query tile's dQ over the pass's key tiles that saw it.
  void end_query_tile(int64_t off, float* dq_acc) {
    if (pending_dq_ == 0) return;
    product(dsp_.data(), k_chunks_, pending_dq_, dq_acc + off * sh_.ld, true);
    pending_dq_ = 0;
  }
  // The key tile's last block, if not full.
  void end_key_tile(KeyTile& t, int u) {
    if (t.in_block > 0) block_products(t, u);
  }

 private:
  static constexpr int64_t kHalf = kTile / 2;
  static constexpr int64_t kPart = kTile * kHalf;  // one part of a 64 x 64 tile as pairs
  // A tile's parts, one after the other; a product's A is its tiles' chunks one after the other
  // (the parts of a chunk side by side in L1 as the one-tile products had them: side by side
  // columns of 4 tiles, 3 parts each, made the exact tier 7-10 % slower).
  int64_t chunk_words() const { return nsplit_ * kPart; }
  // The block's dV and dK from zero, then the block into the key tile's compensated sum.
  void block_products(KeyTile& t, int u) {
    product(ptp_[u].data(), do_chunks_[u], t.in_block, t.dv.data(), false);
    product(dstp_[u].data(), q_chunks_[u], t.in_block, t.dk.data(), false);
    t.flush();
  }
  void pairs(const float* from, uint32_t* to) const {
    bf16::round_to_pairs(from, kTile, kTile, kHalf, to, kHalf, nsplit_, kPart);
  }
  // C (+)= A B over nchunks chunks of 32 pairs: A's chunk i at a + i chunk_words(), B's at b[i].
  // Through vdpbf16ps one chunk a call (its C stays in registers over a call anyway).
  void product(const uint32_t* a, const uint32_t* const* b, int64_t nchunks, float* c,
               bool add) const {
    if (p_.amx) {
      bf16::gemm_amx_chunks(kTile, n16_, nchunks, kHalf, a, kHalf, chunk_words(), b, ldv_, c,
                            sh_.ld, add, nsplit_, kPart);
      return;
    }
    for (int64_t i = 0; i < nchunks; ++i)
      bf16::gemm_dot(kTile, n16_, kHalf, a + i * chunk_words(), kHalf, b[i], ldv_, c, sh_.ld,
                     add || i > 0);
  }
  const Problem& p_;
  const BackwardShape& sh_;
  int64_t n16_, ldv_;
  int nsplit_;
  uint32_t* qvnni_;
  uint32_t* dovnni_;
  LineVector<uint32_t> ptp_[kPassTiles], dstp_[kPassTiles], dsp_, k_vnni_[kPassTiles];
  const uint32_t* do_chunks_[kPassTiles][kDkvBlock] = {};
  const uint32_t* q_chunks_[kPassTiles][kDkvBlock] = {};
  const uint32_t* k_chunks_[kPassTiles] = {};
  int64_t pending_dq_ = 0;
};

}  // namespace ctxpar::kernel::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard

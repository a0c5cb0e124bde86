// The fast forward: K/V of the block packed once per call (K transposed, V row-major, fp32,
// zero-padded to 64-key tiles) and shared by every query tile; per (batch, query head, two or
// four query tiles: Note [Two query tiles a task]) task the scores S = Q K^T and the update
// O += P V run through the register-blocked micro-kernel of simd_tile.h, with the online
// softmax in base 2 in between.
//
// Note [Scores in natural units, exponents in base 2]: Q is packed pre-multiplied by the
// softmax scale, so S and the running max m are in natural units, exactly as the state, the
// LSE and the backward hold them. Only the argument of each exponential, the small difference
// S - m, is converted: P = 2^((S - m) log2(e)). Keeping S itself in natural units matters for
// the backward: it recomputes P = exp(S - LSE) from the forward's fp32 LSE, and the row's max
// score must come out as the same fp32 number there (for a one-hot row LSE == max S, so P = 1
// exactly). Scores converted to log2 units and back differed from LSE by an ulp of |S| -- at
// |S| ~ 5e8 that is 2^(+-64). Rescaling is lazy: a row's acc and l are multiplied by
// alpha = exp(m_old - m_new) only when its max actually grew, and on the AMX path's key steps
// only when it outgrew the row's base (Note [A row's base] in simd_tile.h).
// Compiled once per SIMD target (hwy/foreach_target.h re-includes this file); forward_simd at
// the bottom dispatches to the chosen one.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernel/simd_forward.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <vector>

#include "ctxpar/error.h"
#include "kernel/problem.h"
#include "kernel/simd_bf16.h"
#include "kernel/simd_tile.h"

HWY_BEFORE_NAMESPACE();
namespace ctxpar::kernel::HWY_NAMESPACE {

namespace {

// One forward call's arguments: q [B, Tq, Hq, D]; k, v [B, Tk, Hkv, D]; state.acc
// [B, Tq, Hq, D], state.m / l [B, Hq, Tq]. Or, for the whole forward in one call (Note [The
// whole forward in one call]), no state but out [B, Tq, Hq, D] and lse [B, Hq, Tq].
struct ForwardArgs {
  const Problem& p;
  const TensorView &q, &k, &v;
  const Tokens &q_tokens, &k_tokens;
  const Mask& mask;
  const ForwardStateView* state;
  const TensorView *out = nullptr, *lse = nullptr;
};

// Note [Two query tiles a task]: a task takes kSub = 2 consecutive 64-row query tiles, so
// every K / V tile it brings into L1 serves 128 query rows instead of 64 (faster forward;
// the measurement: docs/kernel.md, "Forward tasks"). Which (query tile, key tile)
// pairs are computed is exactly as with one tile a task: per key tile each query tile is
// classified on its own, and the rows of a skipped one are left out of the products (with two
// tiles the computed ones are always adjacent). A row's result never depends on its
// neighbours, so the bits, the tile counts and tile_progress() calls are those of 64-row tasks.
// fp32 products and the exact bf16 tier through AMX take 4 tiles a task instead
// (ForwardShape::sub): 256 query rows read each key tile half as often per product; the exact
// tier's P V is 3 tile products over the same V tiles. Forward +4-5 % for both (fp32 also with 2
// threads; AVX2 within the noise), where the AMX fast tier lost 1-4 %, so it and the vdpbf16ps
// products (unmeasured: no such CPU here) keep 2 (docs/kernel.md, "Round six"). kMaxSub bounds
// both.
// Note [Gaps in a task]: with more than two tiles a slice mask (any block mask) can show a key
// tile to query tiles 0 and 2 of a task but not 1. The computed rows are those of [first, last];
// a skipped tile between gets -inf scores, so P = 0 and its rows' state keeps its bits (m does
// not grow, l and acc add exact zeros), as if left out. Slices.KernelMatchesReference has one.
constexpr int64_t kSub = 2, kMaxSub = 4;
constexpr int64_t kHalf = kTile / 2;

// Note [Key steps]: with AMX pair products (both bf16 tiers), one online-softmax step takes up
// to kStepTiles consecutive key tiles (a fixed grid: tiles [i kStepTiles, (i + 1) kStepTiles)).
// The step's scores go to side-by-side 64-key blocks of S (only the tiles some query tile of the
// task computes, in key order, each with its own skip / full / partial classification per query
// tile, masked exactly as with one tile a step); then one max and one rescale a row for the
// step, and O += P V as one tile product over the step's keys (bf16::gemm_amx_chunks, one chunk a
// key tile), so each 32 x 32 block of O stays in AMX tiles for 2 x (tiles) steps of 16 pairs
// instead of 2. A query tile that skips a key tile of the step gets -inf scores there (P = 0:
// exact zero products). The sums change order (a row's max is the step's, not the tile's), so
// the bits of both bf16 tiers differ from one tile a step, within their accuracy rules; the fp32
// path and vdpbf16ps's fast tier keep one tile a step, bit for bit. Both tiers take the same
// step: l sums the fp32 P in the step's order, and the tiers' LSE must stay the same bits (2
// tiles a step ran 3-7 % faster for the exact tier and 3-5 % slower for the fast one: lab 10).
// Measured: docs/kernel.md, "Round three: the forward" (dev/10_forward_steps.cc).
constexpr int64_t kStepTiles = 4;

// The sizes a call works with, and its product paths: its tiles (ld the row stride of V, Q
// and acc tiles, Note [Padded rows]; S = Q K^T streams K^T in L1 panels of k_panel rows) and
// its tasks.
struct ForwardShape : CallTiles {
  int64_t npairs = 0, tasks = 0;
  // With exact bf16 products (simd_bf16.h) K is packed as tiles of bf16 pairs: pairs stored
  // a row, words a packed row.
  int64_t np = 0, ldw = 0;
  // With AMX, O += P V in tiles too (Note [P V, dV, dK, dQ through AMX] in amx_bf16.cc): P
  // split into 3 bf16 parts (the exact tier) or rounded to one (the fast tier), V packed as
  // VNNI pair-rows instead; with vdpbf16ps, the fast tier's the same way (Note [The fast tier
  // through vdpbf16ps] in simd_bf16.cc). Both write columns up to d rounded to 16, which the
  // acc rows must hold (they do on the avx512 targets, the only ones with bf16 products).
  bool pairs_pv = false;
  int64_t n16 = 0, ldv = 0;
  int nsplit = 0;
  // fp32 operands through AMX as three bf16 parts (Note [fp32 through three bf16 parts] in
  // amx_bf16.cc): Q's pairs, K's tiles and V's pair-rows each 3 parts; else 1.
  int parts = 1;
  int64_t step_tiles = 1;  // key tiles an online-softmax step (Note [Key steps])
  // Query tiles and rows a task (Note [Two query tiles a task]).
  int64_t sub = kSub;
  int64_t rows() const { return sub * kTile; }
};

ForwardShape forward_shape(const ForwardArgs& a, int64_t step_tiles) {
  const Problem& p = a.p;
  ForwardShape sh;
  static_cast<CallTiles&>(sh) = call_tiles(p, a.q_tokens, a.k_tokens, a.mask);
  sh.np = bf16::stored_pairs(sh.d, p.amx), sh.ldw = bf16::row_words(sh.d, p.amx);
  sh.n16 = round_up(sh.d, 16), sh.ldv = bf16::vnni_words(sh.d);
  sh.pairs_pv = (p.fp32_parts || (bf16::pair_products(p.bf16_scores, p.amx, p.round_p) &&
                                  a.v.dtype() == DType::bf16)) &&
                sh.n16 <= sh.ld;
  sh.nsplit = bf16::amx_parts(p.round_p);
  if (p.fp32_parts) sh.parts = 3;
  if (sh.pairs_pv && p.amx) sh.step_tiles = step_tiles > 0 ? step_tiles : kStepTiles;
  if (!p.bf16_scores || (sh.pairs_pv && p.amx && sh.nsplit > 1))  // Note [Two query tiles a task]
    sh.sub = kMaxSub;
  sh.npairs = (sh.nqt + sh.sub - 1) / sh.sub;
  sh.tasks = p.batch * p.hq * sh.npairs;
  return sh;
}

// K and V of the block, packed once a call for the products of every query tile: K^T tiles
// [B, Hkv, nkt][D][64] (fp32 score products) or K as bf16-pair tiles (exact bf16 products);
// V tiles [B, Hkv, nkt][64][dp] (fp32 P V) or V's VNNI pair-rows (pair products).
struct PackedKv {
  float* kpack = nullptr;
  uint32_t* kpairs = nullptr;
  float* vpack = nullptr;
  uint32_t* vvnni = nullptr;
};

// Key tile [j0, j0 + cols) of (b, hk) in 3 parts (Note [fp32 through three bf16 parts]): K as
// tiles of pairs (bf16::split_key_tile) and V as VNNI pair-rows (part i at vparts + i kHalf ldv);
// tmp 64 x 2 np floats, words 3 x 64 x np.
void split_kv_tile(const ForwardArgs& a, const ForwardShape& sh, int64_t b, int64_t hk, int64_t j0,
                   int64_t cols, float* tmp, uint32_t* words, uint32_t* kparts, uint32_t* vparts) {
  const int64_t np = sh.np, d = sh.d;
  pack_rows(a.k, b, hk, j0, cols, d, 2 * np, tmp);  // the rows widened, zero past d and cols
  bf16::split_key_tile(tmp, np, words, kparts);
  pack_rows(a.v, b, hk, j0, cols, d, 2 * np, tmp);
  std::fill_n(vparts, 3 * kHalf * sh.ldv, 0u);  // the columns past d
  bf16::split_vnni(tmp, 2 * np, kTile, d, sh.ldv, vparts, kHalf * sh.ldv);
}

// Allocated on the calling thread (its scratch), packed by all.
PackedKv pack_kv(const ForwardArgs& a, const ForwardShape& sh) {
  const Problem& p = a.p;
  const int64_t tiles = p.batch * p.hkv * sh.nkt, d = sh.d;
  PackedKv kv;
  if (p.bf16_scores || p.fp32_parts)
    kv.kpairs = bf16::buffer(bf16::Buffer::k_tiles, tiles * sh.np * kTile * sh.parts);
  else
    kv.kpack = scratch(Scratch::k_pack, tiles * d * kTile);
  if (sh.pairs_pv)
    kv.vvnni = bf16::buffer(bf16::Buffer::v_vnni, tiles * kHalf * sh.ldv * sh.parts);
  else
    kv.vpack = scratch(Scratch::v_pack, tiles * kTile * sh.ld);
#pragma omp parallel num_threads(p.threads)
  {
    std::vector<float> row(d);
    LineVector<float> rows(p.fp32_parts ? kTile * 2 * sh.np : 0);
    LineVector<uint32_t> words(p.fp32_parts ? 3 * kTile * sh.np : 0);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t kt = t % sh.nkt, hk = (t / sh.nkt) % p.hkv, b = t / (sh.nkt * p.hkv);
      const int64_t j0 = kt * kTile, cols = std::min(p.tk, (kt + 1) * kTile) - j0;
      if (p.fp32_parts) {
        split_kv_tile(a, sh, b, hk, j0, cols, rows.data(), words.data(),
                      kv.kpairs + t * sh.np * kTile * 3, kv.vvnni + t * kHalf * sh.ldv * 3);
        continue;
      }
      if (p.bf16_scores)
        bf16::pack_tile(a.k, b, hk, j0, cols, d, kv.kpairs + t * sh.np * kTile, p.amx);
      else
        pack_transposed(a.k, b, hk, j0, cols, d, kv.kpack + t * d * kTile, row.data());
      if (sh.pairs_pv)
        bf16::pack_vnni(a.v, b, hk, j0, cols, d, sh.ldv, kv.vvnni + t * kHalf * sh.ldv, kTile);
      else
        pack_rows(a.v, b, hk, j0, cols, d, sh.ld, kv.vpack + t * kTile * sh.ld);
    }
  }
  return kv;
}

// One thread's share of the tasks: per task its rows' state in, every key tile it sees
// absorbed, the state out.
class ForwardWorker {
 public:
  ForwardWorker(const ForwardArgs& a, const ForwardShape& sh, const PackedKv& kv)
      : a_(a),
        p_(a.p),
        sh_(sh),
        kv_(kv),
        nl_(lanes()),
        split_words_(sh.rows() * kHalf),
        qt_(sh.rows() * sh.ld),
        s_(sh.rows() * kTile * sh.step_tiles),
        keep_(kTile * sh.step_tiles),
        acc_(sh.rows() * sh.ld),
        m_(sh.rows()),
        lv_(sh.rows() * nl_),
        qpairs_(a.p.bf16_scores || a.p.fp32_parts ? sh.rows() * sh.ldw * sh.parts : 0),
        qrows_(a.p.fp32_parts ? sh.rows() * 2 * sh.np : 0),
        ppairs_(sh.pairs_pv ? sh.nsplit * split_words_ * sh.step_tiles : 0),
        row_(sh.d),
        steps_(sh.step_tiles),
        vtiles_(sh.step_tiles) {}

  void run(int64_t task) {
    const int64_t qp = task % sh_.npairs, h = (task / sh_.npairs) % p_.hq;
    b_ = task / (sh_.npairs * p_.hq), h_ = h, hk_ = h / p_.group;
    q0_ = qp * sh_.sub, nsub_ = std::min(sh_.sub, sh_.nqt - q0_);
    i0_ = q0_ * kTile, rows_ = std::min(p_.tq, i0_ + nsub_ * kTile) - i0_;
    if (p_.fp32_parts) {  // widened (zero past d and rows_), then its 3 parts as pairs
      pack_rows(a_.q, b_, h_, i0_, rows_, sh_.d, 2 * sh_.np, qrows_.data(), 1.0f, sh_.rows());
      bf16::round_to_pairs(qrows_.data(), 2 * sh_.np, sh_.rows(), sh_.np, qpairs_.data(), sh_.ldw,
                           3, sh_.rows() * sh_.ldw);
    } else if (p_.bf16_scores)
      bf16::pack_rows(a_.q, b_, h_, i0_, rows_, sh_.d, sh_.ldw, qpairs_.data(), sh_.rows());
    else
      pack_rows(a_.q, b_, h_, i0_, rows_, sh_.d, sh_.ld, qt_.data(), p_.scale, sh_.rows());
    if (a_.state)
      load_state();
    else
      fresh_state();
    bool touched = false;
    if (sh_.step_tiles > 1)
      for (int64_t kt = 0; kt < sh_.nkt; kt += sh_.step_tiles)
        touched = key_step(kt, std::min(sh_.nkt, kt + sh_.step_tiles)) || touched;
    else
      for (int64_t kt = 0; kt < sh_.nkt; ++kt) touched = key_tile(kt) || touched;
    if (!a_.state)
      finalize();
    else if (touched)
      store_state();  // else the rows are unchanged (same bits)
  }

 private:
  float* stat_ptr(const TensorView& t) const { return t.ptr<float>(); }
  const ForwardStateView& state() const { return *a_.state; }
  int64_t stat(int64_t r) const { return (b_ * p_.hq + h_) * p_.tq + i0_ + r; }
  float* acc_row(int64_t r) const {
    return state().acc().ptr<float>() + ((b_ * p_.tq + i0_ + r) * p_.hq + h_) * sh_.d;
  }

  void load_state() {
    std::fill(acc_.begin(), acc_.end(), 0.0f);
    for (int64_t r = 0; r < rows_; ++r) {
      m_[r] = stat_ptr(state().m())[stat(r)];
      // Row sums kept as one vector per row (lanes summed once per task, not once per tile).
      std::fill_n(lv_.data() + r * nl_, nl_, 0.0f);
      lv_[r * nl_] = stat_ptr(state().l())[stat(r)];
      std::copy_n(acc_row(r), sh_.d, acc_.data() + r * sh_.ld);
    }
  }

  // Note [The whole forward in one call]: the rows start as a fresh ForwardState's (m = -inf,
  // l = 0, acc = 0: the values load_state would read after reset()) and end through the
  // finalize's own row step (finalize_row, api.cc) instead of into a state: the same
  // operations on the same values, so O and LSE keep the bits of block + finalize; what is
  // saved is the state's memory (its acc is an fp32 O) and four passes over it (reset, load,
  // store, finalize's read).
  // Row r's l: its lane-wise sums added once.
  float row_sum(int64_t r) const {
    const DF df;
    return hn::GetLane(hn::SumOfLanes(df, hn::LoadU(df, lv_.data() + r * nl_)));
  }

  void fresh_state() {
    std::fill(acc_.begin(), acc_.end(), 0.0f);
    std::fill_n(m_.data(), rows_, kNegInf);
    std::fill_n(lv_.data(), rows_ * nl_, 0.0f);
  }

  void finalize() {
    for (int64_t r = 0; r < rows_; ++r) {
      if (r + kRowsAhead < rows_)  // Note [Rows ahead]
        prefetch_row<true>(*a_.out, a_.out->offset(b_, i0_ + r + kRowsAhead, h_), sh_.d);
      a_.lse->ptr<float>()[a_.lse->offset(b_, h_, i0_ + r)] =
          finalize_row(acc_.data() + r * sh_.ld, m_[r], row_sum(r), sh_.d, row_.data(), *a_.out,
                       a_.out->offset(b_, i0_ + r, h_));
    }
  }

  void store_state() {
    for (int64_t r = 0; r < rows_; ++r) {
      stat_ptr(state().m())[stat(r)] = m_[r];
      stat_ptr(state().l())[stat(r)] = row_sum(r);
      std::copy_n(acc_.data() + r * sh_.ld, sh_.d, acc_row(r));
    }
  }

  // Key tile kt absorbed by the task's query tiles that see it; false where none does.
  bool key_tile(int64_t kt) {
    TileKind kinds[kMaxSub];
    int64_t first = -1, last = -1;  // the computed query tiles of this task: [first, last]
    for (int64_t u = 0; u < nsub_; ++u) {
      kinds[u] = classify(a_.mask, sh_.qr, q0_ + u, sh_.kr, kt);
      if (kinds[u] == TileKind::skip) continue;
      if (first < 0) first = u;
      last = u;
    }
    if (first < 0) return false;
    const int64_t j0 = kt * kTile, cols = std::min(p_.tk, j0 + kTile) - j0;
    // Rows [r0, r0 + mrows): the computed tiles' rows; any beyond `rows` are zero padding.
    const int64_t r0 = first * kTile, r1 = std::min(rows_, (last + 1) * kTile);
    const int64_t mrows = round_up(r1 - r0, 4);
    scores(kt, s_.data() + r0 * kTile, r0, mrows);
    mask_rows(s_.data(), kinds, first, last, j0, cols);
    for (int64_t r = r0; r < r0 + mrows; ++r) {
      float* sr = s_.data() + r * kTile;
      if (r >= rows_) {  // padding rows: P = 0 keeps their (unused) acc at 0
        std::fill(sr, sr + kTile, 0.0f);
        continue;
      }
      softmax_row<false>(sr, m_[r], lv_.data() + r * nl_, acc_.data() + r * sh_.ld, sh_.dp,
                         nullptr);
    }
    if (sh_.pairs_pv)
      values_pairs(pk(kt), r0, mrows);
    else
      values_fp32(pk(kt), r0, mrows, cols);
    // The MPI transport's progress calls, if installed (tile_progress.h): one a tile.
    progress(kinds, first, last);
    return true;
  }

  // Key tiles [kt0, kt1) as one online-softmax step (Note [Key steps]); false where no query tile
  // of the task sees any of them.
  bool key_step(int64_t kt0, int64_t kt1) {
    int64_t n = 0, lo = sh_.rows(), hi = 0;  // the step's computed tiles; rows [lo, hi) see one
    for (int64_t kt = kt0; kt < kt1; ++kt) {
      Step& st = steps_[n];
      st.kt = kt, st.first = -1, st.last = -1;
      for (int64_t u = 0; u < nsub_; ++u) {
        st.kinds[u] = classify(a_.mask, sh_.qr, q0_ + u, sh_.kr, kt);
        if (st.kinds[u] == TileKind::skip) continue;
        if (st.first < 0) st.first = u;
        st.last = u;
      }
      if (st.first < 0) continue;
      lo = std::min(lo, st.first * kTile),
      hi = std::max(hi, std::min(rows_, (st.last + 1) * kTile));
      ++n;
    }
    if (n == 0) return false;
    // The step's rows [lo, lo + m16): 16-row tiles; rows from `rows` on are zero padding.
    const int64_t m16 = round_up(hi - lo, 16), block = sh_.rows() * kTile;
    for (int64_t g = 0; g < n; ++g) {
      const Step& st = steps_[g];
      const int64_t j0 = st.kt * kTile, cols = std::min(p_.tk, j0 + kTile) - j0;
      const int64_t r0 = st.first * kTile, r1 = std::min(rows_, (st.last + 1) * kTile);
      const int64_t mrows = round_up(r1 - r0, 4);
      float* sb = s_.data() + g * block;
      vtiles_[g] = kv_.vvnni + pk(st.kt) * kHalf * sh_.ldv * sh_.parts;
      // Q K^T unscaled: the softmax applies the scale (softmax_row<true>, same bits).
      const uint32_t* ktile = kv_.kpairs + pk(st.kt) * sh_.np * kTile * sh_.parts;
      if (sh_.parts == 3)  // rows to a multiple of 16: padding rows of zero pairs, S rows of rows()
        bf16::gemm_amx_chunks(round_up(mrows, 16), kTile, 1, sh_.np, qpairs_.data() + r0 * sh_.ldw,
                              sh_.ldw, 0, &ktile, kTile, sb + r0 * kTile, kTile, false, 3,
                              sh_.rows() * sh_.ldw, 3, sh_.np * kTile);
      else
        bf16::scores(mrows, sh_.np, qpairs_.data() + r0 * sh_.ldw, sh_.ldw, ktile, sb + r0 * kTile,
                     1.0f, true);
      mask_rows(sb, st.kinds, st.first, st.last, j0, cols);
      // The step's rows this tile does not compute (a skipped query tile): nothing seen.
      std::fill(sb + lo * kTile, sb + r0 * kTile, kNegInf);
      std::fill(sb + std::min(r0 + mrows, lo + m16) * kTile, sb + (lo + m16) * kTile, kNegInf);
    }
    // P's pairs: tile g's parts side by side at g a_chunk (as the backward's chunks), 16 rows
    // at a time right after their softmax, while their P is still in L1.
    uint32_t* pp = ppairs_.data();
    const int64_t a_chunk = sh_.nsplit * split_words_;
    for (int64_t r16 = lo; r16 < lo + m16; r16 += 16) {
      for (int64_t r = r16; r < r16 + 16; ++r) {
        float* sr = s_.data() + r * kTile;
        if (r >= rows_) {  // padding rows: P = 0 keeps their (unused) acc at 0
          for (int64_t g = 0; g < n; ++g) std::fill_n(sr + g * block, kTile, 0.0f);
          continue;
        }
        softmax_row<true, true>(sr, m_[r], lv_.data() + r * nl_, acc_.data() + r * sh_.ld, sh_.dp,
                                keep_.data(), n, block, p_.scale);
      }
      for (int64_t g = 0; g < n; ++g)
        bf16::round_to_pairs(s_.data() + g * block + r16 * kTile, kTile, 16, kHalf,
                             pp + g * a_chunk + (r16 - lo) * kHalf, kHalf, sh_.nsplit,
                             split_words_);
    }
    bf16::gemm_amx_chunks(m16, sh_.n16, n, kHalf, pp, kHalf, a_chunk, vtiles_.data(), sh_.ldv,
                          acc_.data() + lo * sh_.ld, sh_.ld, true, sh_.nsplit, split_words_,
                          sh_.parts, kHalf * sh_.ldv);
    for (int64_t g = 0; g < n; ++g) progress(steps_[g].kinds, steps_[g].first, steps_[g].last);
    return true;
  }

  // The scores of key tile j0 / kTile (cols keys) in s (row r at s + r kTile) for the task's
  // query tiles [first, last]: partial tiles and ragged ends masked, a skipped tile between
  // computed ones all -inf (Note [Gaps in a task]).
  void mask_rows(float* s, const TileKind* kinds, int64_t first, int64_t last, int64_t j0,
                 int64_t cols) const {
    for (int64_t u = first; u <= last; ++u) {
      const int64_t u0 = u * kTile, urows = std::min(rows_, u0 + kTile) - u0;
      if (kinds[u] == TileKind::skip)
        std::fill_n(s + u0 * kTile, urows * kTile, kNegInf);
      else if (kinds[u] == TileKind::partial || cols < kTile)
        mask_tile(s + u0 * kTile, urows, cols, kinds[u] == TileKind::partial, a_.mask, a_.q_tokens,
                  i0_ + u0, a_.k_tokens, j0);
    }
  }

  // One tile_progress() a computed (query tile, key tile) pair, as 64-row tasks make them.
  static void progress(const TileKind* kinds, int64_t first, int64_t last) {
    for (int64_t u = first; u <= last; ++u)
      if (kinds[u] != TileKind::skip) tile_progress();
  }

  // S = scale (Q K^T) for rows [r0, r0 + mrows): exact bf16 products (simd_bf16.h), or fp32
  // FMAs of the pre-scaled Q.
  // into s (rows kTile floats apart), key tile kt of the task's kv head.
  void scores(int64_t kt, float* s, int64_t r0, int64_t mrows) {
    if (p_.bf16_scores)
      bf16::scores(mrows, sh_.np, qpairs_.data() + r0 * sh_.ldw, sh_.ldw,
                   kv_.kpairs + pk(kt) * sh_.np * kTile, s, p_.scale, p_.amx);
    else
      gemm_rows(mrows, kTile, sh_.d, qt_.data() + r0 * sh_.ld, sh_.ld,
                kv_.kpack + pk(kt) * sh_.d * kTile, kTile, s, kTile, false, sh_.k_panel);
  }

  // Key tile kt of the task's kv head among the packed tiles.
  int64_t pk(int64_t kt) const { return (b_ * p_.hkv + hk_) * sh_.nkt + kt; }

  // O += P V in fp32 FMAs; the fast bf16 tier rounds P for it (l summed the fp32 P).
  void values_fp32(int64_t pk, int64_t r0, int64_t mrows, int64_t cols) {
    if (p_.round_p) round_bf16(s_.data() + r0 * kTile, mrows * kTile);
    gemm_rows(mrows, sh_.dp, cols, s_.data() + r0 * kTile, kTile, kv_.vpack + pk * kTile * sh_.ld,
              sh_.ld, acc_.data() + r0 * sh_.ld, sh_.ld, true);
  }

  // O += P V as pair products: P's parts, or P rounded (the fast tier), times V's pair-rows,
  // in 16-row tiles: rows past mrows are padding rows (r >= rows), their P pairs zero.
  void values_pairs(int64_t pk, int64_t r0, int64_t mrows) {
    const int64_t m16 = round_up(mrows, 16);
    uint32_t* pp = ppairs_.data();
    bf16::round_to_pairs(s_.data() + r0 * kTile, kTile, mrows, kHalf, pp, kHalf, sh_.nsplit,
                         split_words_);
    for (int sp = 0; sp < sh_.nsplit; ++sp)
      std::fill(pp + sp * split_words_ + mrows * kHalf, pp + sp * split_words_ + m16 * kHalf, 0u);
    bf16::gemm_pairs(m16, sh_.n16, kHalf, pp, kHalf, kv_.vvnni + pk * kHalf * sh_.ldv, sh_.ldv,
                     acc_.data() + r0 * sh_.ld, sh_.ld, true, p_.amx, sh_.nsplit, split_words_);
  }

  const ForwardArgs& a_;
  const Problem& p_;
  const ForwardShape& sh_;
  const PackedKv& kv_;
  int64_t nl_, split_words_;
  LineVector<float> qt_, s_, keep_, acc_, m_, lv_;  // keep_: Note [A row's base]
  LineVector<uint32_t> qpairs_;  // Q as bf16 pairs (3 parts for fp32 parts), unscaled
  LineVector<float> qrows_;      // fp32 parts: Q's rows widened, before the split
  LineVector<uint32_t> ppairs_;  // P's parts as pairs
  std::vector<float> row_;       // finalize_row's scratch
  // A key step's computed tiles (Note [Key steps]): each one's classification per query tile.
  struct Step {
    int64_t kt = 0, first = -1, last = -1;
    TileKind kinds[kMaxSub];
  };
  std::vector<Step> steps_;
  std::vector<const uint32_t*> vtiles_;  // their V pair-rows
  int64_t b_ = 0, h_ = 0, hk_ = 0, q0_ = 0, nsub_ = 0, i0_ = 0, rows_ = 0;
};

// One forward call: K / V packed, then the tasks.
KernelStats run_forward(const ForwardArgs& a, int64_t step_tiles) {
  const Problem& p = a.p;
  const ForwardShape sh = forward_shape(a, step_tiles);
  const PackedKv kv = pack_kv(a, sh);
#pragma omp parallel num_threads(p.threads)
  {
    ForwardWorker worker(a, sh, kv);
    // Each task owns its rows of the state, so which thread runs it cannot change the result:
    // dynamic scheduling balances causal masks (late query tiles see more keys) for free.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < sh.tasks; ++task) worker.run(task);
  }
  return count_tiles(p, a.mask, sh.qr, sh.kr, 1.0);
}

}  // namespace

KernelStats ForwardSimd(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                        const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                        const Mask& mask, const ForwardStateView& state, int64_t step_tiles) {
  return run_forward({p, q, k, v, q_tokens, k_tokens, mask, &state}, step_tiles);
}

KernelStats ForwardSimdWhole(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                             const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                             const Mask& mask, const TensorView& out, const TensorView& lse) {
  return run_forward({p, q, k, v, q_tokens, k_tokens, mask, nullptr, &out, &lse}, 0);
}

// The target's vector exp2 (exp2_capped where capped, else exp2_neg) over n values (n any), for
// its accuracy and cost tests: whole vectors in place, the tail through a padded vector (no
// allocation: the cost test times it).
void Exp2Neg(const float* in, float* out, int64_t n, bool capped) {
  const DF df;
  const int64_t nl = lanes();
  const auto exp2 = [&](VF t) { return capped ? exp2_capped(df, t) : exp2_neg(df, t); };
  int64_t i = 0;
  for (; i + nl <= n; i += nl) hn::StoreU(exp2(hn::LoadU(df, in + i)), df, out + i);
  if (i < n) {
    HWY_ALIGN float a[hn::MaxLanes(DF())] = {}, b[hn::MaxLanes(DF())];
    std::copy_n(in + i, n - i, a);
    hn::Store(exp2(hn::Load(df, a)), df, b);
    std::copy_n(b, n - i, out + i);
  }
}

// Whether the target's MulAdd is one fused operation (AVX2, AVX-512) or a multiply then an
// add (SSE4, SSSE3): the backward's delta must round the same way (api.cc).
bool NativeFma() { return HWY_NATIVE_FMA != 0; }

}  // namespace ctxpar::kernel::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ctxpar::kernel {

HWY_EXPORT(ForwardSimd);
HWY_EXPORT(ForwardSimdWhole);
HWY_EXPORT(Exp2Neg);
HWY_EXPORT(NativeFma);

KernelStats forward_simd(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                         const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                         const Mask& mask, const ForwardStateView& state) {
  return HWY_DYNAMIC_DISPATCH(ForwardSimd)(p, q, q_tokens, k, v, k_tokens, mask, state, 0);
}

KernelStats forward_simd_whole(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                               const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                               const Mask& mask, const TensorView& out, const TensorView& lse) {
  return HWY_DYNAMIC_DISPATCH(ForwardSimdWhole)(p, q, q_tokens, k, v, k_tokens, mask, out, lse);
}

KernelStats forward_simd_steps(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                               const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                               const Mask& mask, const ForwardStateView& state,
                               int64_t step_tiles) {
  CTXPAR_CHECK(step_tiles >= 1, "step_tiles: expected at least 1 key tile a step, got ", step_tiles,
               " (give 1 for the one-tile-a-step path)");
  return HWY_DYNAMIC_DISPATCH(ForwardSimd)(p, q, q_tokens, k, v, k_tokens, mask, state, step_tiles);
}

bool simd_fused_multiply_add() {
  select_simd_target();
  return HWY_DYNAMIC_DISPATCH(NativeFma)();
}

void exp2_neg_simd(const float* in, float* out, int64_t n, bool capped) {
  select_simd_target();
  HWY_DYNAMIC_DISPATCH(Exp2Neg)(in, out, n, capped);
}

}  // namespace ctxpar::kernel
#endif  // HWY_ONCE

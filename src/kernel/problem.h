// Private to the kernel layer: the checked shape of one kernel call, tile ranges of positions
// and document ids, and row loaders that widen bf16 to fp32. Both the readable scalar path
// (scalar_*.cc) and the fast SIMD path (simd_*.cc) start from a Problem.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "ctxpar/kernel.h"
#include "ctxpar/mask.h"
#include "ctxpar/tensor.h"
#include "ctxpar/tile_progress.h"  // tile_progress(): called after each tile

namespace ctxpar::kernel {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Sizes of one call, after the argument checks.
struct Problem {
  int64_t batch = 0, tq = 0, tk = 0, hq = 0, hkv = 0, d = 0;
  int64_t group = 1;  // hq / hkv: query heads per kv head
  float scale = 0;    // softmax scale actually used
  int threads = 1;
  int64_t l1d_bytes = 0;  // KernelConfig::l1d_bytes: 0 for this machine's (kernel_k_panel)
  // Exact bf16 products (simd_bf16.h; api.cc sets them): S = Q K^T when q and k are bf16,
  // dP = dO V^T when dout and v are bf16, and bf16 products are chosen (bf16_products_on).
  bool bf16_scores = false, bf16_dp = false;
  bool amx = false;  // those products through AMX-BF16 tiles (amx_bf16.cc), else vdpbf16ps
  // KernelConfig::bf16_tier fast with bf16 q (api.cc): P and dS rounded to bf16 before the
  // P V, dV, dQ and dK products (the SIMD path; the scalar path ignores it).
  bool round_p = false;
  // KernelConfig::fp32_products parts with fp32 q, k, v (the forward; api.cc): S and P V through
  // AMX tiles on three bf16 parts of each operand (Note [fp32 through three bf16 parts],
  // amx_bf16.cc). amx is then true too.
  bool fp32_parts = false;
};

// Checks q [B, Tq, Hq, D], k, v [B, Tk, Hkv, D], the tokens and the mask's needs; throws
// ctxpar::Error naming the argument and what was expected.
Problem check_forward_args(const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                           const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                           const KernelConfig& config);
// Also checks dout, lse, delta, dq, dk, dv against the Problem.
Problem check_backward_args(const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                            const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                            const TensorView& dout, const TensorView& lse, const TensorView& delta,
                            const TensorView& dq, const TensorView& dk, const TensorView& dv,
                            const KernelConfig& config);
// Throws unless t is [B, H, T] fp32 (any strides).
void check_rows_f32(const char* name, const TensorView& t, int64_t b, int64_t h, int64_t tokens);
// Throws activation_verdict's message (kernel/finite.h) unless it is "".
void check_activation(const char* name, const TensorView& t, bool allow_bf16,
                      const Shape& want = {}, const char* what = "[B, T, H, D]");
// Throws unless the memory `out` spans (first to last element, any strides) is apart from
// `in`'s: "<out_name>: its memory overlaps <in_name>'s ...". An empty view overlaps nothing.
void check_apart(const char* out_name, const TensorView& out, const char* in_name,
                 const TensorView& in);
// Throws naming the first NaN / Inf element of a [B, T, H, D] tensor (scanned with `threads`
// threads: find_non_finite).
void check_finite(const char* name, const TensorView& t, int threads = 1);

// The position / document range of each tile of `tile` consecutive tokens. Positions need not
// be sorted, so a range is the min and max over the tile.
struct TileRanges {
  // Padding tokens (kPaddingPosition) in the tile, as TileRange::Padding.
  enum Padding : uint8_t { none = TileRange::none, some = TileRange::some, all = TileRange::all };
  std::vector<int64_t> pos_lo, pos_hi;  // over the tile's real tokens
  std::vector<int32_t> doc_lo, doc_hi;
  std::vector<Padding> padding;
  int64_t tile = 0;
  int64_t count() const { return static_cast<int64_t>(pos_lo.size()); }
  // Tile i as mask_rules.h's TileRange (doc_lo / doc_hi are empty without documents).
  TileRange at(int64_t i) const {
    TileRange r;
    r.pos_lo = pos_lo[i], r.pos_hi = pos_hi[i];
    if (!doc_lo.empty()) r.doc_lo = doc_lo[i], r.doc_hi = doc_hi[i];
    r.padding = padding[i];  // none, some, all: TileRange's values
    return r;
  }
};
TileRanges tile_ranges(const Tokens& tokens, int64_t n, int64_t tile, bool documents);

// What a (query tile, key tile) pair needs: mask_rules.h's classification, the GPU's too.
using ::ctxpar::TileKind;
inline TileKind classify(const Mask& mask, const TileRanges& qr, int64_t qi, const TileRanges& kr,
                         int64_t kj) {
  return ::ctxpar::classify(mask, qr.at(qi), kr.at(kj));
}

// Tiles computed / skipped over all (batch, query head) and their FLOPs: 4 * D per computed
// score for forward, times `factor` (2.5 for backward).
KernelStats count_tiles(const Problem& p, const Mask& mask, const TileRanges& qr,
                        const TileRanges& kr, double factor);

inline bool visible(const Mask& mask, const Tokens& qt, int64_t i, const Tokens& kt, int64_t j) {
  return mask.visible(qt.positions[i], kt.positions[j], mask.documents ? qt.documents[i] : 0,
                      mask.documents ? kt.documents[j] : 0);
}

// Reads n contiguous elements of t (fp32 or bf16) starting at element offset `off` as fp32.
inline void load_row(const TensorView& t, int64_t off, int64_t n, float* out) {
  if (t.dtype() == DType::f32) {
    std::memcpy(out, t.ptr<const float>() + off, static_cast<size_t>(n) * sizeof(float));
  } else {
    const uint16_t* src = t.ptr<const uint16_t>() + off;
    for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(src[i]);
  }
}
// Note [Rows ahead]: a head's rows of a [B, T, H, D] tensor are H D elements apart (4 KiB at
// H = 8, D = 128 in fp32), each on its own 4 KiB page, and the hardware prefetchers do not cross
// pages: packing a tile of q, k or v row by row (or writing O's rows) waited on memory once a
// row. The packers ask for the row kRowsAhead ahead while they copy this one. Only the speed
// depends on it: no value moves.
inline constexpr int64_t kRowsAhead = 8;
template <bool kWrite = false>
inline void prefetch_row(const TensorView& t, int64_t off, int64_t n) {
  const size_t size = dtype_size(t.dtype());
  const char* p = static_cast<const char*>(t.data()) + static_cast<size_t>(off) * size;
  for (size_t i = 0; i < static_cast<size_t>(n) * size; i += 64)
    __builtin_prefetch(p + i, kWrite, 3);
}
// Rounds n fp32 values to bf16 values (nearest even), in place: the fast bf16 tier's P and dS.
inline void round_bf16(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = round_to_bf16(x[i]);
}
// Writes n fp32 values into t (fp32 or bf16, rounding to nearest even).
inline void store_row(const TensorView& t, int64_t off, int64_t n, const float* in) {
  if (t.dtype() == DType::f32) {
    std::memcpy(t.ptr<float>() + off, in, static_cast<size_t>(n) * sizeof(float));
  } else {
    uint16_t* dst = t.ptr<uint16_t>() + off;
    for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(in[i]);
  }
}

// The SIMD target (dispatch.cc): select_simd_target() applies CTXPAR_SIMD (KernelEnvironment)
// once and throws ctxpar::Error when it names a target this binary or CPU lacks;
// use_scalar_path() is true for CTXPAR_SIMD=scalar or CTXPAR_KERNEL=scalar.
void select_simd_target();
bool use_scalar_path();
// The kernel's environment as installed (set_kernel_environment), or the empty one; the first
// call fixes it for the process.
const KernelEnvironment& kernel_environment();

// Whether bf16 inputs take bf16 x bf16 -> fp32 products (bf16_probe.cc), and which: a level,
// 0 fp32 products, 1 vdpbf16ps (AVX512_BF16), 2 AMX-BF16 tiles. This machine's choice is made
// once by a short probe of vdpbf16ps and AMX tile products against fp32 FMAs, or by
// CTXPAR_BF16_PRODUCTS=on|dot|amx|off|auto; decide_bf16_products is the rule on given
// measurements (tested on every outcome).
constexpr double kBf16Pays = 1.25;  // bf16 dot FLOP/s over fp32 FMA FLOP/s it takes
constexpr double kAmxPays = 2.0;    // AMX tile FLOP/s over fp32 FMA FLOP/s it takes
enum Bf16Level : int { kBf16Fp32 = 0, kBf16Dot = 1, kBf16Amx = 2 };
struct Bf16Choice {
  int level = kBf16Fp32;
  std::string reason;  // what was chosen and why, for `ctxpar --version`
  std::string error;   // a bad CTXPAR_BF16_PRODUCTS ("" if fine)
  double fma_gflops = 0, dot_gflops = 0, amx_gflops = 0;  // the probe's figures (0: not measured)
};
// amx_why: "" where AMX-BF16 is usable (amx_unusable_why()), amx_gflops its measured rate.
Bf16Choice decide_bf16_products(const char* env_value, bool cpu_has, double fma_gflops,
                                double dot_gflops, const std::string& amx_why = "no AMX",
                                double amx_gflops = 0);
const Bf16Choice& bf16_products();
bool cpu_has_bf16_dot();  // AVX-512F and AVX512_BF16 (vdpbf16ps), by CPUID
// The highest level this CPU can take (AMX usable: 2; AVX512_BF16: 1; else 0), for tests.
int bf16_top_level();
// Note [The ranks agree on bf16 products]: the choice changes the bits (vdpbf16ps adds a pair
// of products before rounding, the fp32 path one product at a time, AMX tiles in yet another
// order), and a timed probe can choose differently on two ranks of one job (four ranks on two
// cores: CI saw MPI != threads). So before ranks compute together they agree
// (agree_kernel_choices, device layer): each rank's KernelConfig::bf16_products becomes the
// lowest level any rank of the communicator takes, in that strategy's or cache's own options.
// Nothing is kept for the process, so an agreement on one communicator never changes the bits
// of a strategy made on another.
// The level `products` takes on this machine before the SIMD target is considered: automatic
// is bf16_products().level, the others their own; bf16_products_of_level is its inverse.
int bf16_products_level(Bf16Products products);
constexpr Bf16Products bf16_products_of_level(int level) {
  return level >= kBf16Amx   ? Bf16Products::amx
         : level == kBf16Dot ? Bf16Products::dot
                             : Bf16Products::fp32;
}
// "" where this machine can take `products`, else why not, naming KernelConfig::bf16_products:
// dot on a CPU without AVX512_BF16, amx where AMX-BF16 is not usable (amx_why, "" when usable).
std::string bf16_products_refusal(Bf16Products products, bool cpu_has_dot,
                                  const std::string& amx_why);
std::string bf16_products_refusal(Bf16Products products);  // on this machine
// The level kernel calls with `config` take for bf16 inputs: bf16_products_level where the SIMD
// target in use is an avx512 one, else 0 (CTXPAR_SIMD=avx2 or scalar keeps fp32 products).
// Throws ctxpar::Error on a bad CTXPAR_BF16_PRODUCTS or a refused KernelConfig::bf16_products.
int bf16_products_on(const KernelConfig& config);
// KernelConfig::fp32_products with automatic resolved: CTXPAR_FP32_PRODUCTS (fma | parts) where
// set, else fma; throws ctxpar::Error naming the variable for any other value.
Fp32Products fp32_products_of(const KernelConfig& config);
// "" where this machine can take KernelConfig::fp32_products = parts (AMX-BF16 usable and an
// avx512 SIMD target chosen), else why not, naming the setting.
std::string fp32_parts_refusal();
// Whether the chosen target's multiply-add is fused (AVX2, AVX-512: yes; SSE4, SSSE3: no).
bool simd_fused_multiply_add();
// The chosen target's vector exp2 (2^t, t <= 0; capped: exp2_capped, 2^t for t <= 12 and more
// than 2^12 above, simd_tile.h) over n values, for its accuracy test.
void exp2_neg_simd(const float* in, float* out, int64_t n, bool capped = false);

// The L1 data cache size the fast path sizes its K panels for (simd_tile.h, Note [K panels]),
// where KernelConfig::l1d_bytes leaves it to this machine: CTXPAR_KERNEL_L1D (bytes) when set,
// else what the C library reports for this CPU, else 32 KiB. Decided once per process; a
// malformed CTXPAR_KERNEL_L1D throws ctxpar::Error naming it. Only the speed depends on it,
// never a bit of the results.
constexpr int64_t kMinL1dBytes = 1024, kMaxL1dBytes = int64_t{1} << 30;
int64_t kernel_l1d_bytes();
// CTXPAR_KERNEL_L1D's value checked: kMinL1dBytes .. kMaxL1dBytes, else ctxpar::Error naming it.
int64_t parse_kernel_l1d(const char* text);
// Rows per K panel for a product whose B operand has n floats a row and k rows: B split into
// the fewest equal panels (rounded up to 16 rows) that take at most half of an L1 of
// `l1d_bytes` (0: kernel_l1d_bytes()) each; 0 (one pass, no panels) when the whole B fits.
int64_t kernel_k_panel(int64_t n, int64_t k, int64_t l1d_bytes);

// A finished row's LSE from its online-softmax state (api.cc), the rule's one home (the
// forward's finalize and decode's): m + log(l) in double, rounded once (m may be a row's base,
// up to 8 ln 2 below its max: Note [A row's base], simd_tile.h). A row that saw no visible key
// (m = -inf): -inf; a score beyond the fp32 range (m = +inf) or a NaN in the sums: +inf, never
// -inf, which would read as a masked row. The cuda tile math keeps a device copy (tile_math.cuh).
float row_lse(float m, float l);

// One row of attention_forward_finalize (api.cc), its one home: O = acc / l (d values, through
// `row`, d floats of scratch) into out at element offset `off` in out's dtype; returns
// row_lse(m, l). A row that saw no visible key (m = -inf): O = 0.
float finalize_row(const float* acc, float m, float l, int64_t d, float* row, const TensorView& out,
                   int64_t off);

// The two implementations behind the public calls (see api.cc for the choice).
KernelStats forward_scalar(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                           const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                           const Mask& mask, const ForwardStateView& state);
KernelStats backward_scalar(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                            const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                            const Mask& mask, const TensorView& dout, const TensorView& lse,
                            const TensorView& delta, const TensorView& dq, const TensorView& dk,
                            const TensorView& dv);

KernelStats forward_simd(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                         const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                         const Mask& mask, const ForwardStateView& state);
// forward_simd with step_tiles (>= 1, else ctxpar::Error) key tiles an online-softmax step where
// the products take AMX pairs (simd_forward.cc, Note [Key steps]; elsewhere one tile a step):
// 1 is the one-tile-a-step path kept as the reference; lab 10 and the kernel tests compare them.
KernelStats forward_simd_steps(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                               const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                               const Mask& mask, const ForwardStateView& state, int64_t step_tiles);
// Note [The whole forward in one call] (simd_forward.cc): forward_simd on a fresh state followed
// by the finalize, without the state: out and lse written by the tasks, bit for bit.
KernelStats forward_simd_whole(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                               const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                               const Mask& mask, const TensorView& out, const TensorView& lse);
KernelStats backward_simd(const Problem& p, const TensorView& q, const Tokens& q_tokens,
                          const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                          const Mask& mask, const TensorView& dout, const TensorView& lse,
                          const TensorView& delta, const TensorView& dq, const TensorView& dk,
                          const TensorView& dv);

}  // namespace ctxpar::kernel

// The single-rank attention kernel: one Q block against one K/V block, with global positions.
// Every strategy is built from these calls. See docs/kernel.md.
//
// Shapes (row-major, strided views allowed on the last-but-one dims; the last dim must be
// contiguous):
//   q, o, do     [B, Tq, Hq, D]    fp32 or bf16
//   k, v         [B, Tk, Hkv, D]   fp32 or bf16 (Hq % Hkv == 0; query head h reads kv head
//                                  h / (Hq / Hkv))
//   lse, delta   [B, Hq, Tq]       fp32
//   dq           [B, Tq, Hq, D]    fp32 accumulator
//   dk, dv       [B, Tk, Hkv, D]   fp32 accumulators
// 16 <= D <= 256. Arithmetic and accumulation are fp32 whatever the storage type.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ctxpar/mask.h"
#include "ctxpar/tensor.h"

namespace ctxpar {

// The kernel's query and key tile edge (scalar and SIMD paths alike): masked-tile skipping,
// tile statistics and the ring's last-hop pieces (ring_last_hop_cuts) are whole tiles of it;
// `ctxpar plan --hardware local` models the same tile.
constexpr int64_t kKernelTile = 64;

// How bf16 inputs are multiplied (docs/kernel.md, "bf16 tiers"). exact: every product is of
// the stored bf16 values (exact in fp32), P and dS stay fp32 -- the fp32 accuracy rule.
// fast (opt-in, as GPU flash attention): P rounded to bf16 for O += P V and dV += P^T dO, dS
// rounded to bf16 for dQ and dK, on the SIMD path; its own, looser accuracy rule. fp32 inputs
// and the scalar path ignore it.
enum class Bf16Tier : uint8_t { exact, fast };
// "exact" | "fast": the names the command, the Python package and the ranks' agreement use.
inline const char* bf16_tier_name(Bf16Tier tier) {
  return tier == Bf16Tier::fast ? "fast" : "exact";
}
// The tier a name gives, or nullopt for any other text (each caller says so in its own terms:
// the command's --bf16-tier, the Python package's bf16_tier).
inline std::optional<Bf16Tier> parse_bf16_tier(std::string_view name) {
  if (name == "exact") return Bf16Tier::exact;
  if (name == "fast") return Bf16Tier::fast;
  return std::nullopt;
}

// Which products bf16 inputs take (docs/kernel.md, "bf16 products"): fp32 FMAs of the widened
// values, vdpbf16ps (AVX512_BF16: bf16 pairs into fp32 lanes) or AMX-BF16 tiles. Every product
// is exact; only the order of the fp32 additions differs, so the choice changes bits (within
// the same accuracy rule). automatic: this machine's choice (a short probe, or what
// CTXPAR_BF16_PRODUCTS asked for: KernelEnvironment). The ranks of a job take the lowest level
// any of them takes: Strategy::create and a KvCache's first prefill or decode turn automatic
// into that level (Note [The ranks agree on bf16 products], src/kernel/problem.h). fp32 inputs,
// the scalar path and SIMD targets below avx512 take fp32 products whatever it says.
enum class Bf16Products : uint8_t { automatic, fp32, dot, amx };
// "automatic" | "fp32" | "dot" | "amx", for errors and reports.
const char* bf16_products_name(Bf16Products products);

// Which products fp32 inputs take for S = Q K^T (forward and backward) and the forward's P V
// (docs/kernel.md, "fp32 products"). fma: fp32 fused multiply-adds. parts (opt-in, AMX-BF16
// CPUs): each fp32 value as the sum of three bf16 parts and the six part products that carry a
// product, through AMX tiles (as TPUs make fp32 matrix products): 1.2-1.4x the forward's speed
// here with the same error against fp64, except that the tiles flush subnormal parts (values
// below about 2^-102 keep fewer than 24 bits). Refused, naming why, where AMX-BF16 is not usable
// or the SIMD target is below avx512. automatic: CTXPAR_FP32_PRODUCTS (fma | parts) where set,
// else fma. bf16 inputs and the scalar path ignore it.
enum class Fp32Products : uint8_t { automatic, fma, parts };
// "automatic" | "fma" | "parts": the names the command and errors use; parse_fp32_products
// gives nullopt for any other text.
inline const char* fp32_products_name(Fp32Products products) {
  return products == Fp32Products::parts ? "parts"
         : products == Fp32Products::fma ? "fma"
                                         : "automatic";
}
inline std::optional<Fp32Products> parse_fp32_products(std::string_view name) {
  if (name == "automatic") return Fp32Products::automatic;
  if (name == "fma") return Fp32Products::fma;
  if (name == "parts") return Fp32Products::parts;
  return std::nullopt;
}

struct KernelConfig {
  int threads = 1;     // OpenMP threads inside this rank (over batch, head, query tile)
  float scale = 0.0f;  // softmax scale; 0 means 1/sqrt(D)
  Bf16Tier bf16_tier = Bf16Tier::exact;
  Bf16Products bf16_products = Bf16Products::automatic;
  Fp32Products fp32_products = Fp32Products::automatic;
  // The L1 data cache size the fast path sizes its K panels for (docs/kernel.md, Note [K
  // panels]), 1024 to 2^30 bytes; 0: this machine's (CTXPAR_KERNEL_L1D, else what the C
  // library reports). Only the speed depends on it, never a bit of the results.
  int64_t l1d_bytes = 0;
  // k and v were checked finite by the caller, so the kernel does not scan them again: a KV
  // cache checks each key and value once, when it is stored (docs/inference.md, "Checked at
  // the door"), and decode would otherwise rescan the whole shard for every new token. q (and
  // dout) are always checked.
  bool kv_checked = false;
};

// What a call actually computed, for load-balance and throughput figures.
struct KernelStats {
  double flops = 0;  // 4 * (unmasked-tile scores) * D for forward; 2.5x that for backward
  int64_t tiles_computed = 0;
  int64_t tiles_skipped = 0;
  KernelStats& operator+=(const KernelStats& o) {
    flops += o.flops;
    tiles_computed += o.tiles_computed;
    tiles_skipped += o.tiles_skipped;
    return *this;
  }
};

// The memory of a running online-softmax state, wherever it lives (a ForwardState's own
// tensors, or device memory: DeviceForwardState): contiguous fp32 views acc [B, Tq, Hq, D],
// m and l [B, Hq, Tq].
class ForwardStateView {
 public:
  ForwardStateView() = default;
  ForwardStateView(const TensorView& acc, const TensorView& m, const TensorView& l)
      : acc_(acc), m_(m), l_(l) {}
  const TensorView& acc() const { return acc_; }
  const TensorView& m() const { return m_; }
  const TensorView& l() const { return l_; }

 private:
  TensorView acc_, m_, l_;
};

// Running online-softmax state of one Q block [B, Tq, Hq, D]: fp32 base m (the running max, or
// up to 8 ln 2 below it where the bf16 AMX path keeps a base: docs/kernel.md, Note [Online
// softmax]) and sum l = sum exp(s - m) ([B, Hq, Tq]), and unnormalised output acc ([B, Tq, Hq,
// D]). Absorbs K/V blocks in any order; finalise() turns it into O and LSE.
class ForwardState {
 public:
  ForwardState() = default;
  ForwardState(int64_t batch, int64_t tq, int64_t hq, int64_t d);
  void reset();  // back to "no key seen": m = -inf, l = 0, acc = 0
  int64_t batch() const { return acc_.dim(0); }
  int64_t tokens() const { return acc_.dim(1); }
  int64_t heads() const { return acc_.dim(2); }
  int64_t head_dim() const { return acc_.dim(3); }
  const Tensor& acc() const { return acc_; }
  const Tensor& m() const { return m_; }
  const Tensor& l() const { return l_; }
  Tensor& acc() { return acc_; }
  Tensor& m() { return m_; }
  Tensor& l() { return l_; }
  size_t bytes() const { return acc_.bytes() + m_.bytes() + l_.bytes(); }
  ForwardStateView view() const { return {acc_, m_, l_}; }

 private:
  Tensor acc_, m_, l_;
};

// Accumulates the attention of q over one K/V block into `state`. Tiles whose position ranges
// are fully masked are skipped. Throws ctxpar::Error on bad shapes / dtypes / positions.
KernelStats attention_forward_block(const TensorView& q, const Tokens& q_tokens,
                                    const TensorView& k, const TensorView& v,
                                    const Tokens& k_tokens, const Mask& mask, ForwardState& state,
                                    const KernelConfig& config = {});
// The same on a state's memory given as views (what devices pass).
KernelStats attention_forward_block(const TensorView& q, const Tokens& q_tokens,
                                    const TensorView& k, const TensorView& v,
                                    const Tokens& k_tokens, const Mask& mask,
                                    const ForwardStateView& state, const KernelConfig& config = {});

// O = acc / l (fp32 -> out's dtype), LSE = m + log(l). Rows that saw no visible key:
// O = 0, LSE = -inf.
void attention_forward_finalize(const ForwardState& state, const TensorView& out,
                                const TensorView& lse, const KernelConfig& config = {});
void attention_forward_finalize(const ForwardStateView& state, const TensorView& out,
                                const TensorView& lse, const KernelConfig& config = {});

// The whole forward of q against one K/V block that is all it sees: O and LSE exactly as
// attention_forward_block on a fresh ForwardState then attention_forward_finalize write them (the
// same bits), without the state (its acc is as big as an fp32 O) and its passes over memory:
// each task writes its rows' O and LSE (docs/kernel.md, "The whole forward in one call"). out
// and lse must not share memory with q, k, v or each other (refused, naming both).
KernelStats attention_forward(const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                              const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                              const TensorView& out, const TensorView& lse,
                              const KernelConfig& config = {});

// delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d]  (fp32), the FA2 row term.
void attention_backward_delta(const TensorView& out, const TensorView& dout,
                              const TensorView& delta, const KernelConfig& config = {});

// Adds one K/V block's contribution to dq (for all of q) and to that block's dk, dv, given the
// *final* LSE and delta of the q rows. FA2 form: P = exp(S*scale - lse), dV += P^T dO,
// dP = dO V^T, dS = P * (dP - delta), dQ += scale * dS K, dK += scale * dS^T Q.
KernelStats attention_backward_block(const TensorView& q, const Tokens& q_tokens,
                                     const TensorView& k, const TensorView& v,
                                     const Tokens& k_tokens, const Mask& mask,
                                     const TensorView& dout, const TensorView& lse,
                                     const TensorView& delta, const TensorView& dq,
                                     const TensorView& dk, const TensorView& dv,
                                     const KernelConfig& config = {});

// Combines two partial results of the same queries over disjoint key sets, in place into a:
//   lse = max + log(exp(lse_a - max) + exp(lse_b - max)),
//   o_a = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse).
// Rows with lse = -inf on both sides stay O = 0, LSE = -inf (never NaN).
// o_a, o_b [B, T, H, D] fp32; lse_a, lse_b [B, H, T] fp32.
void merge(const TensorView& o_a, const TensorView& lse_a, const TensorView& o_b,
           const TensorView& lse_b);

// The SIMD targets of the fast kernel (Highway dynamic dispatch; docs/kernel.md, "SIMD
// targets"). Names: avx512, avx2, sse4, ssse3 (and avx512_dl in a -march=native build on such
// a CPU); "scalar" is the readable scalar path.
struct SimdTargets {
  std::vector<std::string> compiled;  // in this binary, best first
  std::vector<std::string> runnable;  // of those, the ones this CPU can run
  std::string chosen;    // what kernel calls run: the best runnable, or CTXPAR_SIMD's choice
  std::string error;     // why CTXPAR_SIMD cannot be honoured ("" if fine); kernel calls throw it
  std::string products;  // fp32 or bf16 products for bf16 inputs, and why (measured or forced)
};
SimdTargets simd_targets();

// The kernel's settings that come from the environment, as the user wrote them ("" = unset):
// read at the edge -- the command, the Python package, a test program
// (environment::kernel(), src/core/kernel_environment.h) -- and installed once, before the
// first kernel call; the library reads no environment variable. Without it the kernel takes
// the best SIMD target, the probe's bf16 products and the C library's L1 size. A value the
// kernel cannot honour is an error of the kernel calls it concerns (and of
// simd_targets().error), named by its variable, as when the variables were read here.
struct KernelEnvironment {
  std::string simd;           // CTXPAR_SIMD: a target name, or scalar; "" for the best
  std::string kernel;         // CTXPAR_KERNEL: scalar selects the readable scalar path
  std::string bf16_products;  // CTXPAR_BF16_PRODUCTS: on | dot | amx | off | auto
  std::string fp32_products;  // CTXPAR_FP32_PRODUCTS: fma | parts
  std::string l1d;            // CTXPAR_KERNEL_L1D: the L1 data cache size in bytes
  bool operator==(const KernelEnvironment&) const = default;
};
// Installs `env`. The kernel's choices are made from it at the first kernel call (or
// simd_targets()) and kept for the process: a later call with another environment throws
// ctxpar::Error (the same one again is a no-op).
void set_kernel_environment(const KernelEnvironment& env);

// Forward FLOPs of a full (unmasked) problem: 4 * B * Hq * Tq * Tk * D.
inline double attention_flops(int64_t b, int64_t hq, int64_t tq, int64_t tk, int64_t d) {
  return 4.0 * static_cast<double>(b) * hq * tq * tk * d;
}

}  // namespace ctxpar

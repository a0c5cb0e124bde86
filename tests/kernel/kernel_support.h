// Test support for the kernel tests: seeded inputs with positions / documents, one call of the
// fast kernel (forward + finalize + delta + backward), and the project's tolerance rule:
//   max |fast - ref64| <= 2 * max |naive32 - ref64| + floor,   floor = 1e-5 * max(1, max|ref64|)
// where naive32 is the materialised fp32 computation on the same (bf16-rounded) inputs.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "ctxpar/kernel.h"
#include "ctxpar/reference.h"

namespace ctxpar::test {

struct Case {
  int64_t batch = 1, tq = 7, tk = 7, hq = 2, hkv = 2, d = 16;
  DType dtype = DType::f32;
  Mask mask;
  // Positions: q_pos[i] = q_offset + q_stride * i (likewise for k); striped layouts have
  // stride P. Documents: doc of a position = position / doc_len (doc_len 0: one document).
  int64_t q_offset = 0, q_stride = 1, k_offset = 0, k_stride = 1, doc_len = 0;
  float qk_scale = 1;    // q and k are multiplied by it: logits spread by its square
  float qk_common = 0;   // q[..., 0] = k[..., 0] = it: every logit offset by qk_common^2 * scale
  float k_rise = 0;      // q[..., 1] = 1, k[j, ..., 1] = k_rise * j: logits rise along the keys
  bool shuffle = false;  // permute the tokens' positions (unsorted, as after a Ulysses all-to-all)
  int threads = 1;
  Bf16Products products = Bf16Products::automatic;  // KernelConfig::bf16_products
  Fp32Products fp32 = Fp32Products::automatic;      // KernelConfig::fp32_products
  uint64_t seed = 1;
  std::string name() const;
};

struct Inputs {
  Tensor q, k, v, dout;
  std::vector<int64_t> q_pos, k_pos;
  std::vector<int32_t> q_doc, k_doc;
  Tokens q_tokens() const { return {q_pos, q_doc}; }
  Tokens k_tokens() const { return {k_pos, k_doc}; }
};
Inputs make_inputs(const Case& c);

struct Outputs {
  Tensor o, lse, dq, dk, dv;  // o fp32 (finalised from the fp32 state), grads fp32
  KernelStats fwd, bwd;
};
// K/V block j of `blocks` (keys [Tk * j / blocks, Tk * (j + 1) / blocks)): a [B, Tk, H, D]
// tensor's slice, and the block's tokens.
TensorView kv_block(const TensorView& t, int j, int blocks);
Tokens kv_tokens(const Inputs& in, int j, int blocks);

// Forward over the K/V split into `kv_blocks` blocks absorbed in `order` (empty: 0, 1, ...),
// then finalize, delta from the fp32 O, and backward block by block in the same order, every
// call with `config` and `threads` threads.
Outputs run_fast(const Inputs& in, const Mask& mask, int threads, bool backward = true,
                 int kv_blocks = 1, std::vector<int> order = {}, KernelConfig config = {});

double max_abs(const std::vector<double>& ref);
// max |t - ref| over finite entries; an entry where exactly one side is -inf counts as infinite.
double max_err(const Tensor& t, const std::vector<double>& ref);
double max_err(const std::vector<double>& a, const std::vector<double>& ref);

// The fp64 truth and the naive fp32 computation of the same inputs.
struct References {
  reference::Result ref64, naive32;
};
References references_of(const Inputs& in, const Mask& mask, bool backward);
// Checks every output of `fast` by the rule; "" when all pass, else what failed and by how much.
std::string rule_violations(const Outputs& fast, const References& refs, bool backward);

// Runs the case through fast, naive32 and ref64 and checks every output by the rule.
// Returns a description of the first violation, or "" when all pass.
std::string check_case(const Case& c, bool backward);

// A sliding window [q - l, q + r] (Mask's window_left / window_right), causal or over
// documents where asked.
inline Mask window(int64_t l, int64_t r, bool causal = false, bool documents = false) {
  Mask m;
  m.window_left = l, m.window_right = r, m.causal = causal, m.documents = documents;
  return m;
}

}  // namespace ctxpar::test

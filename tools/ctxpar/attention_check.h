// --check of `ctxpar attention`: the gathered, unsharded outputs of a distributed run against
// the fp64 reference of the whole problem (ctxpar/reference.h), with the tolerance rule of the
// kernel tests: max |run - ref64| <= 2 * max |naive32 - ref64| + floor.
//
// The fp64 reference materialises scores and costs B*Hq*T*T*D multiply-adds. When that passes
// the budget, evenly spaced query rows are checked (out, lse, dq are per-row exact against all
// keys), and dk, dv are checked on evenly spaced key rows by an fp64 sum over every query that
// uses the run's own LSE and O (themselves checked on the sampled rows): see check_note.
#pragma once
#include <span>
#include <string>
#include <vector>

#include "attention_job.h"

namespace ctxpar::cli {

struct CheckInputs {
  // Full, unsharded, original token order:
  //   q, dout, out [B, T, Hq, D]; k, v [B, T, Hkv, D]; lse [B, Hq, T];
  //   dq [B, T, Hq, D] fp32; dk, dv [B, T, Hkv, D] fp32 (empty views without backward).
  TensorView q, k, v, dout, out, lse, dq, dk, dv;
  Tokens tokens;  // T positions (and document ids) of the whole sequence
  // The user's own document ids (T, int64) when tokens.documents are labels made from them:
  // the check first proves the labels an order-preserving bijection of these ids.
  std::span<const int64_t> document_ids;
  Mask mask;
  DType dtype = DType::f32;              // storage type of q, k, v, out, dout
  Bf16Tier bf16_tier = Bf16Tier::exact;  // fast (bf16 only): the fast tier's floor, 2^-7
};

// Fills result.checked, check_passed, checks, max_abs_err, tolerance, check_sampled,
// check_query_rows, check_key_rows, check_note. `threads` runs reference rows in parallel.
void check_against_reference(const CheckInputs& in, double budget, int threads,
                             AttentionResult& result);

}  // namespace ctxpar::cli

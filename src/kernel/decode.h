// Private to the kernel and inference layers: decode's attention over a KV cache shard read in
// place (src/kernel/simd_decode.cc; docs/inference.md, "Decode reads the cache in place").
#pragma once
#include <cstdint>
#include <span>

#include "ctxpar/mask.h"
#include "ctxpar/tensor.h"

namespace ctxpar::kernel {

// One sequence's Tn new tokens against this rank's shard of it.
//   q          [1, Tn, Hq, D] fp32 or bf16 (any strides; D contiguous)
//   k, v       the shard's n rows in increasing position, as the cache's pages hold them (read
//              where they lie: no copy is made), fp32 or bf16: k_pages[i], v_pages[i] [1, rows_i,
//              Hkv, D] hold rows [i page_rows, i page_rows + rows_i), every rows_i = page_rows
//              but the last's. Row j is row j mod page_rows of page j / page_rows.
//   out        fp32 [1, Tn g, Hkv, D] (row t g + j: query head h g + j of token t, g = Hq / Hkv)
//   lse        fp32 [1, Hkv, Tn g]
// The mask hides keys by position through one range per query (causal, window: no slices) and
// may hold documents: the keys a query sees by position are a run of the shard's rows, found by
// binary search; with documents, those of the query's document within it, which must again be
// one run (documents appended one after another) -- nothing is tested per key in the products.
struct DecodeShard {
  TensorView q;
  std::span<const int64_t> q_positions;  // Tn
  std::span<const int32_t> q_documents;  // Tn, when mask.documents
  std::span<const TensorView> k_pages, v_pages;
  int64_t page_rows = 1;
  std::span<const int64_t> k_positions;  // n, increasing
  std::span<const int32_t> k_documents;  // n, when mask.documents
  Mask mask;
  float scale = 0;  // 0: 1/sqrt(D), as KernelConfig::scale
  int threads = 1;
  // The fast bf16 tier (KernelConfig::bf16_tier, for a bf16 cache): P rounded to bf16 before
  // P V, l summed from the fp32 P -- the tile kernel's rule (docs/kernel.md, "bf16 tiers").
  bool round_p = false;
  TensorView out, lse;
};

// Keys a split of the context holds (Note [Decode splits the context in fixed blocks]).
inline constexpr int64_t kDecodeSplit = 512;

// out, lse of the softmax attention of each query row over its visible keys (O = 0, LSE =
// -inf for a row that sees none), fp32 accumulation; bitwise the same for any `threads` and
// any page_rows (the products run in key order whatever the pages' bounds). Returns false,
// before any work and with out and lse untouched, where a query's visible keys are not one run
// (its document's id also used on a row apart from its run): the caller takes the tile path.
[[nodiscard]] bool decode_in_place(const DecodeShard& p);

}  // namespace ctxpar::kernel

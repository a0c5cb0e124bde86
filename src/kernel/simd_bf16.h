// Private to the kernel layer: the exact bf16 products (docs/kernel.md, "bf16
// products"). With bf16 inputs the scores S = Q K^T and dP = dO V^T are products of bf16
// values, exact in fp32 (8-bit x 8-bit significands), so AVX512_BF16's vdpbf16ps (bf16 pairs
// multiplied and added into fp32 lanes) computes them with fp32 accumulation -- only the order
// of the fp32 additions differs from the fp32 path (pairs along D). P, dS and every
// accumulator stay fp32. Used where the probe measured vdpbf16ps faster than fp32 FMAs, or
// where CTXPAR_BF16_PRODUCTS=on forces it (bf16_probe.cc), on the avx512 SIMD targets only.
// The functions are compiled for AVX512_BF16 by target attributes (simd_bf16.cc): the build
// needs no flag and runs on AVX2-only CPUs, where they are never called.
#pragma once
#include <cstdint>

#include "ctxpar/tensor.h"
#include "kernel/lines.h"

namespace ctxpar::kernel::bf16 {

// bf16 pairs (uint32 words) a packed row of D values holds: ceil(D / 2), the odd tail zero.
inline int64_t pairs(int64_t d) { return (d + 1) / 2; }
// Pairs a packed row / key tile stores: pairs(d), or for AMX tiles (16 pairs deep) rounded up
// to 16 with zero pairs (each adds an exact +0 to the fp32 sums, so no bit of a nonzero score
// changes).
inline int64_t stored_pairs(int64_t d, bool amx) {
  return amx ? (pairs(d) + 15) / 16 * 16 : pairs(d);
}
// Row stride (words) of packed Q / dO rows (one extra cache line where a row is a multiple of
// 256 bytes, as Note [Padded rows] in simd_tile.h).
inline int64_t row_words(int64_t d, bool amx = false) {
  const int64_t w = stored_pairs(d, amx);
  return (w * 4) % 256 == 0 ? w + 16 : w;
}

// Rows [i0, i0 + rows) of one (batch, head) of a bf16 t [B, T, H, D] as bf16 pairs, `ld`
// words a row, rows beyond `rows` (up to tile_rows) and the odd tail zero. The values are
// copied, never rounded: they already are bf16.
void pack_rows(const TensorView& t, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t d,
               int64_t ld, uint32_t* out, int64_t tile_rows);
// Keys [j0, j0 + cols) of one (batch, head) of a bf16 t as a key tile of pairs: word
// [p][c] = (t[j0 + c][2p], t[j0 + c][2p + 1]), 64 columns (kKernelTile), zero-padded to
// stored_pairs(d, amx) pairs.
void pack_tile(const TensorView& t, int64_t b, int64_t h, int64_t j0, int64_t cols, int64_t d,
               uint32_t* out, bool amx = false);
// The same word by word: the reference the vector path is checked against (Note [Packing by
// vectors] in simd_bf16.cc).
void pack_tile_words(const TensorView& t, int64_t b, int64_t h, int64_t j0, int64_t cols, int64_t d,
                     uint32_t* out, bool amx = false);

// C[m][64] = mul * (A B): A m rows of pairs (stride lda words), B a packed key tile of
// `npairs` pairs; m a multiple of 2. Each C element sums its pairs in the order p = 0, 1, ...
// in fp32 (vdpbf16ps: DAZ / FTZ, round to nearest), then is multiplied by `mul` once.
// amx: through AMX-BF16 tiles instead (amx_bf16.cc; npairs = stored_pairs(d, true), lda a
// multiple of 16 as row_words(d, true) is; any m): the same exact products summed in fp32 by
// tdpbf16ps, 16 pairs a step, in its own order (so the bits differ from vdpbf16ps's).
void scores(int64_t m, int64_t npairs, const uint32_t* a, int64_t lda, const uint32_t* b, float* c,
            float mul, bool amx = false);
void scores_amx(int64_t m, int64_t npairs, const uint32_t* a, int64_t lda, const uint32_t* b,
                float* c, float mul);

// P V, dV, dK and dQ through AMX tiles (Note [P V, dV, dK, dQ through AMX] in amx_bf16.cc): the
// exact tier (P and dS split in 3 bf16 parts) and the fast tier (rounded). Their B operands are
// bf16 values paired along the summed (token) index, "VNNI" rows: word [p][c] = (x[2p][c], x[2p +
// 1][c]). Words a pair-row stores: d rounded up to 16 (one tile's columns), one cache line more
// where that is a multiple of 256 bytes (Note [Padded rows] in simd_tile.h).
inline int64_t vnni_words(int64_t d) {
  const int64_t w = (d + 15) / 16 * 16;
  return (w * 4) % 256 == 0 ? w + 16 : w;
}
// Rows [i0, i0 + rows) of one (batch, head) of a bf16 t [B, T, H, D] as tile_rows / 2 pair-rows of
// `ldb` words (tile_rows even, >= rows): rows past `rows` and columns past d zero. The values are
// copied, never rounded.
void pack_vnni(const TensorView& t, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t d,
               int64_t ldb, uint32_t* out, int64_t tile_rows);
void pack_vnni_words(const TensorView& t, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t d,
                     int64_t ldb, uint32_t* out, int64_t tile_rows);  // the reference
// rows rows of 2 npairs fp32 values (ldx floats a row) as bf16 pairs rounded to nearest even
// (vcvtne2ps2bf16: a subnormal comes out 0), ldw words a row. nsplit > 1: also what each part left,
// rounded the same way, as part 2, 3, ... (split_words apart): x = part 1 + part 2 + part 3 exactly
// for 3 parts (8 + 8 + 8 significand bits cover fp32's 24, the signs of the remainders free),
// unless a part falls below bf16's normal range (below 2^-126: flushed).
void round_to_pairs(const float* x, int64_t ldx, int64_t rows, int64_t npairs, uint32_t* out,
                    int64_t ldw, int nsplit = 1, int64_t split_words = 0);
// The bf16 parts P and dS take through the tiles: 1 in the fast tier (rounded), 3 in the exact
// one (their sum is the fp32 value).
inline int amx_parts(bool round_p) { return round_p ? 1 : 3; }
// C[m][n] (+)= A B through AMX tiles: A m rows of npairs pairs (lda words a row), B npairs
// pair-rows of n columns (ldb words a pair-row); m, n and npairs multiples of 16. accumulate: C's
// values are the tiles' starting sums, else zero. Each C element adds 16 pairs a step in fp32
// (round to nearest even) in tdpbf16ps's order. nsplit > 1: A is the sum of nsplit parts
// (round_to_pairs' split, split_words apart), each part's 16 pairs added in turn against the same B
// tiles.
void gemm_amx(int64_t m, int64_t n, int64_t npairs, const uint32_t* a, int64_t lda,
              const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate,
              int nsplit = 1, int64_t split_words = 0);
// The same in nchunks chunks of chunk_pairs (a multiple of 16) pairs: A's chunk i at a + i a_chunk
// (rows lda words apart, parts split_words apart), B's at b[i] (ldb words a pair-row); npairs =
// nchunks chunk_pairs. The backward's deeper products (Note [Deeper tile products] in
// simd_backward_products.h): one C load and store for several query tiles' (or key tiles')
// products, each element adding its pairs (and parts) in the order successive calls of one
// chunk each would.
// b_parts 3 (Note [fp32 through three bf16 parts] in amx_bf16.cc): B is the sum of 3 parts too,
// b_part words apart, and C adds the 6 products of A's part i and B's part j with i + j < 3
// (nsplit 3): for each 16 pairs, B's part 0 against A's parts 0, 1, 2, part 1 against 0, 1, part 2
// against 0.
void gemm_amx_chunks(int64_t m, int64_t n, int64_t nchunks, int64_t chunk_pairs, const uint32_t* a,
                     int64_t lda, int64_t a_chunk, const uint32_t* const* b, int64_t ldb, float* c,
                     int64_t ldc, bool accumulate, int nsplit = 1, int64_t split_words = 0,
                     int b_parts = 1, int64_t b_part = 0);
// fp32 rows [0, rows) (ld floats apart from src), d values a row, as 3 parts of VNNI pair-rows
// (round_to_pairs' split of each value: part i what parts 0..i-1 left, rounded to nearest even,
// subnormal parts flushed): word c of pair-row r / 2 of part i holds row 2i's part (low half)
// and row 2i + 1's (high half, zero past rows); part_words apart, ldb words a pair-row. Columns
// past d and pair-rows past rows / 2 are left as they are (the caller zeroes them).
void split_vnni(const float* src, int64_t ld, int64_t rows, int64_t d, int64_t ldb, uint32_t* out,
                int64_t part_words);
// A key tile's 64 fp32 rows (2 np floats a row, zero past d and past its keys) as 3 parts of a
// key tile of pairs (round_to_pairs' split; part i at out + i np 64: word [p][c] = key c's pair
// p); words holds 3 x 64 x np. (Q's rows take round_to_pairs itself: 3 parts, rows of pairs.)
void split_key_tile(const float* rows, int64_t np, uint32_t* words, uint32_t* out);

// The same C[m][n] (+)= A B (nsplit 1) through vdpbf16ps (simd_bf16.cc): A's pair broadcast
// against 16-column vectors of B's pair-rows, each C element adding its pairs in the order
// p = 0, 1, ... in fp32 (round to nearest even, DAZ / FTZ); m even, n a multiple of 16. The fast
// tier's P V, dV, dK and dQ where the products take vdpbf16ps (Note [The fast tier through
// vdpbf16ps] in simd_bf16.cc).
void gemm_dot(int64_t m, int64_t n, int64_t npairs, const uint32_t* a, int64_t lda,
              const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate);
// gemm_amx where amx, else gemm_dot (nsplit 1 only).
inline void gemm_pairs(int64_t m, int64_t n, int64_t npairs, const uint32_t* a, int64_t lda,
                       const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate,
                       bool amx, int nsplit = 1, int64_t split_words = 0) {
  if (amx)
    gemm_amx(m, n, npairs, a, lda, b, ldb, c, ldc, accumulate, nsplit, split_words);
  else
    gemm_dot(m, n, npairs, a, lda, b, ldb, c, ldc, accumulate);
}
// Whether P V, dV, dK and dQ take bf16 pairs (gemm_pairs) for the given products and tier: always
// through AMX tiles (3 parts make the exact tier's fp32 P and dS; tiles run well over 3 x the FMA
// rate where the probe chose them), through vdpbf16ps only for the fast tier (3 parts at about
// 2 x the FMA rate would be slower than fp32 products).
inline bool pair_products(bool bf16_products, bool amx, bool round_p) {
  return bf16_products && (amx || round_p);
}

// Per-thread buffers of packed pairs that keep their pages between calls (as scratch() in
// simd_tile.h); contents undefined.
enum class Buffer { k_tiles, q_rows, do_rows, v_vnni, q_vnni, do_vnni, count };
uint32_t* buffer(Buffer slot, size_t words);

// sum_c o[c] g[c] over d values added exactly as scores() adds a dP = dO . V (for the
// backward's delta, api.cc): where a row's softmax is one-hot, O is that key's V and
// dS = P (dP - delta) must come out exactly 0. Where every o and g is a bf16 value the sum runs
// through vdpbf16ps itself (whatever order the CPU adds a pair in); otherwise in fp32 as Intel
// documents it (per pair the odd element's product, then the even one's, each add rounded).
// amx: the exact case runs through one AMX tile product chain as scores(..., amx) adds a dP.
float delta_dot(const float* o, const float* g, int64_t d, bool amx = false);
// sum over p < npairs (a multiple of 16) of the pair products of x[p] and y[p], added exactly
// as scores_amx adds one score whose A row is x and whose key column is y (amx_bf16.cc).
float dot_pairs_amx(const uint32_t* x, const uint32_t* y, int64_t npairs);

}  // namespace ctxpar::kernel::bf16

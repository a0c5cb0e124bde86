// The CUDA fallback kernel's mathematics (src/cuda/tile_math.cuh) run on the host -- the same
// functions kernels.cu launches -- over whole problems: against the fp64 reference under the
// accuracy rule (D = 24, 40, 64, 128; fp32 and bf16 storage; GQA; masks from positions with
// strides, shuffles, windows, documents and padding; K/V in several blocks), bitwise against
// the CPU's scalar path (the ctest entry sets CTXPAR_KERNEL=scalar), and its pieces (mask rules,
// tile ranges, merge, casts, copies) against the library's own.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "ctxpar/kernel.h"
#include "ctxpar/mask.h"
#include "cuda/tile_host.h"
#include "kernel/kernel_support.h"
#include "kernel/problem.h"

namespace ctxpar {
namespace {

using test::Case;

// The tile math's outputs for one case, shaped as the CPU kernel's (test::Outputs): forward
// over the K/V split into `blocks` blocks, finalize into fp32, delta, backward block by block.
test::Outputs run_tiles(const test::Inputs& in, const Mask& mask, int blocks) {
  const int64_t b = in.q.dim(0), tq = in.q.dim(1), hq = in.q.dim(2), d = in.q.dim(3);
  const int64_t tk = in.k.dim(1), hkv = in.k.dim(2);
  const bool bf16 = in.q.dtype() == DType::bf16;
  auto block = [&](int j, const TensorView& t) { return test::kv_block(t, j, blocks); };
  auto tokens = [&](int j) { return test::kv_tokens(in, j, blocks); };
  test::Outputs out;
  ForwardState state(b, tq, hq, d);
  for (int j = 0; j < blocks; ++j) {
    if (bf16)
      cuda::forward_host<cuda::Bf16>(in.q, in.q_tokens(), block(j, in.k), block(j, in.v), tokens(j),
                                     mask, state);
    else
      cuda::forward_host<float>(in.q, in.q_tokens(), block(j, in.k), block(j, in.v), tokens(j),
                                mask, state);
  }
  out.o = Tensor(DType::f32, {b, tq, hq, d});
  out.lse = Tensor(DType::f32, {b, hq, tq});
  cuda::finalize_host<float>(state, out.o, out.lse);
  Tensor delta(DType::f32, {b, hq, tq});
  cuda::delta_host<float>(out.o, Tensor::copy_of(in.dout, DType::f32), delta);
  out.dq = Tensor(DType::f32, {b, tq, hq, d});
  out.dk = Tensor(DType::f32, {b, tk, hkv, d});
  out.dv = Tensor(DType::f32, {b, tk, hkv, d});
  for (int j = 0; j < blocks; ++j) {
    auto run = [&](auto storage) {
      using T = decltype(storage);
      cuda::backward_host<T>(in.q, in.q_tokens(), block(j, in.k), block(j, in.v), tokens(j), mask,
                             in.dout, out.lse, delta, out.dq, block(j, out.dk.view()),
                             block(j, out.dv.view()));
    };
    if (bf16)
      run(cuda::Bf16{});
    else
      run(0.0f);
  }
  return out;
}

std::vector<Case> grid() {
  std::vector<Case> cases;
  const char* masks[] = {"none",      "causal",           "window:9,3", "causal+window:20,0",
                         "documents", "causal+documents", "window:0,0"};
  uint64_t seed = 1;
  for (int64_t d : {24, 40, 64, 128})
    for (const char* m : masks)
      for (int variant = 0; variant < 3; ++variant) {
        Case c;
        c.d = d;
        c.mask = parse_mask(m);
        c.seed = seed++;
        c.tq = 70 + 13 * variant, c.tk = 131 - 20 * variant;  // partial tiles, Tq != Tk
        c.hq = variant == 1 ? 4 : 2, c.hkv = variant == 1 ? 2 : variant == 2 ? 1 : 2;  // GQA
        c.batch = variant == 2 ? 2 : 1;
        c.dtype = variant == 1 ? DType::bf16 : DType::f32;
        c.doc_len = 23;
        // Positions: contiguous after the queries (a later K/V block); striped by 3 and offset;
        // shuffled (as after a Ulysses all-to-all).
        if (variant == 0) c.q_offset = 100, c.k_offset = 40;
        if (variant == 1) c.q_stride = 3, c.k_stride = 2, c.q_offset = 7;
        if (variant == 2) c.shuffle = true;
        cases.push_back(c);
      }
  return cases;
}

TEST(CudaTileMath, ForwardAndBackwardMeetTheAccuracyRule) {
  int checked = 0;
  for (const Case& c : grid())
    for (int blocks : {1, 3}) {
      SCOPED_TRACE(c.name() + " kv_blocks=" + std::to_string(blocks));
      const test::Inputs in = test::make_inputs(c);
      const std::string fail = test::rule_violations(run_tiles(in, c.mask, blocks),
                                                     test::references_of(in, c.mask, true), true);
      EXPECT_EQ(fail, "");
      ++checked;
    }
  EXPECT_EQ(checked, 4 * 7 * 3 * 2);
}

// Same rows, same tiles, same order of additions: bitwise the CPU's scalar path.
TEST(CudaTileMath, BitwiseTheScalarPath) {
  const char* kernel = std::getenv("CTXPAR_KERNEL");
  ASSERT_TRUE(kernel && std::string(kernel) == "scalar")
      << "the ctest entry sets CTXPAR_KERNEL=scalar; run test_cuda_tile through ctest";
  for (const Case& c : grid()) {
    if (c.dtype != DType::f32 || c.d > 64) continue;  // bf16: same, one storage type suffices
    SCOPED_TRACE(c.name());
    const test::Inputs in = test::make_inputs(c);
    const test::Outputs cpu = test::run_fast(in, c.mask, 1, true, 2);
    const test::Outputs gpu_math = run_tiles(in, c.mask, 2);
    for (auto [a, b, what] : {std::tuple{&cpu.o, &gpu_math.o, "o"},
                              {&cpu.lse, &gpu_math.lse, "lse"},
                              {&cpu.dq, &gpu_math.dq, "dq"},
                              {&cpu.dk, &gpu_math.dk, "dk"},
                              {&cpu.dv, &gpu_math.dv, "dv"}})
      EXPECT_EQ(std::memcmp(a->data(), b->data(), a->bytes()), 0) << what;
  }
}

// Rows that see no key (padding queries, a window that misses): O = 0, LSE = -inf, no gradient.
TEST(CudaTileMath, FullyMaskedRowsAreZeroWithMinusInfinityLse) {
  Case c;
  c.tq = 80, c.tk = 70, c.d = 40, c.mask = parse_mask("window:0,0"), c.q_stride = 2, c.k_offset = 1,
  c.k_stride = 2;  // odd keys, even queries: nothing visible anywhere
  test::Inputs in = test::make_inputs(c);
  for (int64_t i = 60; i < 80; ++i) in.q_pos[i] = kPaddingPosition;
  const test::Outputs out = run_tiles(in, c.mask, 1);
  for (int64_t i = 0; i < out.o.numel(); ++i) ASSERT_EQ(out.o.ptr<float>()[i], 0.0f);
  for (int64_t i = 0; i < out.lse.numel(); ++i)
    ASSERT_EQ(out.lse.ptr<float>()[i], -std::numeric_limits<float>::infinity());
  for (const Tensor* g : {&out.dq, &out.dk, &out.dv})
    for (int64_t i = 0; i < g->numel(); ++i) ASSERT_EQ(g->ptr<float>()[i], 0.0f);
}

// tile_range_of against the CPU kernel's tile_ranges (problem.h), through the classification
// both kernels share (mask_rules.h).
TEST(CudaTileMath, TileRangesAndClassesAgreeWithTheCpuKernel) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t n = 1 + int64_t(rng() % 300);
    std::vector<int64_t> pos(n);
    std::vector<int32_t> doc(n);
    for (int64_t i = 0; i < n; ++i) {
      pos[i] = rng() % 5 == 0 ? kPaddingPosition : int64_t(rng() % 500) - 100;
      doc[i] = int32_t(rng() % 4);
    }
    if (trial % 7 == 0)
      for (int64_t i = 0; i < std::min<int64_t>(n, 64); ++i) pos[i] = kPaddingPosition;
    const Mask m = parse_mask(trial % 2 ? "causal+window:50,10+documents" : "window:30,-1");
    const Tokens t{pos, doc};
    const kernel::TileRanges cpu = kernel::tile_ranges(t, n, kKernelTile, m.documents);
    const std::vector<cuda::TileRange> ours = cuda::tile_ranges_host(t, n, m.documents);
    ASSERT_EQ(int64_t(ours.size()), cpu.count());
    for (int64_t a = 0; a < cpu.count(); ++a) {
      ASSERT_EQ(ours[a].padding, int(cpu.padding[a]));
      for (int64_t b = 0; b < cpu.count(); ++b)
        ASSERT_EQ(cuda::classify(m, ours[a], ours[b]), kernel::classify(m, cpu, a, cpu, b));
    }
  }
}

TEST(CudaTileMath, MergeIsTheLibrarysMergeBitwise) {
  const int64_t b = 2, t = 9, h = 3, d = 40;
  Tensor oa(DType::f32, {b, t, h, d}), ob(DType::f32, {b, t, h, d});
  Tensor la(DType::f32, {b, h, t}), lb(DType::f32, {b, h, t});
  fill_normal(oa, 1), fill_normal(ob, 2), fill_normal(la, 3, 20), fill_normal(lb, 4, 20);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < b * h * t; r += 4) la.ptr<float>()[r] = ninf;  // a saw nothing
  for (int64_t r = 0; r < b * h * t; r += 3) lb.ptr<float>()[r] = ninf;  // b saw nothing
  Tensor oa2 = Tensor::copy_of(oa), la2 = Tensor::copy_of(la);
  merge(oa, la, ob, lb);
  cuda::merge_host(oa2, la2, ob, lb);
  EXPECT_EQ(std::memcmp(oa.data(), oa2.data(), oa.bytes()), 0);
  EXPECT_EQ(std::memcmp(la.data(), la2.data(), la.bytes()), 0);
}

TEST(CudaTileMath, CastsAreTheLibrarysBitwise) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {  // every bf16, NaNs and infinities included
    const float wide = cuda::to_f32(cuda::Bf16{uint16_t(bits)});
    ASSERT_EQ(cuda::f32_bits(wide), cuda::f32_bits(bf16_to_f32(uint16_t(bits))));
  }
  std::mt19937 rng(5);
  for (int i = 0; i < 4000000; ++i) {  // fp32 -> bf16 on random bit patterns (all classes)
    const uint32_t u = i < 65536 ? (uint32_t(i) << 16) | 0x8000u : rng();
    const float f = cuda::f32_of_bits(u);
    ASSERT_EQ(cuda::bf16_bits_of(f), f32_to_bf16(f)) << std::hex << u;
  }
}

// pack_kv's strided copy with a cast, and the token permutations, against copy_into and the
// definitions of device.h (dst[index[i]] = src[i]; dst[i] = src[index[i]]).
TEST(CudaTileMath, CopiesAndPermutationsAreTheLibrarys) {
  const int64_t b = 2, t = 11, h = 3, d = 40;
  Tensor wide(DType::f32, {b, t, h + 2, d});
  fill_normal(wide, 9);
  const TensorView src = TensorView(wide.data(), DType::f32, {b, t, h, d},
                                    {t * (h + 2) * d, (h + 2) * d, d, 1});  // strided: 3 of 5 heads
  Tensor want(DType::bf16, {b, t, h, d}), got(DType::bf16, {b, t, h, d});
  copy_into(src, want);
  for (int64_t n = 0; n < b * t * h * d; ++n)
    cuda::copy_element(cuda::view4<const float>(src), got.ptr<cuda::Bf16>(), t, h, d, n);
  EXPECT_EQ(std::memcmp(want.data(), got.data(), want.bytes()), 0);

  std::vector<int64_t> index(t);
  for (int64_t i = 0; i < t; ++i) index[i] = (i * 7 + 3) % t;  // a permutation of 0..10
  const int64_t row = h * d * 4;
  for (bool scatter : {true, false}) {
    std::vector<std::byte> out(b * t * row), expect(b * t * row);
    const auto* in = static_cast<const std::byte*>(wide.data());
    for (int64_t o = 0; o < b; ++o)
      for (int64_t i = 0; i < t; ++i) {
        const int64_t from = scatter ? i : index[i], to = scatter ? index[i] : i;
        std::memcpy(&expect[(o * t + to) * row], in + (o * t + from) * row, row);
      }
    for (int64_t n = 0; n < b * t * row; ++n) {
      const cuda::BytePair at = cuda::permute_byte(n, t, row, index.data(), scatter);
      out[at.dst] = in[at.src];
    }
    EXPECT_EQ(out, expect) << (scatter ? "scatter" : "gather");
  }
}

}  // namespace
}  // namespace ctxpar

// The fused-call decomposition (src/device/fused_calls.h), exhaustively: every layout x
// P = 1..8 x mask x (query rank, key rank) block pair, with and without padding, user
// positions and packed documents. The coverage check is exact (a count per (q, k) pair); the
// numeric check runs every call through the CPU kernel and merges the partial results as the
// CUDA device will, against the fp64 reference under the accuracy rule.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "ctxpar/kernel.h"
#include "ctxpar/layout.h"
#include "ctxpar/mask.h"
#include "ctxpar/reference.h"
#include "ctxpar/tensor.h"
#include "device/fused_calls.h"

namespace ctxpar {
namespace {

using fused::Call;

const char* kMasks[] = {"none",
                        "causal",
                        "window:5,0",
                        "causal+window:7,0",
                        "window:6,3",
                        "window:0,4",
                        "documents",
                        "causal+documents",
                        "causal+window:4,0+documents",
                        "window:3,2+documents"};

// Per-token document ids for T tokens: lengths 5, 1, 9, 3, 11, ... cycling, the last cut short.
std::vector<int32_t> documents_of(int64_t t) {
  const int64_t lengths[] = {5, 1, 9, 3, 11, 2};
  std::vector<int32_t> d(t);
  int64_t at = 0;
  for (int32_t doc = 0; at < t; ++doc)
    for (int64_t n = 0; n < lengths[doc % 6] && at < t; ++n) d[at++] = doc;
  return d;
}

// Returns "" when `calls` cover exactly the visible pairs of (q, k) once each and every call
// row sees a key; else what is wrong.
std::string check_coverage(const Tokens& q, const Tokens& k, const Mask& mask,
                           const std::vector<Call>& calls) {
  const int64_t nq = q.positions.size(), nk = k.positions.size();
  std::vector<int> count(nq * nk, 0);
  for (const Call& c : calls) {
    if (c.q_begin < 0 || c.q_end > nq || c.q_begin >= c.q_end || c.k_begin < 0 || c.k_end > nk ||
        c.k_begin >= c.k_end)
      return "call out of bounds or empty";
    if ((c.has_upper && c.upper < 0) || (c.has_lower && c.lower < 0)) return "negative bound";
    for (int64_t i = 0; i < c.rows(); ++i) {
      int seen = 0;
      for (int64_t j = 0; j < c.keys(); ++j)
        if (c.visible(i, j)) {
          ++count[(c.q_begin + i) * nk + c.k_begin + j];
          ++seen;
        }
      if (seen == 0) return "call " + c.describe() + " has a row with no visible key";
    }
  }
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t j = 0; j < nk; ++j) {
      const bool want =
          mask.visible(q.positions[i], k.positions[j], mask.documents ? q.documents[i] : 0,
                       mask.documents ? k.documents[j] : 0);
      if (count[i * nk + j] != (want ? 1 : 0))
        return "pair (" + std::to_string(i) + ", " + std::to_string(j) + ") covered " +
               std::to_string(count[i * nk + j]) + " times, visible " + std::to_string(want);
    }
  return "";
}

struct Block {
  std::vector<int64_t> positions;
  std::vector<int32_t> documents;
  Tokens tokens() const { return {positions, documents}; }
};

Block block_of(const Layout& layout, int rank, const std::vector<int64_t>& user_positions,
               const std::vector<int32_t>& docs) {
  Block b;
  b.positions = layout.token_positions(rank, user_positions);
  if (!docs.empty()) b.documents = layout.shard(docs, rank, int32_t{-1});
  return b;
}

TEST(FusedDecompose, CoversEveryVisiblePairOnceForEveryLayoutRanksAndMask) {
  int blocks = 0, calls_total = 0;
  for (LayoutKind kind : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped})
    for (int p = 1; p <= 8; ++p) {
      const int64_t granule = layout_granule(kind, p);
      for (int64_t t : {granule * 3, granule * 3 - 1, granule * 2 + 1})
        for (int offset : {0, 1}) {
          // offset 1: user positions 1000 + 3t (a stride the layout does not know about)
          std::vector<int64_t> user;
          if (offset)
            for (int64_t i = 0; i < t; ++i) user.push_back(1000 + 3 * i);
          const std::vector<int32_t> docs = documents_of(t);
          const Layout layout(kind, t, p);
          for (const char* m : kMasks) {
            const Mask mask = parse_mask(m);
            for (int rq = 0; rq < p; ++rq)
              for (int rk = 0; rk < p; ++rk) {
                const Block q = block_of(layout, rq, user, docs),
                            k = block_of(layout, rk, user, docs);
                const auto calls = fused::decompose(q.tokens(), k.tokens(), mask);
                const std::string bad = check_coverage(q.tokens(), k.tokens(), mask, calls);
                ASSERT_EQ(bad, "")
                    << layout_name(kind) << " P=" << p << " T=" << t << " offset=" << offset
                    << " mask=" << m << " q rank " << rq << " k rank " << rk;
                ++blocks;
                calls_total += calls.size();
              }
          }
        }
    }
  EXPECT_GT(blocks, 10000);
  RecordProperty("blocks", blocks);
  RecordProperty("calls", calls_total);
}

// The calls the issue names: zigzag's diagonal is causal top-left and its off-diagonal halves
// take no mask; striped's upper blocks are q[1:] x k[:-1] causal.
TEST(FusedDecompose, CausalBlocksTakeTheExpectedShapes) {
  const Mask causal = Mask::causal_mask();
  {
    const Layout z(LayoutKind::zigzag, 64, 4);  // chunks of 8; rank 1 holds chunks 1 and 6
    const Block q = block_of(z, 1, {}, {}), k = block_of(z, 1, {}, {});
    const auto calls = fused::decompose(q.tokens(), k.tokens(), causal);
    ASSERT_EQ(calls.size(), 3u);
    EXPECT_EQ(calls[0].describe(), "causal top-left");  // chunk 1 x chunk 1
    EXPECT_EQ(calls[1].describe(), "none");             // chunk 6 x chunk 1
    EXPECT_EQ(calls[1].q_begin, 8);
    EXPECT_EQ(calls[1].k_end, 8);
    EXPECT_EQ(calls[2].describe(), "causal top-left");  // chunk 6 x chunk 6
  }
  {
    const Layout s(LayoutKind::striped, 32, 4);  // rank r: r, r+4, ...
    const Block q = block_of(s, 1, {}, {}), k = block_of(s, 2, {}, {});
    const auto calls = fused::decompose(q.tokens(), k.tokens(), causal);
    ASSERT_EQ(calls.size(), 1u);
    EXPECT_EQ(calls[0].q_begin, 1);
    EXPECT_EQ(calls[0].q_end, 8);
    EXPECT_EQ(calls[0].k_begin, 0);
    EXPECT_EQ(calls[0].k_end, 7);
    EXPECT_EQ(calls[0].describe(), "causal top-left");
  }
}

// Arbitrary positions (gaps, repeats, descending steps, values near the ends of int64),
// random documents and padding: the coverage stays exact.
TEST(FusedDecompose, CoversRandomTokensExactly) {
  std::mt19937_64 rng(7);
  const int64_t edge[] = {0, INT64_MIN + 10, INT64_MAX - 200};
  for (int trial = 0; trial < 3000; ++trial) {
    auto make = [&](int64_t n) {
      Block b;
      int64_t pos = edge[rng() % 3] + int64_t(rng() % 50);
      int32_t doc = 0;
      for (int64_t i = 0; i < n; ++i) {
        const int r = rng() % 10;
        pos += r < 6 ? 1 : r < 8 ? int64_t(rng() % 4) : -int64_t(rng() % 3);
        if (rng() % 7 == 0) ++doc;
        b.positions.push_back(pos);
        b.documents.push_back(doc);
      }
      for (int64_t i = n - int64_t(rng() % 3); i < n && i >= 0; ++i)
        b.positions[i] = kPaddingPosition;
      return b;
    };
    const Block q = make(1 + rng() % 20), k = make(1 + rng() % 20);
    const Mask mask = parse_mask(kMasks[rng() % (sizeof(kMasks) / sizeof(kMasks[0]))]);
    const auto calls = fused::decompose(q.tokens(), k.tokens(), mask);
    ASSERT_EQ(check_coverage(q.tokens(), k.tokens(), mask, calls), "") << "trial " << trial;
  }
}

// A batch never holds one query row twice and keeps one mask form.
TEST(FusedDecompose, BatchesHaveDisjointRowsAndOneForm) {
  const Layout z(LayoutKind::zigzag, 200, 4);
  const std::vector<int32_t> docs = documents_of(200);
  const Mask mask = parse_mask("causal+documents");
  const Block q = block_of(z, 1, {}, docs), k = block_of(z, 1, {}, docs);
  const auto calls = fused::decompose(q.tokens(), k.tokens(), mask);
  const auto batches = fused::batch_calls(calls);
  size_t total = 0;
  for (const auto& b : batches) {
    total += b.size();
    for (size_t x = 0; x < b.size(); ++x)
      for (size_t y = x + 1; y < b.size(); ++y) {
        EXPECT_EQ(calls[b[x]].describe(), calls[b[y]].describe());
        EXPECT_TRUE(calls[b[x]].q_end <= calls[b[y]].q_begin ||
                    calls[b[y]].q_end <= calls[b[x]].q_begin);
      }
  }
  EXPECT_EQ(total, calls.size());
  EXPECT_LT(batches.size(), calls.size());  // documents do batch
}

// Rows [begin, end) of a [1, T, H, D] tensor, contiguous.
Tensor rows(const Tensor& t, int64_t begin, int64_t end) {
  return Tensor::copy_of(t.view().slice(1, begin, end));
}

// Each call through the CPU kernel on its sliced tensors with call-local positions and its
// local mask (what the fused library would compute), partial results merged in fp32.
void run_decomposed(const Tensor& q, const Tensor& k, const Tensor& v,
                    const std::vector<Call>& calls, Tensor& out, Tensor& lse) {
  const int64_t nq = q.shape()[1], h = q.shape()[2], d = q.shape()[3];
  out = Tensor(DType::f32, {1, nq, h, d});
  lse = Tensor(DType::f32, {1, h, nq});
  for (int64_t i = 0; i < lse.numel(); ++i) lse.ptr<float>()[i] = -INFINITY;
  for (const Call& c : calls) {
    std::vector<int64_t> qp(c.rows()), kp(c.keys());
    for (int64_t i = 0; i < c.rows(); ++i) qp[i] = i;
    for (int64_t j = 0; j < c.keys(); ++j) kp[j] = j;
    const Tensor qc = rows(q, c.q_begin, c.q_end), kc = rows(k, c.k_begin, c.k_end),
                 vc = rows(v, c.k_begin, c.k_end);
    ForwardState st(1, c.rows(), h, d);
    attention_forward_block(qc, {qp, {}}, kc, vc, {kp, {}}, c.local_mask(), st);
    Tensor oc(DType::f32, {1, c.rows(), h, d}), lc(DType::f32, {1, h, c.rows()});
    attention_forward_finalize(st, oc, lc);
    // Widen to the whole block (other rows: O = 0, LSE = -inf) and merge.
    Tensor ow(DType::f32, {1, nq, h, d}), lw(DType::f32, {1, h, nq});
    for (int64_t i = 0; i < lw.numel(); ++i) lw.ptr<float>()[i] = -INFINITY;
    for (int64_t i = 0; i < c.rows(); ++i)
      for (int64_t x = 0; x < h * d; ++x)
        ow.ptr<float>()[(c.q_begin + i) * h * d + x] = oc.ptr<float>()[i * h * d + x];
    for (int64_t hh = 0; hh < h; ++hh)
      for (int64_t i = 0; i < c.rows(); ++i)
        lw.ptr<float>()[hh * nq + c.q_begin + i] = lc.ptr<float>()[hh * c.rows() + i];
    merge(out, lse, ow, lw);
  }
}

TEST(FusedDecompose, CallsThroughTheCpuKernelMatchTheReference) {
  int checked = 0;
  for (LayoutKind kind : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped})
    for (int p : {1, 2, 3, 4, 8}) {
      const int64_t t = layout_granule(kind, p) * 9 - 1;  // padded
      const Layout layout(kind, t, p);
      const std::vector<int32_t> docs = documents_of(t);
      for (const char* m : kMasks) {
        const Mask mask = parse_mask(m);
        for (int rq = 0; rq < p; rq += 1 + p / 3)
          for (int rk = 0; rk < p; rk += 1 + p / 4) {
            const Block qb = block_of(layout, rq, {}, docs), kb = block_of(layout, rk, {}, docs);
            const int64_t n = layout.local_tokens(), h = 2, d = 16;
            Tensor q(DType::f32, {1, n, h, d}), k(DType::f32, {1, n, h, d}),
                v(DType::f32, {1, n, h, d});
            fill_normal(q, 1 + rq, 1.5f);
            fill_normal(k, 100 + rk, 1.5f);
            fill_normal(v, 200 + rk);
            Tensor out, lse;
            run_decomposed(q, k, v, fused::decompose(qb.tokens(), kb.tokens(), mask), out, lse);
            const auto ref = reference::attention_f64(q, qb.tokens(), k, v, kb.tokens(), mask);
            const auto naive =
                reference::attention_naive_f32(q, qb.tokens(), k, v, kb.tokens(), mask);
            double ref_max = 0, naive_err = 0, err = 0;
            for (size_t i = 0; i < ref.o.size(); ++i) {
              ref_max = std::max(ref_max, std::abs(ref.o[i]));
              naive_err = std::max(naive_err, std::abs(naive.o[i] - ref.o[i]));
              err = std::max(err, std::abs(double(out.ptr<float>()[i]) - ref.o[i]));
            }
            for (size_t i = 0; i < ref.lse.size(); ++i) {
              const double got = lse.ptr<float>()[i];
              if (std::isinf(ref.lse[i])) {
                ASSERT_EQ(got, ref.lse[i]) << "fully masked row " << i;
              } else {
                err =
                    std::max(err, std::abs(got - ref.lse[i]) / std::max(1.0, std::abs(ref.lse[i])));
              }
            }
            ASSERT_LE(err, reference::accuracy_tolerance(naive_err, ref_max))
                << layout_name(kind) << " P=" << p << " mask=" << m << " q rank " << rq
                << " k rank " << rk;
            ++checked;
          }
      }
    }
  EXPECT_GT(checked, 300);
}

}  // namespace
}  // namespace ctxpar

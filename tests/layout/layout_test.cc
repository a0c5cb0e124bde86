// Layouts checked against their definitions written out independently here (a direct formula
// per layout), not against the library's own runs.
#include "ctxpar/layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

namespace ctxpar {
namespace {

// The owner of token t by each layout's definition in DESIGN.md.
int owner_by_definition(LayoutKind kind, int64_t t, int64_t tokens, int p) {
  switch (kind) {
    case LayoutKind::contiguous:
      return static_cast<int>(t / (tokens / p));
    case LayoutKind::zigzag: {
      int64_t chunk = t / (tokens / (2 * p));
      return static_cast<int>(chunk < p ? chunk : 2 * p - 1 - chunk);
    }
    case LayoutKind::striped:
      return static_cast<int>(t % p);
    case LayoutKind::balanced:  // no closed form: tests/layout/balanced_test.cc
      break;
  }
  return -1;
}

const LayoutKind kKinds[] = {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped};

TEST(Layout, PositionsPartitionTheSequenceIncreasingPerRank) {
  for (LayoutKind kind : kKinds)
    for (int p : {1, 2, 3, 4, 8}) {
      const int64_t t = 2 * p * 6;
      Layout layout(kind, t, p);
      std::vector<int> seen(t, 0);
      for (int r = 0; r < p; ++r) {
        std::vector<int64_t> pos = layout.positions(r);
        ASSERT_EQ(static_cast<int64_t>(pos.size()), t / p);
        EXPECT_TRUE(std::is_sorted(pos.begin(), pos.end()) &&
                    std::adjacent_find(pos.begin(), pos.end()) == pos.end())
            << layout_name(kind) << " P=" << p << " rank " << r;
        for (size_t i = 0; i < pos.size(); ++i) {
          ++seen[pos[i]];
          EXPECT_EQ(owner_by_definition(kind, pos[i], t, p), r);
          EXPECT_EQ(layout.owner(pos[i]), r);
          EXPECT_EQ(layout.local_index(pos[i]), static_cast<int64_t>(i));
        }
      }
      for (int64_t i = 0; i < t; ++i) EXPECT_EQ(seen[i], 1) << "token " << i;
    }
}

TEST(Layout, ZigzagPairsEarlyAndLateChunks) {
  // T = 16, P = 4: chunks of 2; rank 1 holds chunks 1 and 6.
  Layout z(LayoutKind::zigzag, 16, 4);
  EXPECT_EQ(z.positions(1), (std::vector<int64_t>{2, 3, 12, 13}));
  EXPECT_EQ(z.positions(0), (std::vector<int64_t>{0, 1, 14, 15}));
  Layout s(LayoutKind::striped, 12, 3);
  EXPECT_EQ(s.positions(2), (std::vector<int64_t>{2, 5, 8, 11}));
}

TEST(Layout, ShardUnshardRoundTripsTensorsAndArrays) {
  for (LayoutKind kind : kKinds)
    for (int p : {1, 3, 4}) {
      const int64_t t = 24;
      Layout layout(kind, t, p);
      for (DType dt : {DType::f32, DType::bf16}) {
        Tensor full(dt, {2, t, 3, 4});
        fill_normal(full, 7);
        std::vector<Tensor> shards;
        std::vector<TensorView> views;
        for (int r = 0; r < p; ++r) {
          shards.push_back(layout.shard(full, r));
          views.push_back(shards.back());
          std::vector<int64_t> pos = layout.positions(r);
          ASSERT_EQ(shards[r].shape(), (Shape{2, t / p, 3, 4}));
          for (int64_t b = 0; b < 2; ++b)
            for (size_t i = 0; i < pos.size(); ++i)
              for (int64_t h = 0; h < 3; ++h)
                for (int64_t d = 0; d < 4; ++d)
                  ASSERT_EQ(shards[r].view().get(b, i, h, d), full.view().get(b, pos[i], h, d));
        }
        Tensor back(dt, {2, t, 3, 4});
        layout.unshard(views, back);
        EXPECT_EQ(std::memcmp(back.data(), full.data(), full.bytes()), 0);
      }
      // LSE-like [B, H, T]: token dim 2.
      Tensor lse(DType::f32, {2, 3, t});
      fill_normal(lse, 3);
      std::vector<Tensor> ls;
      std::vector<TensorView> lv;
      for (int r = 0; r < p; ++r) {
        ls.push_back(layout.shard(lse, r, 2));
        lv.push_back(ls.back());
      }
      Tensor lback(DType::f32, {2, 3, t});
      layout.unshard(lv, lback, 2);
      EXPECT_EQ(std::memcmp(lback.data(), lse.data(), lse.bytes()), 0);
      // Per-token arrays (labels, document ids).
      std::vector<int32_t> docs(t);
      std::iota(docs.begin(), docs.end(), 100);
      std::vector<std::vector<int32_t>> parts;
      for (int r = 0; r < p; ++r) {
        parts.push_back(layout.shard(docs, r));
        std::vector<int64_t> pos = layout.positions(r);
        for (size_t i = 0; i < pos.size(); ++i) EXPECT_EQ(parts[r][i], 100 + pos[i]);
      }
      EXPECT_EQ(layout.unshard(parts), docs);
    }
}

// Any T: the layout pads to its granule (P, or 2P for zigzag) with tokens at the end. Checked
// against the definitions on the padded length, and against the full tensors: shard fills
// padding rows with zeros, unshard drops them, token_positions marks them kPaddingPosition.
TEST(Layout, PadsAnyLengthToItsGranule) {
  for (LayoutKind kind : kKinds)
    for (int p : {1, 2, 3, 4})
      for (int64_t t : {1, 5, 23, 24, 25}) {
        const int64_t g = kind == LayoutKind::zigzag ? 2 * p : p;
        const int64_t tp = (t + g - 1) / g * g;
        const std::string what =
            std::string(layout_name(kind)) + " P=" + std::to_string(p) + " T=" + std::to_string(t);
        Layout layout(kind, t, p);
        ASSERT_EQ(layout.tokens(), t) << what;
        ASSERT_EQ(layout.padded_tokens(), tp) << what;
        ASSERT_EQ(layout.local_tokens(), tp / p) << what;
        Tensor full(DType::f32, {2, t, 3, 4});
        fill_normal(full, 11);
        std::vector<int64_t> user_pos(t);
        for (int64_t i = 0; i < t; ++i) user_pos[i] = 1000 - 3 * i;  // any positions
        std::vector<Tensor> shards;
        std::vector<TensorView> views;
        std::vector<int> seen(tp, 0);
        for (int r = 0; r < p; ++r) {
          shards.push_back(layout.shard(full, r));
          views.push_back(shards.back());
          const std::vector<int64_t> idx = layout.positions(r);
          const std::vector<int64_t> pos = layout.token_positions(r, user_pos);
          ASSERT_EQ(static_cast<int64_t>(idx.size()), tp / p) << what;
          for (size_t i = 0; i < idx.size(); ++i) {
            ++seen[idx[i]];
            EXPECT_EQ(owner_by_definition(kind, idx[i], tp, p), r) << what;
            const bool padding = idx[i] >= t;
            EXPECT_EQ(layout.is_padding(idx[i]), padding) << what;
            EXPECT_EQ(pos[i], padding ? kPaddingPosition : user_pos[idx[i]]) << what;
            for (int64_t b = 0; b < 2; ++b)
              for (int64_t h = 0; h < 3; ++h)
                EXPECT_EQ(shards[r].view().get(b, i, h, 0),
                          padding ? 0.0f : full.view().get(b, idx[i], h, 0))
                    << what;
          }
          const std::vector<int32_t> ids = layout.shard(std::vector<int32_t>(t, 7), r, -1);
          for (size_t i = 0; i < idx.size(); ++i) EXPECT_EQ(ids[i], idx[i] >= t ? -1 : 7) << what;
        }
        for (int64_t i = 0; i < tp; ++i) EXPECT_EQ(seen[i], 1) << what << " token " << i;
        Tensor back(DType::f32, {2, t, 3, 4});
        layout.unshard(views, back);
        EXPECT_EQ(std::memcmp(back.data(), full.data(), full.bytes()), 0) << what;
      }
}

TEST(Layout, BadArgumentsNameTheProblem) {
  EXPECT_THROW(Layout(LayoutKind::contiguous, 0, 2), Error);
  EXPECT_THROW(Layout(LayoutKind::contiguous, 8, 0), Error);
  EXPECT_THROW(parse_layout("zig-zag"), Error);
  EXPECT_EQ(parse_layout("striped"), LayoutKind::striped);
  Layout ok(LayoutKind::contiguous, 8, 2);
  Tensor wrong(DType::f32, {1, 6, 1, 1});
  EXPECT_THROW(ok.shard(wrong, 0), Error);
  EXPECT_THROW(ok.positions(2), Error);
  EXPECT_THROW(ok.shard(std::vector<int>(7), 0), Error);
}

}  // namespace
}  // namespace ctxpar

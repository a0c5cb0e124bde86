// Decode's in-place kernel (kernel/decode.h, docs/inference.md "Decode reads the cache in
// place") against the fp64 reference and beside the tile kernel's path it replaced (its
// reference, KvCacheOptions::decode_in_place = false): shards longer than one split of the
// context (kDecodeSplit), windows that start inside a split, GQA groups, fp32 and bf16 caches;
// its bits for any thread count and on the sim device.
#include <gtest/gtest.h>

#include <cstring>

#include "ctxpar/error.h"
#include "inference/inference_support.h"
#include "kernel/decode.h"

using namespace ctxpar;
using namespace ctxpar::testing;

namespace {

// Decode rows [from, N) of sequence b, out and lse, of two runs' rank 0: the same bits.
bool same_decode_bits(const RankResult& a, const RankResult& b, int64_t seq, int64_t from) {
  const Tensor &oa = a.out[seq], &ob = b.out[seq], &la = a.lse[seq], &lb = b.lse[seq];
  const int64_t n = oa.dim(1), h = oa.dim(2), hd = h * oa.dim(3);
  if (std::memcmp(oa.ptr<float>() + from * hd, ob.ptr<float>() + from * hd,
                  size_t((n - from) * hd) * 4) != 0)
    return false;
  for (int64_t i = 0; i < h; ++i)
    if (std::memcmp(la.ptr<float>() + i * n + from, lb.ptr<float>() + i * n + from,
                    size_t(n - from) * 4) != 0)
      return false;
  return true;
}

// A shard of more than one split on one rank (kDecodeSplit + 88 tokens), GQA g = 4 (or hq / hkv).
Scenario long_shard(const char* mask, DType dtype, int64_t hq = 8, int64_t hkv = 2) {
  Scenario s;
  s.hq = hq, s.hkv = hkv, s.d = 32, s.block = 64;
  s.mask = parse_mask(mask);
  s.dtype = dtype;
  s.prefill = {kernel::kDecodeSplit + 88, 3};  // a long sequence and a short one, decoded together
  s.decode_steps = 2;
  s.decode_tokens = 2;  // two new tokens a step: the first must not see the second
  s.build();
  return s;
}

}  // namespace

TEST(DecodeInPlace, MatchesTheReferenceAndTheTilePath) {
  // window:300,0: a query's first visible key lies inside a split, not at its start.
  for (const char* mask : {"causal", "causal+window:300,0"})
    for (DType dtype : {DType::f32, DType::bf16}) {
      Scenario s = long_shard(mask, dtype);
      Scenario tiles = s;
      tiles.decode_in_place = false;
      for (int p : {1, 2}) {
        const auto fast = run_on_threads(s, p), ref = run_on_threads(tiles, p);
        for (int64_t b = 0; b < s.sequences(); ++b) {
          const std::string what = std::string(mask) + " " + dtype_name(dtype) +
                                   " P=" + std::to_string(p) + " sequence " + std::to_string(b);
          EXPECT_EQ(check_accuracy(s, b, combine(fast, s, b), s.prefill[b]), "") << what;
          EXPECT_EQ(check_accuracy(s, b, combine(ref, s, b), s.prefill[b]), "") << what;
          for (int r = 1; r < p; ++r)
            EXPECT_TRUE(same_decode_bits(fast[0], fast[r], b, s.prefill[b])) << what;
        }
      }
    }
}

// The kernel reads each page where it lies (one page per placement block, docs/inference.md
// "Paged storage"), its V chunks cut at the pages' ends. On one rank the block changes nothing
// else, so every page size must give the bits of one page holding the whole shard (the
// contiguous rows the kernel read before pages), and those are within the accuracy rule. Block
// 37 is odd (the scores' pairs of keys break at its ends) and no multiple of the V chunk (16)
// nor of the split (512); g = 4, 3 and 1 take gemm_rows, axpy and row_block.
TEST(DecodeInPlace, PagesOfAnySizeGiveTheOnePageBits) {
  for (DType dtype : {DType::f32, DType::bf16})
    for (int64_t hq : {8, 6, 2}) {
      Scenario one = long_shard("causal", dtype, hq, 2);
      one.block = 1 << 12;  // one page: the whole shard
      const auto base = run_on_threads(one, 1);
      for (int64_t block : {16, 37, 64}) {
        Scenario s = one;
        s.block = block;
        s.threads = block == 37 ? 2 : 1;
        const auto got = run_on_threads(s, 1);
        for (int64_t b = 0; b < s.sequences(); ++b) {
          const std::string what = std::string(dtype_name(dtype)) + " hq=" + std::to_string(hq) +
                                   " block " + std::to_string(block) + " sequence " +
                                   std::to_string(b);
          EXPECT_TRUE(same_decode_bits(base[0], got[0], b, s.prefill[b])) << what;
          if (block == 37) {
            EXPECT_EQ(check_accuracy(s, b, combine(got, s, b), s.prefill[b]), "") << what;
          }
        }
      }
    }
  // The tile kernel's path gathers each chunk's rows from the pages: the one-page bits too.
  Scenario one = long_shard("causal", DType::f32);
  one.decode_in_place = false;
  one.block = 1 << 12;
  Scenario paged = one;
  paged.block = 37;
  const auto base = run_on_threads(one, 1), got = run_on_threads(paged, 1);
  for (int64_t b = 0; b < one.sequences(); ++b)
    EXPECT_TRUE(same_decode_bits(base[0], got[0], b, one.prefill[b]))
        << "tile path, sequence " << b;
}

TEST(DecodeInPlace, BitsDoNotDependOnTheThreadCount) {
  // Note [Decode splits the context in fixed blocks]: the threads share the splits, whose
  // bounds and merge order are the context's alone.
  Scenario one = long_shard("causal", DType::f32);
  const auto base = run_on_threads(one, 1);
  for (int threads : {2, 3}) {
    Scenario s = one;
    s.threads = threads;
    const auto got = run_on_threads(s, 1);
    for (int64_t b = 0; b < s.sequences(); ++b)
      EXPECT_TRUE(same_decode_bits(base[0], got[0], b, s.prefill[b]))
          << threads << " threads, sequence " << b;
  }
}

TEST(DecodeInPlace, SimDeviceGivesTheCpuBits) {
  // The sim device queues the new rows' copies: the kernel reads the shard after they are done.
  Scenario s;
  s.prefill = {80, 50};
  s.chunk = 30;
  s.build();
  Scenario sim = s;
  sim.device = DeviceKind::sim;
  for (int p : {1, 3}) {
    const auto a = run_on_threads(s, p), b = run_on_threads(sim, p);
    for (int64_t seq = 0; seq < 2; ++seq)
      EXPECT_TRUE(same_decode_bits(a[0], b[0], seq, s.prefill[seq])) << "P=" << p;
  }
}

TEST(DecodeInPlace, RanksThatChooseOtherKernelsAreRefused) {
  // The two kernels round differently: a rank on the other one would merge other bits.
  run_threads(2, [](Communicator& comm) {
    Scenario s;
    s.prefill = {10};
    s.build();
    KvCacheOptions o = s.cache_options();
    o.decode_in_place = comm.rank() == 0;
    KvCache cache(comm, o);
    Tensor q(DType::f32, {1, 1, s.hq, s.d}), k(DType::f32, {1, 1, s.hkv, s.d}),
        v(DType::f32, {1, 1, s.hkv, s.d}), out(DType::f32, {1, 1, s.hq, s.d}),
        lse(DType::f32, {1, s.hq, 1});
    try {
      decode(cache, q, k, v, out, lse);
      ADD_FAILURE() << "decode ran on ranks with different kernels";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("KvCacheOptions::decode_in_place"), std::string::npos)
          << e.what();
    }
    EXPECT_EQ(cache.tokens(0), 0) << "a refused call stored the new token";
  });
}

TEST(DecodeInPlace, EveryGroupSizeAndHeadDim) {
  // The products' paths: g = 1 (one row per KV head), 3 (no blocked case), 8 (two of 4); D a
  // multiple of every target's lanes or not (24: the vectors' scalar tail, V by axpy); D 128
  // and 80 take bf16 V's blocks of several column vectors (pv_bf16) and a single one after.
  struct Shape {
    int64_t hq, hkv, d;
  };
  for (const Shape& sh : {Shape{2, 2, 16}, Shape{3, 1, 16}, Shape{8, 1, 24}, Shape{4, 2, 48},
                          Shape{8, 2, 128}, Shape{4, 1, 80}})
    for (DType dtype : {DType::f32, DType::bf16}) {
      Scenario s;
      s.hq = sh.hq, s.hkv = sh.hkv, s.d = sh.d, s.block = 64, s.dtype = dtype;
      s.prefill = {kernel::kDecodeSplit + 40};
      s.decode_steps = 1;
      s.decode_tokens = 3;  // an odd count of new keys: the scores' single-key tail
      s.build();
      const auto rs = run_on_threads(s, 1);
      EXPECT_EQ(check_accuracy(s, 0, combine(rs, s, 0), s.prefill[0]), "")
          << "Hq " << sh.hq << " Hkv " << sh.hkv << " D " << sh.d << " " << dtype_name(dtype);
    }
}

namespace {

// Sequence b's document ids: id `ids[i]` on positions [starts[i], starts[i + 1]) (the last to
// the end), in place of build()'s.
void set_documents(Scenario& s, int64_t b, std::vector<int64_t> starts, std::vector<int32_t> ids) {
  starts.push_back(s.length(b));
  for (size_t i = 0; i + 1 < starts.size(); ++i)
    for (int64_t t = starts[i]; t < std::min(starts[i + 1], s.length(b)); ++t)
      s.documents[size_t(b)][size_t(t)] = ids[i];
}

// Documents appended one after another, then one whose id is used again apart (a second run
// of document 5): three sequences decoded in one call, block 64.
//   0: [0, 100) 0, [100, 130) 1 (over the page end at 128), [130, 604) 2: its decoded tokens'
//      document starts inside a split and spans the split at 512 and pages;
//   1: 3 tokens prefilled, decode tokens start documents 1 and 2 (a query whose document is
//      its own first key);
//   2: [0, 80) 5, [80, 160) 6, [160, 204) 5 -- document 5's keys are two runs: the tile path
//      (but for a window of 100, which leaves one).
Scenario documents_scenario(const char* mask, DType dtype) {
  Scenario s;
  s.hq = 8, s.hkv = 2, s.d = 32, s.block = 64;
  s.mask = parse_mask(mask);
  s.dtype = dtype;
  s.prefill = {kernel::kDecodeSplit + 88, 3, 200};
  s.decode_steps = 2;
  s.decode_tokens = 2;
  s.build();
  set_documents(s, 0, {0, 100, 130}, {0, 1, 2});
  set_documents(s, 1, {0, 3, 5}, {0, 1, 2});
  set_documents(s, 2, {0, 80, 160}, {5, 6, 5});
  return s;
}

}  // namespace

TEST(DecodeInPlace, DocumentsMatchTheReference) {
  // window:100,0+documents: the run by position is cut again by the document (fp32, P = 1
  // and 3 only: the test's time).
  for (const char* mask : {"causal+documents", "causal+window:100,0+documents"})
    for (DType dtype : {DType::f32, DType::bf16})
      for (int p : {1, 2, 3}) {
        if (std::string(mask).find("window") != std::string::npos &&
            (dtype == DType::bf16 || p == 2))
          continue;
        const Scenario s = documents_scenario(mask, dtype);
        const auto rs = run_on_threads(s, p);
        for (int64_t b = 0; b < s.sequences(); ++b) {
          const std::string what = std::string(mask) + " " + dtype_name(dtype) +
                                   " P=" + std::to_string(p) + " sequence " + std::to_string(b);
          EXPECT_EQ(check_accuracy(s, b, combine(rs, s, b), s.prefill[b]), "") << what;
          for (int r = 1; r < p; ++r)  // Note [Each rank picks its documents' path]
            EXPECT_TRUE(same_decode_bits(rs[0], rs[r], b, s.prefill[b])) << what;
        }
      }
}

TEST(DecodeInPlace, DocumentsSeenAsRunsTakeTheKernelOthersTheTilePath) {
  // On one rank, sequence 2 (document 5's keys in two runs) gets the tile path's bits, and
  // sequences 0 and 1 the kernel's, whatever the thread count: the choice is per sequence.
  Scenario s = documents_scenario("causal+documents", DType::f32);
  Scenario tiles = s;
  tiles.decode_in_place = false;
  const auto ref = run_on_threads(tiles, 1);
  EXPECT_TRUE(same_decode_bits(ref[0], run_on_threads(s, 1)[0], 2, s.prefill[2]));
  s.threads = 3;
  const auto got = run_on_threads(s, 1);
  EXPECT_TRUE(same_decode_bits(ref[0], got[0], 2, s.prefill[2]));
  // Sequence 0 alone in a call (its own kernel bits whatever else the call holds).
  Scenario alone = s;
  alone.prefill = {s.prefill[0]};
  alone.build();
  alone.documents[0] = s.documents[0];
  EXPECT_TRUE(same_decode_bits(got[0], run_on_threads(alone, 1)[0], 0, s.prefill[0]));
  // One document over the whole of sequence 0: the causal mask's kernel bits (its run is the
  // whole shard), not the tile path's.
  Scenario causal = alone;
  causal.mask = parse_mask("causal");
  std::fill(alone.documents[0].begin(), alone.documents[0].end(), 3);
  EXPECT_TRUE(
      same_decode_bits(run_on_threads(causal, 1)[0], run_on_threads(alone, 1)[0], 0, s.prefill[0]));
}

TEST(DecodeInPlace, KernelRefusesAKeysDocumentApartBeforeAnyWork) {
  // The kernel itself: one query at position 9 over keys 0..9 of documents
  // {0 x4, 1 x3, 0 x3} -- document 0 is two runs: false, out and lse untouched; {0 x4, 1 x6}:
  // true, the query's row gets an answer.
  const int64_t n = 10, d = 16;
  Tensor q(DType::f32, {1, 1, 2, d}), k(DType::f32, {1, n, 1, d}), v(DType::f32, {1, n, 1, d});
  fill_normal(q, 1), fill_normal(k, 2), fill_normal(v, 3);
  std::vector<int64_t> kpos(n), qpos = {n - 1};
  for (int64_t j = 0; j < n; ++j) kpos[size_t(j)] = j;
  const TensorView kp[] = {k.view()}, vp[] = {v.view()};
  for (const bool runs : {false, true}) {
    std::vector<int32_t> kdoc = {0, 0, 0, 0, 1, 1, 1, 0, 0, 0}, qdoc = {0};
    if (runs) std::fill(kdoc.begin() + 4, kdoc.end(), 1), qdoc = {1};
    Tensor out(DType::f32, {1, 2, 1, d}), lse(DType::f32, {1, 1, 2});
    std::fill(out.ptr<float>(), out.ptr<float>() + 2 * d, 7.0f);
    std::fill(lse.ptr<float>(), lse.ptr<float>() + 2, 7.0f);
    kernel::DecodeShard p;
    p.q = q.view(), p.q_positions = qpos, p.q_documents = qdoc;
    p.k_pages = kp, p.v_pages = vp, p.page_rows = n;
    p.k_positions = kpos, p.k_documents = kdoc;
    p.mask = parse_mask("causal+documents");
    p.out = out.view(), p.lse = lse.view();
    EXPECT_EQ(kernel::decode_in_place(p), runs);
    EXPECT_EQ(lse.ptr<float>()[0] == 7.0f, !runs) << (runs ? "one run" : "two runs");
    EXPECT_EQ(out.ptr<float>()[0] == 7.0f, !runs) << (runs ? "one run" : "two runs");
    if (!runs) continue;
    p.k_documents = {};  // no id per key: refused, naming the counts
    try {
      (void)kernel::decode_in_place(p);
      ADD_FAILURE() << "a documents mask without the keys' ids was taken";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("per key (10); got 1 and 0"), std::string::npos)
          << e.what();
    }
  }
}

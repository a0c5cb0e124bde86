// `ctxpar bench decode`: decode's time per token against this machine's memory bandwidth,
// measured in the same run. Each decoded token reads its whole cache once, so the figure that
// matters is the cache's bytes over the time, as a share of what the same threads can read
// at all (a STREAM-style sum, kernel/peak.h). The in-place kernel (KvCacheOptions::
// decode_in_place) and the tile kernel's path it replaced run side by side, alternating, on two
// caches of the same tokens; the machines here are shared, so each figure is the median of the
// repeats and the bandwidth the best of its own.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <span>
#include <vector>

#include <nlohmann/json.hpp>

#include "ctxpar/clock.h"
#include "ctxpar/inference.h"
#include "ctxpar/memory.h"
#include "kernel/peak.h"
#include "options.h"

namespace ctxpar::cli {

namespace {

struct DecodeBench {
  std::vector<int64_t> contexts;
  std::vector<DType> dtypes;
  int64_t hq = 8, hkv = 2, d = 128;
  int threads = 1, repeats = 5;
  size_t stream_bytes = 0;
  bool reference = true;
  Mask mask = Mask::causal_mask();
  std::vector<int64_t> documents;  // with documents: their lengths (the last one continues)
};

Options bench_decode_options() {
  Options o("bench decode",
            "Decode time per token (one new token, one sequence, one rank) over a cache of\n"
            "--context tokens, as bytes/s = the cache's K and V bytes / time, against a\n"
            "STREAM-style read bandwidth of the same threads measured in the same run (the sum\n"
            "of an fp32 array of --stream-mib, best of 3). The in-place kernel and the tile\n"
            "kernel's path (--no-reference: skip it) alternate; figures are medians of --repeats.");
  o.add("context", "32K,128K", "cached tokens, comma-separated (64K / 1M suffixes: 32K,128K,1M)")
      .add("dtype", "fp32,bf16", "cache dtypes, comma-separated: fp32 | bf16")
      .add("heads", "8", "query heads Hq")
      .add("kv-heads", "2", "key/value heads Hkv (the cache's)")
      .add("head-dim", "128", "head dimension D, 16..256")
      .add("threads", "1", "OpenMP threads (not given: OMP_NUM_THREADS when set)")
      .add("repeats", "5", "decoded tokens timed per kernel (alternating); the median counts")
      .add("stream-mib", "0", "MiB the bandwidth sum reads (0: 4x the last-level cache, >= 256)")
      .add("mask", "causal",
           "the cache's: causal | causal+window:L,0 | causal+documents:LEN,LEN,... (packed "
           "documents of these lengths from the first token; the last one continues to the "
           "context's end and takes the decoded tokens)")
      .flag("no-reference", "time the in-place kernel only")
      .flag("json", "print one JSON object instead of text");
  o.example("ctxpar bench decode --context 32K,128K,1M --dtype fp32,bf16 --threads 2 --json");
  o.example(
      "ctxpar bench decode --context 32K --mask "
      "causal+documents:4096,4096,4096,4096,4096,4096,4096,4096");
  return o;
}

// The options, checked before anything is allocated (UsageError or ctxpar::Error naming one).
DecodeBench decode_bench_from_options(const Options& o) {
  DecodeBench b;
  b.contexts = o.list_i64("context");
  for (int64_t c : b.contexts)
    if (c < 1 || c > kMaxTokens)
      throw UsageError(detail::concat("--context: each must be 1..", kMaxTokens, ", got ", c));
  for (const std::string& name : o.list("dtype")) {
    const DType t = parse_dtype(name);
    if (t != DType::f32 && t != DType::bf16)
      throw UsageError("--dtype: a cache is fp32 or bf16, got '" + name + "'");
    b.dtypes.push_back(t);
  }
  if (b.contexts.empty() || b.dtypes.empty())
    throw UsageError("--context and --dtype need at least one value each");
  b.hq = o.i64("heads", 1, kMaxHeads), b.hkv = o.i64("kv-heads", 1, kMaxHeads);
  b.d = o.i64("head-dim", 16, 256);
  if (b.hq % b.hkv != 0)
    throw UsageError(detail::concat("--heads ", b.hq, " must be a multiple of --kv-heads ", b.hkv,
                                    " (grouped-query attention)"));
  b.threads = threads_option(o);
  b.repeats = o.i32("repeats", 1, kMaxRepeats);
  const int64_t mib = o.i64("stream-mib", 0, int64_t{1} << 30);
  b.stream_bytes = mib > 0 ? size_t(mib) << 20 : kernel::read_bandwidth_bytes();
  b.reference = !o.on("no-reference");
  b.mask = parse_mask(o.str("mask"));
  check_cache_mask(b.mask, "--mask");  // the library's rule, KvCache's
  if (b.mask.documents) {
    b.documents = parse_document_lengths(o.str("mask"));
    int64_t sum = 0;
    for (int64_t n : b.documents) sum += n;
    if (b.documents.empty() || sum > *std::min_element(b.contexts.begin(), b.contexts.end()))
      throw UsageError(detail::concat(
          "--mask: documents need their lengths, summing to at most the smallest --context (", sum,
          " given), e.g. causal+documents:4096,4096"));
  }
  // The largest moment: the caches of the largest context (two with the reference), or the
  // bandwidth array, whichever is larger (they are never held together).
  const int64_t most = *std::max_element(b.contexts.begin(), b.contexts.end());
  KvCacheOptions co;
  co.kv_heads = b.hkv, co.head_dim = b.d, co.dtype = DType::f32;
  for (DType t : b.dtypes)
    if (t == DType::f32) co.dtype = t;
  const double caches =
      double(kv_cache_bytes(co, {most + b.repeats + 2}, 1, 0)) * (b.reference ? 2 : 1);
  const double need = std::max(caches, double(b.stream_bytes));
  const MemoryLimit limit = memory_limit();
  CTXPAR_CHECK(!limit.known() || need <= limit.bytes, "bench decode: this run ",
               limit.shortfall(need), ", or lower --context (or --stream-mib), or give ",
               "--no-reference");
  return b;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// The context's document ids (--mask with documents): document i over its length, the last
// to the end. Empty without documents.
std::vector<int32_t> document_ids(const DecodeBench& b, int64_t context) {
  std::vector<int32_t> ids;
  if (!b.mask.documents) return ids;
  ids.assign(size_t(context), int32_t(b.documents.size() - 1));
  int64_t at = 0;
  for (size_t i = 0; i < b.documents.size(); ++i)
    for (int64_t t = 0; t < b.documents[i]; ++t) ids[size_t(at++)] = int32_t(i);
  return ids;
}

// One sequence of `context` tokens. The rows' values do not change the time: one random chunk
// is appended over and over (drawing a million rows of normals took longer than the run).
std::unique_ptr<KvCache> filled_cache(Communicator& comm, const DecodeBench& b, DType dtype,
                                      int64_t context, bool in_place) {
  KvCacheOptions o;
  o.kv_heads = b.hkv, o.head_dim = b.d, o.dtype = dtype;
  o.kernel.threads = b.threads;
  o.decode_in_place = in_place;
  o.mask = b.mask;
  auto cache = std::make_unique<KvCache>(comm, o);
  cache->reserve({context + b.repeats + 2});
  const int64_t chunk = std::min<int64_t>(context, 4096);
  Tensor k(dtype, {1, chunk, b.hkv, b.d}), v(dtype, {1, chunk, b.hkv, b.d});
  fill_normal(k, 11), fill_normal(v, 12);
  const std::vector<int32_t> ids = document_ids(b, context);
  for (int64_t at = 0; at < context; at += chunk) {
    const int64_t n = std::min(chunk, context - at);
    std::span<const int32_t> docs;
    if (b.mask.documents) docs = std::span<const int32_t>(ids).subspan(size_t(at), size_t(n));
    cache->append(0, k.view().slice(1, 0, n), v.view().slice(1, 0, n), docs);
  }
  return cache;
}

nlohmann::json run_decode_bench(const DecodeBench& b) {
  nlohmann::json rows = nlohmann::json::array();
  run_threads(1, [&](Communicator& comm) {
    for (DType dtype : b.dtypes)
      for (int64_t context : b.contexts) {
        const kernel::ReadBandwidth stream =
            kernel::measure_read_bandwidth(b.threads, b.stream_bytes, 3);
        std::unique_ptr<KvCache> fast = filled_cache(comm, b, dtype, context, true);
        std::unique_ptr<KvCache> ref;
        if (b.reference) ref = filled_cache(comm, b, dtype, context, false);
        Tensor q(dtype, {1, 1, b.hq, b.d}), kn(dtype, {1, 1, b.hkv, b.d}),
            vn(dtype, {1, 1, b.hkv, b.d}), out(dtype, {1, 1, b.hq, b.d}),
            lse(DType::f32, {1, b.hq, 1});
        fill_normal(q, 1), fill_normal(kn, 2), fill_normal(vn, 3);
        // A decoded token continues the last document.
        const int32_t last = int32_t(std::max<size_t>(b.documents.size(), 1) - 1);
        std::span<const int32_t> doc;
        if (b.mask.documents) doc = std::span<const int32_t>(&last, 1);
        auto timed = [&](KvCache& c) {
          const double t0 = now_seconds();
          decode(c, q, kn, vn, out, lse, doc);
          return now_seconds() - t0;
        };
        timed(*fast);  // warm-up: the kernels' agreement, first touch of the scratch
        if (ref) timed(*ref);
        std::vector<double> tf, tr;
        for (int r = 0; r < b.repeats; ++r) {
          tf.push_back(timed(*fast));
          if (ref) tr.push_back(timed(*ref));
        }
        // The cache read per token: K and V of the keys the middle repeat's token sees (every
        // cached token under causal; its window, its document's).
        const int64_t pos = context + b.repeats / 2;
        const Mask::KeyRange kr = b.mask.key_range(pos);
        int64_t lo = std::max<int64_t>(kr.lo, 0);
        if (b.mask.documents) {
          int64_t last_start = 0;
          for (size_t i = 0; i + 1 < b.documents.size(); ++i) last_start += b.documents[i];
          lo = std::max(lo, last_start);
        }
        const double bytes = double(std::min(kr.hi, pos) - lo + 1) * double(b.hkv * b.d) * 2 *
                             double(dtype_size(dtype));
        nlohmann::json j;
        j["dtype"] = dtype_name(dtype), j["context"] = context;
        j["cache_bytes_per_token"] = bytes;
        j["stream_bytes_per_second"] = stream.bytes_per_second;
        j["stream_array_bytes"] = stream.bytes;
        const double f = median(tf);
        j["in_place_seconds"] = f;
        j["in_place_bytes_per_second"] = bytes / f;
        j["in_place_of_stream"] = bytes / f / stream.bytes_per_second;
        if (ref) {
          const double r = median(tr);
          j["tiles_seconds"] = r;
          j["tiles_bytes_per_second"] = bytes / r;
          j["tiles_of_stream"] = bytes / r / stream.bytes_per_second;
          j["in_place_over_tiles"] = f / r;  // time: < 1 is faster
        }
        rows.push_back(j);
      }
  });
  nlohmann::json j;
  j["heads"] = b.hq, j["kv_heads"] = b.hkv, j["head_dim"] = b.d, j["threads"] = b.threads;
  j["repeats"] = b.repeats, j["simd_target"] = kernel::simd_target_name();
  j["mask"] = b.mask.describe();
  j["rows"] = rows;
  return j;
}

void print_decode_bench(const DecodeBench& b, const nlohmann::json& j) {
  std::printf(
      "decode Hq=%lld Hkv=%lld D=%lld, mask %s, 1 token, %d thread(s), SIMD %s, median of %d\n",
      (long long)b.hq, (long long)b.hkv, (long long)b.d, b.mask.describe().c_str(), b.threads,
      kernel::simd_target_name(), b.repeats);
  std::printf(
      "  dtype  context  STREAM GB/s | in place ms  GB/s  of STREAM | tiles ms  GB/s  "
      "of STREAM | in place / tiles\n");
  for (const nlohmann::json& r : j["rows"]) {
    std::printf(
        "  %-5s %8lld %12.2f | %11.2f %5.2f %9.2f", r["dtype"].get<std::string>().c_str(),
        (long long)r["context"].get<int64_t>(), r["stream_bytes_per_second"].get<double>() / 1e9,
        r["in_place_seconds"].get<double>() * 1e3,
        r["in_place_bytes_per_second"].get<double>() / 1e9, r["in_place_of_stream"].get<double>());
    if (r.contains("tiles_seconds"))
      std::printf(" | %8.2f %5.2f %9.2f | %.2f", r["tiles_seconds"].get<double>() * 1e3,
                  r["tiles_bytes_per_second"].get<double>() / 1e9,
                  r["tiles_of_stream"].get<double>(), r["in_place_over_tiles"].get<double>());
    std::printf("\n");
  }
}

}  // namespace

int bench_decode(int argc, char** argv) {
  Options o = bench_decode_options();
  if (!o.parse(argc, argv)) return 0;
  const DecodeBench b = decode_bench_from_options(o);
  const nlohmann::json j = run_decode_bench(b);
  if (o.on("json")) {
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  print_decode_bench(b, j);
  return 0;
}

}  // namespace ctxpar::cli

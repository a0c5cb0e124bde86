// ctxpar decode: long-context inference with the KV cache spread over the ranks. Fills each
// sequence's cache with a context (random, or the keys / values of .npy files), by prefill
// attention (pass-KV or pass-Q) or by storing the K/V alone, then decodes tokens one per step
// and reports the per-token latency, the bytes moved and the cache's memory per rank.
// See docs/inference.md.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention_job.h"
#include "commands.h"
#include "decode_job.h"
#include "ctxpar/comm.h"
#include "ctxpar/error.h"
#include "ctxpar/gloo.h"
#include "ctxpar/hash.h"
#include "ctxpar/inference.h"
#include "ctxpar/memory.h"
#include "ctxpar/npy.h"
#include "options.h"
#include "rank_agreement.h"

namespace ctxpar::cli {
namespace {

using namespace decode_cli;

// Rows of a random tensor [1, n, H, D] at `indices`, each token's row drawn from its own seed
// (token_seed, as `ctxpar attention` draws): the values depend on neither P nor --block, and a
// rank draws only its own rows (drawing whole blocks costs the block size, whatever the context).
Tensor random_rows(const std::vector<int64_t>& indices, int64_t heads, int64_t d, uint64_t seed,
                   int which, int64_t seq, DType dtype) {
  Tensor out(DType::f32, {1, int64_t(indices.size()), heads, d});
  for (size_t i = 0; i < indices.size(); ++i)
    fill_normal(out.view().slice(1, int64_t(i), int64_t(i) + 1),
                token_seed(seed, which, seq, indices[i]));
  return Tensor::copy_of(out, dtype);
}

// This rank's rows of the context's keys or values, from the .npy file or drawn at random.
Tensor context_rows(const DecodeConfig& c, const std::string& npy, const std::vector<int64_t>& rows,
                    int64_t seq, int which) {
  const KvCacheOptions& o = c.cache;
  if (npy.empty()) return random_rows(rows, o.kv_heads, o.head_dim, c.seed, which, seq, o.dtype);
  const NpyHeader h = read_npy_header(npy);
  const int token_dim = h.shape.size() == 4 ? 1 : 0;
  const Tensor t = read_npy_rows(npy, token_dim, rows, o.dtype);  // contiguous
  return Tensor::copy_of(
      TensorView(t.data(), t.dtype(), {1, int64_t(rows.size()), o.kv_heads, o.head_dim}));
}

void run_rank(Communicator& comm, const DecodeConfig& c, Report& report) {
  KvCacheOptions options = c.cache;
  DecodeMergeTimes merge_times;
  if (c.merge_auto && comm.size() > 1) {  // collective: the same pick on every rank
    merge_times = time_decode_merges(comm, options, c.hq, 1, 20);
    options.merge = merge_times.fastest;
  }
  KvCache cache(comm, options);
  const KvCacheOptions& o = c.cache;
  const int me = comm.rank();
  const int64_t nseq = o.sequences, d = o.head_dim;
  std::vector<int64_t> lengths;
  for (int64_t n : c.context) lengths.push_back(n + c.tokens);
  cache.reserve(lengths);  // no growth (copies, spare room) while it prefills and decodes
  uint64_t sent0 = comm.counters().bytes_sent;
  auto t0 = std::chrono::steady_clock::now();
  std::string mode = c.attend ? "" : "fill";
  for (int64_t s = 0; s < nseq; ++s) {
    const int64_t chunk = c.chunk > 0 ? c.chunk : std::max<int64_t>(1, c.context[s]);
    for (int64_t at = 0; at < c.context[s]; at += chunk) {
      const int64_t t = std::min(chunk, c.context[s] - at);
      const std::vector<int64_t> rows = cache.placement(at, t, me);
      const Tensor k = context_rows(c, c.k_npy, rows, s, 1),
                   v = context_rows(c, c.v_npy, rows, s, 2);
      if (!c.attend) {
        cache.append_local(s, t, k, v);
        continue;
      }
      const Tensor q = random_rows(rows, c.hq, d, c.seed, 0, s, o.dtype);
      const int64_t tl = int64_t(rows.size());
      Tensor out(DType::f32, {1, tl, c.hq, d}), lse(DType::f32, {1, c.hq, tl});
      const std::string ran = prefill_mode_name(prefill(cache, s, t, q, k, v, out, lse, c.mode));
      if (mode.find(ran) == std::string::npos) mode += (mode.empty() ? "" : "+") + ran;
    }
  }
  comm.barrier();
  const double prefill_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const uint64_t prefill_sent = comm.counters().bytes_sent - sent0;
  sent0 = comm.counters().bytes_sent;
  std::vector<double> steps;
  double merge = 0, cpu = 0;
  uint64_t outputs_hash = kFnv1a64Offset;
  for (int64_t step = 0; step < c.tokens; ++step) {
    Tensor q(DType::f32, {nseq, 1, c.hq, d}), k(DType::f32, {nseq, 1, o.kv_heads, d}),
        v(DType::f32, {nseq, 1, o.kv_heads, d});
    fill_normal(q, c.seed * 7919 + uint64_t(step) * 3 + 1);
    fill_normal(k, c.seed * 7919 + uint64_t(step) * 3 + 2);
    fill_normal(v, c.seed * 7919 + uint64_t(step) * 3 + 3);
    Tensor out(DType::f32, {nseq, 1, c.hq, d}), lse(DType::f32, {nseq, c.hq, 1});
    const Tensor qs = Tensor::copy_of(q, o.dtype), ks = Tensor::copy_of(k, o.dtype),
                 vs = Tensor::copy_of(v, o.dtype);
    const auto s0 = std::chrono::steady_clock::now();
    decode(cache, qs, ks, vs, out, lse);
    steps.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count());
    merge += cache.last_stats().merge_seconds;
    cpu += cache.last_stats().cpu_seconds;
    outputs_hash = fnv1a64(lse.data(), lse.bytes(), fnv1a64(out.data(), out.bytes(), outputs_hash));
  }
  const uint64_t decode_sent = comm.counters().bytes_sent - sent0;
  // Every rank's figures to rank 0 (one small all-gather: [prefill bytes, decode bytes, cache,
  // decode CPU nanoseconds]).
  const uint64_t mine[4] = {prefill_sent, decode_sent, uint64_t(cache.bytes()),
                            uint64_t(cpu * 1e9)};
  std::vector<uint64_t> all(4 * size_t(comm.size()));
  comm.allgather(mine, all.data(), sizeof mine);
  if (me != 0) return;
  report.step_seconds = steps;
  report.prefill_seconds = prefill_seconds;
  report.merge_seconds = merge;
  report.prefill_mode = mode;
  report.merge = options.merge;
  report.merge_times = merge_times;
  report.outputs_hash = outputs_hash;
  for (int r = 0; r < comm.size(); ++r) {
    report.prefill_bytes += all[4 * r];
    report.decode_bytes += all[4 * r + 1];
    report.cache_bytes.push_back(all[4 * r + 2]);
    report.cpu_seconds.push_back(double(all[4 * r + 3]) * 1e-9);
  }
}

Options decode_options() {
  Options o("decode",
            "Long-context inference with the KV cache spread over the ranks (block round-robin):\n"
            "fill each sequence's cache with a context, by prefill attention (pass-KV or pass-Q)\n"
            "or by storing its K/V alone, then decode tokens one per step; report the per-token\n"
            "latency, the bytes moved and the cache's memory per rank.");
  o.add("context", "4096", "context tokens per sequence before decoding (64K / 1M suffixes)")
      .add("lengths", "", "context tokens of each sequence, comma-separated (instead of --context)")
      .add("batch", "1", "sequences decoded together (each --context tokens long)")
      .add("tokens", "16", "tokens to decode per sequence, one per step")
      .add("ranks", "2", "ranks on the threads transport (ignored under mpirun and torchrun)")
      .add("transport", "auto",
           "auto | threads | mpi | gloo (auto: mpi under mpirun, gloo under torchrun, else "
           "threads)")
      .add("heads", "8", "query heads Hq")
      .add("kv-heads", "1", "key/value heads Hkv (divides Hq; GQA)")
      .add("head-dim", "64", "head dimension D (16..256)")
      .add("dtype", "fp32", "q, k, v and cache storage: fp32 | bf16")
      .add("bf16-tier", "exact", kBf16TierHelp)
      .add("mask", "causal", "causal | causal+window:L,0 (keys at or before the query)")
      .add("block", "64", "placement block: tokens each rank takes in turn")
      .add("prefill", "auto",
           "attend (prefill attention) | fill (store the K/V only) | auto "
           "(attend up to 32K tokens per sequence)")
      .add("prefill-mode", "auto", "attend: auto | pass-kv | pass-q (auto: fewer bytes)")
      .add("merge", "auto",
           "decode's merge across ranks: auto | allgather | chain | tree (auto: the faster of "
           "allgather and chain, which give the same bits, timed on these ranks at the start; "
           "tree: log2 P rounds, other bits)")
      .add("chunk", "0", "attend: prefill in chunks of this many tokens (0: all at once)")
      .add("k-npy", "", "keys of the context, .npy [C, Hkv, D] or [1, C, Hkv, D] (with --v-npy)")
      .add("v-npy", "", "values of the context, the same shape as --k-npy")
      .add("max-cache-bytes", "0", "refuse a rank's cache beyond this many bytes (0: no limit)")
      .add("threads", "1", "kernel threads per rank (not given: OMP_NUM_THREADS when set)")
      .add_device()
      .add("seed", "1", "seed of the random context, queries and decoded tokens")
      .flag("json", "one JSON object on stdout")
      .flag("plan",
            "run nothing: predict decode's per-token time, bytes and memory per rank "
            "and prefill's (--chunk tokens onto the rest) in both modes with the "
            "crossover, from rates measured here (about a second)")
      .example("ctxpar decode --context 1M --ranks 8 --tokens 64 --prefill fill")
      .example(
          "ctxpar decode --context 8192 --ranks 2 --tokens 16 --prefill-mode pass-q --chunk 1024")
      .example("mpirun -n 4 ctxpar decode --context 256K --tokens 32 --prefill fill")
      .example("torchrun --no-python --nproc-per-node 2 ctxpar decode --context 64K --tokens 8")
      .example("ctxpar decode --plan --context 131072 --chunk 4096 --ranks 2")
      .example("ctxpar decode --context 32K --ranks 8 --merge tree");
  return o;
}

// --lengths, else --batch sequences of --context tokens.
std::vector<int64_t> context_lengths(const Options& o) {
  std::vector<int64_t> context;
  const int64_t batch = o.i64("batch", 1, kMaxBatch);
  if (o.given("lengths")) {
    context = o.list_i64("lengths");
    if (int64_t(context.size()) > kMaxBatch)
      throw UsageError("--lengths gives " + std::to_string(context.size()) + " sequences, " +
                       "over the " + std::to_string(kMaxBatch) + " --batch takes");
    for (int64_t n : context)
      if (n < 1 || n > kMaxTokens)
        throw UsageError("--lengths: each length must be in [1, " + std::to_string(kMaxTokens) +
                         "], got " + std::to_string(n));
    if (o.given("batch") && int64_t(context.size()) != batch)
      throw UsageError("--lengths gives " + std::to_string(context.size()) +
                       " sequences but --batch is " + std::to_string(batch) + "; give one");
  } else {
    context.assign(size_t(batch), o.i64("context", 1, kMaxTokens));
  }
  return context;
}

// --k-npy / --v-npy: headers of the shape [C, Hkv, D] (or [1, C, Hkv, D]) with C >= `longest`.
void check_context_files(const DecodeConfig& c, int64_t longest) {
  const KvCacheOptions& k = c.cache;
  if (c.k_npy.empty() != c.v_npy.empty())
    throw UsageError("--k-npy and --v-npy go together: give both or neither");
  for (const auto& [option, path] : {std::pair{"k-npy", c.k_npy}, std::pair{"v-npy", c.v_npy}}) {
    if (path.empty()) continue;
    NpyHeader h;
    try {
      h = read_npy_header(path);
    } catch (const Error& e) {
      throw UsageError(std::string("--") + option + ": " + e.what());
    }
    const bool rank3 = h.shape.size() == 3, rank4 = h.shape.size() == 4 && h.shape[0] == 1;
    const int64_t tokens = rank3 ? h.shape[0] : rank4 ? h.shape[1] : 0;
    const Shape tail = rank3   ? Shape{h.shape[1], h.shape[2]}
                       : rank4 ? Shape{h.shape[2], h.shape[3]}
                               : Shape{};
    if (!(rank3 || rank4) || tail != Shape({k.kv_heads, k.head_dim}) || tokens < longest)
      throw UsageError(std::string("--") + option + " " + path + ": expected shape [C, " +
                       std::to_string(k.kv_heads) + ", " + std::to_string(k.head_dim) +
                       "] (or [1, C, ...]) with C >= " + std::to_string(longest) +
                       " (--kv-heads, --head-dim, --context), got " + shape_str(h.shape));
  }
}

// The run a parsed command line asks for, checked (a UsageError naming the option).
DecodeConfig decode_from_options(const Options& o) {
  DecodeConfig c;
  KvCacheOptions& k = c.cache;
  c.context = context_lengths(o);
  k.sequences = int64_t(c.context.size());
  c.tokens = o.i64("tokens", 0, kMaxTokens);
  c.hq = o.i64("heads", 1, kMaxHeads);
  k.kv_heads = o.i64("kv-heads", 1, kMaxHeads);
  if (c.hq % k.kv_heads != 0)
    throw UsageError("--kv-heads " + std::to_string(k.kv_heads) + " must divide --heads " +
                     std::to_string(c.hq) + " (GQA: each KV head serves Hq / Hkv query heads)");
  k.head_dim = o.i64("head-dim", 16, 256);
  k.dtype = parse_dtype(o.str("dtype"));
  if (k.dtype != DType::f32 && k.dtype != DType::bf16)
    throw UsageError("--dtype must be fp32 or bf16, got '" + o.str("dtype") + "'");
  k.kernel.bf16_tier = bf16_tier_option(o);  // prefill's and decode's kernel calls
  k.mask = parse_mask(o.str("mask"));
  check_cache_mask(k.mask, "--mask");  // the library's rule, KvCache's and ctxpar.KVCache's
  if (k.mask.documents)
    throw UsageError(
        "--mask with documents is not offered by the command (the library takes "
        "document ids: ctxpar/inference.h)");
  k.block = o.i64("block", 1, int64_t{1} << 30);
  k.max_bytes_per_rank = o.num("max-cache-bytes", 0, 1e18);
  k.kernel.threads = threads_option(o);
  k.device = device_of(o);
  c.seed = uint64_t(o.i64("seed", 0, kMaxSeed));
  c.chunk = o.i64("chunk", 0, kMaxTokens);
  c.json = o.on("json");
  c.merge_auto = o.str("merge") == "auto";
  try {
    if (!c.merge_auto) k.merge = parse_decode_merge(o.str("merge"));
  } catch (const Error& e) {
    throw UsageError(std::string("--merge: ") + e.what() + " (or auto)");
  }
  try {
    c.mode = parse_prefill_mode(o.str("prefill-mode"));
  } catch (const Error& e) {
    throw UsageError(std::string("--prefill-mode: ") + e.what());
  }
  const std::string how = o.str("prefill");
  if (how != "auto" && how != "attend" && how != "fill")
    throw UsageError("--prefill must be auto, attend or fill, got '" + how + "'");
  int64_t longest = 0;
  for (int64_t n : c.context) longest = std::max(longest, n);
  c.attend = how == "attend" || (how == "auto" && longest <= 32768);
  c.k_npy = o.str("k-npy"), c.v_npy = o.str("v-npy");
  check_context_files(c, longest);
  return c;
}

// Runs `c` on the ranks of `transport` (the world of a launcher's job, already joined, or
// --ranks threads): agrees the options across processes, then plans (--plan) or runs.
int run_decode(const Options& o, const DecodeConfig& c, TransportKind transport) {
  const bool one_per_process = transport_traits(transport).one_rank_per_process;
  auto world = [&]() -> Communicator& { return process_world(transport, 120); };
  const KvCacheOptions& k = c.cache;
  const int ranks =
      one_per_process ? world().size() : o.i32("ranks", 1, kMaxThreadsRanks, kThreadsRanksNote);
  if (one_per_process && k.device.kind != DeviceKind::cpu)
    throw UsageError(
        "--device sim runs on the threads transport only; use --device cpu under "
        "mpirun or torchrun");

  // Every process parsed its own command line (an MPMD mpirun line, or torchrun's copies):
  // before anything else, --plan included, refuse ranks that differ, naming the option (a rank
  // alone with --plan returned while the others waited 120 s for it, naming nothing).
  if (one_per_process) {
    Signature sig;
    for (const char* name :
         {"context", "lengths", "batch", "tokens", "heads", "kv-heads", "head-dim", "dtype",
          "bf16-tier", "mask", "block", "prefill", "prefill-mode", "merge", "chunk",
          "max-cache-bytes", "threads", "seed"})
      sig.push_back({name, o.str(name)});
    sig.push_back({"plan", o.on("plan") ? "on" : "off"});
    sig.push_back({"json", o.on("json") ? "on" : "off"});
    for (const auto& [option, path] : {std::pair{"k-npy", c.k_npy}, std::pair{"v-npy", c.v_npy}})
      sig.push_back({option, path.empty() ? "" : path + ", " + file_fingerprint(path)});
    agree_on_options(world(), sig, "decode");
  }
  const bool leader = !one_per_process || world().rank() == 0;  // prints
  if (o.on("plan")) {
    if (leader) print_plan(c, ranks);
    return 0;
  }
  // Everything the run allocates, checked before anything runs (exit 2 naming the options).
  check_decode_memory(c, ranks, one_per_process ? 1 : ranks);

  Report report;
  auto body = [&](Communicator& comm) { run_rank(comm, c, report); };
  LaunchOptions launch_options;
  launch_options.gloo = gloo_options(120);
  launch_ranks(transport, ranks, body, launch_options);  // a threads rank's failure: exit 1
  if (leader) print(c, ranks, transport_name(transport), report);
  return 0;
}

}  // namespace

int cmd_decode(int argc, char** argv) {
  Options o = decode_options();
  if (!o.parse(argc, argv)) return 0;
  // torchrun: one rank per process over gloo (an incomplete environment is refused by
  // gloo_from_torchrun_env, naming the variable); other launchers without MPI are refused
  // (each copy would run the whole job alone), as `attention` and `train` do.
  if (!torchrun_job()) refuse_foreign_launcher("decode");
  using enum TransportKind;
  const TransportKind transport = transport_option(o.str("transport"), {threads, mpi, gloo});
  if (transport == gloo && !torchrun_job())
    throw UsageError(
        "--transport gloo needs the job started by torchrun, e.g. torchrun "
        "--nproc-per-node 2 --no-python ctxpar decode ...; or use --transport "
        "threads");
  // Joined first: from here on a rank's error ends every rank at once (mpirun), or within
  // seconds naming it (gloo), instead of leaving the others waiting to be joined.
  if (transport_traits(transport).one_rank_per_process) process_world(transport, 120);
  return run_decode(o, decode_from_options(o), transport);
}

}  // namespace ctxpar::cli

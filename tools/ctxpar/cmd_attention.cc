// `ctxpar attention`: run, check and time one distributed attention (attention_job.h), on
// random inputs or the user's .npy tensors, and print a per-rank table or one JSON object.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include <unistd.h>

#include "attention_job.h"
#include "commands.h"
#include "ctxpar/error.h"
#include "ctxpar/gloo.h"
#include "ctxpar/npy.h"
#include "options.h"
#include "out_folder.h"
#include "progress.h"
#include "rank_agreement.h"

namespace ctxpar::cli {
namespace {

Options attention_options() {
  Options o("attention",
            "Exact attention over a sequence split across P ranks (ring, all-gather, Ulysses or\n"
            "hybrid), forward and backward, checked against an fp64 reference. Under\n"
            "`mpirun -n P` each process is one rank and rank 0 prints the result.");
  o.add("seq", "4096", "sequence length T (64K, 1M suffixes accepted)")
      .add_job_shape()
      .add("mask", "none",
           "none | causal | window:L,R | documents:len1,len2,... | prefix-tree:P,R1,R2,... | "
           "slices:FILE.json | rules joined by '+', e.g. causal+documents:300,724")
      .add("ranks", "1", "ranks P (under mpirun: the number of processes)")
      .add("strategy", "ring", "ring | allgather | ulysses | hybrid")
      .add("ulysses-degree", "0", "hybrid: ranks per Ulysses group u, must divide P (0 = P)")
      .add("exchange", "auto",
           "ring, allgather: needed (each rank sends a peer only the K/V tiles the peer's "
           "queries can see) | ring (every block around the ring, or all gathered) | auto "
           "(needed under a documents or slice mask)")
      .add("layout", "auto",
           "how tokens map to ranks: auto (balanced for document and slice masks, else zigzag) | "
           "zigzag (balanced under a causal mask) | balanced (by the mask's work) | contiguous | "
           "striped; any T (padded to the layout's granule: P, 2P for zigzag, 64P for balanced)")
      .add_device()
      .add("transport", "auto",
           "threads | mpi | gloo | nccl | loopback (auto: mpi under mpirun, gloo under "
           "torchrun, else threads; nccl: one GPU per process under mpirun or torchrun, "
           "loopback: P ranks on one GPU; both need --device cuda, docs/cuda.md)")
      .add("link-gbps", "0", "threads transport: simulated link bandwidth in GB/s (0 = none)")
      .add("link-latency-us", "0", "threads transport: simulated link latency in microseconds")
      .add("timeout", "300", "seconds a rank waits for a message before the job fails")
      .flag("backward", "also run the backward pass (dq, dk, dv)")
      .flag("check", "compare with the fp64 reference of the whole problem; exit 1 on mismatch")
      .add("check-budget", "3e8",
           "--check: fp64 multiply-adds allowed (B*Hq*rows*T*D); above it, rows are sampled")
      .flag("json", "print one JSON object instead of the table")
      .flag("progress", "progress lines on stderr even when it is not a terminal")
      .add("q", "", "queries .npy (float32/float16, [B, T, Hq, D]; see --layout-in)")
      .add("k", "", "keys .npy ([B, T, Hkv, D])")
      .add("v", "", "values .npy ([B, T, Hkv, D])")
      .add("do", "", "output gradient .npy ([B, T, Hq, D]; implies --backward)")
      .add("layout-in", "bthd", "axis order of the .npy tensors: bthd | bhtd (PyTorch SDPA)")
      .add("documents", "", "document id per token, .npy int32/int64 [T] (packed sequences)")
      .add("positions", "", "position id per token, .npy int32/int64 [T] (default 0..T-1)")
      .add("out", "",
           "write out.npy, lse.npy (and dq, dk, dv .npy) to this folder, replacing "
           "it as a whole (a new, empty, or earlier --out folder)");
  o.example(
      "ctxpar attention --seq 64K --heads 2 --head-dim 64 --ranks 4 --strategy ring "
      "--layout zigzag --mask causal --backward --check");
  o.example("mpirun -n 4 ctxpar attention --seq 16K --strategy ulysses --mask causal --check");
  o.example(
      "ctxpar attention --q q.npy --k k.npy --v v.npy --layout-in bhtd --ranks 2 "
      "--mask causal --out results/");
  return o;
}

// bhtd file -> [B, T, H, D] tensor (and back for writing).
Tensor swap_heads_tokens(const Tensor& t, DType dtype) {
  const Shape s = t.shape();
  TensorView swapped(t.data(), t.dtype(), {s[0], s[2], s[1], s[3]},
                     {s[1] * s[2] * s[3], s[3], s[2] * s[3], 1});
  return Tensor::copy_of(swapped, dtype);
}

// The header of an input file (each rank reads its own rows later, in the job).
InputFile input_file(const Options& o, const std::string& name) {
  InputFile f;
  f.path = o.str(name);
  f.heads_first = o.str("layout-in") == "bhtd";
  const NpyHeader h = read_npy_header(f.path);
  CTXPAR_CHECK(h.type == NpyType::f32 || h.type == NpyType::f16, f.path, ": --", name,
               " must hold float32 or float16, not ", npy_type_name(h.type));
  CTXPAR_CHECK(h.shape.size() == 4, f.path, ": --", name, " must be 4-D [B, T, H, D] (or ",
               "[B, H, T, D] with --layout-in bhtd), got ", shape_str(h.shape));
  f.shape = h.shape;
  if (f.heads_first) std::swap(f.shape[1], f.shape[2]);
  return f;
}

AttentionJob job_from(const Options& o) {
  AttentionJob job;
  job.seq = o.i64("seq", 1, kMaxTokens);
  read_job_shape(o, job);
  job.mask = parse_mask(o.str("mask"));
  job.document_lengths = parse_document_lengths(o.str("mask"));
  job.dtype = parse_dtype(o.str("dtype"));
  job.strategy = parse_strategy(o.str("strategy"));
  job.ulysses_degree = o.i32("ulysses-degree", 0, kMaxProcesses);
  job.exchange = parse_exchange(o.str("exchange"));
  job.layout = choose_layout(o.str("layout"), job.mask);
  if (const int64_t total = mask_length_total(o.str("mask")); job.mask.sliced && total > 0)
    CTXPAR_CHECK(total == job.seq, "--mask ", o.str("mask"), ": the prefix tree has ", total,
                 " tokens but --seq is ", job.seq, "; they must be equal");
  using enum TransportKind;
  job.transport = transport_option(o.str("transport"), {threads, mpi, gloo, nccl, loopback});
  check_gpu_transport(job.transport, o.str("device"));
  job.device = device_of(o);
  job.ranks = job.transport == threads ? o.i32("ranks", 1, kMaxThreadsRanks, kThreadsRanksNote)
                                       : o.i32("ranks", 1, kMaxProcesses);
  if (job.transport == mpi && !o.given("ranks") && launched_by_mpi())
    job.ranks = mpi_world().size();
  job.timeout_seconds = o.num("timeout", kMinTimeout, kMaxTimeout);
  if (job.transport == gloo && !o.given("ranks") && torchrun_job())
    job.ranks = gloo_world(job.timeout_seconds).size();
  if (job.transport == nccl && !o.given("ranks"))  // (a launcher: check_gpu_transport)
    job.ranks = launched_by_mpi() ? mpi_world().size() : gloo_world(job.timeout_seconds).size();
  job.link.gbytes_per_second = o.num_or_zero("link-gbps", kMinLinkGbps, kMaxLinkGbps);
  job.link.latency_us = o.num("link-latency-us", 0, kMaxLinkLatencyUs);
  job.backward = o.on("backward") || o.given("do");
  job.check = o.on("check");
  job.check_budget = o.num("check-budget", 0, 1e18);
  job.keep_outputs = o.given("out");

  const std::string layout_in = o.str("layout-in");
  if (layout_in != "bthd" && layout_in != "bhtd")
    throw UsageError("--layout-in must be bthd ([B, T, H, D]) or bhtd ([B, H, T, D]), got '" +
                     layout_in + "'");
  if (o.given("q") || o.given("k") || o.given("v")) {
    if (!(o.given("q") && o.given("k") && o.given("v")))
      throw UsageError("--q, --k and --v come together (and --do for the backward)");
    job.q_file = input_file(o, "q");
    job.k_file = input_file(o, "k");
    job.v_file = input_file(o, "v");
    if (o.given("do")) job.dout_file = input_file(o, "do");
    // The files decide the problem's shape; a conflicting explicit option is a mistake.
    auto take = [&](const char* name, int64_t& field, int64_t value) {
      if (o.given(name) && o.i64(name) != value)
        throw UsageError(std::string("--") + name + " " + o.str(name) +
                         " disagrees with --q/--k (" + std::to_string(value) + "); drop it");
      field = value;
    };
    take("batch", job.batch, job.q_file.shape[0]);
    take("seq", job.seq, job.q_file.shape[1]);
    take("heads", job.heads, job.q_file.shape[2]);
    take("head-dim", job.head_dim, job.q_file.shape[3]);
    take("kv-heads", job.kv_heads, job.k_file.shape[2]);
  } else if (o.given("do")) {
    throw UsageError("--do needs --q, --k and --v");
  }
  if (o.given("documents")) {
    job.document_ids = read_npy_ints(o.str("documents"));
    job.documents = dense_document_labels(job.document_ids);
    job.mask.documents = true;
  }
  if (o.given("positions")) job.positions = read_npy_ints(o.str("positions"));
  return job;
}

std::string count_str(int64_t n) {  // 65536 -> 65,536
  std::string s = std::to_string(n), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i > 0 && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

void print_table(const AttentionJob& job, const AttentionResult& r) {
  const int64_t hkv = job.kv_heads ? job.kv_heads : job.heads;
  std::printf("%s attention, T = %s tokens, B = %lld, H = %lld (kv %lld), D = %lld, %s%s\n",
              job.mask.describe().c_str(), count_str(job.seq).c_str(),
              static_cast<long long>(job.batch), static_cast<long long>(job.heads),
              static_cast<long long>(hkv), static_cast<long long>(job.head_dim),
              dtype_label(job.dtype, job.bf16_tier), job.backward ? ", forward + backward" : "");
  std::string how = strategy_name(job.strategy);
  if (job.strategy == StrategyKind::hybrid)
    how += " (ulysses groups of " +
           std::to_string(job.ulysses_degree ? job.ulysses_degree : job.ranks) + ")";
  if (exchange_of(strategy_options(job)) == Exchange::needed) how += " (needed K/V only)";
  std::printf("%s over %d ranks, %s layout, %s transport, %d thread%s per rank\n\n", how.c_str(),
              job.ranks, layout_name(job.layout), transport_name(job.transport), job.threads,
              job.threads == 1 ? "" : "s");
  std::printf("%5s %10s %12s %9s %9s %11s %11s %12s\n", "rank", "tokens", "work GFLOP", "busy s",
              "wait s", "sent", "received", "peak memory");
  double flops = 0, max_flops = 0, busy = 0, wait = 0, sent = 0, recv = 0, peak = 0;
  for (const auto& k : r.ranks) {
    const double mem = static_cast<double>(k.peak_bytes + k.shard_bytes);
    std::printf("%5d %10s %12.2f %9.3f %9.3f %11s %11s %12s\n", k.rank, count_str(k.tokens).c_str(),
                k.attention_flops * 1e-9, k.busy_seconds, k.comm_wait_seconds,
                bytes_text(static_cast<double>(k.bytes_sent)).c_str(),
                bytes_text(static_cast<double>(k.bytes_received)).c_str(), bytes_text(mem).c_str());
    flops += k.attention_flops, max_flops = std::max(max_flops, k.attention_flops);
    busy += k.busy_seconds, wait += k.comm_wait_seconds;
    sent += static_cast<double>(k.bytes_sent), recv += static_cast<double>(k.bytes_received);
    peak = std::max(peak, mem);
  }
  std::printf("%5s %10s %12.2f %9.3f %9.3f %11s %11s %12s\n\n", "total", count_str(job.seq).c_str(),
              flops * 1e-9, busy, wait, bytes_text(sent).c_str(), bytes_text(recv).c_str(),
              ("max " + bytes_text(peak)).c_str());
  double fwd_flops = 0, bwd_flops = 0;
  for (const auto& k : r.ranks) fwd_flops += k.forward_flops, bwd_flops += k.backward_flops;
  std::printf("forward   %.3f s  (%.1f GFLOP/s)\n", r.forward_seconds,
              r.forward_seconds > 0 ? fwd_flops / r.forward_seconds * 1e-9 : 0.0);
  if (job.backward)
    std::printf("backward  %.3f s  (%.1f GFLOP/s)\n", r.backward_seconds,
                r.backward_seconds > 0 ? bwd_flops / r.backward_seconds * 1e-9 : 0.0);
  if (!r.ranks.empty() && flops > 0)
    std::printf("load balance: busiest rank does %.2fx the mean work\n",
                max_flops / (flops / r.ranks.size()));
  std::printf(
      "memory: %s on the busiest rank; one rank alone would need %s "
      "(%s more with a materialised fp32 score matrix)\n",
      bytes_text(peak).c_str(), bytes_text(r.single_rank_bytes).c_str(),
      bytes_text(r.scores_bytes).c_str());
  if (!r.checked) return;
  std::printf("check: %s  max |err| %.3g, tolerance %.3g  (", r.check_passed ? "PASSED" : "FAILED",
              r.max_abs_err, r.tolerance);
  for (size_t i = 0; i < r.checks.size(); ++i)
    std::printf("%s%s %.2g%s", i ? ", " : "", r.checks[i].name.c_str(), r.checks[i].max_abs_err,
                r.checks[i].passed ? "" : " FAIL");
  std::printf(")\n       %s (%.1f s)\n", r.check_note.c_str(), r.check_seconds);
}

void write_outputs(const Options& o, const OutFolder& folder, const AttentionResult& r) {
  const bool bhtd = o.str("layout-in") == "bhtd";
  std::vector<Tensor> kept;  // the bhtd copies must live until written
  std::vector<std::pair<std::string, TensorView>> files;
  auto put = [&](const char* name, const Tensor& t) {
    if (t.empty()) return;
    if (bhtd) kept.push_back(swap_heads_tokens(t, DType::f32));
    files.emplace_back(name, bhtd ? kept.back().view() : t.view());
  };
  kept.reserve(5);
  put("out.npy", r.out);
  files.emplace_back("lse.npy", r.lse.view());  // [B, H, T] whatever --layout-in
  put("dq.npy", r.dq);
  put("dk.npy", r.dk);
  put("dv.npy", r.dv);
  folder.replace_with(files);
}

// Every option that changes the answer, or what the ranks send each other, for the ranks to
// agree on under MPI (rank_agreement.h). --threads and --timeout are left out: they change
// neither. Input files: path, header and a sample of the contents (file_fingerprint).
Signature signature_of(const Options& o, const AttentionJob& job) {
  auto num = [](auto v) { return std::to_string(v); };
  auto file = [](const InputFile& f) {
    return f.given() ? f.path + " " + shape_str(f.shape) + ", " + file_fingerprint(f.path) : "";
  };
  auto ints = [](const auto& v) {
    return v.empty() ? std::string() : hash_hex(v.data(), v.size() * sizeof v[0]);
  };
  std::string lengths;
  for (int64_t l : job.document_lengths) lengths += num(l) + ",";
  // Files first: they decide the shape, so a file on one rank only is named as the cause.
  return {{"q", file(job.q_file)},
          {"k", file(job.k_file)},
          {"v", file(job.v_file)},
          {"do", file(job.dout_file)},
          {"layout-in", o.str("layout-in")},
          {"seq", num(job.seq)},
          {"batch", num(job.batch)},
          {"heads", num(job.heads)},
          {"kv-heads", num(job.kv_heads ? job.kv_heads : job.heads)},
          {"head-dim", num(job.head_dim)},
          {"mask", job.mask.describe() + " " + lengths},
          {"dtype", dtype_name(job.dtype)},
          {"bf16-tier", bf16_tier_name(job.bf16_tier)},
          {"ranks", num(job.ranks)},
          {"strategy", strategy_name(job.strategy)},
          {"ulysses-degree", num(job.ulysses_degree)},
          {"exchange", exchange_name(job.exchange)},
          {"layout", layout_name(job.layout)},
          {"transport", transport_name(job.transport)},
          {"seed", num(job.seed)},
          {"repeats", num(job.repeats)},
          {"backward", job.backward ? "on" : "off"},
          {"check", job.check ? "on" : "off"},
          {"check-budget", o.str("check-budget")},
          {"out", o.given("out") ? "given" : ""},
          {"json", o.on("json") ? "on" : "off"},
          {"documents", ints(job.document_ids)},
          {"positions", ints(job.positions)}};
}

}  // namespace

int cmd_attention(int argc, char** argv) {
  Options o = attention_options();
  if (!o.parse(argc, argv)) return 0;
  // torchrun: one rank per process over gloo (an incomplete environment is refused by
  // gloo_from_torchrun_env, naming the variable); other launchers without MPI are refused.
  if (!torchrun_job()) refuse_foreign_launcher("attention");
  // Under mpirun, MPI first: from here on a rank's error ends every rank at once (main.cc),
  // where a rank that exits before MPI_Init would leave the others waiting in it.
  join_mpi_first(o.str("transport"));
  AttentionJob job = job_from(o);
  // (--transport mpi without mpirun is refused by validate, with how to start it; nccl runs
  // over mpirun's ranks, else torchrun's.)
  const TransportKind host = host_transport(job.transport);
  const bool under_mpi = host == TransportKind::mpi && launched_by_mpi();
  const bool under_torchrun = host == TransportKind::gloo && !under_mpi && launched_by_torchrun();
  if (under_mpi || under_torchrun) {
    Communicator& world = process_world(job.transport, job.timeout_seconds);
    world.set_timeout(
        std::chrono::milliseconds(static_cast<int64_t>(std::max(1.0, job.timeout_seconds) * 1000)));
    agree_on_options(world, signature_of(o, job));
  }
  // Before computing: an --out that cannot be written fails now, not after the run.
  std::unique_ptr<OutFolder> out_folder;
  const bool writes_out =
      o.given("out") && (under_mpi        ? mpi_world().rank() == 0
                         : under_torchrun ? gloo_world(job.timeout_seconds).rank() == 0
                                          : true);
  if (writes_out) out_folder = std::make_unique<OutFolder>(o.str("out"));
  // A bar (stderr) on a terminal; elsewhere (a log, a pipe, `--json 2>&1`) nothing unless
  // --progress asks for plain lines every few seconds.
  ProgressOptions po;
  if (!isatty(fileno(stderr)))
    po.mode = o.on("progress") ? ProgressOptions::Mode::plain : ProgressOptions::Mode::quiet;
  // Rough relative cost of each step, so the ETA follows the work: backward is 2.5 forwards,
  // drawing the inputs and the sampled check are a fraction of one.
  auto weight = [](const std::string& step) {
    return step.rfind("backward", 0) == 0  ? 2.5
           : step.rfind("forward", 0) == 0 ? 1.0
           : step == "check"               ? 0.5
                                           : 0.05;
  };
  const double total_work =
      0.05 + job.repeats * (1.0 + (job.backward ? 2.5 : 0.0)) + (job.check ? 0.5 : 0.0);
  std::unique_ptr<Progress> bar;
  std::string current;
  job.on_step = [&](const std::string& step) {
    if (!bar) {
      bar = std::make_unique<Progress>("attention", progress_steps(job), stderr, po);
      bar->set_work(total_work);
    } else {
      bar->advance_work(weight(current));
    }
    current = step;
    bar->note(step);
  };
  AttentionResult result = run_attention_job(job);
  if (bar) bar->advance_work(weight(current)), bar->finish();
  if (!result.is_root) return 0;
  if (out_folder) {
    try {
      write_outputs(o, *out_folder, result);
    } catch (const Error& e) {
      throw RankFailure(e.what());  // the run is done: a failed write is a run-time failure
    }
  }
  if (o.on("json")) {
    std::printf("%s\n", to_json(job, result).dump(2).c_str());
  } else {
    print_table(job, result);
    if (o.given("out")) std::printf("wrote %s\n", o.str("out").c_str());
  }
  std::fflush(stdout);
  return result.checked && !result.check_passed ? 1 : 0;
}

}  // namespace ctxpar::cli

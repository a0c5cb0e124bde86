// ctxpar plan: memory, communication and overlap of context-parallel training for a model on a
// cluster, from the model in src/plan/ (see docs/plan.md).
#include <algorithm>
#include <cstdio>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <iostream>

#include <numeric>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "ctxpar/layout.h"
#include "ctxpar/plan.h"
#include "options.h"

namespace ctxpar::cli {
namespace {

// Model sizes (--layers, --hidden, --heads, --ffn, --vocab, ...): far past any real model.
constexpr int64_t kMaxModelSize = int64_t{1} << 30;
// The ring schedule is simulated rank by rank and step by step: P^2 steps (see
// src/plan/ring_schedule.cc). 4096 ranks answer in seconds; beyond that no real cluster runs
// one ring.
constexpr int kMaxPlanCp = 4096;
constexpr const char* kPlanCpNote = "the ring is simulated step by step, cp^2 steps";

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

// "A" or "A,B": intra-node and inter-node values (one value sets both).
std::pair<double, double> pair_of(const Options& o, const std::string& name, double hi) {
  const auto items = o.list(name);
  if (items.empty() || items.size() > 2)
    throw UsageError("--" + name + " expects VALUE or INTRA,INTER, got '" + o.str(name) + "'");
  auto num = [&](const std::string& s) {
    char* end = nullptr;
    errno = 0;
    double v = std::strtod(s.c_str(), &end);
    if (s.empty() || *end != '\0' || errno == ERANGE || !(v >= 0 && v <= hi))
      throw UsageError("--" + name + " expects numbers in [0, " + number_text(hi) +
                       "] (VALUE or INTRA,INTER), got '" + s + "'");
    return v;
  };
  return {num(items[0]), num(items.back())};
}

ModelSpec model_from(const Options& o) {
  ModelSpec m;
  if (o.given("model") || !o.given("layers")) {
    try {
      m = model_preset(o.str("model"));
    } catch (const Error& e) {  // the library names no flag: say the command's
      throw Error(std::string("--") + e.what() + " (or give --layers --hidden --heads ...)");
    }
  }
  auto set = [&](const char* name, int64_t& field) {
    if (o.given(name)) {
      field = o.i64(name, 1, kMaxModelSize);
      m.name = o.given("model") ? m.name + "+custom" : "custom";
    }
  };
  set("layers", m.layers);
  set("hidden", m.hidden);
  set("heads", m.heads);
  set("kv-heads", m.kv_heads);
  set("ffn", m.ffn);
  set("vocab", m.vocab);
  if (o.given("head-dim")) {
    m.head_dim = o.i64("head-dim", 1, 1 << 16);
  } else if (o.given("hidden") || o.given("heads")) {
    if (m.heads > 0) m.head_dim = m.hidden / m.heads;
  }
  if (!o.given("kv-heads") && o.given("heads") && !o.given("model")) m.kv_heads = m.heads;
  return m;
}

// `local`: our kernel timed on one block pair of this plan's shape, our transport timed with
// the simulated link of --link-gbps / --latency-us, the cores shared by the cp ranks. Under
// mpirun -n cp: each process times its rank, and the MPI link is measured.
HardwareSpec hardware_from(const Options& o, const PlanInput& in) {
  HardwareSpec h;
  const std::string name = o.str("hardware");
  if (name == "local") {
    LocalOptions lo;
    lo.block_tokens = in.seq / in.cp;
    lo.batch = in.batch;
    lo.heads = in.model.heads / in.tp;
    lo.kv_heads = std::max<int64_t>(1, in.model.kv_heads / in.tp);
    lo.head_dim = in.model.head_dim;
    lo.dtype = in.dtype;
    if (o.given("link-gbps"))
      lo.link.gbytes_per_second = pair_of(o, "link-gbps", kMaxLinkGbps).first;
    if (o.given("latency-us"))
      lo.link.latency_us = pair_of(o, "latency-us", kMaxLinkLatencyUs).first;
    lo.message_bytes =
        2.0 * lo.batch * lo.block_tokens * lo.kv_heads * lo.head_dim * dtype_size(in.dtype);
    lo.ranks = in.cp;
    lo.layout = in.layout;
    lo.causal = in.causal;
    if (launched_by_mpi()) {
      if (o.given("link-gbps") || o.given("latency-us"))
        throw UsageError(
            "--link-gbps and --latency-us set the threads transport's simulated "
            "link; under mpirun --hardware local measures the MPI link instead");
      lo.comm = &mpi_world();
      if (lo.comm->size() != in.cp)
        throw UsageError(
            "--hardware local under mpirun measures one rank per process: mpirun "
            "started " +
            std::to_string(lo.comm->size()) + " processes but --cp is " + std::to_string(in.cp) +
            "; use mpirun -n " + std::to_string(in.cp));
    }
    h = local_hardware(measure_local(lo), in.cp);
  } else if (o.given("hardware") || !o.given("flops")) {
    try {
      h = hardware_preset(name);
    } catch (const Error& e) {
      throw Error(std::string("--") + e.what() +
                  " (or give --flops --mem-gb --link-gbps --latency-us)");
    }
  } else {
    h.name = "custom";
  }
  if (o.given("flops")) h.flops = o.num("flops", 1e-6, 1e9) * 1e12;
  if (o.given("mem-gb")) h.mem_gb = o.num("mem-gb", 1e-3, 1e9);
  if (o.given("link-gbps") && name != "local") {
    auto [a, b] = pair_of(o, "link-gbps", kMaxLinkGbps);
    h.intra.gbytes_per_second = a;
    h.inter.gbytes_per_second = b;
  }
  if (o.given("latency-us") && name != "local") {
    auto [a, b] = pair_of(o, "latency-us", kMaxLinkLatencyUs);
    h.intra.latency_us = a;
    h.inter.latency_us = b;
  }
  if (o.given("devices-per-node")) h.devices_per_node = o.i32("devices-per-node", 1, kMaxProcesses);
  if (o.given("efficiency")) h.efficiency = o.num("efficiency", 1e-6, 1);
  return h;
}

Options plan_options() {
  Options o("plan",
            "Memory, FLOPs, communication and ring overlap of context-parallel training for a "
            "model on a cluster (see docs/plan.md).");
  o.add("model", "llama3-8b", "model preset: " + join(model_preset_names()))
      .add("layers", "", "transformer blocks (custom model; overrides the preset)")
      .add("hidden", "", "model width")
      .add("heads", "", "query heads")
      .add("kv-heads", "", "key/value heads (GQA; default = heads for a custom model)")
      .add("head-dim", "", "head dimension (default hidden / heads)")
      .add("ffn", "", "MLP inner width (SwiGLU)")
      .add("vocab", "", "vocabulary size")
      .add("seq", "131072", "tokens per sequence (64K, 1M suffixes accepted)")
      .add("video-hours", "", "set --seq from a video: hours * 3600 * fps * tokens-per-frame")
      .add("fps", "1", "video frames per second (with --video-hours)")
      .add("tokens-per-frame", "256", "tokens per video frame (with --video-hours)")
      .add("batch", "1", "sequences per data-parallel replica per step")
      .add("dp", "1", "data-parallel degree")
      .add("cp", "auto", "context-parallel degree (auto: the smallest power of two that fits)")
      .add("tp", "1", "tensor-parallel degree (sequence-parallel activations)")
      .add("pp", "1",
           "pipeline stages (ceil(layers / pp) layers a device; 1F1B: pp micro-batches in flight)")
      .add("zero", "3", "ZeRO stage over dp x cp: 0 replicated, 1 optimizer, 2 +grads, 3 +weights")
      .add("strategy", "ring", "ring | allgather | ulysses | hybrid")
      .add("ulysses-degree", "0", "hybrid: ranks per Ulysses group (0: largest within a node)")
      .add("layout", "zigzag", "contiguous | zigzag | striped")
      .add("mask", "causal", "causal | none")
      .add("dtype", "bf16", "bf16 | fp32 (weights, activations and transfers)")
      .flag("recompute", "full activation recomputation (keep only each layer's input)")
      .add("hardware", "h100",
           "hardware preset: " + join(hardware_preset_names()) +
               " (local under mpirun -n cp: the MPI link is measured)")
      .add("flops", "", "peak dense TFLOP/s per device (overrides the preset)")
      .add("efficiency", "",
           "fraction of peak the kernels reach (presets: 1, as the Ring "
           "Attention paper assumes)")
      .add("mem-gb", "", "device memory in GB")
      .add("link-gbps", "", "link GB/s per device, one direction: INTRA[,INTER]")
      .add("latency-us", "", "link latency in microseconds: INTRA[,INTER]")
      .add("devices-per-node", "", "devices sharing the intra-node link")
      .add("tile", "0", "kernel tile edge for masked-tile skipping (0: exact pairs; local: 64)")
      .add("documents", "",
           "packed documents (causal within each): LEN,LEN,... adding up to --seq, or "
           "lognormal:MEDIAN,SIGMA,SEED (lengths drawn until --seq is full); prints each "
           "layout's balance and the K/V a rank receives, ring against the needed exchange")
      .flag("compare", "estimate and rank ring, allgather, ulysses and hybrid")
      .flag("json", "print every figure as JSON")
      .example("ctxpar plan --model lwm-7b --video-hours 1")
      .example("ctxpar plan --seq 128K --cp 8 --documents lognormal:1000,1.5,1")
      .example("ctxpar plan --model llama3-70b --seq 1M --cp 16 --tp 8 --hardware h100 --compare")
      .example(
          "ctxpar plan --hardware local --layers 1 --hidden 512 --heads 4 --ffn 1024 "
          "--vocab 1000 --seq 8192 --cp 4 --link-gbps 1 --json");
  return o;
}

// --seq, or --video-hours x 3600 x --fps x --tokens-per-frame.
int64_t plan_seq(const Options& o) {
  if (o.given("video-hours")) {
    if (o.given("seq")) throw UsageError("give --seq or --video-hours, not both");
    const double hours = o.num("video-hours", 1e-6, 1e6), fps = o.num("fps", 1e-6, 1e4);
    const int64_t per_frame = o.i64("tokens-per-frame", 1, 1 << 20);
    int64_t seq = 0;
    try {
      seq = video_tokens(hours, fps, per_frame);
    } catch (const Error&) {  // past int64: the library names its arguments, say the flags
      throw Error(detail::concat(
          "--video-hours x 3600 x --fps x --tokens-per-frame is ",
          std::floor(hours * 3600.0 * fps + 0.5) * double(per_frame),
          " tokens, past int64 (more than the largest --seq); lower --video-hours, --fps or "
          "--tokens-per-frame"));
    }
    if (seq > kMaxTokens)
      throw UsageError("--video-hours x 3600 x --fps x --tokens-per-frame is " +
                       std::to_string(seq) + " tokens, more than the largest --seq (" +
                       std::to_string(kMaxTokens) + ")");
    return seq;
  }
  return o.i64("seq", 1, kMaxTokens);
}

// The plan's input from the options, checked; --cp auto: the smallest cp that fits.
PlanInput plan_from_options(const Options& o) {
  PlanInput in;
  in.model = model_from(o);
  in.seq = plan_seq(o);
  in.batch = o.i64("batch", 1, kMaxBatch);
  in.dp = o.i32("dp", 1, kMaxProcesses);
  in.tp = o.i32("tp", 1, kMaxProcesses);
  in.pp = o.i32("pp", 1, kMaxProcesses);
  in.zero = o.i32("zero", 0, 3);
  in.strategy = parse_strategy(o.str("strategy"));
  in.ulysses_degree = o.i32("ulysses-degree", 0, kMaxPlanCp);
  in.layout = parse_layout(o.str("layout"));
  const std::string mask = o.str("mask");
  if (mask != "causal" && mask != "none")
    throw UsageError("--mask must be causal or none, got '" + mask + "'");
  in.causal = mask == "causal";
  in.dtype = parse_dtype(o.str("dtype"));
  in.recompute = o.on("recompute") ? Recompute::full : Recompute::none;
  in.tile = o.i32("tile", 0, 1 << 16);
  const bool auto_cp = o.str("cp") == "auto";
  in.cp = auto_cp ? 1 : o.i32("cp", 1, kMaxPlanCp, kPlanCpNote);
  if (o.str("hardware") == "local" && !o.given("tile")) in.tile = static_cast<int>(kKernelTile);
  const bool local = o.str("hardware") == "local";
  if (auto_cp) {
    if (local)
      throw UsageError("--hardware local needs an explicit --cp (the ranks share this machine)");
    in.hardware = hardware_from(o, in);
    Plan probe = make_plan(in, false);
    const int fit = in.recompute == Recompute::full ? probe.cp_to_fit_recompute : probe.cp_to_fit;
    in.cp = fit > 0 ? fit : 8;
    if (in.cp > kMaxPlanCp)
      throw Error(detail::concat("--seq ", in.seq, " needs cp ", in.cp,
                                 " to fit in memory (with full recompute: ",
                                 probe.cp_to_fit_recompute, "), more than the ", kMaxPlanCp,
                                 " ranks whose ring the plan "
                                 "simulates (",
                                 kPlanCpNote, "); add --recompute or --tp, or give --cp ",
                                 kMaxPlanCp, " to see that plan (it will show what does not fit)"));
  }
  in.hardware = hardware_from(o, in);
  return in;
}

// --documents: LEN,LEN,... (adding up to seq) or lognormal:MEDIAN,SIGMA,SEED.
std::vector<int64_t> document_lengths(const Options& o, int64_t seq) {
  const std::string text = o.str("documents");
  std::vector<int64_t> out;
  if (text.rfind("lognormal:", 0) == 0) {
    std::vector<std::string> parts;
    std::stringstream in(text.substr(10));
    for (std::string p; std::getline(in, p, ',');) parts.push_back(p);
    auto num = [&](size_t i, double lo, double hi) {
      char* end = nullptr;
      const double v = i < parts.size() ? std::strtod(parts[i].c_str(), &end) : NAN;
      if (i >= parts.size() || parts[i].empty() || *end != '\0' || !(v >= lo && v <= hi))
        throw UsageError(
            "--documents lognormal:MEDIAN,SIGMA,SEED expects a median in [1, 1e9], "
            "a sigma in [0, 10] and a seed in [0, 1e15], got '" +
            text + "'");
      return v;
    };
    if (parts.size() != 3) num(3, 0, 0);  // names the grammar
    const double median = num(0, 1, 1e9), sigma = num(1, 0, 10);
    std::mt19937_64 rng(static_cast<uint64_t>(num(2, 0, 1e15)));
    std::lognormal_distribution<double> len(std::log(median), sigma);
    for (int64_t sum = 0; sum < seq;) {
      const int64_t l =
          std::min(seq - sum, std::max<int64_t>(1, int64_t(std::min(len(rng), 1e15))));
      out.push_back(l), sum += l;
    }
    return out;
  }
  // LEN,LEN,...: the --mask documents:LEN,... parser (src/core/mask.cc), one home for the rule.
  try {
    out = parse_document_lengths("documents:" + text);
  } catch (const Error& e) {
    throw UsageError(std::string("--documents: ") + e.what());
  }
  const int64_t sum = std::accumulate(out.begin(), out.end(), int64_t{0});
  if (sum != seq)
    throw UsageError(detail::concat("--documents: the lengths add up to ", sum, " but --seq is ",
                                    seq, "; they must cover the sequence"));
  return out;
}

// The data-aware figures: per layout, the busiest rank's attention work over the mean (kernel
// tiles of the causal + documents mask, Layout::rank_work) and the K/V bytes the busiest
// receiver takes in a layer's forward, by a ring and by the needed exchange (Layout::needed_rows:
// the 64-row tiles the exchange sends, K and V; 8-12 bytes of token ids a row travel beside them).
struct DocumentsRow {
  LayoutKind layout;
  double busiest_over_mean, ring_bytes, needed_bytes;
};

std::vector<DocumentsRow> documents_rows(const PlanInput& in, const std::vector<int64_t>& lengths) {
  std::vector<int32_t> ids;
  for (size_t d = 0; d < lengths.size(); ++d) ids.insert(ids.end(), lengths[d], int32_t(d));
  Mask mask = Mask::causal_mask();
  mask.documents = true;
  const BalanceInput balance{mask, ids, {}};
  const double per_row =
      2.0 * double(in.model.kv_heads * in.model.head_dim) * double(dtype_size(in.dtype));
  std::vector<DocumentsRow> rows;
  for (LayoutKind kind :
       {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped, LayoutKind::balanced}) {
    const Layout l(kind, in.seq, in.cp, balance);
    const std::vector<double> work = l.rank_work(balance);
    const double mean = std::accumulate(work.begin(), work.end(), 0.0) / double(work.size());
    const std::vector<int64_t> needed = l.needed_rows(balance);
    rows.push_back({kind, mean > 0 ? *std::max_element(work.begin(), work.end()) / mean : 1.0,
                    double(in.cp - 1) * double(l.local_tokens()) * per_row,
                    double(*std::max_element(needed.begin(), needed.end())) * per_row});
  }
  return rows;
}

std::string documents_table(const PlanInput& in, const std::vector<int64_t>& lengths,
                            const std::vector<DocumentsRow>& rows) {
  std::ostringstream out;
  out << "\npacked documents: " << lengths.size() << " (largest "
      << *std::max_element(lengths.begin(), lengths.end()) << " tokens), causal within each; cp "
      << in.cp << "; K/V the busiest receiver takes, one layer's forward:\n";
  char line[256];
  std::snprintf(line, sizeof line, "  %-11s %14s %16s %16s %10s\n", "layout", "busiest/mean",
                "ring (MB)", "needed (MB)", "needed/ring");
  out << line;
  for (const DocumentsRow& r : rows) {
    std::snprintf(line, sizeof line, "  %-11s %14.3f %16.1f %16.1f %10.2f\n", layout_name(r.layout),
                  r.busiest_over_mean, r.ring_bytes / 1e6, r.needed_bytes / 1e6,
                  r.ring_bytes > 0 ? r.needed_bytes / r.ring_bytes : 0.0);
    out << line;
  }
  return out.str();
}

// The same figures as JSON, added to plan_json's object.
std::string with_documents(const std::string& plan, const std::vector<int64_t>& lengths,
                           const std::vector<DocumentsRow>& rows) {
  nlohmann::json j = nlohmann::json::parse(plan);
  nlohmann::json d;
  d["lengths"] = lengths;
  for (const DocumentsRow& r : rows)
    d["layouts"][layout_name(r.layout)] = {{"busiest_over_mean_work", r.busiest_over_mean},
                                           {"ring_bytes_received", r.ring_bytes},
                                           {"needed_bytes_received", r.needed_bytes}};
  j["documents"] = d;
  return j.dump(2);
}

}  // namespace

int cmd_plan(int argc, char** argv) {
  Options o = plan_options();
  if (!o.parse(argc, argv)) return 0;
  const PlanInput in = plan_from_options(o);
  const bool local = o.str("hardware") == "local";
  const Plan plan = make_plan(in, o.on("compare"));
  if (local && launched_by_mpi() && mpi_world().rank() != 0) return 0;  // rank 0 prints
  const std::vector<int64_t> lengths =
      o.given("documents") ? document_lengths(o, in.seq) : std::vector<int64_t>{};
  const std::vector<DocumentsRow> rows =
      lengths.empty() ? std::vector<DocumentsRow>{} : documents_rows(in, lengths);
  if (o.on("json")) {
    std::cout << (lengths.empty() ? plan_json(plan)
                                  : with_documents(plan_json(plan), lengths, rows))
              << "\n";
  } else {
    std::cout << plan_table(plan);
    if (!lengths.empty()) std::cout << documents_table(in, lengths, rows);
  }
  return 0;
}

}  // namespace ctxpar::cli

// The job runner behind `ctxpar attention` and `ctxpar bench cp`: one rank's part is
// run_rank (shard, strategy forward / backward, timings); the threads transport runs it on P
// threads sharing one RankData per rank, MPI runs it once per process and gathers the shards
// to rank 0. Inputs are drawn per token (see token_seed), so a rank makes its own shard
// without ever holding the whole sequence, and the values do not depend on P or the layout.
#include "attention_job.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <numeric>
#include <thread>

#include "attention_check.h"
#include "options.h"
#include "ctxpar/npy.h"
#include "memory_estimate.h"

namespace ctxpar::cli {
namespace {

using Clock = std::chrono::steady_clock;

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

int64_t kv_heads_of(const AttentionJob& job) { return job.kv_heads ? job.kv_heads : job.heads; }

uint64_t token_seed(uint64_t seed, int which, int64_t b, int64_t t) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(which) * 0xbf58476d1ce4e5b9ull +
               static_cast<uint64_t>(b) * 0x94d049bb133111ebull + static_cast<uint64_t>(t);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// shard [B, Tl, H, D]: row i is global token index[i], drawn from its own seed; padding rows
// (index >= the layout's T) stay zero.
void fill_shard(const TensorView& shard, const Layout& layout, const std::vector<int64_t>& index,
                uint64_t seed, int which) {
  for (int64_t b = 0; b < shard.dim(0); ++b)
    for (size_t i = 0; i < index.size(); ++i)
      if (!layout.is_padding(index[i]))
        fill_normal(shard.slice(0, b, b + 1).slice(1, i, i + 1),
                    token_seed(seed, which, b, index[i]));
}

// One rank's tensors and measurements. Under threads, rank r's thread fills all_data[r].
struct RankData {
  Tensor q, k, v, dout, out, lse, dq, dk, dv;  // shards, layout order
  std::vector<int64_t> positions;
  std::vector<int32_t> documents;
  int64_t tokens = 0;
  size_t shard_bytes = 0;
  uint64_t input_bytes_read = 0;
  std::vector<double> fwd_wall, bwd_wall, fwd_cpu, bwd_cpu;
  std::vector<StrategyStats> fwd_stats, bwd_stats;
};

// The whole sequence's token identity (T entries): positions and document ids.
struct SequenceTokens {
  std::vector<int64_t> positions;
  std::vector<int32_t> documents;
};

SequenceTokens sequence_tokens(const AttentionJob& job) {
  SequenceTokens s;
  s.positions = job.positions;
  if (s.positions.empty()) {
    s.positions.resize(job.seq);
    std::iota(s.positions.begin(), s.positions.end(), int64_t{0});
  }
  if (!job.documents.empty()) {
    s.documents = job.documents;
  } else if (!job.document_lengths.empty()) {
    for (size_t d = 0; d < job.document_lengths.size(); ++d)
      s.documents.insert(s.documents.end(), job.document_lengths[d], static_cast<int32_t>(d));
  }
  if (!job.mask.documents) s.documents.clear();
  return s;
}

void run_rank(Communicator& comm, const AttentionJob& job, const SequenceTokens& seq,
              RankData& rd) {
  const int r = comm.rank();
  auto step = [&](const std::string& name) {
    if (r == 0 && job.on_step) job.on_step(name);
  };
  step("inputs");
  // Test hook: CTXPAR_FAULT_RANK=r makes rank r fail here, as a rank failing at run time would.
  if (const char* fault = std::getenv("CTXPAR_FAULT_RANK"); fault && std::atoi(fault) == r)
    throw Error(detail::concat("injected fault (CTXPAR_FAULT_RANK=", fault, ")"));
  const Layout layout(job.layout, job.seq, job.ranks);
  const std::vector<int64_t> index = layout.positions(r);
  const int64_t B = job.batch, Tl = layout.local_tokens(), Hq = job.heads;
  const int64_t Hkv = kv_heads_of(job), D = job.head_dim;
  rd.tokens = std::count_if(index.begin(), index.end(),
                            [&](int64_t t) { return !layout.is_padding(t); });
  rd.positions = layout.token_positions(r, seq.positions);
  if (!seq.documents.empty()) rd.documents = layout.shard(seq.documents, r);
  auto input = [&](const Tensor& given, const InputFile& file, int64_t heads, int which) {
    if (!given.empty()) return Tensor::copy_of(layout.shard(given, r), job.dtype);
    if (file.given()) {
      // The real tokens' rows (padding, indices >= T, ends the increasing index), read as fp32
      // and then stored as job.dtype: the same rounding as a whole-file read. Padding rows
      // stay zero, as layout.shard leaves them.
      const std::vector<int64_t> real(index.begin(), index.begin() + rd.tokens);
      Tensor rows = read_npy_rows(file.path, file.heads_first ? 2 : 1, real, DType::f32,
                                  &rd.input_bytes_read);
      const Shape s = rows.shape();  // [B, H, T_real, D] -> [B, T_real, H, D] when heads first
      const TensorView rows_bthd =
          file.heads_first ? TensorView(rows.data(), rows.dtype(), {s[0], s[2], s[1], s[3]},
                                        {s[1] * s[2] * s[3], s[3], s[2] * s[3], 1})
                           : rows.view();
      Tensor t(job.dtype, {B, Tl, heads, D});
      copy_into(rows_bthd, t.view().slice(1, 0, rd.tokens));
      return t;
    }
    Tensor t(job.dtype, {B, Tl, heads, D});
    fill_shard(t, layout, index, job.seed, which);
    return t;
  };
  rd.q = input(job.q, job.q_file, Hq, 0);
  rd.k = input(job.k, job.k_file, Hkv, 1);
  rd.v = input(job.v, job.v_file, Hkv, 2);
  rd.out = Tensor(job.dtype, {B, Tl, Hq, D});
  rd.lse = Tensor(DType::f32, {B, Hq, Tl});
  if (job.backward) {
    rd.dout = input(job.dout, job.dout_file, Hq, 3);
    rd.dq = Tensor(DType::f32, {B, Tl, Hq, D});
    rd.dk = Tensor(DType::f32, {B, Tl, Hkv, D});
    rd.dv = Tensor(DType::f32, {B, Tl, Hkv, D});
  }
  for (const Tensor* t : {&rd.q, &rd.k, &rd.v, &rd.out, &rd.lse, &rd.dout, &rd.dq, &rd.dk, &rd.dv})
    rd.shard_bytes += t->empty() ? 0 : t->bytes();

  comm.set_timeout(std::chrono::milliseconds(static_cast<int64_t>(job.timeout_seconds * 1000)));
  StrategyOptions options;
  options.kind = job.strategy;
  options.ulysses_degree = job.ulysses_degree;
  options.mask = job.mask;
  options.kernel.threads = job.threads;
  options.device = job.device;
  std::unique_ptr<Strategy> strategy = Strategy::create(comm, options);
  const Tokens tokens{rd.positions, rd.documents};

  auto nth = [&](const char* phase, int rep) {
    return job.repeats == 1 ? std::string(phase)
                            : detail::concat(phase, " ", rep + 1, "/", job.repeats);
  };
  for (int rep = 0; rep < job.repeats; ++rep) {
    step(nth("forward", rep));
    comm.barrier();  // every rank starts the timed call together
    auto t0 = Clock::now();
    const double c0 = thread_cpu_seconds();
    strategy->forward(rd.q, rd.k, rd.v, tokens, rd.out, rd.lse);
    rd.fwd_wall.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    rd.fwd_cpu.push_back(thread_cpu_seconds() - c0);
    rd.fwd_stats.push_back(strategy->last_stats());
  }
  if (!job.backward) return;
  for (int rep = 0; rep < job.repeats; ++rep) {
    step(nth("backward", rep));
    comm.barrier();
    auto t0 = Clock::now();
    const double c0 = thread_cpu_seconds();
    strategy->backward(rd.q, rd.k, rd.v, tokens, rd.out, rd.lse, rd.dout, rd.dq, rd.dk, rd.dv);
    rd.bwd_wall.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    rd.bwd_cpu.push_back(thread_cpu_seconds() - c0);
    rd.bwd_stats.push_back(strategy->last_stats());
  }
}

// ---- MPI: every rank's measurements and (when the root needs them) tensors go to rank 0 ----

constexpr int kStatFields = 9;

void pack_stats(const StrategyStats& s, double wall, double cpu, double* out) {
  const double v[kStatFields] = {cpu, wall, s.attention_flops, s.busy_seconds, s.wall_seconds,
                                 s.comm_wait_seconds, static_cast<double>(s.bytes_sent),
                                 static_cast<double>(s.bytes_received),
                                 static_cast<double>(s.peak_bytes)};
  std::copy(v, v + kStatFields, out);
}

StrategyStats unpack_stats(const double* in, double& wall, double& cpu) {
  StrategyStats s;
  cpu = *in++;
  wall = in[0];
  s.attention_flops = in[1], s.busy_seconds = in[2], s.wall_seconds = in[3];
  s.comm_wait_seconds = in[4];
  s.bytes_sent = static_cast<uint64_t>(in[5]), s.bytes_received = static_cast<uint64_t>(in[6]);
  s.peak_bytes = static_cast<size_t>(in[7]);
  return s;
}

void gather_to_root(Communicator& comm, const AttentionJob& job, RankData& mine,
                    std::vector<RankData>& all, bool tensors) {
  const int P = comm.size(), R = job.repeats;
  const size_t n = 3 + 2 * static_cast<size_t>(R) * kStatFields;
  std::vector<double> send(n, 0), recv(n * P);
  send[0] = static_cast<double>(mine.tokens), send[1] = static_cast<double>(mine.shard_bytes);
  send[2] = static_cast<double>(mine.input_bytes_read);
  for (int rep = 0; rep < R; ++rep) {
    pack_stats(mine.fwd_stats[rep], mine.fwd_wall[rep], mine.fwd_cpu[rep],
               &send[3 + rep * kStatFields]);
    if (job.backward)
      pack_stats(mine.bwd_stats[rep], mine.bwd_wall[rep], mine.bwd_cpu[rep],
                 &send[3 + (R + rep) * kStatFields]);
  }
  comm.allgather(send.data(), recv.data(), n * sizeof(double));
  if (comm.rank() == 0) {
    all.resize(P);
    for (int p = 0; p < P; ++p) {
      const double* in = &recv[p * n];
      RankData& rd = all[p];
      rd.tokens = static_cast<int64_t>(in[0]), rd.shard_bytes = static_cast<size_t>(in[1]);
      rd.input_bytes_read = static_cast<uint64_t>(in[2]);
      rd.fwd_wall.resize(R), rd.fwd_cpu.resize(R), rd.fwd_stats.resize(R);
      for (int rep = 0; rep < R; ++rep) {
        rd.fwd_stats[rep] =
            unpack_stats(&in[3 + rep * kStatFields], rd.fwd_wall[rep], rd.fwd_cpu[rep]);
        if (!job.backward) continue;
        rd.bwd_wall.resize(R), rd.bwd_cpu.resize(R), rd.bwd_stats.resize(R);
        rd.bwd_stats[rep] =
            unpack_stats(&in[3 + (R + rep) * kStatFields], rd.bwd_wall[rep], rd.bwd_cpu[rep]);
      }
    }
  }
  if (!tensors) return;
  auto fields = [](RankData& rd) {
    return std::vector<Tensor*>{&rd.q, &rd.k, &rd.v, &rd.out, &rd.lse,
                                &rd.dout, &rd.dq, &rd.dk, &rd.dv};
  };
  if (comm.rank() != 0) {
    std::vector<Request> sends;
    int tag = 0;
    for (Tensor* t : fields(mine)) {
      ++tag;
      if (t->empty()) continue;
      Buffer buf(t->bytes());
      std::memcpy(buf.data(), t->data(), t->bytes());
      sends.push_back(comm.isend(std::move(buf), 0, 1 << 20 | tag));
    }
    for (auto& s : sends) s.wait();
    return;
  }
  all[0].q = mine.q, all[0].k = mine.k, all[0].v = mine.v, all[0].out = mine.out;
  all[0].lse = mine.lse, all[0].dout = mine.dout, all[0].dq = mine.dq, all[0].dk = mine.dk;
  all[0].dv = mine.dv;
  for (int p = 1; p < P; ++p) {
    std::vector<Tensor*> theirs = fields(all[p]), ours = fields(mine);
    for (size_t f = 0; f < ours.size(); ++f) {
      if (ours[f]->empty()) continue;
      *theirs[f] = Tensor(ours[f]->dtype(), ours[f]->shape());
      Buffer buf = comm.irecv(ours[f]->bytes(), p, 1 << 20 | static_cast<int>(f + 1)).take();
      std::memcpy(theirs[f]->data(), buf.data(), buf.size());
    }
  }
}

// Index of the repeat whose slowest rank was fastest.
int fastest_repeat(const std::vector<RankData>& all, bool backward_phase) {
  int best = 0;
  double best_wall = 1e300;
  const size_t R = backward_phase ? all[0].bwd_wall.size() : all[0].fwd_wall.size();
  for (size_t rep = 0; rep < R; ++rep) {
    double wall = 0;
    for (const auto& rd : all)
      wall = std::max(wall, backward_phase ? rd.bwd_wall[rep] : rd.fwd_wall[rep]);
    if (wall < best_wall) best_wall = wall, best = static_cast<int>(rep);
  }
  return best;
}

// Full tensor of the shards' field `f`, in original token order.
Tensor unshard_field(const Layout& layout, std::vector<RankData>& all, Tensor RankData::*f,
                     int token_dim) {
  if ((all[0].*f).empty()) return {};
  Shape shape = (all[0].*f).shape();
  shape[token_dim] = layout.tokens();
  Tensor full((all[0].*f).dtype(), shape);
  std::vector<TensorView> shards;
  for (auto& rd : all) shards.push_back((rd.*f).view());
  layout.unshard(shards, full, token_dim);
  return full;
}

}  // namespace

std::vector<int32_t> dense_document_labels(const std::vector<int64_t>& ids) {
  std::vector<int64_t> distinct = ids;
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  CTXPAR_CHECK(distinct.size() <= static_cast<size_t>(INT32_MAX),
               "--documents: more than 2^31 distinct document ids");
  std::vector<int32_t> labels(ids.size());
  for (size_t i = 0; i < ids.size(); ++i)
    labels[i] = static_cast<int32_t>(std::lower_bound(distinct.begin(), distinct.end(), ids[i]) -
                                     distinct.begin());
  return labels;
}

void refuse_foreign_launcher(const char* command) {
  const ForeignLauncher l = foreign_launcher();
  if (l.ranks == 0) return;
  throw UsageError(detail::concat(
      "started by ", l.name, " as ", l.ranks, " separate processes without MPI: each would run "
      "the whole job alone. Launch it with mpirun -n ", l.ranks, " ctxpar ", command,
      " ... (or srun --mpi=pmix with an MPI build), or as one process with --ranks ", l.ranks));
}

void run_rank_threads(int ranks, const std::function<void(Communicator&)>& fn,
                      const ThreadsOptions& options) {
  std::atomic<bool> started{false};
  try {
    run_threads(ranks, [&](Communicator& comm) {
      started = true;
      fn(comm);
    }, options);
  } catch (const Error& e) {
    if (started) throw RankFailure(e.what());
    throw;
  }
}

void validate(const AttentionJob& job) {
  const int64_t T = job.seq, P = job.ranks, Hq = job.heads, Hkv = kv_heads_of(job);
  CTXPAR_CHECK(job.batch >= 1, "--batch must be >= 1, got ", job.batch);
  CTXPAR_CHECK(T >= 1, "--seq must be >= 1, got ", T);
  CTXPAR_CHECK(Hq >= 1 && Hkv >= 1, "--heads and --kv-heads must be >= 1");
  CTXPAR_CHECK(Hq % Hkv == 0, "--heads ", Hq, " must be a multiple of --kv-heads ", Hkv,
               " (grouped-query attention); e.g. --kv-heads ", std::gcd(Hq, Hkv));
  CTXPAR_CHECK(job.head_dim >= 16 && job.head_dim <= 256, "--head-dim must be in [16, 256], got ",
               job.head_dim);
  CTXPAR_CHECK(job.dtype == DType::f32 || job.dtype == DType::bf16,
               "--dtype must be fp32 or bf16, got ", dtype_name(job.dtype));
  CTXPAR_CHECK(P >= 1, "--ranks must be >= 1, got ", P);
  CTXPAR_CHECK(job.threads >= 1, "--threads must be >= 1, got ", job.threads);
  CTXPAR_CHECK(job.repeats >= 1, "--repeats must be >= 1, got ", job.repeats);
  CTXPAR_CHECK(job.timeout_seconds >= 1e-3, "--timeout must be at least 0.001 seconds (waits are "
               "counted in milliseconds), got ", job.timeout_seconds);

  // Any --seq works: the layout pads it to its granule (docs/layouts.md, "Padding").

  const bool uses_ulysses =
      job.strategy == StrategyKind::ulysses || job.strategy == StrategyKind::hybrid;
  CTXPAR_CHECK(job.ulysses_degree == 0 || job.strategy == StrategyKind::hybrid,
               "--ulysses-degree applies to --strategy hybrid only (ulysses uses all ", P,
               " ranks); drop it or use --strategy hybrid");
  if (uses_ulysses) {
    const int64_t u = job.ulysses_degree ? job.ulysses_degree : P;
    std::string divisors;
    for (int64_t d = 1; d <= P; ++d)
      if (P % d == 0) divisors += (divisors.empty() ? "" : ", ") + std::to_string(d);
    CTXPAR_CHECK(u >= 1 && P % u == 0, "--ulysses-degree ", u, " does not divide --ranks ", P,
                 "; use one of ", divisors);
    if (!ulysses_heads_rule(Hq, int(u)).empty()) {
      // The library's rule, in flag names; the largest Ulysses group it allows, for the hint.
      int64_t best = 1;
      for (int64_t d = 1; d <= P; ++d)
        if (P % d == 0 && ulysses_heads_rule(Hq, int(d)).empty()) best = d;
      throw Error(detail::concat(
          strategy_name(job.strategy), " splits heads across ", u, " ranks: needs --heads (", Hq,
          ") divisible by ", u, " (--kv-heads that do not split are replicated); use --heads ",
          (Hq + u - 1) / u * u,
          ", or --strategy ring, or --strategy hybrid --ulysses-degree ", best));
    }
  }

  CTXPAR_CHECK(job.transport == "threads" || job.transport == "mpi",
               "--transport must be threads or mpi, got '", job.transport, "'");
  CTXPAR_CHECK(job.device.kind == DeviceKind::cpu || job.transport == "threads",
               "--device ", device_name(job.device.kind), " runs on the threads transport only "
               "(its streams' worker threads use the communicator); use --device cpu under mpirun");
  if (job.transport == "mpi") {
    CTXPAR_CHECK(launched_by_mpi(), "--transport mpi needs the job started by mpirun, e.g. "
                 "mpirun -n ", P, " ctxpar attention ...; or use --transport threads");
    CTXPAR_CHECK(job.link.gbytes_per_second == 0 && job.link.latency_us == 0,
                 "--link-gbps / --link-latency-us simulate a link on the threads transport only");
  }
  CTXPAR_CHECK(job.link.gbytes_per_second >= 0 && job.link.latency_us >= 0,
               "--link-gbps and --link-latency-us must be >= 0");

  if (job.mask.documents) {
    CTXPAR_CHECK(!job.documents.empty() || !job.document_lengths.empty(),
                 "--mask documents needs the document lengths (--mask documents:512,512) or "
                 "--documents doc_ids.npy");
    if (job.documents.empty()) {
      int64_t sum = 0;
      for (int64_t len : job.document_lengths) {
        CTXPAR_CHECK(len >= 1, "--mask documents: every length must be >= 1, got ", len);
        sum += len;
      }
      CTXPAR_CHECK(sum == T, "--mask documents: the lengths add up to ", sum,
                   " but --seq is ", T, "; they must cover the sequence exactly");
    }
  }
  CTXPAR_CHECK(job.documents.empty() || static_cast<int64_t>(job.documents.size()) == T,
               "--documents: ", job.documents.size(), " ids for ", T, " tokens");
  CTXPAR_CHECK(job.positions.empty() || static_cast<int64_t>(job.positions.size()) == T,
               "--positions: ", job.positions.size(), " positions for ", T, " tokens");
  for (size_t i = 0; i < job.positions.size(); ++i)
    CTXPAR_CHECK(job.positions[i] != kPaddingPosition, "--positions: token ", i, " has position ",
                 kPaddingPosition, " (INT64_MIN), which marks padding; use any other value");

  // Tensors given by a library caller, or files (shape from the header) by the command.
  struct Input {
    const char* name;
    const Tensor& tensor;
    const InputFile& file;
    int64_t heads;
  };
  const Input inputs[] = {{"--q", job.q, job.q_file, Hq}, {"--k", job.k, job.k_file, Hkv},
                          {"--v", job.v, job.v_file, Hkv}, {"--do", job.dout, job.dout_file, Hq}};
  for (const Input& in : inputs) {
    if (in.tensor.empty() && !in.file.given()) continue;
    const Shape want{job.batch, T, in.heads, job.head_dim};
    const Shape got = in.file.given() ? in.file.shape : in.tensor.shape();
    CTXPAR_CHECK(got == want, in.name, in.file.given() ? " " + in.file.path : "", ": shape ",
                 shape_str(got), ", expected ", shape_str(want),
                 " [B, T, H, D] to match the other inputs");
  }
  auto given = [](const Input& in) { return !in.tensor.empty() || in.file.given(); };
  CTXPAR_CHECK(given(inputs[0]) == given(inputs[1]) && given(inputs[1]) == given(inputs[2]),
               "--q, --k and --v come together");
  check_memory(job);  // last: a shape that is wrong is named as such, not as too large
}

int progress_steps(const AttentionJob& job) {
  return 1 + job.repeats * (job.backward ? 2 : 1) + (job.check ? 1 : 0);
}

AttentionResult run_attention_job(const AttentionJob& job) {
  validate(job);
  const SequenceTokens seq = sequence_tokens(job);
  const int P = job.ranks;
  const bool need_tensors = job.check || job.keep_outputs;
  std::vector<RankData> all;
  AttentionResult result;

  if (job.transport == "mpi") {
    Communicator& world = mpi_world();
    CTXPAR_CHECK(world.size() == P, "mpirun started ", world.size(), " processes but --ranks is ",
                 P, "; drop --ranks or use mpirun -n ", P);
    run_mpi([&](Communicator& comm) {
      RankData mine;
      run_rank(comm, job, seq, mine);
      gather_to_root(comm, job, mine, all, need_tensors);
    });
    result.is_root = world.rank() == 0;
    if (!result.is_root) return result;
  } else {
    all.resize(P);
    ThreadsOptions options;
    options.link = job.link;
    options.timeout = std::chrono::milliseconds(static_cast<int64_t>(job.timeout_seconds * 1000));
    run_rank_threads(P, [&](Communicator& comm) { run_rank(comm, job, seq, all[comm.rank()]); },
                     options);
  }

  const int fwd = fastest_repeat(all, false);
  const int bwd = job.backward ? fastest_repeat(all, true) : 0;
  for (int p = 0; p < P; ++p) {
    const RankData& rd = all[p];
    RankReport rep;
    rep.rank = p;
    rep.tokens = rd.tokens;
    rep.shard_bytes = rd.shard_bytes;
    rep.input_bytes_read = rd.input_bytes_read;
    const StrategyStats& f = rd.fwd_stats[fwd];
    rep.forward_flops = f.attention_flops;
    rep.forward_busy_seconds = f.busy_seconds;
    rep.forward_cpu_seconds = rd.fwd_cpu[fwd];
    rep.wall_seconds = rd.fwd_wall[fwd];
    rep.comm_wait_seconds = f.comm_wait_seconds;
    rep.bytes_sent = f.bytes_sent, rep.bytes_received = f.bytes_received;
    rep.peak_bytes = f.peak_bytes;
    result.forward_seconds = std::max(result.forward_seconds, rd.fwd_wall[fwd]);
    if (job.backward) {
      const StrategyStats& b = rd.bwd_stats[bwd];
      rep.backward_flops = b.attention_flops;
      rep.backward_busy_seconds = b.busy_seconds;
      rep.backward_cpu_seconds = rd.bwd_cpu[bwd];
      rep.wall_seconds += rd.bwd_wall[bwd];
      rep.comm_wait_seconds += b.comm_wait_seconds;
      rep.bytes_sent += b.bytes_sent, rep.bytes_received += b.bytes_received;
      rep.peak_bytes = std::max(rep.peak_bytes, b.peak_bytes);
      result.backward_seconds = std::max(result.backward_seconds, rd.bwd_wall[bwd]);
    }
    rep.attention_flops = rep.forward_flops + rep.backward_flops;
    rep.busy_seconds = rep.forward_busy_seconds + rep.backward_busy_seconds;
    result.ranks.push_back(rep);
  }

  // One rank alone: inputs and outputs of the whole sequence plus the kernel's fp32 state
  // (acc [B, T, Hq, D], m and l [B, Hq, T]); backward adds dO, fp32 dQ, dK, dV and delta.
  const double B = static_cast<double>(job.batch), T = static_cast<double>(job.seq);
  const double Hq = static_cast<double>(job.heads), Hkv = static_cast<double>(kv_heads_of(job));
  const double D = static_cast<double>(job.head_dim), es = static_cast<double>(dtype_size(job.dtype));
  double single = B * T * (2 * Hq + 2 * Hkv) * D * es + B * Hq * T * 4 + B * T * Hq * D * 4 +
                  2 * B * Hq * T * 4;
  if (job.backward) single += B * T * Hq * D * (es + 4) + 2 * B * T * Hkv * D * 4 + B * Hq * T * 4;
  result.single_rank_bytes = single;
  result.scores_bytes = B * Hq * T * T * 4;

  if (!need_tensors) return result;
  const Layout layout(job.layout, job.seq, P);
  result.out = unshard_field(layout, all, &RankData::out, 1);
  result.lse = unshard_field(layout, all, &RankData::lse, 2);
  result.dq = unshard_field(layout, all, &RankData::dq, 1);
  result.dk = unshard_field(layout, all, &RankData::dk, 1);
  result.dv = unshard_field(layout, all, &RankData::dv, 1);
  if (job.check) {
    CheckInputs in;
    Tensor q = unshard_field(layout, all, &RankData::q, 1);
    Tensor k = unshard_field(layout, all, &RankData::k, 1);
    Tensor v = unshard_field(layout, all, &RankData::v, 1);
    Tensor dout = unshard_field(layout, all, &RankData::dout, 1);
    all.clear();  // the shards are no longer needed; the reference wants the memory
    in.q = q, in.k = k, in.v = v, in.dout = dout.empty() ? TensorView() : dout.view();
    in.out = result.out, in.lse = result.lse;
    if (job.backward) in.dq = result.dq, in.dk = result.dk, in.dv = result.dv;
    in.tokens = Tokens{seq.positions, seq.documents};
    if (!seq.documents.empty()) in.document_ids = job.document_ids;
    in.mask = job.mask;
    in.dtype = job.dtype;
    if (job.on_step) job.on_step("check");
    const int threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    const auto t0 = Clock::now();
    check_against_reference(in, job.check_budget, threads, result);
    result.check_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  return result;
}

nlohmann::json to_json(const AttentionJob& job, const AttentionResult& result) {
  nlohmann::json j;
  j["command"] = "attention";
  j["batch"] = job.batch, j["seq"] = job.seq, j["heads"] = job.heads;
  j["kv_heads"] = kv_heads_of(job), j["head_dim"] = job.head_dim;
  j["dtype"] = job.dtype == DType::bf16 ? "bf16" : "fp32";
  j["mask"] = job.mask.describe();
  j["num_ranks"] = job.ranks;
  j["strategy"] = strategy_name(job.strategy);
  j["ulysses_degree"] = job.strategy == StrategyKind::hybrid
                            ? (job.ulysses_degree ? job.ulysses_degree : job.ranks)
                            : (job.strategy == StrategyKind::ulysses ? job.ranks : 1);
  j["layout"] = layout_name(job.layout);
  j["transport"] = job.transport;
  j["device"] = device_name(job.device.kind);
  j["threads"] = job.threads;
  j["backward"] = job.backward;
  j["seed"] = job.seed;
  j["repeats"] = job.repeats;
  j["link_gbps"] = job.link.gbytes_per_second;
  j["link_latency_us"] = job.link.latency_us;
  j["forward_seconds"] = result.forward_seconds;
  j["backward_seconds"] = result.backward_seconds;
  double fwd_flops = 0, bwd_flops = 0, max_flops = 0, total_flops = 0;
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& r : result.ranks) {
    fwd_flops += r.forward_flops, bwd_flops += r.backward_flops;
    total_flops += r.attention_flops, max_flops = std::max(max_flops, r.attention_flops);
    ranks.push_back({{"rank", r.rank},
                     {"tokens", r.tokens},
                     {"attention_flops", r.attention_flops},
                     {"forward_flops", r.forward_flops},
                     {"backward_flops", r.backward_flops},
                     {"busy_seconds", r.busy_seconds},
                     {"forward_busy_seconds", r.forward_busy_seconds},
                     {"backward_busy_seconds", r.backward_busy_seconds},
                     {"forward_cpu_seconds", r.forward_cpu_seconds},
                     {"backward_cpu_seconds", r.backward_cpu_seconds},
                     {"wall_seconds", r.wall_seconds},
                     {"comm_wait_seconds", r.comm_wait_seconds},
                     {"bytes_sent", r.bytes_sent},
                     {"bytes_received", r.bytes_received},
                     {"peak_bytes", r.peak_bytes},
                     {"shard_bytes", r.shard_bytes},
                     {"input_bytes_read", r.input_bytes_read}});
  }
  j["ranks"] = ranks;
  j["forward_flops"] = fwd_flops;
  j["backward_flops"] = bwd_flops;
  j["forward_gflops_per_second"] =
      result.forward_seconds > 0 ? fwd_flops / result.forward_seconds * 1e-9 : 0.0;
  j["backward_gflops_per_second"] =
      result.backward_seconds > 0 ? bwd_flops / result.backward_seconds * 1e-9 : 0.0;
  j["load_balance"] = total_flops > 0 ? max_flops / (total_flops / result.ranks.size()) : 1.0;
  j["single_rank_bytes"] = result.single_rank_bytes;
  j["scores_bytes"] = result.scores_bytes;
  if (result.checked) {
    j["check_passed"] = result.check_passed;
    j["check_seconds"] = result.check_seconds;
    j["max_abs_err"] = result.max_abs_err;
    j["tolerance"] = result.tolerance;
    nlohmann::json q = nlohmann::json::array();
    for (const auto& c : result.checks)
      q.push_back({{"name", c.name},
                   {"max_abs_err", c.max_abs_err},
                   {"naive32_err", c.naive_err},
                   {"tolerance", c.tolerance},
                   {"passed", c.passed}});
    j["check"] = {{"sampled", result.check_sampled},
                  {"note", result.check_note},
                  {"rule", "max|run - fp64| <= 2 * max|naive fp32 - fp64| + floor"},
                  {"quantities", q},
                  {"query_rows", result.check_query_rows},
                  {"key_rows", result.check_key_rows}};
  }
  return j;
}

}  // namespace ctxpar::cli

// One rank of an attention job: its shard (drawn per token, see token_seed, so a rank makes
// its own shard without ever holding the whole sequence and the values do not depend on P or
// the layout; or read from the user's files, its own rows only), then the strategy's forward
// and backward, timed.
#include <cstdlib>
#include <ctime>
#include <numeric>

#include "ctxpar/clock.h"
#include "ctxpar/npy.h"
#include "cuda/external.h"
#include "job_internal.h"

namespace ctxpar::cli {

uint64_t token_seed(uint64_t seed, int which, int64_t b, int64_t t) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(which) * 0xbf58476d1ce4e5b9ull +
               static_cast<uint64_t>(b) * 0x94d049bb133111ebull + static_cast<uint64_t>(t);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

namespace job {
namespace {

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

// Rank r's shards of q, k, v (and dO): a library caller's tensors, the rows of the input
// files, or drawn from the seed; and the outputs it writes. `index`: the rank's global token
// index per row (layout.positions(r)).
void make_shards(const AttentionJob& job, const Layout& layout, int r,
                 const std::vector<int64_t>& index, RankData& rd) {
  const int64_t B = job.batch, Tl = layout.local_tokens(), Hq = job.heads;
  const int64_t Hkv = kv_heads_of(job), D = job.head_dim;
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
}

// Where the cuda device's blocks went (totals over the calls so far).
void note_cudnn(Strategy& strategy, RankData& rd) {
  cuda::CudnnReport c;
  if (!cuda::cudnn_report(strategy.device(), &c)) return;
  rd.cudnn_blocks = c.cudnn_blocks, rd.cudnn_calls = c.cudnn_calls;
  rd.fallback_blocks = c.fallback_blocks, rd.cudnn_refused_blocks = c.refused_blocks;
}

}  // namespace

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

Layout job_layout(const AttentionJob& job, const SequenceTokens& seq) {
  return Layout(job.layout, job.seq, job.ranks, {job.mask, seq.documents, seq.positions});
}

void run_rank(Communicator& comm, const AttentionJob& job, const SequenceTokens& seq,
              RankData& rd) {
  const int r = comm.rank();
  auto step = [&](const std::string& name) {
    if (r == 0 && job.on_step) job.on_step(name);
  };
  step("inputs");
#ifdef CTXPAR_FAULT_HOOKS
  // Test hook (the test build ctxpar-faults only): CTXPAR_FAULT_RANK=r makes rank r fail here,
  // as a rank failing at run time would.
  if (const char* fault = std::getenv("CTXPAR_FAULT_RANK"); fault && std::atoi(fault) == r)
    throw Error(detail::concat("injected fault (CTXPAR_FAULT_RANK=", fault, ")"));
#endif
  const Layout layout = job_layout(job, seq);
  const std::vector<int64_t> index = layout.positions(r);
  rd.tokens =
      std::count_if(index.begin(), index.end(), [&](int64_t t) { return !layout.is_padding(t); });
  rd.positions = layout.token_positions(r, seq.positions);
  if (!seq.documents.empty()) rd.documents = layout.shard(seq.documents, r);
  make_shards(job, layout, r, index, rd);

  comm.set_timeout(std::chrono::milliseconds(static_cast<int64_t>(job.timeout_seconds * 1000)));
  std::unique_ptr<Strategy> strategy = Strategy::create(comm, strategy_options(job));
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
  note_cudnn(*strategy, rd);
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
  note_cudnn(*strategy, rd);
}

}  // namespace job

StrategyOptions strategy_options(const AttentionJob& job) {
  StrategyOptions options;
  options.kind = job.strategy;
  options.ulysses_degree = job.ulysses_degree;
  options.ulysses_groups = job.ulysses_groups;
  options.exchange = job.exchange;
  options.mask = job.mask;
  options.kernel.threads = job.threads;
  options.kernel.bf16_tier = job.bf16_tier;
  options.device = job.device;
  return options;
}

}  // namespace ctxpar::cli

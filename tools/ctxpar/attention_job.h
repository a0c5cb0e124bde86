// One distributed attention run, as `ctxpar attention` and `ctxpar bench cp` use it (the
// library ctxpar_job: validate in job_validate.cc, one rank in job_rank.cc, the MPI gather in
// job_gather.cc, the run in job_run.cc, the JSON in job_report.cc): each rank draws or reads
// its own shard of the inputs, the strategy runs on P ranks (threads transport, or this
// process's rank under mpirun), and the outputs, gathered to rank 0 when asked for, are checked
// against the fp64 reference of the whole unsharded problem.
#pragma once
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ctxpar/comm.h"
#include "ctxpar/launch.h"
#include "ctxpar/layout.h"
#include "ctxpar/mask.h"
#include "ctxpar/strategy.h"
#include "ctxpar/tensor.h"

namespace ctxpar::cli {

// A failure while the ranks run (a rank threw, timed out, ran out of memory): exit status 1,
// where a ctxpar::Error before the run (bad options, bad input) is 2.
class RankFailure : public std::runtime_error {
 public:
  explicit RankFailure(const std::string& what) : std::runtime_error(what) {}
};

// The seed of the random row of token t (batch row b) of input `which` (q, k, v, ...): every
// command draws its random inputs row by row from it, so a rank draws only its own rows and the
// values depend on neither the number of ranks nor how tokens are placed on them.
uint64_t token_seed(uint64_t seed, int which, int64_t b, int64_t t);

// Refuses a launcher (torchrun, srun) that started copies of `ctxpar <command>` without MPI:
// each copy would run the whole job alone (a UsageError saying how to launch it).
void refuse_foreign_launcher(const char* command);

// --transport: "auto" (launcher_transport(): mpi under mpirun, gloo under torchrun, else
// threads) or the name of one of `allowed`; a UsageError listing them otherwise.
TransportKind transport_option(const std::string& given,
                               std::initializer_list<TransportKind> allowed);

// Under mpirun, MPI first (unless --transport threads): from there on a rank's error ends
// every rank at once (main.cc), where a rank that exits before MPI_Init, on a bad option,
// would leave the others waiting in it.
void join_mpi_first(const std::string& transport_option);

// How the command joins a torchrun job over gloo: `timeout_seconds` (at least 1 s), at the
// address CTXPAR_GLOO_IFNAME / CTXPAR_GLOO_HOST name (environment::gloo_interface).
GlooOptions gloo_options(double timeout_seconds);
// This torchrun job's gloo communicator (ctxpar::gloo_world(gloo_options(timeout_seconds)),
// made on first use; kept until the process exits).
Communicator& gloo_world(double timeout_seconds);
// The world of a job of one rank per process on `kind` (host_transport: nccl's is mpirun's or
// torchrun's): mpi_world(), else gloo_world(timeout_seconds).
Communicator& process_world(TransportKind kind, double timeout_seconds);

// launch() for a command: on the threads transport a rank that fails once the ranks run
// becomes a RankFailure (exit 1, as under MPI), while run_threads refusing its arguments
// before any rank starts stays a ctxpar::Error (exit 2).
void launch_ranks(TransportKind kind, int ranks, const std::function<void(Communicator&)>& fn,
                  const LaunchOptions& options);
// launch_ranks on the threads transport.
void run_rank_threads(int ranks, const std::function<void(Communicator&)>& fn,
                      const ThreadsOptions& options = {});

// A user's .npy input, read by each rank for its own token rows only (read_npy_rows): memory
// and bytes read per rank are those of its shard, T/P of the file.
struct InputFile {
  std::string path;          // empty: not given
  bool heads_first = false;  // the file is [B, H, T, D] (--layout-in bhtd), else [B, T, H, D]
  Shape shape;               // [B, T, H, D] as the header says (after --layout-in)
  bool given() const { return !path.empty(); }
};

struct AttentionJob {
  int64_t batch = 1, seq = 4096, heads = 8, kv_heads = 0 /* 0 = heads */, head_dim = 128;
  DType dtype = DType::f32;
  Bf16Tier bf16_tier = Bf16Tier::exact;  // --bf16-tier (bf16 inputs only): KernelConfig's
  Mask mask;
  std::vector<int64_t> document_lengths;  // --mask documents:len1,len2,... (sum = seq)
  int ranks = 1;
  StrategyKind strategy = StrategyKind::ring;
  int ulysses_degree = 0;
  int ulysses_groups = 0;  // StrategyOptions::ulysses_groups (CTXPAR_ULYSSES_GROUPS)
  Exchange exchange = Exchange::automatic;  // --exchange: what the ring moves
  LayoutKind layout = LayoutKind::contiguous;
  TransportKind transport = TransportKind::threads;
  DeviceOptions device;  // --device cpu | sim, --sim-seed
  int threads = 1;       // OpenMP threads per rank
  bool backward = false;
  bool check = false;
  uint64_t seed = 0;
  int repeats = 1;     // timed repetitions; the figures are of the fastest
  SimulatedLink link;  // threads transport only
  double timeout_seconds = 300;
  bool keep_outputs = false;  // fill AttentionResult's full tensors (on the root)
  // --check cost budget: B * Hq * rows * T * D multiply-adds of the fp64 reference. Above it,
  // a sample of evenly spaced query rows (and key rows for dK, dV) is checked instead.
  double check_budget = 3e8;
  // Called on rank 0 before each of progress_steps(job) steps ("inputs", "forward 1/3", ...,
  // "check"), for a progress bar. May be empty.
  std::function<void(const std::string& step)> on_step;

  // User inputs, full and unsharded, [B, T, H, D] (empty: seeded random inputs) ...
  Tensor q, k, v, dout;
  // ... or .npy files, each rank reading its own rows (what `ctxpar attention --q` uses).
  InputFile q_file, k_file, v_file, dout_file;
  // Per token (empty: from document_lengths, if any). The kernel's ids are int32: a user's
  // int64 ids (document_ids) become their rank among the distinct ids (dense_document_labels),
  // which keeps equality and order, so tiles are still skipped by id ranges.
  std::vector<int32_t> documents;
  std::vector<int64_t> document_ids;  // the user's --documents ids as given (for --check)
  std::vector<int64_t> positions;     // per token (empty: 0..T-1)
};

struct RankReport {
  int rank = 0;
  int64_t tokens = 0;
  double attention_flops = 0;  // forward + backward FLOPs actually computed
  double busy_seconds = 0;
  double wall_seconds = 0;
  double comm_wait_seconds = 0;
  uint64_t bytes_sent = 0, bytes_received = 0;
  size_t peak_bytes = 0;          // largest total of buffers the strategy held (max fwd, bwd)
  size_t shard_bytes = 0;         // this rank's own inputs and outputs (q, k, v, o, lse, ...)
  uint64_t input_bytes_read = 0;  // bytes of --q/--k/--v/--do files this rank read (its rows)
  double forward_flops = 0, backward_flops = 0;
  double forward_busy_seconds = 0, backward_busy_seconds = 0;
  // CPU time of the rank's own thread in the timed calls (its OpenMP workers not included, so
  // with --threads 1 it is all the rank's work). On a shared machine this, not the wall time,
  // shows what the rank would take with a core of its own.
  double forward_cpu_seconds = 0, backward_cpu_seconds = 0;
  // --device cuda: attention blocks run as cuDNN calls (and the calls), blocks on the fallback
  // kernel, and of those the ones cuDNN refused a graph of (all repeats, forward and backward).
  int64_t cudnn_blocks = 0, cudnn_calls = 0, fallback_blocks = 0, cudnn_refused_blocks = 0;
};

// One compared quantity of --check: error of the run and of a plain fp32 computation, both
// against fp64; passes when max_abs_err <= tolerance = 2 * naive_err + floor.
struct QuantityCheck {
  std::string name;  // "out", "lse", "dq", "dk", "dv"
  double max_abs_err = 0, naive_err = 0, tolerance = 0;
  bool passed = false;
};

struct AttentionResult {
  bool is_root = true;  // false on MPI ranks other than 0 (they print nothing)
  std::vector<RankReport> ranks;
  std::string cudnn_version;     // --device cuda: cuDNN in use (rank 0's process), or
  std::string cudnn_off_reason;  // why it is off
  double forward_seconds = 0, backward_seconds = 0;  // wall, slowest rank
  double single_rank_bytes = 0;  // memory one rank would need for the whole problem
  double scores_bytes = 0;       // a materialised fp32 score matrix B*Hq*T*T (no flash kernel)
  bool checked = false, check_passed = false;
  double max_abs_err = 0, tolerance = 0;  // of the quantity closest to its tolerance
  std::vector<QuantityCheck> checks;
  bool check_sampled = false;  // only some rows were checked (T too large for full fp64)
  std::vector<int64_t> check_query_rows, check_key_rows;  // token indices (when sampled)
  std::string check_note;
  double check_seconds = 0;     // wall time of the check itself
  Tensor out, lse, dq, dk, dv;  // full, unsharded, original order (keep_outputs, root only)
};

// Label of each id = its rank among the distinct ids: equal ids get equal labels, and
// id_i < id_j exactly when label_i < label_j.
std::vector<int32_t> dense_document_labels(const std::vector<int64_t>& ids);

// Validates the job (same verdict on every rank), throws ctxpar::Error naming what is wrong
// and what would work instead.
void validate(const AttentionJob& job);
// The options every rank's strategy is created with (and the memory estimate models).
StrategyOptions strategy_options(const AttentionJob& job);
int progress_steps(const AttentionJob& job);
AttentionResult run_attention_job(const AttentionJob& job);
nlohmann::json to_json(const AttentionJob& job, const AttentionResult& result);

}  // namespace ctxpar::cli

// The job runner behind `ctxpar attention` and `ctxpar bench cp`: the threads transport runs
// job::run_rank on P threads sharing one RankData per rank, MPI runs it once per process and
// gathers to rank 0; then the per-rank reports, and the check against the fp64 reference.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <functional>
#include <thread>

#include "attention_check.h"
#include "core/environment.h"
#include "ctxpar/gloo.h"
#include "cuda/api.h"
#include "cuda/cudnn_use.h"
#include "cuda/loopback.h"
#ifdef CTXPAR_FAULT_HOOKS
#include "cuda/api_recording.h"
#include "cuda/cuda_device.h"
#include "device/devices.h"
#endif
#include "job_internal.h"
#include "options.h"
#ifdef CTXPAR_HAVE_NCCL
#include "cuda/nccl_comm.h"
#endif

namespace ctxpar::cli {

using namespace job;

void refuse_foreign_launcher(const char* command) {
  const ForeignLauncher l = foreign_launcher();
  if (l.ranks == 0) return;
  throw UsageError(detail::concat(
      "started by ", l.name, " as ", l.ranks,
      " separate processes without MPI: each would run "
      "the whole job alone. Launch it with mpirun -n ",
      l.ranks, " ctxpar ", command,
      " ... (or srun --mpi=pmix with an MPI build), or as one process with --ranks ", l.ranks,
      l.name.rfind("torchrun", 0) == 0 ? " (ctxpar attention, train and decode run under "
                                         "torchrun, on the gloo transport)"
                                       : ""));
}

TransportKind transport_option(const std::string& given,
                               std::initializer_list<TransportKind> allowed) {
  if (given == "auto") return launcher_transport();
  std::string names = "auto";
  for (TransportKind k : allowed) {
    if (given == transport_name(k)) return k;
    names += std::string(k == *(allowed.end() - 1) ? " or " : ", ") + transport_name(k);
  }
  throw UsageError("--transport must be " + names + ", got '" + given + "'");
}

void join_mpi_first(const std::string& transport_option) {
  if (launched_by_mpi() && transport_option != transport_name(TransportKind::threads)) mpi_world();
}

GlooOptions gloo_options(double timeout_seconds) {
  GlooOptions options;
  options.timeout =
      std::chrono::milliseconds(static_cast<int64_t>(std::max(1.0, timeout_seconds) * 1000));
  options.hostname_or_interface = environment::gloo_interface();
  return options;
}

Communicator& gloo_world(double timeout_seconds) {
  return ctxpar::gloo_world(gloo_options(timeout_seconds));
}

Communicator& process_world(TransportKind kind, double timeout_seconds) {
  return host_transport(kind) == TransportKind::mpi ? mpi_world() : gloo_world(timeout_seconds);
}

void launch_ranks(TransportKind kind, int ranks, const std::function<void(Communicator&)>& fn,
                  const LaunchOptions& options) {
  std::atomic<bool> started{false};
  try {
    launch(
        kind, ranks,
        [&](Communicator& comm) {
          started = true;
          fn(comm);
        },
        options);
  } catch (const Error& e) {
    if (started) throw RankFailure(e.what());
    throw;
  }
}

void run_rank_threads(int ranks, const std::function<void(Communicator&)>& fn,
                      const ThreadsOptions& options) {
  LaunchOptions launch;
  launch.threads = options;
  launch_ranks(TransportKind::threads, ranks, fn, launch);
}

namespace {

// --transport nccl: each process's GPU is its rank's number among this machine's ranks
// (mpirun's and torchrun's local rank); device memory moves by NCCL, the rest over `host`.
void run_over_nccl(Communicator& host, const AttentionJob& job,
                   const std::function<void(Communicator&)>& body) {
#ifdef CTXPAR_HAVE_NCCL
  cuda::NcclOptions options;
  options.cuda_device = std::max(0, environment::launcher().local_rank);
  options.timeout =
      std::chrono::milliseconds(static_cast<int64_t>(std::max(1.0, job.timeout_seconds) * 1000));
  std::unique_ptr<cuda::NcclCommunicator> comm = cuda::nccl_over(host, options);
  body(*comm);
#else
  (void)host, (void)body;
  throw Error(detail::concat("--transport ", transport_name(job.transport),
                             ": this ctxpar was "
                             "built without NCCL (docs/cuda.md)"));
#endif
}

// --transport loopback: P ranks as threads of this process on one GPU (the launcher's local
// rank's, else the first), their device memory exchanged by device-to-device copies
// (src/cuda/loopback.h); the ranks' cuda devices share that GPU's CudaApi with the loopback
// world.
void run_loopback(int P, const AttentionJob& job, const SequenceTokens& seq,
                  std::vector<RankData>& all, const ThreadsOptions& options) {
  const int index = std::max(0, environment::launcher().local_rank);
  std::string why;
  std::shared_ptr<cuda::CudaApi> api;
#ifdef CTXPAR_FAULT_HOOKS
  // ctxpar-faults only: the whole path on the CPU, every rank's cuda device and the loopback
  // world over one RecordingCudaApi (the fallback kernel's tile math on the host), so the CLI
  // tests run `--device cuda --transport loopback --check` without a GPU (CliCuda.*).
  std::shared_ptr<const DeviceRegistry> recording_devices;
  if (std::getenv("CTXPAR_FAULT_CUDA_RECORDING")) {
    api = std::make_shared<cuda::RecordingCudaApi>();
    recording_devices = DeviceRegistry::builtin()->with(
        DeviceKind::cuda, [api](const DeviceOptions&, int rank) -> std::unique_ptr<Device> {
          return std::make_unique<cuda::CudaDevice>(api, rank);
        });
    cuda::CudnnState no_cudnn;
    no_cudnn.off_reason = "the recording CUDA API (CTXPAR_FAULT_CUDA_RECORDING) has no cuDNN";
    cuda::set_cudnn_state(no_cudnn);
  }
#endif
  if (!api) api = cuda::shared_real_api(index, &why);
  if (!api) throw Error("--transport loopback --device cuda: " + why);
  auto world = std::make_shared<cuda::LoopbackWorld>(api);
  AttentionJob on_one_gpu = job;
  on_one_gpu.device.cuda_index = index;
#ifdef CTXPAR_FAULT_HOOKS
  if (recording_devices) on_one_gpu.device.registry = recording_devices;
#endif
  run_rank_threads(
      P,
      [&](Communicator& host) {
        cuda::LoopbackComm comm(host, world);
        run_rank(comm, on_one_gpu, seq, all[comm.rank()]);
      },
      options);
}

// Runs the job's ranks on its transport; `all` gets every rank's data on the root (this
// process under threads or loopback; rank 0's process under a launcher). Returns whether this
// process is the root.
bool run_ranks(const AttentionJob& job, const SequenceTokens& seq, std::vector<RankData>& all) {
  const int P = job.ranks;
  const bool need_tensors = job.check || job.keep_outputs;
  if (transport_traits(job.transport).one_rank_per_process) {
    // One rank per process: mpirun's, or torchrun's over gloo (nccl: bootstrapped over either).
    const bool mpi = host_transport(job.transport) == TransportKind::mpi;
    Communicator& world = process_world(job.transport, job.timeout_seconds);
    const char* launcher = mpi ? "mpirun -n " : "torchrun --nproc-per-node ";
    CTXPAR_CHECK(world.size() == P, mpi ? "mpirun" : "torchrun", " started ", world.size(),
                 " processes but --ranks is ", P, "; drop --ranks or use ", launcher, P);
    std::function<void(Communicator&)> body = [&](Communicator& comm) {
      RankData mine;
      run_rank(comm, job, seq, mine);
      gather_to_root(comm, job, mine, all, need_tensors);
    };
    if (job.transport == TransportKind::nccl)
      body = [&job, rank_body = body](Communicator& host) { run_over_nccl(host, job, rank_body); };
    LaunchOptions options;
    options.gloo = gloo_options(job.timeout_seconds);
    launch(job.transport, P, body, options);
    return world.rank() == 0;
  }
  all.resize(P);
  ThreadsOptions options;
  options.link = job.link;
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(job.timeout_seconds * 1000));
  if (job.transport == TransportKind::loopback) {
    run_loopback(P, job, seq, all, options);
  } else {
    run_rank_threads(
        P, [&](Communicator& comm) { run_rank(comm, job, seq, all[comm.rank()]); }, options);
  }
  return true;
}

// Rank p's figures, from its fastest forward (and backward) repeat.
RankReport rank_report(const AttentionJob& job, const RankData& rd, int p, int fwd, int bwd) {
  RankReport rep;
  rep.rank = p;
  rep.tokens = rd.tokens;
  rep.cudnn_blocks = rd.cudnn_blocks, rep.cudnn_calls = rd.cudnn_calls;
  rep.fallback_blocks = rd.fallback_blocks, rep.cudnn_refused_blocks = rd.cudnn_refused_blocks;
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
  if (job.backward) {
    const StrategyStats& b = rd.bwd_stats[bwd];
    rep.backward_flops = b.attention_flops;
    rep.backward_busy_seconds = b.busy_seconds;
    rep.backward_cpu_seconds = rd.bwd_cpu[bwd];
    rep.wall_seconds += rd.bwd_wall[bwd];
    rep.comm_wait_seconds += b.comm_wait_seconds;
    rep.bytes_sent += b.bytes_sent, rep.bytes_received += b.bytes_received;
    rep.peak_bytes = std::max(rep.peak_bytes, b.peak_bytes);
  }
  rep.attention_flops = rep.forward_flops + rep.backward_flops;
  rep.busy_seconds = rep.forward_busy_seconds + rep.backward_busy_seconds;
  return rep;
}

// One rank alone: inputs and outputs of the whole sequence plus the kernel's fp32 state
// (acc [B, T, Hq, D], m and l [B, Hq, T]); backward adds dO, fp32 dQ, dK, dV and delta.
void set_single_rank_bytes(const AttentionJob& job, AttentionResult& result) {
  const double B = static_cast<double>(job.batch), T = static_cast<double>(job.seq);
  const double Hq = static_cast<double>(job.heads), Hkv = static_cast<double>(kv_heads_of(job));
  const double D = static_cast<double>(job.head_dim),
               es = static_cast<double>(dtype_size(job.dtype));
  double single = B * T * (2 * Hq + 2 * Hkv) * D * es + B * Hq * T * 4 + B * T * Hq * D * 4 +
                  2 * B * Hq * T * 4;
  if (job.backward) single += B * T * Hq * D * (es + 4) + 2 * B * T * Hkv * D * 4 + B * Hq * T * 4;
  result.single_rank_bytes = single;
  result.scores_bytes = B * Hq * T * T * 4;
}

// The outputs of the whole sequence from the ranks' shards, and (--check) their check against
// the fp64 reference; frees the shards before the reference runs.
void unshard_and_check(const AttentionJob& job, const SequenceTokens& seq,
                       std::vector<RankData>& all, AttentionResult& result) {
  const Layout layout = job_layout(job, seq);
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
    in.bf16_tier = job.bf16_tier;
    if (job.on_step) job.on_step("check");
    const int threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    const auto t0 = Clock::now();
    check_against_reference(in, job.check_budget, threads, result);
    result.check_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  }
}

}  // namespace

AttentionResult run_attention_job(const AttentionJob& job) {
  validate(job);
  const SequenceTokens seq = sequence_tokens(job);
  const int P = job.ranks;
  std::vector<RankData> all;
  AttentionResult result;
  result.is_root = run_ranks(job, seq, all);
  if (!result.is_root) return result;

  if (job.device.kind == DeviceKind::cuda) {
    const cuda::CudnnState cudnn = cuda::cudnn_state();
    result.cudnn_version = cudnn.version;
    result.cudnn_off_reason = cudnn.known ? cudnn.off_reason : "no cuda device was made";
  }
  const int fwd = fastest_repeat(all, false);
  const int bwd = job.backward ? fastest_repeat(all, true) : 0;
  for (int p = 0; p < P; ++p) {
    result.ranks.push_back(rank_report(job, all[p], p, fwd, bwd));
    result.forward_seconds = std::max(result.forward_seconds, all[p].fwd_wall[fwd]);
    if (job.backward)
      result.backward_seconds = std::max(result.backward_seconds, all[p].bwd_wall[bwd]);
  }
  set_single_rank_bytes(job, result);
  if (job.check || job.keep_outputs) unshard_and_check(job, seq, all, result);
  return result;
}

}  // namespace ctxpar::cli

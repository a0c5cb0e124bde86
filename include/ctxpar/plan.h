// The planning model behind `ctxpar plan`: per-device memory, FLOPs, communication volume and
// a step-by-step simulation of the ring schedule, for real models on real clusters. It models
// the same schedules src/strategy/ runs (ring with double-buffered K/V, all-gather, Ulysses,
// hybrid), so its predictions can be checked against our own measured runs. See docs/plan.md.
//
// Units: bytes, FLOPs, seconds; link bandwidth in GB/s (1e9 bytes per second, one direction).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "ctxpar/layout.h"
#include "ctxpar/strategy.h"
#include "ctxpar/tensor.h"

namespace ctxpar {

// A decoder-only transformer of the LLaMA family (RMSNorm, GQA attention, SwiGLU MLP,
// untied embedding and LM head).
struct ModelSpec {
  std::string name = "custom";
  int64_t layers = 0, hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, ffn = 0, vocab = 0;
  double layer_params() const;  // one transformer block
  double params() const;        // whole model, embeddings and LM head included
};
ModelSpec model_preset(const std::string& name);  // throws listing the valid names
std::vector<std::string> model_preset_names();

struct LinkSpec {
  double gbytes_per_second = 0;  // one direction, per device
  double latency_us = 0;
  double seconds(double bytes) const;  // latency + bytes / bandwidth
};

struct HardwareSpec {
  std::string name = "custom";
  double flops = 0;         // peak dense FLOP/s per device in the training dtype
  double efficiency = 1.0;  // fraction of peak the kernels reach (1: the paper's F)
  double mem_gb = 0;        // device memory, GB (1e9 bytes)
  LinkSpec intra;           // between devices of one node (NVLink, ICI)
  LinkSpec inter;           // between nodes (InfiniBand, DCN)
  int devices_per_node = 8;
  double backward_flops = 0;  // backward kernel FLOP/s when measured apart (0: = flops)
  // Sends lend their memory to the receiver (Device::lends_sent_buffers; `local` on the
  // threads transport): the ring's forward then ends with a barrier (strategy_memory.h).
  bool lends_sent_buffers = false;
  double effective_flops() const { return flops * efficiency; }
  double effective_backward_flops() const {
    return (backward_flops > 0 ? backward_flops : flops) * efficiency;
  }
};
// a100-nvlink a100-infiniband h100 h200 b200 tpu-v4 (published figures); `local` is measured
// by measure_local_hardware() instead.
HardwareSpec hardware_preset(const std::string& name);
std::vector<std::string> hardware_preset_names();

enum class Recompute { none, full };

struct PlanInput {
  ModelSpec model;
  HardwareSpec hardware;
  int64_t seq = 0;    // tokens per sequence
  int64_t batch = 1;  // sequences per data-parallel replica per step
  int dp = 1, cp = 1, tp = 1, pp = 1;
  int zero = 3;  // 0: replicated states; 1/2/3: ZeRO stage over dp*cp (FSDP)
  StrategyKind strategy = StrategyKind::ring;
  int ulysses_degree = 0;  // hybrid: ranks per Ulysses group (0: as large as heads allow)
  LayoutKind layout = LayoutKind::zigzag;
  bool causal = true;
  DType dtype = DType::bf16;
  Recompute recompute = Recompute::none;
  int tile = 0;  // kernel tile edge for masked-tile skipping (0: exact pairs)
};
// Throws ctxpar::Error naming the argument and the rule (e.g. heads % tp == 0).
void validate(const PlanInput& in);
// The largest pipeline stage: ceil(layers / pp) (uneven stages, as Llama 3 trained).
inline int64_t layers_per_stage(const PlanInput& in) {
  return (in.model.layers + in.pp - 1) / in.pp;
}

// The sequence length the plan models: seq padded to the layout's granule (P, or 2P for
// zigzag), as the runtime pads it: layout_padded_tokens() (layout.h). Any seq >= 1 plans.
int64_t plan_padded_seq(const PlanInput& in);
// The all-gather head groups the plan models: the runtime's own rule,
// allgather_head_groups() (strategy.h), on the KV heads one device holds after tp.
int64_t plan_allgather_groups(const PlanInput& in);
// The hybrid Ulysses degree the plan models: ulysses_degree when given, else the largest u
// dividing cp and the query heads per device whose group stays inside one node.
int plan_ulysses_degree(const PlanInput& in);

// ---- memory ----------------------------------------------------------------------------
struct MemoryBreakdown {
  double weights = 0, gradients = 0, optimizer = 0;
  double gathered_weights = 0;  // ZeRO-3: full layers gathered for compute (prefetch: 2)
  double activations_per_layer = 0;
  double activations = 0;        // all layers on this device (+ the layer being recomputed)
  double logits = 0;             // LM head output and its fp32 softmax for the loss
  double attention_buffers = 0;  // the strategy's peak: attention_buffer_bytes()
  double total = 0, capacity = 0;
  bool fits = false;
};
MemoryBreakdown plan_memory(const PlanInput& in);

// ---- FLOPs ------------------------------------------------------------------------------
struct FlopCount {
  double attention_forward = 0;  // per layer, whole sequence batch (masked pairs skipped)
  double attention_step = 0;     // all layers, forward + backward (+ recompute), per replica
  double dense_step = 0;         // matmuls: projections, MLP, LM head, per replica
  double total_step = 0;
  double per_device = 0;  // total_step / (cp * tp * pp)
};
FlopCount plan_flops(const PlanInput& in);

// ---- communication ----------------------------------------------------------------------
// Bytes one device sends for one layer's attention (forward, backward), per strategy: the
// formulas of docs/plan.md, which the tests check against our communicators' counters.
struct CommVolume {
  StrategyKind strategy = StrategyKind::ring;
  double forward_bytes = 0, backward_bytes = 0;
  double step_bytes = 0;  // all layers on this device, forward + backward
};
// `heads`/`kv_heads` as one device of the cp group holds them (after tensor parallelism);
// head_groups: allgather's (0: as the strategy picks, the largest divisor of kv_heads <= 4).
CommVolume attention_comm_bytes(StrategyKind kind, int ranks, int ulysses_degree, int64_t batch,
                                int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                size_t dtype_bytes, int head_groups = 0);

// ---- the ring: balance, overlap and a step-by-step schedule ------------------------------
// Score pairs (q, k) that rank q_rank's queries compute against rank k_rank's keys, per
// batch row and head: visible pairs when tile == 0, else whole tiles of tile x tile that are
// not fully masked (as our kernel skips them).
double visible_pairs(LayoutKind layout, int64_t seq, int ranks, int q_rank, int k_rank, bool causal,
                     int tile = 0);
// visible_pairs for every (q_rank, k_rank) of one ring, from three evaluations: under the
// contiguous, zigzag and striped layouts the count depends only on whether the key rank comes
// before, is, or comes after the query rank (see ring_schedule.cc). P^2 pairs of a 4096-rank
// plan cost three tile walks instead of 16.7 million.
class RankPairs {
 public:
  RankPairs(LayoutKind layout, int64_t seq, int ranks, bool causal, int tile = 0);
  double operator()(int q_rank, int k_rank) const {
    return k_rank < q_rank ? before_ : k_rank == q_rank ? same_ : after_;
  }

 private:
  double before_ = 0, same_ = 0, after_ = 0;
};

// Ring Attention's c >= F/B, generalised: the smallest per-rank block (tokens) whose compute
// hides one step's transfer. fraction = visible share of a block pair (causal balanced: 1/2).
struct MinBlock {
  double forward = 0, backward = 0, tokens = 0;  // tokens = max(forward, backward)
};
MinBlock min_block_tokens(double flops_per_second, const LinkSpec& link, int64_t heads,
                          int64_t kv_heads, int64_t head_dim, size_t dtype_bytes, double fraction);

struct RingStepTrace {
  double start = 0, compute = 0, wait = 0;  // seconds; wait = blocked on the next block
};
// simulate_ring keeps per-step traces (RingRankTrace::forward / backward) only up to this many
// ranks: there are P^2 of them. The per-rank totals are kept for any P.
constexpr int kRingStepsTraced = 64;
struct RingRankTrace {
  std::vector<RingStepTrace> forward, backward;  // per step (empty above kRingStepsTraced ranks)
  double compute = 0, wait = 0, finish = 0, bytes_sent = 0;
};
struct RingSimulation {
  std::vector<RingRankTrace> ranks;
  double forward_seconds = 0, backward_seconds = 0, seconds = 0;  // slowest rank
  double compute_seconds = 0;                                     // slowest rank's pure compute
  double exposed_comm = 0;     // seconds - slowest rank's compute
  double perfect_seconds = 0;  // one device's compute / P, no communication
  double efficiency = 0;       // perfect_seconds / seconds
};
// Simulates one attention layer (forward, then backward when `backward`) of the ring on P
// ranks: rank r posts the send of the block it holds before computing on it, each outgoing
// link carries one message at a time, a step starts when its block has arrived. links[r] is
// the link from rank r to rank r+1; flops_per_second[r] is rank r's attention throughput.
struct RingProblem {
  int ranks = 1;
  int64_t batch = 1, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  size_t dtype_bytes = 2;
  LayoutKind layout = LayoutKind::zigzag;
  bool causal = true;
  bool backward = true;
  int tile = 0;
  std::vector<LinkSpec> links;                    // size ranks (or 1: the same for all)
  std::vector<double> flops_per_second;           // size ranks (or 1)
  std::vector<double> backward_flops_per_second;  // empty: the same as forward
  bool barrier_after_forward = false;             // ring_forward_ends_with_barrier(ranks, ...)
  // ring.cc computes into a local partial and adds the travelling dK/dV accumulator after the
  // compute (false), which hides the accumulator's hop behind one step's compute; true models
  // waiting for the accumulator before the compute (ring.cc's earlier order).
  bool accumulator_before_compute = false;
  double step_overhead_seconds = 0;  // fixed cost per kernel call (local: measured)
};
RingSimulation simulate_ring(const RingProblem& problem);

// ---- this machine ------------------------------------------------------------------------
// The `local` preset: our kernel and threads transport, measured on the spot.
struct LocalOptions {
  int ranks = 1;                // ranks sharing the cores (min(ranks, cores) threads are timed)
  int64_t block_tokens = 1024;  // tokens per rank (measured on at most 2048)
  int64_t batch = 1, heads = 8, kv_heads = 8, head_dim = 128;
  DType dtype = DType::f32;
  LayoutKind layout = LayoutKind::zigzag;
  bool causal = true;
  SimulatedLink link;              // the threads transport's simulated link (0: none)
  double message_bytes = 1 << 20;  // size of the timed message (use one K/V block)
  double min_seconds = 0.2;        // each timing runs at least this long
  // The ranks of an mpirun job (ranks must equal its size; every process calls measure_local):
  // each process times its own rank's kernel, all at once, and the link is the transport's,
  // timed as the ring uses it: every rank sends a block to the next at the same moment.
  Communicator* comm = nullptr;
};
struct LocalMeasurement {
  double forward_flops = 0, backward_flops = 0;  // per rank, all ranks running, FLOP/s
  int cores = 1;                                 // this machine's (for the record)
  LinkSpec link;                      // threads: the simulated link, its latency + the measured
                                      // hand-over; MPI: the measured ring shift (below)
  double handover_seconds = 0;        // one message between two rank threads, link off; MPI: one
                                      // ring shift of 8 bytes
  double block_message_seconds = 0;   // one block through the link (0: threads without a link)
  std::string transport = "threads";  // what was measured: threads | mpi
  bool lends_sent_buffers = false;    // the cpu device's answer on that transport
  double mem_gb = 0;
};
LocalMeasurement measure_local(const LocalOptions& options);
// The hardware P ranks see when they share this machine's cores.
HardwareSpec local_hardware(const LocalMeasurement& measured, int ranks);

// ---- the whole plan ---------------------------------------------------------------------
struct StrategyEstimate {
  StrategyKind strategy = StrategyKind::ring;
  bool valid = true;
  std::string why_invalid;
  double attention_seconds = 0;  // per step, all layers on the device, fwd + bwd
  double exposed_comm_seconds = 0;
  double efficiency = 0;  // vs perfect scaling of the same attention compute
  double bytes_per_step = 0;
  double attention_buffer_bytes = 0;
  bool fits = true;  // the whole device memory with this strategy's buffers
};

struct Plan {
  PlanInput input;
  MemoryBreakdown memory;
  FlopCount flops;
  std::vector<CommVolume> comm;  // ring, allgather, ulysses, hybrid
  MinBlock min_block;
  int64_t padded_seq = 0;    // plan_padded_seq(input): the length the runtime cuts
  int64_t block_tokens = 0;  // this plan's per-rank block (padded_seq / cp)
  RingSimulation ring;       // one layer
  double ring_seconds_accumulator_before = 0;  // the same with accumulator_before_compute on
  std::vector<StrategyEstimate> compare;       // ranked, fastest first (valid ones)
  double dense_seconds = 0;                    // per step, per device
  double step_seconds = 0;                     // dense + the chosen strategy's attention
  int cp_to_fit = 0;            // smallest power-of-two cp that fits (0: none <= 2^16)
  int cp_to_fit_recompute = 0;  // the same with full recomputation
};
// compare: also estimate every strategy (else only the chosen one).
Plan make_plan(const PlanInput& in, bool compare = false);
std::string plan_json(const Plan& plan);   // every figure of the table
std::string plan_table(const Plan& plan);  // human-readable

// Tokens of a video: hours * 3600 * fps * tokens_per_frame.
int64_t video_tokens(double hours, double fps, int64_t tokens_per_frame);

}  // namespace ctxpar

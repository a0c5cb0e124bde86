// Training a decoder-only transformer whose attention is context-parallel. See docs/training.md.
//
// Mesh: world ranks = dp x cp. World rank r is context rank r % cp of data group r / cp. Each
// data group holds one batch of sequences, split over its cp ranks by the layout; weights are
// replicated; gradients are summed over the context group and averaged over the data group.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ctxpar/comm.h"
#include "ctxpar/layout.h"
#include "ctxpar/memory.h"
#include "ctxpar/strategy.h"

namespace ctxpar {

struct ModelConfig {
  int layers = 2;
  int dim = 64;       // model width C
  int heads = 4;      // query heads Hq
  int kv_heads = 2;   // key/value heads Hkv (GQA: Hq % Hkv == 0)
  int head_dim = 16;  // D (the kernel needs 16 <= D <= 256, even for RoPE)
  int hidden = 192;   // SwiGLU inner width F
  int vocab = 256;    // byte tokens
  double rope_base = 10000.0;
  float norm_eps = 1e-5f;
  // Throws ctxpar::Error naming the bad field.
  void validate() const;
  std::string describe()
      const;  // "layers=2 dim=64 heads=4 kv_heads=2 head_dim=16 hidden=192 vocab=256"
};

struct TrainConfig {
  ModelConfig model;
  int64_t seq = 1024;  // T, global tokens per sequence
  int64_t batch = 1;   // sequences per data group per step
  int64_t steps = 100;
  uint64_t seed = 1;
  int dp = 1, cp = 1;  // dp * cp must equal the communicator's size
  StrategyKind strategy = StrategyKind::ring;
  int ulysses_degree = 0;
  int ulysses_groups = 0;  // StrategyOptions::ulysses_groups (0: the strategy's default)
  DeviceOptions device;    // each rank's device for attention (cpu | sim)
  LayoutKind layout = LayoutKind::zigzag;
  int threads = 1;        // BLAS and kernel threads per rank
  std::string data_path;  // empty: the built-in long-range copy task
  int64_t copy_len = 0;   // built-in task: length of the copied block; 0 = min(128, T/4)
  // With data_path: the token that ends a document (-1: none, one long stream). Each window
  // of seq tokens is cut after every separator into packed documents: attention causal within
  // a document, RoPE positions from 0 at each document start, and no loss across a boundary
  // (the separator's own target, the next document's first token, is not predicted). Needs
  // batch 1 (the documents mask is one per sequence; use dp for more sequences a step). The
  // balanced layout needs it (packed_documents_rule below).
  int separator = -1;
  // Optimiser: AdamW, global-norm clipping, linear warm-up then cosine decay to min_lr.
  double lr = 3e-3, min_lr = 1e-3, weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double clip = 1.0;  // <= 0: no clipping
  int64_t warmup = 10;
  // Files (written by world rank 0).
  std::string log_path;     // JSON lines, one record per step
  std::string save_path;    // checkpoint path (safetensors)
  int64_t save_every = 0;   // 0: only at the end when save_path is set
  std::string resume_path;  // continue from this checkpoint
  std::string dump_path;    // write weights, batch and gradients of the first step here
};

// One step as every rank saw it (loss and accuracy are global figures).
struct StepRecord {
  int64_t step = 0;     // 1-based
  double loss = 0;      // mean cross-entropy over the counted tokens of all data groups
  double accuracy = 0;  // argmax accuracy on the counted (long-range) tokens
  double lr = 0;
  double grad_norm = 0;  // before clipping
  double seconds = 0;
  double tokens_per_second = 0;  // global tokens (dp * batch * T) / step time
  size_t peak_bytes = 0;         // this rank: peak of activations and buffers held in the step
  size_t peak_bytes_max = 0;     // max over ranks
};

struct TrainResult {
  // Empty when the checkpoint resumed from is already at config.steps or past it (nothing
  // was trained; first_step is then its step + 1).
  std::vector<StepRecord> steps;
  std::vector<float> weights;  // final weights, flat, in parameter order
  int64_t first_step = 1;
};

// What one rank of a training run holds, estimated from the config alone (nothing is
// allocated), in bytes; doubles, so an absurd config gives a huge figure rather than an
// overflow. See docs/training.md, "Memory".
struct TrainMemory {
  double params = 0;       // parameter count
  double state = 0;        // weights, gradients, Adam m and v: 16 bytes a parameter
  double activations = 0;  // the model's activations and scratch for B x T/cp tokens, plus the
                           // strategy's K/V buffers
  double data = 0;         // the batch (3 bytes a token of B x T), the --data file (read whole
                           // by every rank) and, on --resume, the checkpoint file read whole
  double total() const { return state + activations + data; }
};
TrainMemory estimate_train_memory(const TrainConfig& config);
// Throws ctxpar::Error when `ranks_here` ranks of this config (the ranks sharing this machine's
// memory) need more than `limit` allows (memory_limit(), ctxpar/memory.h), with the figures,
// the binding limit and the options to lower. An unknown limit: no check.
void check_train_memory(const TrainConfig& config, int ranks_here, const MemoryLimit& limit);

// The rules of packed documents that train() checks: TrainConfig::separator a token of the
// vocabulary, with a data file, batch 1 and no gradient dump; the balanced layout only with
// documents. "" when fine, else the reason (naming the fields): exported so that a caller (the
// ctxpar command) refuses before it starts its ranks, in its own words.
std::string packed_documents_rule(const TrainConfig& config);

// OpenBLAS threads for the whole process (a global setting: call it before starting ranks).
void set_blas_threads(int threads);

// Runs the training loop on this rank; every rank of `world` must call it with the same
// config. on_step is called on every rank after each step.
TrainResult train(Communicator& world, const TrainConfig& config,
                  const std::function<void(const StepRecord&)>& on_step = {});

}  // namespace ctxpar

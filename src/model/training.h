// The pieces of the training loop around the model: optimiser (adamw.cc), data (data.cc),
// checkpoints (safetensors.cc, checkpoint.cc) and the memory estimate (train_memory.cc).
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ctxpar/model.h"
#include "model/params.h"

namespace ctxpar::model {

// ---- adamw.cc -------------------------------------------------------------------------------
// Linear warm-up over `warmup` steps to lr, then cosine decay to min_lr at `steps`.
double learning_rate(const TrainConfig& config, int64_t step);  // step is 1-based
double global_norm(const std::vector<float>& grads);
// Scales grads so their global norm is at most max_norm (no-op when max_norm <= 0); returns the
// norm before clipping.
double clip_grad_norm(std::vector<float>& grads, double max_norm);
struct AdamState {
  std::vector<float> m, v;
  int64_t step = 0;  // number of updates applied
};
// Decoupled weight decay (AdamW) on the tensors marked decay; bias-corrected moments.
void adamw_update(std::vector<float>& weights, const std::vector<float>& grads, AdamState& state,
                  const std::vector<ParamInfo>& infos, const TrainConfig& config, double lr);

// ---- data.cc --------------------------------------------------------------------------------
// One data group's batch in global token order: tokens, labels (the next token) and the loss
// weight (1 = counted), each [B, T]. With TrainConfig::separator, also each token's document
// (ids from 0 in each sequence; the separator ends its document) and its position in it (RoPE
// restarts at 0 at each document's start), each [B, T]; a separator's weight is 0 (its label
// is the next document's first token).
struct Batch {
  int64_t batch = 0, tokens = 0;
  std::vector<uint8_t> inputs, labels, weight;
  std::vector<int32_t> documents;
  std::vector<int64_t> document_positions;
  int64_t counted = 0;  // number of weight-1 tokens in the batch
};
// With --data, the file is opened once and each batch reads only its own sequences (T + 1
// bytes each, pread): a rank never holds the file, so the threads transport's ranks do not
// each load it whole.
class DataSource {
 public:
  explicit DataSource(const TrainConfig& config);  // opens --data; checks sizes
  ~DataSource();
  DataSource(const DataSource&) = delete;
  DataSource& operator=(const DataSource&) = delete;
  // Deterministic in (seed, step, group): a resumed run sees the same batches.
  Batch batch(int64_t step, int group) const;
  int64_t copy_len() const { return copy_len_; }
  bool builtin() const { return fd_ < 0; }
  // Bytes of --data read so far (by batch()).
  uint64_t bytes_read() const { return bytes_read_.load(std::memory_order_relaxed); }

 private:
  void read_sequence(uint64_t start, uint8_t* to, size_t n) const;
  TrainConfig config_;
  int fd_ = -1;
  int64_t file_bytes_ = 0;
  mutable std::atomic<uint64_t> bytes_read_{0};
  int64_t copy_len_ = 0;
};

// ---- safetensors.cc -------------------------------------------------------------------------
struct NamedTensor {
  std::string name;
  std::string dtype;  // "F32" | "U8"
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t bytes = 0;
};
// Writes path atomically: an exclusively created temporary beside it (never a planted file or
// link; two writers never share one), fsync, rename, fsync of the folder; an existing file at
// path stays intact until the new one is complete. Adds __metadata__["checksum"] (FNV-1a 64 of
// the header and the data section; see safetensors.cc).
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata);

struct LoadedTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
struct SafetensorsFile {
  std::map<std::string, std::string> metadata;
  std::map<std::string, LoadedTensor> tensors;
  bool checksummed = false;  // the file had a checksum, and it matched
};
// Throws ctxpar::Error for a missing, truncated, malformed or corrupt file, naming what is
// wrong: not a regular file, a header length past the file, a byte range that is not exactly
// dtype x shape, ranges that do not tile the data section, a checksum that does not match.
SafetensorsFile read_safetensors(const std::string& path);

// ---- checkpoint.cc --------------------------------------------------------------------------
void save_checkpoint(const std::string& path, const TrainConfig& config,
                     const std::vector<float>& weights, const AdamState& adam);
// Refuses (ctxpar::Error) a checkpoint of another model config, with both configs in the
// message; one without a checksum (unless it predates them), a step that is not a non-negative
// integer, non-finite values or a negative Adam second moment, naming the tensor.
void load_checkpoint(const std::string& path, const TrainConfig& config,
                     std::vector<float>& weights, AdamState& adam);

}  // namespace ctxpar::model

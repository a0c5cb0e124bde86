// The model's parameters as one flat fp32 buffer with named tensors: the all-reduce, the
// optimiser, clipping and checkpoints each see one array; the layers see named pointers.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "ctxpar/model.h"

namespace ctxpar::model {

struct ParamInfo {
  std::string name;  // PyTorch-style: "embed", "layers.0.wq", "final_norm"
  std::vector<int64_t> shape;
  size_t offset = 0, numel = 0;
  bool decay = false;  // AdamW weight decay on matrices only, not on norm gains
};

// Parameter order and shapes for a config; identical on every rank.
std::vector<ParamInfo> param_infos(const ModelConfig& config);
size_t param_count(const std::vector<ParamInfo>& infos);

struct LayerParams {
  float *attn_norm, *wq, *wk, *wv, *wo, *mlp_norm, *w1, *w3, *w2;
};
struct ModelParams {
  float* embed;  // [V, C], also the LM head (tied)
  std::vector<LayerParams> layers;
  float* final_norm;  // [C]
};
// Named pointers into a flat buffer laid out by param_infos (weights or their gradients).
ModelParams bind_params(const ModelConfig& config, float* flat);

// Seeded init: matrices normal(0, 0.02) (output projections scaled by 1/sqrt(2 * layers)),
// norm gains 1. Same seed, same weights on every rank and platform.
void init_params(const ModelConfig& config, std::vector<float>& flat, uint64_t seed);

}  // namespace ctxpar::model

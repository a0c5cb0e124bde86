// The decoder-only transformer on one rank's shard of the sequence. Every layer but attention
// works on local tokens only; attention calls the context-parallel strategy. See
// docs/training.md for the block diagram.
#pragma once
#include <cstdint>
#include <vector>

#include "ctxpar/model.h"
#include "ctxpar/strategy.h"
#include "model/layers.h"
#include "model/params.h"

namespace ctxpar::model {

// Activations one block keeps for its backward, [N, .] with N = B * Tl local rows.
struct BlockActs {
  std::vector<float> x_in, rstd1, xn1, q, k, v, att, lse, x_mid, rstd2, xn2, h1, h3, g;
};

// ---- attention_layer.cc ---------------------------------------------------------------------
// xn [N, C] -> q, k, v projections, RoPE at global positions, strategy attention, writes
// acts.att [B, Tl, Hq, D] and acts.lse [B, Hq, Tl]; y [N, C] = att Wo^T.
void attention_forward(const ModelConfig& m, const LayerParams& w, Strategy& strategy,
                       const Tokens& tokens, const RopeTable& rope, int64_t batch, BlockActs& acts,
                       float* y);
// dy [N, C] -> dxn1 [N, C] (overwritten); weight gradients accumulated into g.
// scratch: datt [N, Hq*D], dq [N, Hq*D], dk, dv [N, Hkv*D].
struct AttentionScratch {
  std::vector<float> datt, dq, dk, dv;
};
void attention_backward(const ModelConfig& m, const LayerParams& w, const LayerParams& g,
                        Strategy& strategy, const Tokens& tokens, const RopeTable& rope,
                        int64_t batch, const BlockActs& acts, const float* dy, float* dxn1,
                        AttentionScratch& scratch);

// ---- transformer.cc -------------------------------------------------------------------------
class Transformer {
 public:
  // positions: global positions of this rank's Tl local tokens (from the layout).
  Transformer(const ModelConfig& config, Strategy& strategy, std::vector<int64_t> positions,
              int64_t batch);
  // tokens, labels, weight [B, Tl] (local shard). Computes the loss and ADDS the gradient of
  // this rank's share of it into grads (flat, param order). global_count: counted tokens of
  // the whole data group's batch.
  // Packed documents (the layout may change every step): the global positions the mask reads,
  // the positions RoPE rotates by (from 0 at each document's start) and the document ids of
  // the Tl local tokens.
  void set_tokens(std::vector<int64_t> positions, const std::vector<int64_t>& rope_positions,
                  std::vector<int32_t> documents);
  LossSums forward_backward(const float* weights, float* grads, const uint8_t* tokens,
                            const uint8_t* labels, const uint8_t* weight, double global_count);
  // Bytes of activations and scratch buffers held during a step, plus the largest peak the
  // strategy reported for one call.
  size_t peak_bytes() const { return held_bytes_ + strategy_peak_; }

 private:
  ModelConfig config_;
  Strategy& strategy_;
  std::vector<int64_t> positions_;
  std::vector<int32_t> documents_;  // empty: no documents mask
  RopeTable rope_;
  int64_t batch_, rows_;
  std::vector<BlockActs> acts_;
  std::vector<float> x_, xf_, rstdf_, xnf_, logits_, dx_, dxn_, tmp_, dg_, dh1_, dh3_;
  AttentionScratch attn_scratch_;
  size_t held_bytes_ = 0, strategy_peak_ = 0;
};

}  // namespace ctxpar::model

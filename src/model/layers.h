// The transformer's layers, each a forward/backward pair on local tokens (llm.c style: plain
// float buffers, shapes first). Rows are tokens: N = B * Tl rows of the local shard.
// Backward functions ACCUMULATE into parameter gradients (dw) and, where noted, into dx.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace ctxpar::model {

// ---- linear.cc: y = x W^T, W [out, in] as in PyTorch ----------------------------------------
// x [N, in], w [out, in], y [N, out]
void linear_forward(const float* x, const float* w, float* y, int64_t n, int64_t in, int64_t out);
// dy [N, out]; dx [N, in] (accumulated when accumulate_dx, else overwritten); dw [out, in] +=.
void linear_backward(const float* dy, const float* x, const float* w, float* dx, float* dw,
                     int64_t n, int64_t in, int64_t out, bool accumulate_dx);

// ---- rmsnorm.cc: y = x / rms(x) * w -----------------------------------------------------------
// x, y [N, C]; w [C]; rstd [N] saved for backward.
void rmsnorm_forward(const float* x, const float* w, float* y, float* rstd, int64_t n, int64_t c,
                     float eps);
// dy [N, C]; dx [N, C] +=; dw [C] +=.
void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd, float* dx,
                      float* dw, int64_t n, int64_t c);

// ---- rope.cc: rotary embedding from each token's GLOBAL position -----------------------------
// Pairs (2i, 2i+1) of every head are rotated by angle pos * base^(-2i/D).
struct RopeTable {
  int64_t tokens = 0, half = 0;
  std::vector<float> cos, sin;  // [Tl, D/2]
};
RopeTable rope_table(const std::vector<int64_t>& positions, int64_t head_dim, double base);
// x [B, Tl, H, D] in place; inverse = true rotates back (the backward of the forward).
void rope_apply(float* x, const RopeTable& table, int64_t batch, int64_t heads, int64_t head_dim,
                bool inverse);

// ---- swiglu.cc: g = silu(h1) * h3 -------------------------------------------------------------
// h1, h3, g [N, F]
void swiglu_forward(const float* h1, const float* h3, float* g, int64_t count);
// dg [N, F] -> dh1, dh3 [N, F] (overwritten)
void swiglu_backward(const float* dg, const float* h1, const float* h3, float* dh1, float* dh3,
                     int64_t count);

// ---- embedding.cc: token embedding, tied LM head and the loss ---------------------------------
// tokens [N]; table [V, C]; x [N, C]
void embedding_forward(const uint8_t* tokens, const float* table, float* x, int64_t n, int64_t c);
// dx [N, C]; dtable [V, C] +=
void embedding_backward(const uint8_t* tokens, const float* dx, float* dtable, int64_t n,
                        int64_t c);

struct LossSums {
  double loss = 0;      // sum over counted tokens of -log p(label), already divided by the
                        // global count
  int64_t counted = 0;  // local counted tokens
  int64_t correct = 0;  // local counted tokens whose argmax is the label
};
// logits [N, V] are overwritten with dloss/dlogits = (softmax - onehot) * weight / global_count
// for counted tokens (weight[i] != 0) and 0 elsewhere. labels, weight [N].
LossSums cross_entropy_forward_backward(float* logits, const uint8_t* labels, const uint8_t* weight,
                                        int64_t n, int64_t v, double global_count);

}  // namespace ctxpar::model

// Token embedding, the LM head tied to it, and the cross-entropy loss.
//
// The loss is averaged over the GLOBAL count of counted tokens (all ranks of the context group
// together), so the sum of the ranks' local losses, and of their gradients, is exactly the
// single-rank loss and gradient: context parallelism changes who computes a token, not its
// weight.
#include <cmath>
#include <cstring>

#include "model/layers.h"

namespace ctxpar::model {

void embedding_forward(const uint8_t* tokens, const float* table, float* x, int64_t n, int64_t c) {
  for (int64_t i = 0; i < n; ++i) std::memcpy(x + i * c, table + int64_t(tokens[i]) * c, c * 4);
}

void embedding_backward(const uint8_t* tokens, const float* dx, float* dtable, int64_t n,
                        int64_t c) {
  for (int64_t i = 0; i < n; ++i) {
    float* row = dtable + int64_t(tokens[i]) * c;
    const float* d = dx + i * c;
    for (int64_t j = 0; j < c; ++j) row[j] += d[j];
  }
}

LossSums cross_entropy_forward_backward(float* logits, const uint8_t* labels, const uint8_t* weight,
                                        int64_t n, int64_t v, double global_count) {
  LossSums sums;
  const float inv = static_cast<float>(1.0 / global_count);
  for (int64_t i = 0; i < n; ++i) {
    float* z = logits + i * v;
    if (!weight[i]) {
      std::memset(z, 0, v * 4);
      continue;
    }
    int64_t arg = 0;
    float mx = z[0];
    for (int64_t j = 1; j < v; ++j)
      if (z[j] > mx) mx = z[j], arg = j;
    double sum = 0;
    for (int64_t j = 0; j < v; ++j) sum += std::exp(double(z[j] - mx));
    const double lse = double(mx) + std::log(sum);
    sums.loss += (lse - double(z[labels[i]])) / global_count;
    sums.counted += 1;
    sums.correct += (arg == labels[i]);
    for (int64_t j = 0; j < v; ++j) z[j] = static_cast<float>(std::exp(double(z[j]) - lse)) * inv;
    z[labels[i]] -= inv;
  }
  return sums;
}

}  // namespace ctxpar::model

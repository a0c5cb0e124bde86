// SwiGLU gate: g = silu(h1) * h3, silu(a) = a * sigmoid(a).
#include <cmath>

#include "model/layers.h"

namespace ctxpar::model {

void swiglu_forward(const float* h1, const float* h3, float* g, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const float a = h1[i];
    const float sig = 1.0f / (1.0f + std::exp(-a));
    g[i] = a * sig * h3[i];
  }
}

void swiglu_backward(const float* dg, const float* h1, const float* h3, float* dh1, float* dh3,
                     int64_t count) {
  // d silu(a)/da = sig * (1 + a * (1 - sig))
  for (int64_t i = 0; i < count; ++i) {
    const float a = h1[i];
    const float sig = 1.0f / (1.0f + std::exp(-a));
    dh3[i] = dg[i] * a * sig;
    dh1[i] = dg[i] * h3[i] * sig * (1.0f + a * (1.0f - sig));
  }
}

}  // namespace ctxpar::model

// RMSNorm: y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps). Row statistics in double:
// C is small and the backward needs rstd exact to match finite differences.
#include <cmath>

#include "model/layers.h"

namespace ctxpar::model {

void rmsnorm_forward(const float* x, const float* w, float* y, float* rstd, int64_t n, int64_t c,
                     float eps) {
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * c;
    double ss = 0;
    for (int64_t j = 0; j < c; ++j) ss += double(xi[j]) * xi[j];
    const float r = static_cast<float>(1.0 / std::sqrt(ss / double(c) + eps));
    rstd[i] = r;
    float* yi = y + i * c;
    for (int64_t j = 0; j < c; ++j) yi[j] = xi[j] * r * w[j];
  }
}

void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd, float* dx,
                      float* dw, int64_t n, int64_t c) {
  // With xhat = x * r:  dx = r * (dy*w - xhat * mean(dy*w*xhat)),  dw += dy * xhat.
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * c;
    const float* dyi = dy + i * c;
    const float r = rstd[i];
    double dot = 0;
    for (int64_t j = 0; j < c; ++j) dot += double(dyi[j]) * w[j] * xi[j] * r;
    const float mean = static_cast<float>(dot / double(c));
    float* dxi = dx + i * c;
    for (int64_t j = 0; j < c; ++j) {
      const float xhat = xi[j] * r;
      dxi[j] += r * (dyi[j] * w[j] - xhat * mean);
      dw[j] += dyi[j] * xhat;
    }
  }
}

}  // namespace ctxpar::model

// AdamW, global-norm clipping and the warm-up + cosine schedule. Weights are replicated, and
// every rank applies the same update to the same all-reduced gradients, so they stay identical
// without a broadcast.
#include <cmath>
#include <numbers>

#include "model/training.h"

namespace ctxpar::model {

double learning_rate(const TrainConfig& c, int64_t step) {
  if (c.warmup > 0 && step <= c.warmup) return c.lr * double(step) / double(c.warmup);
  const double span = double(std::max<int64_t>(1, c.steps - c.warmup));
  const double t = std::min(1.0, double(step - c.warmup) / span);
  return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1.0 + std::cos(std::numbers::pi * t));
}

double global_norm(const std::vector<float>& grads) {
  double ss = 0;
  for (float g : grads) ss += double(g) * g;
  return std::sqrt(ss);
}

double clip_grad_norm(std::vector<float>& grads, double max_norm) {
  const double norm = global_norm(grads);
  if (max_norm > 0 && norm > max_norm) {
    const float s = static_cast<float>(max_norm / (norm + 1e-6));
    for (float& g : grads) g *= s;
  }
  return norm;
}

void adamw_update(std::vector<float>& weights, const std::vector<float>& grads, AdamState& st,
                  const std::vector<ParamInfo>& infos, const TrainConfig& c, double lr) {
  if (st.m.size() != weights.size()) {
    st.m.assign(weights.size(), 0.0f);
    st.v.assign(weights.size(), 0.0f);
  }
  st.step += 1;
  const double bc1 = 1.0 - std::pow(c.beta1, double(st.step));
  const double bc2 = 1.0 - std::pow(c.beta2, double(st.step));
  const float b1 = float(c.beta1), b2 = float(c.beta2);
  for (const ParamInfo& p : infos) {
    const float decay = p.decay ? float(lr * c.weight_decay) : 0.0f;
    for (size_t i = p.offset; i < p.offset + p.numel; ++i) {
      const float g = grads[i];
      st.m[i] = b1 * st.m[i] + (1.0f - b1) * g;
      st.v[i] = b2 * st.v[i] + (1.0f - b2) * g * g;
      const double mhat = st.m[i] / bc1, vhat = st.v[i] / bc2;
      weights[i] -= float(lr * mhat / (std::sqrt(vhat) + c.eps)) + decay * weights[i];
    }
  }
}

}  // namespace ctxpar::model

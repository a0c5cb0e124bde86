// Rotary position embedding from GLOBAL positions: a rank's local tokens are not contiguous
// under zigzag or striped layouts, so every angle comes from the layout's position of the token,
// never from its local index. Angles are computed in double: at positions near 1M a float
// product pos * theta loses the low bits that the highest frequencies need.
#include <cmath>

#include "ctxpar/error.h"
#include "ctxpar/mask.h"
#include "model/layers.h"

namespace ctxpar::model {

RopeTable rope_table(const std::vector<int64_t>& positions, int64_t head_dim, double base) {
  CTXPAR_CHECK(head_dim % 2 == 0, "rope: head_dim must be even, got ", head_dim);
  RopeTable t;
  t.tokens = static_cast<int64_t>(positions.size());
  t.half = head_dim / 2;
  t.cos.resize(t.tokens * t.half);
  t.sin.resize(t.tokens * t.half);
  for (int64_t i = 0; i < t.tokens; ++i)
    for (int64_t k = 0; k < t.half; ++k) {
      const double theta = std::pow(base, -2.0 * double(k) / double(head_dim));
      // A padding token (layouts pad T to their granule) sees and is seen by nothing; its
      // rotation is irrelevant, so it gets angle 0 rather than one from a sentinel position.
      const double a = positions[i] == kPaddingPosition ? 0.0 : double(positions[i]) * theta;
      t.cos[i * t.half + k] = static_cast<float>(std::cos(a));
      t.sin[i * t.half + k] = static_cast<float>(std::sin(a));
    }
  return t;
}

void rope_apply(float* x, const RopeTable& table, int64_t batch, int64_t heads, int64_t head_dim,
                bool inverse) {
  // x [B, Tl, H, D]; the backward of a rotation is the rotation by the opposite angle.
  const float sign = inverse ? -1.0f : 1.0f;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < table.tokens; ++i) {
      const float* c = table.cos.data() + i * table.half;
      const float* s = table.sin.data() + i * table.half;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x + ((b * table.tokens + i) * heads + h) * head_dim;
        for (int64_t k = 0; k < table.half; ++k) {
          const float x0 = v[2 * k], x1 = v[2 * k + 1], sk = sign * s[k];
          v[2 * k] = x0 * c[k] - x1 * sk;
          v[2 * k + 1] = x0 * sk + x1 * c[k];
        }
      }
    }
}

}  // namespace ctxpar::model

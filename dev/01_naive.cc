// Lab 01: the textbook forward. Materialise a row of scores S = scale * q K^T, softmax it, and
// O = P V: three passes over all keys per query row, every key row read twice per query.
//   ./build/dev/lab_01_naive [T] [H] [D]
#include "lab_common.h"

int main(int argc, char** argv) {
  lab::Problem p(argc, argv);
  const int64_t t = p.t, h = p.h, d = p.d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float* q = p.q.ptr<float>();
  const float* k = p.k.ptr<float>();
  const float* v = p.v.ptr<float>();
  std::vector<float> o(t * h * d), s(t);
  auto run = [&] {
    for (int64_t hh = 0; hh < h; ++hh)
      for (int64_t i = 0; i < t; ++i) {
        float mx = -INFINITY;
        for (int64_t j = 0; j < t; ++j) {
          float dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += q[(i * h + hh) * d + c] * k[(j * h + hh) * d + c];
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        float sum = 0;
        for (int64_t j = 0; j < t; ++j) sum += (s[j] = std::exp(s[j] - mx));
        float* out = o.data() + (i * h + hh) * d;
        for (int64_t c = 0; c < d; ++c) out[c] = 0;
        for (int64_t j = 0; j < t; ++j)
          for (int64_t c = 0; c < d; ++c) out[c] += s[j] / sum * v[(j * h + hh) * d + c];
      }
  };
  return lab::report("01_naive", p, run, o);
}

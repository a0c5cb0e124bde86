// Lab 02: tiled online softmax (the library's scalar path, CTXPAR_KERNEL=scalar, in miniature).
// 64 x 64 tiles of (queries, keys); each query row keeps a running max m, sum l and
// unnormalised output; a new tile rescales them by exp(m_old - m_new) only when the max grows.
// One pass over the keys, tiles small enough to stay in cache; still scalar arithmetic.
//   ./build/dev/lab_02_blocked [T] [H] [D]
#include "lab_common.h"

int main(int argc, char** argv) {
  lab::Problem p(argc, argv);
  const int64_t t = p.t, h = p.h, d = p.d, tile = 64;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float* q = p.q.ptr<float>();
  const float* k = p.k.ptr<float>();
  const float* v = p.v.ptr<float>();
  std::vector<float> o(t * h * d), s(tile * tile), m(tile), l(tile);
  auto run = [&] {
    for (int64_t hh = 0; hh < h; ++hh)
      for (int64_t i0 = 0; i0 < t; i0 += tile) {
        const int64_t rows = std::min(tile, t - i0);
        std::fill(m.begin(), m.end(), -INFINITY);
        std::fill(l.begin(), l.end(), 0.0f);
        for (int64_t r = 0; r < rows; ++r) std::fill_n(o.data() + ((i0 + r) * h + hh) * d, d, 0.0f);
        for (int64_t j0 = 0; j0 < t; j0 += tile) {
          const int64_t cols = std::min(tile, t - j0);
          for (int64_t r = 0; r < rows; ++r) {
            const float* qr = q + ((i0 + r) * h + hh) * d;
            float mx = m[r];
            for (int64_t c = 0; c < cols; ++c) {
              const float* kc = k + ((j0 + c) * h + hh) * d;
              float dot = 0;
              for (int64_t x = 0; x < d; ++x) dot += qr[x] * kc[x];
              s[r * tile + c] = dot * scale;
              mx = std::max(mx, s[r * tile + c]);
            }
            float* out = o.data() + ((i0 + r) * h + hh) * d;
            if (mx > m[r]) {
              const float alpha = std::exp(m[r] - mx);
              l[r] *= alpha;
              for (int64_t x = 0; x < d; ++x) out[x] *= alpha;
              m[r] = mx;
            }
            for (int64_t c = 0; c < cols; ++c) {
              const float pc = std::exp(s[r * tile + c] - mx);
              l[r] += pc;
              const float* vc = v + ((j0 + c) * h + hh) * d;
              for (int64_t x = 0; x < d; ++x) out[x] += pc * vc[x];
            }
          }
        }
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t x = 0; x < d; ++x) o[((i0 + r) * h + hh) * d + x] /= l[r];
      }
  };
  return lab::report("02_blocked", p, run, o);
}

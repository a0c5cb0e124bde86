// Every layer's backward against central finite differences of its forward, on tiny shapes.
// Scalar objective L = sum(y * r) for a fixed random r, so dL/dy = r. Forward in fp32 with
// eps = 1e-2 gives FD errors ~1e-4 relative; the rule: |fd - analytic| <= 2e-3 * max|analytic|
// + 2e-4 for each checked entry.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "model/layers.h"

namespace ctxpar::model {
namespace {

std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.0f) {
  std::vector<float> v(n);
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (auto& x : v) {
    // sum of uniforms: a cheap, smooth-enough normal-ish sample
    double acc = 0;
    for (int i = 0; i < 4; ++i) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      acc += double(s >> 11) / double(1ull << 53) - 0.5;
    }
    x = float(acc * std::sqrt(3.0)) * scale;
  }
  return v;
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * b[i];
  return s;
}

// Checks analytic gradient `grad` of objective f with respect to `param` by central differences.
void expect_fd(std::vector<float>& param, const std::vector<float>& grad,
               const std::function<double()>& f, const char* what, float eps = 1e-2f) {
  ASSERT_EQ(param.size(), grad.size());
  double gmax = 0;
  for (float g : grad) gmax = std::max(gmax, double(std::fabs(g)));
  const size_t stride = std::max<size_t>(1, param.size() / 40);
  for (size_t i = 0; i < param.size(); i += stride) {
    const float keep = param[i];
    param[i] = keep + eps;
    const double up = f();
    param[i] = keep - eps;
    const double down = f();
    param[i] = keep;
    const double fd = (up - down) / (2.0 * eps);
    EXPECT_NEAR(fd, grad[i], 2e-3 * gmax + 2e-4) << what << " entry " << i;
  }
}

TEST(Layers, LinearBackwardMatchesFiniteDifferences) {
  const int64_t n = 5, in = 7, out = 3;
  auto x = randn(n * in, 1), w = randn(out * in, 2), r = randn(n * out, 3);
  std::vector<float> y(n * out);
  auto f = [&]() {
    linear_forward(x.data(), w.data(), y.data(), n, in, out);
    return dot(y, r);
  };
  std::vector<float> dx(n * in, 0.5f), dw(out * in, 0.0f);
  linear_backward(r.data(), x.data(), w.data(), dx.data(), dw.data(), n, in, out, false);
  expect_fd(x, dx, f, "dx");
  expect_fd(w, dw, f, "dw");
  // accumulate_dx adds on top of what is there
  std::vector<float> dx2(n * in, 1.0f), dw2(out * in, 0.0f);
  linear_backward(r.data(), x.data(), w.data(), dx2.data(), dw2.data(), n, in, out, true);
  // One fp32 addition: a few ulps, within the rule's floor 1e-5 * max(1, |ref|).
  for (size_t i = 0; i < dx.size(); ++i)
    EXPECT_NEAR(dx2[i], dx[i] + 1.0f, 1e-5 * std::max(1.0f, std::fabs(dx[i] + 1.0f)));
}

TEST(Layers, RmsNormBackwardMatchesFiniteDifferences) {
  const int64_t n = 4, c = 9;
  auto x = randn(n * c, 4), w = randn(c, 5), r = randn(n * c, 6);
  std::vector<float> y(n * c), rstd(n);
  auto f = [&]() {
    rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), n, c, 1e-5f);
    return dot(y, r);
  };
  f();
  std::vector<float> dx(n * c, 0.0f), dw(c, 0.0f);
  rmsnorm_backward(r.data(), x.data(), w.data(), rstd.data(), dx.data(), dw.data(), n, c);
  expect_fd(x, dx, f, "dx");
  expect_fd(w, dw, f, "dw");
}

TEST(Layers, RopeUsesGlobalPositionsAndInverseIsItsBackward) {
  const int64_t b = 2, h = 3, d = 16;
  const std::vector<int64_t> pos = {3, 4, 17, 1000};  // a zigzag-like, non-contiguous shard
  const int64_t t = pos.size();
  auto table = rope_table(pos, d, 10000.0);
  auto x = randn(b * t * h * d, 7), r = randn(b * t * h * d, 8);
  std::vector<float> y;
  auto f = [&]() {
    y = x;
    rope_apply(y.data(), table, b, h, d, false);
    return dot(y, r);
  };
  std::vector<float> dx = r;
  rope_apply(dx.data(), table, b, h, d, true);
  expect_fd(x, dx, f, "dx");
  // Relative-position property: <rot(q, i), rot(k, j)> depends only on i - j.
  auto q = randn(d, 9), k = randn(d, 10);
  auto score = [&](int64_t i, int64_t j) {
    auto tb = rope_table({i, j}, d, 10000.0);
    std::vector<float> qq = q, kk = k;
    RopeTable ti = tb, tj = tb;
    ti.tokens = tj.tokens = 1;
    tj.cos.erase(tj.cos.begin(), tj.cos.begin() + d / 2);
    tj.sin.erase(tj.sin.begin(), tj.sin.begin() + d / 2);
    rope_apply(qq.data(), ti, 1, 1, d, false);
    rope_apply(kk.data(), tj, 1, 1, d, false);
    return dot(qq, kk);
  };
  EXPECT_NEAR(score(10, 3), score(5007, 5000), 1e-3);
}

TEST(Layers, SwiGluBackwardMatchesFiniteDifferences) {
  const int64_t count = 30;
  auto h1 = randn(count, 11, 2.0f), h3 = randn(count, 12), r = randn(count, 13);
  std::vector<float> g(count);
  auto f = [&]() {
    swiglu_forward(h1.data(), h3.data(), g.data(), count);
    return dot(g, r);
  };
  std::vector<float> dh1(count), dh3(count);
  swiglu_backward(r.data(), h1.data(), h3.data(), dh1.data(), dh3.data(), count);
  expect_fd(h1, dh1, f, "dh1", 1e-3f);
  expect_fd(h3, dh3, f, "dh3", 1e-3f);
}

TEST(Layers, EmbeddingAndCrossEntropyMatchFiniteDifferences) {
  const int64_t n = 6, c = 4, v = 256;
  const std::vector<uint8_t> tokens = {1, 200, 1, 7, 255, 0};
  const std::vector<uint8_t> labels = {5, 9, 200, 3, 3, 1};
  const std::vector<uint8_t> weight = {1, 0, 1, 1, 0, 1};
  auto table = randn(v * c, 14), r = randn(n * c, 15);
  std::vector<float> x(n * c);
  auto f = [&]() {
    embedding_forward(tokens.data(), table.data(), x.data(), n, c);
    return dot(x, r);
  };
  std::vector<float> dtable(v * c, 0.0f);
  embedding_backward(tokens.data(), r.data(), dtable.data(), n, c);
  expect_fd(table, dtable, f, "dtable");

  // Loss averaged over a global count larger than the local one (other ranks' tokens).
  const double global = 10.0;
  auto logits = randn(n * v, 16, 3.0f);
  auto loss = [&]() {
    std::vector<float> z = logits;
    return cross_entropy_forward_backward(z.data(), labels.data(), weight.data(), n, v, global)
        .loss;
  };
  std::vector<float> dz = logits;
  LossSums s =
      cross_entropy_forward_backward(dz.data(), labels.data(), weight.data(), n, v, global);
  EXPECT_EQ(s.counted, 4);
  // Independent loss in double.
  double want = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!weight[i]) continue;
    double mx = -1e30, sum = 0;
    for (int64_t j = 0; j < v; ++j) mx = std::max(mx, double(logits[i * v + j]));
    for (int64_t j = 0; j < v; ++j) sum += std::exp(double(logits[i * v + j]) - mx);
    want += (mx + std::log(sum) - logits[i * v + labels[i]]) / global;
  }
  EXPECT_NEAR(s.loss, want, 1e-9 * std::fabs(want) + 1e-12);
  expect_fd(logits, dz, loss, "dlogits", 1e-2f);
}

}  // namespace
}  // namespace ctxpar::model

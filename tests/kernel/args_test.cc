// Bad arguments throw ctxpar::Error whose message names the argument and the expectation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "ctxpar/kernel.h"
#include "ctxpar/reference.h"
#include "kernel/finite.h"

namespace ctxpar {
namespace {

void expect_error(const std::function<void()>& f, const std::string& must_contain) {
  try {
    f();
    ADD_FAILURE() << "no error thrown, expected one mentioning '" << must_contain << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(must_contain), std::string::npos)
        << "message '" << e.what() << "' lacks '" << must_contain << "'";
  }
}

struct Args {
  int64_t B = 1, Tq = 5, Tk = 6, Hq = 4, Hkv = 2, D = 16;
  Tensor q{DType::f32, {B, Tq, Hq, D}}, k{DType::f32, {B, Tk, Hkv, D}},
      v{DType::f32, {B, Tk, Hkv, D}};
  std::vector<int64_t> qp{0, 1, 2, 3, 4}, kp{0, 1, 2, 3, 4, 5};
  std::vector<int32_t> qd{0, 0, 0, 1, 1}, kd{0, 0, 1, 1, 1, 1};
  ForwardState state{B, Tq, Hq, D};
  Tokens qt() const { return {qp, qd}; }
  Tokens kt() const { return {kp, kd}; }
};

TEST(Args, ForwardRejectsBadShapesAndTypes) {
  Args a;
  const Mask m = Mask::causal_mask();
  EXPECT_NO_THROW(attention_forward_block(a.q, a.qt(), a.k, a.v, a.kt(), m, a.state));
  Tensor k3(DType::f32, {1, 6, 3, 16});  // 4 % 3 != 0
  expect_error([&] { attention_forward_block(a.q, a.qt(), k3, k3, a.kt(), m, a.state); },
               "Hq % Hkv");
  Tensor kd(DType::f32, {1, 6, 2, 32});
  expect_error([&] { attention_forward_block(a.q, a.qt(), kd, kd, a.kt(), m, a.state); },
               "k: head dim");
  Tensor v7(DType::f32, {1, 7, 2, 16});
  expect_error([&] { attention_forward_block(a.q, a.qt(), a.k, v7, a.kt(), m, a.state); }, "v:");
  Tensor kb(DType::f32, {2, 6, 2, 16});
  expect_error([&] { attention_forward_block(a.q, a.qt(), kb, kb, a.kt(), m, a.state); },
               "k: batch");
  Tensor qi(DType::i32, {1, 5, 4, 16});
  expect_error([&] { attention_forward_block(qi, a.qt(), a.k, a.v, a.kt(), m, a.state); },
               "q: expected dtype");
  Tensor q8(DType::f32, {1, 5, 4, 8}), k8(DType::f32, {1, 6, 2, 8});
  ForwardState s8(1, 5, 4, 8);
  expect_error([&] { attention_forward_block(q8, a.qt(), k8, k8, a.kt(), m, s8); }, "16..256");
  Tensor q3(DType::f32, {5, 4, 16});
  expect_error([&] { attention_forward_block(q3, a.qt(), a.k, a.v, a.kt(), m, a.state); },
               "4 dimensions");
  // A view whose last dim is strided.
  Tensor wide(DType::f32, {1, 5, 4, 32});
  TensorView strided(wide.data(), DType::f32, {1, 5, 4, 16}, {640, 128, 32, 2});
  expect_error([&] { attention_forward_block(strided, a.qt(), a.k, a.v, a.kt(), m, a.state); },
               "contiguous");
  ForwardState wrong(1, 4, 4, 16);
  expect_error([&] { attention_forward_block(a.q, a.qt(), a.k, a.v, a.kt(), m, wrong); }, "state");
}

TEST(Args, ForwardRejectsBadTokens) {
  Args a;
  std::vector<int64_t> short_pos{0, 1, 2};
  expect_error(
      [&] {
        attention_forward_block(a.q, Tokens{short_pos, {}}, a.k, a.v, a.kt(), Mask{}, a.state);
      },
      "q_tokens.positions");
  expect_error(
      [&] {
        attention_forward_block(a.q, a.qt(), a.k, a.v, Tokens{short_pos, {}}, Mask{}, a.state);
      },
      "k_tokens.positions");
  Mask docs;
  docs.documents = true;
  expect_error(
      [&] {
        attention_forward_block(a.q, Tokens{a.qp, {}}, a.k, a.v, a.kt(), docs, a.state);
      },
      "q_tokens.documents");
  KernelConfig bad;
  bad.threads = 0;
  expect_error(
      [&] { attention_forward_block(a.q, a.qt(), a.k, a.v, a.kt(), Mask{}, a.state, bad); },
      "config.threads");
  // The L1 size the K panels are sized for: 0 (this machine's) or a cache's size in bytes.
  for (const int64_t l1d : {int64_t{-1}, int64_t{512}, (int64_t{1} << 30) + 1}) {
    KernelConfig cache;
    cache.l1d_bytes = l1d;
    expect_error(
        [&] { attention_forward_block(a.q, a.qt(), a.k, a.v, a.kt(), Mask{}, a.state, cache); },
        "config.l1d_bytes: expected 0 (this machine's) or 1024 to 2^30 bytes, got " +
            std::to_string(l1d));
  }
  for (const int64_t l1d : {int64_t{1024}, int64_t{1} << 30}) {
    KernelConfig cache;
    cache.l1d_bytes = l1d;
    EXPECT_NO_THROW(attention_forward_block(a.q, a.qt(), a.k, a.v, a.kt(), Mask{}, a.state, cache));
  }
}

TEST(Args, BackwardAndFinalizeRejectBadShapes) {
  Args a;
  Tensor o(DType::f32, {1, 5, 4, 16}), lse(DType::f32, {1, 4, 5}), delta(DType::f32, {1, 4, 5});
  Tensor dq(DType::f32, {1, 5, 4, 16}), dk(DType::f32, {1, 6, 2, 16}),
      dv(DType::f32, {1, 6, 2, 16});
  const Mask m;
  EXPECT_NO_THROW(
      attention_backward_block(a.q, a.qt(), a.k, a.v, a.kt(), m, o, lse, delta, dq, dk, dv));
  Tensor lse_bad(DType::f32, {1, 5, 4});
  expect_error(
      [&] {
        attention_backward_block(a.q, a.qt(), a.k, a.v, a.kt(), m, o, lse_bad, delta, dq, dk, dv);
      },
      "lse: expected shape");
  Tensor dq_bf(DType::bf16, {1, 5, 4, 16});
  expect_error(
      [&] {
        attention_backward_block(a.q, a.qt(), a.k, a.v, a.kt(), m, o, lse, delta, dq_bf, dk, dv);
      },
      "dq: expected dtype fp32");
  expect_error(
      [&] {
        attention_backward_block(a.q, a.qt(), a.k, a.v, a.kt(), m, o, lse, delta, dq, dq, dv);
      },
      "dk: expected shape");
  expect_error(
      [&] {
        attention_backward_block(a.q, a.qt(), a.k, a.v, a.kt(), m, dk, lse, delta, dq, dk, dv);
      },
      "dout: expected shape");
  expect_error([&] { attention_forward_finalize(a.state, dk, lse); }, "out: expected shape");
  expect_error([&] { attention_forward_finalize(a.state, o, lse_bad); }, "lse: expected shape");
  expect_error([&] { attention_backward_delta(o, dq_bf, lse_bad); }, "delta: expected shape");
  expect_error(
      [&] {
        Tensor k5(DType::f32, {1, 6, 5, 16});
        reference::attention_f64(a.q, a.qt(), k5, k5, a.kt(), m);
      },
      "k:");
}

}  // namespace
}  // namespace ctxpar

namespace ctxpar {
namespace {

// NaN / Inf inputs must fail loudly: without the check a NaN in q comes out as a fully masked
// row (O = 0, LSE = -inf), a silently wrong answer.
TEST(Args, NonFiniteInputsAreRejected) {
  const Mask m = Mask::none();
  for (DType dt : {DType::f32, DType::bf16}) {
    Args a;
    Tensor q = Tensor::copy_of(a.q.view(), dt), k = Tensor::copy_of(a.k.view(), dt),
           v = Tensor::copy_of(a.v.view(), dt);
    EXPECT_NO_THROW(attention_forward_block(q, a.qt(), k, v, a.kt(), m, a.state));
    q.view().set(std::numeric_limits<float>::quiet_NaN(), 0, 3, 1, 7);
    expect_error([&] { attention_forward_block(q, a.qt(), k, v, a.kt(), m, a.state); },
                 "q: non-finite value (nan) at [0, 3, 1, 7]");
    q.view().set(0.0f, 0, 3, 1, 7);
    v.view().set(std::numeric_limits<float>::infinity(), 0, 5, 0, 0);
    expect_error([&] { attention_forward_block(q, a.qt(), k, v, a.kt(), m, a.state); },
                 "v: non-finite value (inf) at [0, 5, 0, 0]");
    v.view().set(0.0f, 0, 5, 0, 0);
    Tensor dout = Tensor::copy_of(a.q.view(), dt), lse(DType::f32, {1, 4, 5}),
           delta(DType::f32, {1, 4, 5}), dq(DType::f32, {1, 5, 4, 16}),
           dk(DType::f32, {1, 6, 2, 16}), dv(DType::f32, {1, 6, 2, 16});
    dout.view().set(-std::numeric_limits<float>::infinity(), 0, 0, 0, 0);
    expect_error(
        [&] { attention_backward_block(q, a.qt(), k, v, a.kt(), m, dout, lse, delta, dq, dk, dv); },
        "dout: non-finite value (-inf)");
  }
}

// find_non_finite tests a tensor that is one run in memory by vectors first, then row by row
// (simd_finite.cc): a bad element anywhere -- the first, the vectors' tail, the last -- is found
// at its indices, fp32 and bf16; in a view that is not one run (a slice of the tokens), only
// elements inside the view count.
TEST(Args, NonFiniteFoundWhereverItIs) {
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(),
                       std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()};
  for (DType dt : {DType::f32, DType::bf16}) {
    Tensor t(dt, {2, 7, 3, 19});  // 798 elements: no multiple of any target's lanes
    fill_normal(t.view(), 7);
    EXPECT_FALSE(kernel::find_non_finite(t.view()).found()) << dtype_name(dt);
    const int64_t at[][4] = {{0, 0, 0, 0}, {1, 6, 2, 18}, {1, 6, 2, 5}, {0, 3, 1, 7}, {1, 0, 0, 0}};
    int k = 0;
    for (const auto& i : at) {
      const float x = bad[k++ % 3];
      t.view().set(x, i[0], i[1], i[2], i[3]);
      const kernel::NonFinite f = kernel::find_non_finite(t.view());
      EXPECT_TRUE(f.found() && f.b == i[0] && f.t == i[1] && f.h == i[2] && f.d == i[3])
          << dtype_name(dt) << " at " << i[0] << "," << i[1] << "," << i[2] << "," << i[3]
          << ": found " << f.b << "," << f.t << "," << f.h << "," << f.d;
      // A view of tokens 1..5: the element is seen iff its token is inside, at its index there.
      const kernel::NonFinite g = kernel::find_non_finite(t.view().slice(1, 1, 6));
      if (i[1] >= 1 && i[1] < 6)
        EXPECT_TRUE(g.found() && g.b == i[0] && g.t == i[1] - 1 && g.d == i[3]) << dtype_name(dt);
      else
        EXPECT_FALSE(g.found()) << dtype_name(dt) << " token " << i[1] << " is outside the view";
      t.view().set(1.0f, i[0], i[1], i[2], i[3]);
    }
  }
}

// A [B, T, H, D] view of [B, H, T, D] storage (what the torch layer passes for SDPA's tensors) is
// one run in memory too: a finite one passes, a bad element is found at its indices, and of two
// the first in index order (b, t, h, d) is the finding, not the first in memory; with 1 and 2
// threads, above kParallelScan elements as well.
TEST(Args, NonFiniteFoundInHeadsMajorStorage) {
  for (DType dt : {DType::f32, DType::bf16})
    for (const int64_t n : {int64_t{7}, int64_t{4099}}) {
      const int64_t b = 2, h = 3, d = n == 7 ? 19 : 128;  // 4099: 3.1 M elements
      Tensor storage(dt, {b, h, n, d});
      fill_normal(storage.view(), 5);
      const TensorView t = storage.view().transpose(1, 2);
      for (int threads : {1, 2}) EXPECT_FALSE(kernel::find_non_finite(t, threads).found());
      // (1, n - 1, 0, 3) comes before (1, 1, 2, 5) in memory (head 0's rows first), after it in
      // index order.
      t.set(std::numeric_limits<float>::infinity(), 1, n - 1, 0, 3);
      for (int threads : {1, 2}) {
        const kernel::NonFinite f = kernel::find_non_finite(t, threads);
        EXPECT_TRUE(f.found() && f.b == 1 && f.t == n - 1 && f.h == 0 && f.d == 3)
            << dtype_name(dt) << " T " << n << ": found " << f.b << "," << f.t << "," << f.h;
      }
      t.set(std::numeric_limits<float>::quiet_NaN(), 1, 1, 2, 5);
      for (int threads : {1, 2}) {
        const kernel::NonFinite f = kernel::find_non_finite(t, threads);
        EXPECT_TRUE(f.found() && f.b == 1 && f.t == 1 && f.h == 2 && f.d == 5 &&
                    std::isnan(f.value))
            << dtype_name(dt) << " T " << n << ": found " << f.b << "," << f.t << "," << f.h;
      }
      // Tokens 2.. of the view are not one run; the bad element at token 1 is outside them.
      t.set(1.0f, 1, n - 1, 0, 3);
      EXPECT_FALSE(kernel::find_non_finite(t.slice(1, 2, n), 2).found()) << dtype_name(dt);
    }
}

// From kParallelScan elements on, a tensor that is one run is tested by the call's threads in
// equal chunks: a bad element in any chunk, at a chunk's edge, or in two chunks at once is found
// where one thread finds it (the first in memory order), and a finite tensor passes.
TEST(Args, NonFiniteFoundByAnyNumberOfThreads) {
  for (DType dt : {DType::f32, DType::bf16}) {
    const int64_t b = 1, n = 1031, h = 8, d = 128;  // 1,055,744 elements: over kParallelScan
    ASSERT_GE(b * n * h * d, kernel::kParallelScan);
    Tensor t(dt, {b, n, h, d});
    fill_normal(t.view(), 11);
    for (int threads : {1, 2, 3, 8})
      EXPECT_FALSE(kernel::find_non_finite(t.view(), threads).found());
    const int64_t total = b * n * h * d;
    // Element indices: the first, the last, the edges of 2 and 3 equal chunks, a middle one.
    const int64_t at[] = {0,         total - 1,         total / 2 - 1,  total / 2,
                          total / 3, 2 * total / 3 - 1, total / 2 + 777};
    for (int64_t e : at) {
      const int64_t i3 = e % d, i2 = (e / d) % h, i1 = e / (d * h);
      t.view().set(std::numeric_limits<float>::quiet_NaN(), 0, i1, i2, i3);
      const auto expect_first = [&](const char* what) {
        for (int threads : {1, 2, 3, 8}) {
          const kernel::NonFinite f = kernel::find_non_finite(t.view(), threads);
          EXPECT_TRUE(f.found() && f.b == 0 && f.t == i1 && f.h == i2 && f.d == i3 &&
                      std::isnan(f.value))
              << dtype_name(dt) << " element " << e << what << ", " << threads << " threads: found "
              << f.t << "," << f.h << "," << f.d;
        }
      };
      expect_first(" alone");
      // A second bad element later in memory (another chunk): the first is still the finding.
      const int64_t later = std::min(total - 1, e + total / 3);
      const bool two = later != e;
      if (two) {
        t.view().set(std::numeric_limits<float>::infinity(), 0, later / (d * h), (later / d) % h,
                     later % d);
        expect_first(" and a later one");
      }
      t.view().set(1.0f, 0, i1, i2, i3);
      if (two) t.view().set(1.0f, 0, later / (d * h), (later / d) % h, later % d);
    }
  }
}

}  // namespace
}  // namespace ctxpar

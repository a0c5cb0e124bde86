// The fast path's memory layout -- K panels sized to the L1 (simd_tile.h, Note [K panels]),
// padded rows (Note [Padded rows]) and two query tiles a forward task (simd_forward.cc, Note
// [Two query tiles a task]) -- changes where data sits and in what order the micro-kernels walk
// it, never a bit of a result:
//   - every output of forward and backward is bitwise the same whatever L1 size the kernel
//     tiles for, from one pass (1 GiB) down to 16-row panels (4 KiB), for head dims whose rows
//     are padded (64, 128, 256) or not (80), with GQA, a causal mask, ragged tiles and both
//     storage types; each is also checked against the fp64 reference by the tolerance rule, so
//     "equal" cannot mean "equally wrong";
//   - a query row's outputs do not depend on which rows share its task: dropping the first
//     query tile pairs every later tile with another neighbour, and the remaining rows keep
//     their bits, under masks whose tiles are skipped, partial or full in every combination;
//   - likewise a key row's dK / dV do not depend on which key tile shares its backward pass
//     (simd_backward.cc, Note [Key tiles a pass]): the backward of the keys without the
//     first tile, given the same LSE and delta, reproduces the other rows bitwise;
//   - the same inputs and outputs as views of [B, H, T, D] storage (any strides: what the torch
//     layer passes) give the bits of contiguous [B, T, H, D] tensors;
//   - the kernel's own buffers start on a 64-byte line (Note [Buffers on cache lines],
//     kernel/lines.h): a tile row off a line touches two lines, and the AMX products ran at a
//     third of their speed; the alignment itself changes no bit (the grids above).
// Runs for every SIMD target the ctest entries force (CTXPAR_SIMD).
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "kernel/lines.h"
#include "kernel/problem.h"
#include "kernel/simd_bf16.h"
#include "kernel/kernel_support.h"
#include "same_bits.h"

namespace ctxpar {
namespace {

using test::Case;
using test::Inputs;
using test::Outputs;
using test::run_fast;

// A kernel configuration that sizes its K panels for an L1 of `bytes`.
KernelConfig with_l1d(int64_t bytes) {
  KernelConfig c;
  c.l1d_bytes = bytes;
  return c;
}

TEST(Layout, PanelRowsFollowTheL1Size) {
  // Zen 3: a 128 x 64 K^T tile (32 KiB) in two 16 KiB panels
  EXPECT_EQ(kernel::kernel_k_panel(64, 128, 32768), 64);
  EXPECT_EQ(kernel::kernel_k_panel(64, 64, 32768), 0);  // 16 KiB fits half of 32 KiB: one pass
  EXPECT_EQ(kernel::kernel_k_panel(64, 256, 32768), 64);
  // Sapphire Rapids: 24 KiB budget, still two even panels
  EXPECT_EQ(kernel::kernel_k_panel(64, 128, 49152), 64);
  EXPECT_EQ(kernel::kernel_k_panel(64, 128, 4096), 16);  // the floor: 16 rows
  EXPECT_EQ(kernel::kernel_k_panel(64, 256, 1 << 30), 0);
  // 0: this machine's L1
  EXPECT_EQ(kernel::kernel_k_panel(64, 256, 0),
            kernel::kernel_k_panel(64, 256, kernel::kernel_l1d_bytes()));
}

TEST(Layout, MalformedL1SizeIsRefusedByName) {
  EXPECT_EQ(kernel::parse_kernel_l1d("32768"), 32768);
  for (const char* bad : {"", "abc", "32k", "512", "0", "-32768", "99999999999", "2147483648"}) {
    try {
      kernel::parse_kernel_l1d(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("CTXPAR_KERNEL_L1D="), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("1024"), std::string::npos) << e.what();
    }
  }
}

TEST(Layout, ResultsDoNotDependOnTheL1Size) {
  if (kernel::use_scalar_path()) GTEST_SKIP() << "the scalar path has no panels";
  for (int64_t d : {64, 80, 128, 256}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      Case c;
      c.tq = 150, c.tk = 200, c.hq = 4, c.hkv = 2, c.d = d, c.dtype = dtype;
      c.mask = Mask::causal_mask(), c.q_offset = 50, c.seed = 7 + d;
      const Inputs in = make_inputs(c);
      const Outputs base = run_fast(in, c.mask, 2, true, 1, {}, with_l1d(1 << 30));  // one pass
      const std::string violations = rule_violations(base, references_of(in, c.mask, true), true);
      EXPECT_EQ(violations, "") << c.name();
      for (int64_t bytes : {4096, 32768, 49152}) {
        const Outputs f = run_fast(in, c.mask, 2, true, 1, {}, with_l1d(bytes));
        for (auto [x, y, what] : {std::tuple{&f.o, &base.o, "o"},
                                  {&f.lse, &base.lse, "lse"},
                                  {&f.dq, &base.dq, "dq"},
                                  {&f.dk, &base.dk, "dk"},
                                  {&f.dv, &base.dv, "dv"}})
          EXPECT_TRUE(test::same_bits(*x, *y))
              << what << ", L1 " << bytes << " bytes, " << c.name();
      }
    }
  }
}

// Rows [from, T) of in's queries (and dout), with their positions and documents.
Inputs drop_query_rows(const Inputs& in, int64_t from) {
  Inputs out = in;
  const int64_t tq = in.q.dim(1);
  out.q = Tensor::copy_of(in.q.view().slice(1, from, tq));
  out.dout = Tensor::copy_of(in.dout.view().slice(1, from, tq));
  out.q_pos.erase(out.q_pos.begin(), out.q_pos.begin() + from);
  if (!out.q_doc.empty()) out.q_doc.erase(out.q_doc.begin(), out.q_doc.begin() + from);
  return out;
}

// Whether the full run's tensor, from token `from` on along its token dim `dim` (1 for
// [B, T, ...], 2 for LSE [B, H, T]), equals the sliced run's tensor bitwise.
bool tail_equal(const Tensor& full, const Tensor& part, int64_t from, int dim) {
  return test::same_bits(Tensor::copy_of(full.view().slice(dim, from, full.dim(dim))), part);
}

TEST(Layout, QueryRowsDoNotDependOnTheirTaskNeighbours) {
  struct Named {
    const char* name;
    Mask mask;
    int64_t q_offset, doc_len;
  };
  Mask window, documents = Mask::causal_mask();
  window.window_left = 100, window.window_right = 0;
  documents.documents = true;
  const Named cases[] = {
      {"none", Mask::none(), 0, 0},
      {"causal", Mask::causal_mask(), 0, 0},
      {"causal, queries after the keys", Mask::causal_mask(), 70, 0},
      {"window 100 left", window, 0, 0},
      {"causal documents of 90", documents, 0, 90},
  };
  for (const Named& n : cases) {
    Case c;
    c.tq = 330, c.tk = 300, c.hq = 2, c.hkv = 1, c.d = 64, c.mask = n.mask;
    c.q_offset = n.q_offset, c.doc_len = n.doc_len, c.seed = 11;
    const Inputs in = make_inputs(c);
    const Outputs full = run_fast(in, c.mask, 1);
    EXPECT_EQ(rule_violations(full, references_of(in, c.mask, true), true), "") << n.name;
    const Outputs part = run_fast(drop_query_rows(in, 64), c.mask, 1);
    EXPECT_TRUE(tail_equal(full.o, part.o, 64, 1)) << "o, " << n.name;
    EXPECT_TRUE(tail_equal(full.lse, part.lse, 64, 2)) << "lse, " << n.name;
    EXPECT_TRUE(tail_equal(full.dq, part.dq, 64, 1)) << "dq, " << n.name;
  }
}

TEST(Layout, KeyRowsDoNotDependOnTheirPassNeighbours) {
  Mask documents = Mask::causal_mask();
  documents.documents = true;
  for (const Mask& mask : {Mask::none(), Mask::causal_mask(), documents}) {
    for (int threads : {1, 2}) {  // one kv head: two threads deal the key tiles into 2 chunks
      Case c;
      c.tq = 300, c.tk = 330, c.hq = 2, c.hkv = 1, c.d = 64, c.mask = mask, c.doc_len = 90;
      c.seed = 13;
      const Inputs in = make_inputs(c);
      const Outputs full = run_fast(in, c.mask, threads);
      EXPECT_EQ(rule_violations(full, references_of(in, c.mask, true), true), "")
          << c.mask.describe();
      KernelConfig cfg;
      cfg.threads = threads;
      Tensor delta(DType::f32, {1, c.hq, c.tq});
      attention_backward_delta(full.o, in.dout, delta, cfg);
      const int64_t from = 64, tk = c.tk;
      Tokens keys;
      keys.positions = std::span<const int64_t>(in.k_pos).subspan(from);
      if (!in.k_doc.empty()) keys.documents = std::span<const int32_t>(in.k_doc).subspan(from);
      Tensor dq(DType::f32, {1, c.tq, c.hq, c.d}), dk(DType::f32, {1, tk - from, c.hkv, c.d}),
          dv(DType::f32, {1, tk - from, c.hkv, c.d});
      attention_backward_block(in.q, in.q_tokens(), in.k.view().slice(1, from, tk),
                               in.v.view().slice(1, from, tk), keys, c.mask, in.dout, full.lse,
                               delta, dq, dk, dv, cfg);
      EXPECT_TRUE(tail_equal(full.dk, dk, from, 1))
          << "dk, " << c.mask.describe() << ", threads " << threads;
      EXPECT_TRUE(tail_equal(full.dv, dv, from, 1))
          << "dv, " << c.mask.describe() << ", threads " << threads;
    }
  }
}

// The kernel takes [B, T, H, D] views of any strides: the torch layer passes SDPA's [B, H, T, D]
// tensors transposed, and `ctxpar bench kernel --memory bhtd` times views of [B, H, T, D]
// storage. Every input and output so laid out (q, k, v, dO, O, dQ, dK, dV) gives the bits of
// contiguous tensors, fp32 and bf16, causal with GQA, 1 and 2 threads.
TEST(Layout, HeadsMajorStorageGivesTheSameBits) {
  for (DType dtype : {DType::f32, DType::bf16})
    for (int threads : {1, 2}) {
      Case c;
      c.tq = c.tk = 150, c.hq = 4, c.hkv = 2, c.d = 64, c.dtype = dtype;
      c.mask = Mask::causal_mask(), c.seed = 11;
      const Inputs in = make_inputs(c);
      KernelConfig config;
      config.threads = threads;
      // O, LSE, dQ, dK, dV (contiguous copies) of the kernel on views of [B, H, T, D] storage
      // (heads_major) or on contiguous [B, T, H, D] tensors.
      const auto run = [&](bool heads_major) {
        std::vector<Tensor> storage;
        const auto tensor = [&](DType dt, const TensorView& like) {
          const int64_t b = like.dim(0), t = like.dim(1), h = like.dim(2), d = like.dim(3);
          if (!heads_major) return TensorView(storage.emplace_back(dt, Shape{b, t, h, d}));
          return TensorView(storage.emplace_back(dt, Shape{b, h, t, d})).transpose(1, 2);
        };
        const auto input = [&](const Tensor& x) {
          const TensorView v = tensor(x.dtype(), x);
          copy_into(x, v);
          return v;
        };
        const TensorView q = input(in.q), k = input(in.k), v = input(in.v), dout = input(in.dout);
        const TensorView o = tensor(dtype, q), dq = tensor(DType::f32, q),
                         dk = tensor(DType::f32, k), dv = tensor(DType::f32, k);
        Tensor lse(DType::f32, {1, c.hq, c.tq}), delta(DType::f32, {1, c.hq, c.tq});
        attention_forward(q, in.q_tokens(), k, v, in.k_tokens(), c.mask, o, lse, config);
        attention_backward_delta(o, dout, delta, config);
        attention_backward_block(q, in.q_tokens(), k, v, in.k_tokens(), c.mask, dout, lse, delta,
                                 dq, dk, dv, config);
        EXPECT_EQ(heads_major, !o.contiguous() && !dq.contiguous() && !dk.contiguous());
        return std::vector<Tensor>{Tensor::copy_of(o), lse, Tensor::copy_of(dq),
                                   Tensor::copy_of(dk), Tensor::copy_of(dv)};
      };
      const std::vector<Tensor> base = run(false), heads = run(true);
      const char* names[] = {"o", "lse", "dq", "dk", "dv"};
      for (size_t i = 0; i < base.size(); ++i)
        EXPECT_TRUE(test::same_bits(heads[i], base[i]))
            << names[i] << ", " << dtype_name(dtype) << ", " << threads << " thread(s)";
    }
}

TEST(Layout, KernelBuffersStartOnALine) {
  // Sizes a std::vector serves from the heap's small chunks and from mmap, growing in place.
  kernel::LineVector<float> grown;
  for (size_t n : {size_t{1}, size_t{3}, size_t{17}, size_t{1000}, size_t{1} << 18}) {
    kernel::LineVector<float> f(n);
    kernel::LineVector<uint32_t> w(n + 1);
    grown.resize(grown.size() + n);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(f.data()) % kLineBytes, 0u) << n;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(w.data()) % kLineBytes, 0u) << n;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(grown.data()) % kLineBytes, 0u) << n;
    // The per-thread pack buffers of the bf16 products, grown to n words.
    for (int slot = 0; slot < static_cast<int>(kernel::bf16::Buffer::count); ++slot)
      EXPECT_EQ(reinterpret_cast<uintptr_t>(
                    kernel::bf16::buffer(static_cast<kernel::bf16::Buffer>(slot), n)) %
                    kLineBytes,
                0u)
          << n << " words, buffer " << slot;
  }
}

}  // namespace
}  // namespace ctxpar

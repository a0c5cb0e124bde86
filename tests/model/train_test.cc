// The whole model and the training loop:
//  - the transformer's gradient (attention through the strategy, RoPE at global positions)
//    against finite differences of its loss;
//  - context parallelism changes nothing: --cp 2 / 4 (several strategies and layouts) give the
//    --cp 1 losses and final weights up to fp32 summation-order noise. Rule (no CPU-specific
//    constant): the only difference between the runs is the order of fp32 additions (attention
//    merges, gradient all-reduce), each a relative 2^-24 ~ 6e-8 per operation; over 20 AdamW
//    steps it grows to at most kLossRel = 1e-4 relative per loss (~1700 ulps) and kWeightAbs =
//    5e-4 absolute per weight (AdamW normalises the gradient, so noise moves a weight by a
//    fraction of lr = 3e-3 per step; 5e-4 is well under one step). Measured worst, on both
//    the AVX-512 kernel with OpenBLAS SkylakeX and the AVX2 kernel with OpenBLAS Zen
//    (OPENBLAS_CORETYPE=Zen, -DCTXPAR_ARCH=znver3): losses ~1e-8 relative, weights 2.5e-6,
//    i.e. a margin over 100x on either CPU;
//  - the data x context mesh: dp 2 x cp 2 equals dp 2 x cp 1;
//  - activation memory per rank falls with P.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>

#include "ctxpar/comm.h"
#include "ctxpar/model.h"
#include "model/params.h"
#include "model/transformer.h"
#include "error_text.h"
#include "model/train_support.h"

namespace ctxpar {
namespace {

constexpr double kLossRel = 1e-4;  // see the rule at the top
using test::kWeightAbs;

TrainConfig tiny_config() {
  TrainConfig c;
  c.model.layers = 2;
  c.model.dim = 32;
  c.model.heads = 4;
  c.model.kv_heads = 2;
  c.model.head_dim = 16;
  c.model.hidden = 48;
  c.seq = 64;
  c.batch = 2;
  c.steps = 20;
  c.warmup = 3;
  c.copy_len = 16;
  c.seed = 7;
  return c;
}

TEST(Transformer, GradientMatchesFiniteDifferences) {
  ModelConfig m;
  m.layers = 1;
  m.dim = 16;
  m.heads = 2;
  m.kv_heads = 1;
  m.head_dim = 16;
  m.hidden = 24;
  const int64_t t = 12, b = 2;
  std::vector<uint8_t> tokens(b * t), labels(b * t), weight(b * t);
  for (int64_t i = 0; i < b * t; ++i) {
    tokens[i] = uint8_t((i * 37 + 11) % 256);
    labels[i] = uint8_t((i * 53 + 5) % 256);
    weight[i] = i % 3 != 0;
  }
  run_threads(1, [&](Communicator& comm) {
    StrategyOptions so;
    so.mask = Mask::causal_mask();
    auto strategy = Strategy::create(comm, so);
    std::vector<int64_t> pos(t);
    for (int64_t i = 0; i < t; ++i) pos[i] = 100 + i;  // positions need not start at 0
    model::Transformer net(m, *strategy, pos, b);
    std::vector<float> w;
    model::init_params(m, w, 3);
    for (float& x : w) x *= 10.0f;  // larger weights: attention far from uniform
    auto infos = model::param_infos(m);
    std::vector<float> g(w.size(), 0.0f);
    net.forward_backward(w.data(), g.data(), tokens.data(), labels.data(), weight.data(), 20.0);
    std::vector<float> scratch(w.size());
    auto loss = [&]() {
      return net
          .forward_backward(w.data(), scratch.data(), tokens.data(), labels.data(), weight.data(),
                            20.0)
          .loss;
    };
    for (const auto& p : infos) {
      double gmax = 0;
      for (size_t i = p.offset; i < p.offset + p.numel; ++i)
        gmax = std::max(gmax, double(std::fabs(g[i])));
      const size_t stride = std::max<size_t>(1, p.numel / 7);
      for (size_t i = p.offset; i < p.offset + p.numel; i += stride) {
        const float keep = w[i], eps = 1e-3f;
        w[i] = keep + eps;
        const double up = loss();
        w[i] = keep - eps;
        const double down = loss();
        w[i] = keep;
        EXPECT_NEAR((up - down) / (2 * eps), g[i], 3e-3 * gmax + 3e-5)
            << p.name << " [" << i - p.offset << "]";
      }
    }
  });
}

struct CpCase {
  int cp;
  StrategyKind strategy;
  LayoutKind layout;
  int ulysses_degree = 0;
};

// Any --seq: 61 tokens divide by no granule here; the layout pads, padding tokens carry no
// input, label or loss, and attention ignores them: the losses are those of one rank (same
// rule as below).
TEST(ContextParallelAnyLength, PaddedSequenceSameLossesAsOneRank) {
  TrainConfig c = tiny_config();
  c.seq = 61;
  c.copy_len = 12;
  c.steps = 8;
  const test::TrainRun single = test::train_run(c, 1);
  for (CpCase cs : {CpCase{4, StrategyKind::ring, LayoutKind::zigzag},
                    CpCase{3, StrategyKind::allgather, LayoutKind::striped},
                    CpCase{2, StrategyKind::ulysses, LayoutKind::contiguous}}) {
    TrainConfig m = c;
    m.cp = cs.cp;
    m.strategy = cs.strategy;
    m.layout = cs.layout;
    const test::TrainRun multi = test::train_run(m, cs.cp);
    ASSERT_EQ(multi.losses.size(), single.losses.size());
    for (size_t s = 0; s < single.losses.size(); ++s)
      EXPECT_LE(std::fabs(multi.losses[s] - single.losses[s]), 1e-4 * std::fabs(single.losses[s]))
          << strategy_name(cs.strategy) << " cp " << cs.cp << " step " << s + 1;
  }
}

class ContextParallel : public ::testing::TestWithParam<CpCase> {};

TEST_P(ContextParallel, SameLossesAndWeightsAsOneRank) {
  static test::TrainRun single = test::train_run(tiny_config(), 1);
  const CpCase cs = GetParam();
  TrainConfig c = tiny_config();
  c.cp = cs.cp;
  c.strategy = cs.strategy;
  c.layout = cs.layout;
  c.ulysses_degree = cs.ulysses_degree;
  test::TrainRun multi = test::train_run(c, cs.cp);
  ASSERT_EQ(multi.losses.size(), single.losses.size());
  for (size_t s = 0; s < single.losses.size(); ++s)
    EXPECT_LE(std::fabs(multi.losses[s] - single.losses[s]), kLossRel * std::fabs(single.losses[s]))
        << "step " << s + 1 << ": " << multi.losses[s] << " vs " << single.losses[s];
  float worst = 0;
  for (size_t i = 0; i < single.weights.size(); ++i)
    worst = std::max(worst, std::fabs(multi.weights[i] - single.weights[i]));
  EXPECT_LE(worst, kWeightAbs);
  // The model learns something in 20 steps (the losses are not all equal by accident).
  EXPECT_LT(single.losses.back(), single.losses.front());
}

INSTANTIATE_TEST_SUITE_P(Strategies, ContextParallel,
                         ::testing::Values(CpCase{2, StrategyKind::ring, LayoutKind::zigzag},
                                           CpCase{4, StrategyKind::ring, LayoutKind::contiguous},
                                           CpCase{4, StrategyKind::ring, LayoutKind::zigzag},
                                           CpCase{2, StrategyKind::allgather,
                                                  LayoutKind::contiguous},
                                           CpCase{4, StrategyKind::allgather, LayoutKind::zigzag},
                                           CpCase{2, StrategyKind::ulysses, LayoutKind::striped},
                                           CpCase{4, StrategyKind::hybrid, LayoutKind::zigzag, 2}),
                         [](const auto& info) {
                           return std::string(strategy_name(info.param.strategy)) + "_" +
                                  layout_name(info.param.layout) + "_cp" +
                                  std::to_string(info.param.cp);
                         });

TEST(Mesh, DataTimesContextEqualsDataParallelAlone) {
  TrainConfig c = tiny_config();
  c.steps = 6;
  c.dp = 2;
  c.cp = 1;
  test::TrainRun dp_only = test::train_run(c, 2);
  c.cp = 2;
  test::TrainRun mesh = test::train_run(c, 4);
  for (size_t s = 0; s < dp_only.losses.size(); ++s)
    EXPECT_LE(std::fabs(mesh.losses[s] - dp_only.losses[s]), kLossRel * dp_only.losses[s]) << s;
  // Two data groups see different batches: not the single-group loss.
  c.dp = 1;
  c.cp = 1;
  test::TrainRun one = test::train_run(c, 1);
  EXPECT_NE(one.losses[0], dp_only.losses[0]);
}

TEST(Memory, ActivationBytesPerRankFallWithP) {
  TrainConfig c = tiny_config();
  c.seq = 256;
  c.steps = 1;
  size_t prev = 0;
  for (int p : {1, 2, 4}) {
    c.cp = p;
    test::TrainRun r = test::train_run(c, p);
    if (prev) {
      // Halving T/P halves everything the model holds; the strategy's buffers fall too.
      EXPECT_LT(double(r.peak), 0.6 * double(prev)) << "P = " << p;
    }
    prev = r.peak;
  }
}

TEST(Train, BadMeshIsRefusedOnEveryRank) {
  TrainConfig c = tiny_config();
  c.dp = 3;
  c.cp = 1;
  EXPECT_THROW(test::train_run(c, 2), Error);
}

// The library names its fields, not the command's flags (`ctxpar train` translates them back:
// train_cli_test.cc checks its users still read --dp, --layers, --log ...).
TEST(Train, LibraryMessagesNameFieldsNotFlags) {
  const auto message_of = test::error_text;
  TrainConfig c = tiny_config();
  c.dp = 3;
  const std::string mesh = message_of([&] { test::train_run(c, 2); });
  EXPECT_NE(mesh.find("TrainConfig::dp x TrainConfig::cp must equal the number of ranks"),
            std::string::npos)
      << mesh;
  c = tiny_config();
  c.model.head_dim = 8;
  const std::string model = message_of([&] { c.model.validate(); });
  EXPECT_NE(model.find("ModelConfig::head_dim must be even"), std::string::npos) << model;
  c = tiny_config();
  c.seq = 4;
  const std::string seq = message_of([&] { test::train_run(c, 1); });
  EXPECT_NE(seq.find("TrainConfig::seq must be >= 8"), std::string::npos) << seq;
  for (const std::string& m : {mesh, model, seq})
    EXPECT_EQ(m.find("--"), std::string::npos) << "names a command flag: " << m;
}

// Bytes this process has read through read(2) / pread(2) so far (/proc/self/io rchar).
uint64_t bytes_read_by_this_process() {
  std::ifstream in("/proc/self/io");
  std::string key;
  uint64_t value = 0;
  while (in >> key >> value)
    if (key == "rchar:") return value;
  return 0;
}

// --data on the threads transport: each rank reads only the sequences its steps use (T + 1
// bytes each), not the whole file (4 ranks loaded an 8 MiB file four times: 32 MiB read and
// held). Measured by the kernel's count of bytes read, independent of the loader.
TEST(Train, DataFileIsNotLoadedWholeByEveryRank) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("ctxpar_data_share_" + std::to_string(::getpid()) + ".txt"))
                               .string();
  {
    std::ofstream out(path, std::ios::binary);
    std::string chunk(1 << 20, 'x');
    for (size_t i = 0; i < chunk.size(); ++i) chunk[i] = char('a' + i * 7 % 26);
    for (int i = 0; i < 8; ++i) out << chunk;
  }
  TrainConfig c = tiny_config();
  c.data_path = path;
  c.steps = 3;
  c.cp = 4;
  const uint64_t before = bytes_read_by_this_process();
  const test::TrainRun out = test::train_run(c, 4);
  const uint64_t read = bytes_read_by_this_process() - before;
  std::filesystem::remove(path);
  ASSERT_EQ(out.losses.size(), 3u);
  // What the steps use: 4 ranks x 3 steps x batch 2 x (T + 1) bytes = 1560; allow 64 KiB for
  // anything else the process reads meanwhile. The whole file once would be 8 MiB.
  EXPECT_LT(read, uint64_t{64} << 10) << "read " << read << " bytes for 3 steps";
}

}  // namespace
}  // namespace ctxpar

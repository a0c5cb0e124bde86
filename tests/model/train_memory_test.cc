// The memory estimate that lets `ctxpar train` refuse a run before allocating it, held against
// what the model really allocates (Transformer::peak_bytes, counted from its buffers) and
// param_infos' count.
#include <gtest/gtest.h>

#include <fstream>

#include "ctxpar/comm.h"
#include "ctxpar/model.h"
#include "ctxpar/strategy_memory.h"
#include "model/params.h"
#include "model/train_support.h"

namespace ctxpar {
namespace {

TEST(TrainMemory, ParameterCountIsParamInfos) {
  TrainConfig c = test::small_train_config();
  for (int layers : {1, 3}) {
    c.model.layers = layers;
    c.model.hidden = 40 + layers;
    EXPECT_EQ(estimate_train_memory(c).params,
              double(model::param_count(model::param_infos(c.model))));
    EXPECT_EQ(estimate_train_memory(c).state, 16 * estimate_train_memory(c).params);
  }
}

// The activation estimate must not fall below what a step really holds (or the check would
// pass runs that do not fit), nor be far above it (or it would refuse runs that do).
TEST(TrainMemory, ActivationEstimateBoundsTheMeasuredPeak) {
  TrainConfig c = test::small_train_config();
  c.model.layers = 2;
  c.model.heads = 4;
  c.model.kv_heads = 2;  // ulysses and hybrid split heads over cp
  c.seq = 128;
  c.steps = 1;
  for (int cp : {2, 4}) {
    for (StrategyKind s : {StrategyKind::ring, StrategyKind::allgather, StrategyKind::ulysses,
                           StrategyKind::hybrid}) {
      c.cp = cp;
      c.strategy = s;
      const double measured = double(test::run_train(c, cp).at(0).peak_bytes_max);
      const double estimate = estimate_train_memory(c).activations;
      EXPECT_GE(estimate, measured) << strategy_name(s) << " cp " << cp;
      EXPECT_LE(estimate, 1.5 * measured) << strategy_name(s) << " cp " << cp;
    }
  }
}

// The strategy's part of the activations is the runtime's model (attention_buffer_bytes), not
// a multiple of its own: two strategies' estimates differ by exactly the model's difference.
TEST(TrainMemory, StrategyTermIsTheLibrarysModel) {
  TrainConfig c = test::small_train_config();
  c.model.heads = 4;
  c.model.kv_heads = 2;
  c.seq = 128;
  c.cp = 4;
  auto model = [&](StrategyKind kind) {
    StrategyOptions o;
    o.kind = kind;
    o.mask = Mask::causal_mask();
    o.kernel.threads = c.threads;
    AttentionDims d;
    d.batch = c.batch, d.seq = c.seq;
    d.heads = c.model.heads, d.kv_heads = c.model.kv_heads, d.head_dim = c.model.head_dim;
    return std::max(attention_buffer_bytes(o, d, c.cp, AttentionPass::forward),
                    attention_buffer_bytes(o, d, c.cp, AttentionPass::backward));
  };
  c.strategy = StrategyKind::ring;
  const double ring = estimate_train_memory(c).activations;
  c.strategy = StrategyKind::ulysses;
  const double ulysses = estimate_train_memory(c).activations;
  EXPECT_DOUBLE_EQ(ulysses - ring, model(StrategyKind::ulysses) - model(StrategyKind::ring));
}

// The checkpoint is read whole while loading; the --data file is not held (each step reads
// its own sequences), so it adds nothing.
TEST(TrainMemory, CheckpointFileIsCountedDataFileIsNot) {
  TrainConfig c = test::small_train_config();
  const double without = estimate_train_memory(c).data;
  const std::string file = ::testing::TempDir() + "ctxpar_memory_data.bin";
  std::ofstream(file, std::ios::binary) << std::string(1 << 20, 'x');
  c.data_path = file;
  EXPECT_EQ(estimate_train_memory(c).data, without);
  c.resume_path = file;
  EXPECT_EQ(estimate_train_memory(c).data, without + (1 << 20));
  std::remove(file.c_str());
}

TEST(TrainMemory, TooBigARunIsRefusedWithTheFigureAndWhatToLower) {
  TrainConfig c = test::small_train_config();
  const double gib = double(1ull << 30);
  MemoryLimit limit;
  limit.bytes = 16 * gib;
  limit.source = MemorySource::meminfo;
  EXPECT_NO_THROW(check_train_memory(c, 4, limit));
  EXPECT_NO_THROW(check_train_memory(c, 4, MemoryLimit{}));  // unknown: no check
  c.model.layers = 100000;  // ~4e9 parameters: 16 bytes each, per rank
  try {
    check_train_memory(c, 4, limit);
    FAIL() << "not refused";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("but the machine's available memory (MemAvailable in /proc/meminfo) leaves "
                     "16.0 GiB; free memory on this machine"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("(4 rank(s) on this machine,"), std::string::npos) << m;
    EXPECT_NE(m.find("lower ModelConfig::layers"), std::string::npos) << m;
    EXPECT_EQ(m.find("--"), std::string::npos) << "a library message names no command flag: " << m;
  }
  EXPECT_TRUE(memory_limit().known()) << "no memory limit read (not even /proc/meminfo)";
}

}  // namespace
}  // namespace ctxpar

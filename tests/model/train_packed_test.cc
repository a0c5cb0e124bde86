// Training on packed documents (TrainConfig::separator, `ctxpar train --data F --separator B`):
//  - against an independent reference: at step 1 (the initial weights) the one-rank packed loss
//    is the mean, over the predicted tokens, of the losses of each document run ALONE through
//    the model (its own sequence, positions from 0, a plain causal mask, no separator target),
//    and the first AdamW update from the sum of those documents' gradients gives the packed
//    run's weights;
//  - context parallelism changes nothing: 2 and 3 ranks, layouts balanced (re-solved for every
//    window's documents) and zigzag, give the one-rank losses and weights after 3 steps;
//  - refusals, before any step: a separator outside the vocabulary, a separator without a data
//    file, with batch > 1 or with a gradient dump, the balanced layout without documents.
// Tolerances: the runs compared differ only in the order of fp32 additions (attention tiles,
// the gradient all-reduce). Losses: the project's rule, reference::accuracy_tolerance
// (ctxpar/reference.h), at its strictest (naive error 0): 1e-5 max(1, |ref|); measured ~1e-9.
// Weights: the trainer tests' rule test::kWeightAbs = 5e-4 (train_support.h): AdamW divides
// the gradient by its own size, so a weight whose gradient is nearly 0 moves by noise;
// measured 1.5e-6 (AVX-512) and 3.3e-6 (CTXPAR_SIMD=avx2 OPENBLAS_CORETYPE=Zen) after 3
// steps, while every wiring fault tried moved weights by 3e-3 to 1e-2.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "ctxpar/comm.h"
#include "ctxpar/model.h"
#include "ctxpar/reference.h"
#include "model/train_support.h"
#include "model/training.h"
#include "model/transformer.h"

namespace ctxpar {
namespace {

constexpr int kSeparator = 10;  // one document a line
constexpr int64_t kSeq = 256;

// Long-tailed documents of random letters, each ended by the separator: one of 150 tokens
// (split over ranks), mid-sized and short ones, an empty line (a lone separator), enough for
// `windows` training windows of kSeq + 1 bytes.
std::string packed_documents(int64_t windows) {
  std::mt19937 rng(37);
  const int64_t lengths[] = {150, 3, 40, 0, 20, 9, 33, 1, 70, 5, 12, 0, 60, 7, 25};
  std::string bytes;
  for (size_t d = 0; int64_t(bytes.size()) < windows * kSeq + 1; ++d) {
    for (int64_t i = 0; i < lengths[d % std::size(lengths)]; ++i)
      bytes.push_back(char('a' + rng() % 26));
    bytes.push_back(char(kSeparator));
  }
  bytes.resize(windows * kSeq + 1);
  return bytes;
}

class PackedTraining : public test::TempDirTest {
 protected:
  TrainConfig config(int64_t steps) {
    const std::string bytes = packed_documents(steps);
    std::ofstream(path("docs.txt"), std::ios::binary) << bytes;
    bytes_ = bytes;
    TrainConfig c = test::small_train_config();
    c.seq = kSeq;
    c.batch = 1;
    c.steps = steps;
    c.data_path = path("docs.txt");
    c.separator = kSeparator;
    return c;
  }
  std::string bytes_;
};

void expect_same_weights(const std::vector<float>& ours, const std::vector<float>& ref,
                         const std::string& what) {
  ASSERT_EQ(ours.size(), ref.size()) << what;
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i)
    worst = std::max(worst, std::fabs(double(ours[i]) - double(ref[i])));
  EXPECT_LE(worst, test::kWeightAbs) << what;
}

// Step 1 of the one-rank packed run, recomputed one document at a time from the file's first
// kSeq + 1 bytes (the first window: DataSource reads window i at step i + 1).
TEST_F(PackedTraining, OneRankLossIsTheMeanOverDocumentsRunAlone) {
  const TrainConfig c = config(1);
  const test::TrainRun packed = test::train_run(c, 1);
  ASSERT_EQ(packed.losses.size(), 1u);

  std::vector<float> weights;
  model::init_params(c.model, weights, c.seed);
  std::vector<float> grads(weights.size(), 0.0f);
  int64_t predicted = 0;  // every input but a separator predicts its next byte
  for (int64_t p = 0; p < kSeq; ++p) predicted += bytes_[p] != char(kSeparator);
  double loss = 0;
  run_threads(1, [&](Communicator& comm) {
    StrategyOptions so;
    so.mask = Mask::causal_mask();
    auto strategy = Strategy::create(comm, so);
    for (int64_t start = 0, end = 0; start < kSeq; start = end) {
      end = start;  // the document is [start, end): up to and with its separator
      while (end < kSeq && bytes_[end] != char(kSeparator)) ++end;
      end = std::min(end + 1, kSeq);
      const int64_t n = end - start;
      std::vector<int64_t> positions(n);
      std::vector<uint8_t> tokens(n), labels(n), weight(n);
      for (int64_t i = 0; i < n; ++i) {
        positions[i] = i;
        tokens[i] = uint8_t(bytes_[start + i]);
        labels[i] = uint8_t(bytes_[start + i + 1]);
        weight[i] = tokens[i] != kSeparator;
      }
      model::Transformer net(c.model, *strategy, positions, 1);
      loss += net.forward_backward(weights.data(), grads.data(), tokens.data(), labels.data(),
                                   weight.data(), double(predicted))
                  .loss;
    }
  });
  EXPECT_LE(std::fabs(packed.losses[0] - loss), reference::accuracy_tolerance(0.0, loss))
      << "packed " << packed.losses[0] << ", documents alone " << loss;
  // The first update from the documents' summed gradient: what the trainer does after it.
  model::AdamState adam;
  model::clip_grad_norm(grads, c.clip);
  model::adamw_update(weights, grads, adam, model::param_infos(c.model), c,
                      model::learning_rate(c, 1));
  expect_same_weights(packed.weights, weights, "weights after step 1");
}

// The window cut into documents, against the bytes read directly: a token's document is the
// number of separators before it, its RoPE position the distance from the last one (0 at a
// document's start), and a separator predicts nothing (its label starts the next document).
// (RoPE is relative, so under the documents mask the restart leaves the losses above equal
// to rounding: it is checked here, where the positions are made.)
TEST_F(PackedTraining, WindowIsCutAfterEachSeparator) {
  const TrainConfig c = config(1);
  const model::DataSource data(c);
  const model::Batch batch = data.batch(1, 0);
  ASSERT_EQ(batch.documents.size(), size_t(kSeq));
  ASSERT_EQ(batch.document_positions.size(), size_t(kSeq));
  int64_t counted = 0;
  for (int64_t p = 0; p < kSeq; ++p) {
    const std::string before = bytes_.substr(0, p);
    const size_t last = before.rfind(char(kSeparator));
    const int64_t start = last == std::string::npos ? 0 : int64_t(last) + 1;
    EXPECT_EQ(batch.documents[p], std::count(before.begin(), before.end(), char(kSeparator))) << p;
    EXPECT_EQ(batch.document_positions[p], p - start) << p;
    EXPECT_EQ(batch.weight[p], bytes_[p] != char(kSeparator)) << p;
    EXPECT_EQ(batch.labels[p], uint8_t(bytes_[p + 1])) << p;
    counted += bytes_[p] != char(kSeparator);
  }
  EXPECT_EQ(batch.counted, counted);
  // 150 + 1, 3 + 1, 40 + 1, a lone separator, 20 + 1, 9 + 1 tokens, then the seventh's head.
  EXPECT_EQ(batch.documents.back(), 6);
}

struct PackedCase {
  int cp;
  StrategyKind strategy;
  LayoutKind layout;
};

TEST_F(PackedTraining, ContextParallelGivesTheOneRankLossesAndWeights) {
  const TrainConfig c = config(3);
  const test::TrainRun single = test::train_run(c, 1);
  ASSERT_EQ(single.losses.size(), 3u);
  for (const PackedCase pc : {PackedCase{2, StrategyKind::ring, LayoutKind::balanced},
                              PackedCase{3, StrategyKind::ring, LayoutKind::balanced},
                              PackedCase{3, StrategyKind::ring, LayoutKind::zigzag},
                              PackedCase{2, StrategyKind::allgather, LayoutKind::balanced}}) {
    TrainConfig m = c;
    m.cp = pc.cp;
    m.strategy = pc.strategy;
    m.layout = pc.layout;
    const std::string what = std::string(strategy_name(pc.strategy)) + " " +
                             layout_name(pc.layout) + " cp " + std::to_string(pc.cp);
    const test::TrainRun multi = test::train_run(m, pc.cp);
    ASSERT_EQ(multi.losses.size(), single.losses.size()) << what;
    for (size_t s = 0; s < single.losses.size(); ++s)
      EXPECT_LE(std::fabs(multi.losses[s] - single.losses[s]),
                reference::accuracy_tolerance(0.0, std::fabs(single.losses[s])))
          << what << " step " << s + 1;
    expect_same_weights(multi.weights, single.weights, what);
  }
}

TEST_F(PackedTraining, BadSeparatorsAndLayoutsAreRefusedBeforeAnyStep) {
  const TrainConfig good = config(1);
  const struct {
    std::function<void(TrainConfig&)> change;
    std::string message;
  } cases[] = {
      {[](TrainConfig& c) { c.separator = 256; },
       "TrainConfig::separator 256 is not a token id: the vocabulary is 0..255"},
      {[](TrainConfig& c) { c.separator = -2; }, "TrainConfig::separator -2 is not a token id"},
      {[](TrainConfig& c) { c.data_path.clear(); },
       "TrainConfig::separator needs TrainConfig::data_path"},
      {[](TrainConfig& c) { c.batch = 2; },
       "TrainConfig::separator needs TrainConfig::batch 1, got 2"},
      {[](TrainConfig& c) {
         c.separator = -1;
         c.layout = LayoutKind::balanced;
       },
       "TrainConfig::layout balanced balances the work of packed documents and needs "
       "TrainConfig::separator"},
      {[&](TrainConfig& c) { c.dump_path = path("grads.safetensors"); },
       "TrainConfig::dump_path writes a plain causal batch"},
  };
  for (const auto& k : cases) {
    TrainConfig c = good;
    c.cp = 2;
    c.log_path = path("refused.jsonl");
    k.change(c);
    const std::string error = test::train_error(c, 2);
    EXPECT_NE(error.find(k.message), std::string::npos) << error;
    EXPECT_FALSE(std::filesystem::exists(c.log_path)) << k.message << ": a step ran";
    EXPECT_FALSE(std::filesystem::exists(path("grads.safetensors"))) << k.message;
  }
}

}  // namespace
}  // namespace ctxpar

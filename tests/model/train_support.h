// What the training tests share: a small config that trains in milliseconds, running it on
// the threads transport, and a fresh folder per test.
#pragma once
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "ctxpar/model.h"

namespace ctxpar::test {

// P ranks against one rank after a few AdamW steps: the runs differ only in the order of fp32
// additions, and AdamW (which normalises the gradient) turns that noise into at most this much
// per weight, a fraction of one step of lr = 3e-3 (derivation and the margins measured on
// AVX-512 + OpenBLAS SkylakeX and AVX2 + OpenBLAS Zen: the top of train_test.cc).
constexpr float kWeightAbs = 5e-4f;

// 1 block, C = 32, T = 32, B = 2, 10 steps.
TrainConfig small_train_config();
// Rank 0's step records.
std::vector<StepRecord> run_train(const TrainConfig& c, int ranks,
                                  const std::function<void(const StepRecord&)>& on_step = {});
// Rank 0's whole result (steps and final weights).
TrainResult train_rank0(const TrainConfig& c, int ranks);
// Rank 0's losses, final weights and last step's peak bytes (the most of any rank).
struct TrainRun {
  std::vector<double> losses;
  std::vector<float> weights;
  size_t peak = 0;
};
TrainRun train_run(const TrainConfig& c, int ranks);
// The ctxpar::Error message of the run ("" when it succeeds).
std::string train_error(const TrainConfig& c, int ranks);

// A fresh folder per test, removed afterwards.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::filesystem::path dir_;
};

}  // namespace ctxpar::test

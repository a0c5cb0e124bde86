#include "model/train_support.h"

#include <unistd.h>

#include <mutex>

#include "ctxpar/comm.h"

namespace ctxpar::test {

namespace fs = std::filesystem;

TrainConfig small_train_config() {
  TrainConfig c;
  c.model.layers = 1;
  c.model.dim = 32;
  c.model.heads = 2;
  c.model.kv_heads = 1;
  c.model.head_dim = 16;
  c.model.hidden = 40;
  c.seq = 32;
  c.batch = 2;
  c.steps = 10;
  c.warmup = 2;
  c.copy_len = 8;
  return c;
}

std::vector<StepRecord> run_train(const TrainConfig& c, int ranks,
                                  const std::function<void(const StepRecord&)>& on_step) {
  std::vector<StepRecord> out;
  std::mutex mu;
  run_threads(ranks, [&](Communicator& comm) {
    TrainResult r = train(comm, c, comm.rank() == 0 ? on_step : nullptr);
    std::lock_guard<std::mutex> lock(mu);
    if (comm.rank() == 0) out = r.steps;
  });
  return out;
}

TrainResult train_rank0(const TrainConfig& c, int ranks) {
  TrainResult out;
  std::mutex mu;
  run_threads(ranks, [&](Communicator& comm) {
    TrainResult r = train(comm, c);
    std::lock_guard<std::mutex> lock(mu);
    if (comm.rank() == 0) out = std::move(r);
  });
  return out;
}

TrainRun train_run(const TrainConfig& c, int ranks) {
  const TrainResult r = train_rank0(c, ranks);
  TrainRun out{{}, r.weights, r.steps.empty() ? 0 : r.steps.back().peak_bytes_max};
  for (const auto& s : r.steps) out.losses.push_back(s.loss);
  return out;
}

std::string train_error(const TrainConfig& c, int ranks) {
  try {
    run_train(c, ranks);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void TempDirTest::SetUp() {
  dir_ =
      fs::temp_directory_path() / ("ctxpar_model_" + std::to_string(::getpid()) + "_" +
                                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::remove_all(dir_);
  fs::create_directories(dir_);
}

void TempDirTest::TearDown() { fs::remove_all(dir_); }

}  // namespace ctxpar::test

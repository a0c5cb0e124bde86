// Checkpoints: a resumed run continues with exactly the losses of an uninterrupted one; a
// truncated checkpoint, or one from another model config, is refused with a clear message;
// the file is valid safetensors (header length, JSON, 8-byte aligned data).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <mutex>

#include "ctxpar/comm.h"
#include "ctxpar/model.h"
#include "model/training.h"

namespace ctxpar {
namespace {

namespace fs = std::filesystem;

TrainConfig small() {
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

std::vector<StepRecord> run(const TrainConfig& c, int ranks,
                            const std::function<void(const StepRecord&)>& on_step = {}) {
  std::vector<StepRecord> out;
  std::mutex mu;
  run_threads(ranks, [&](Communicator& comm) {
    TrainResult r = train(comm, c, comm.rank() == 0 ? on_step : nullptr);
    std::lock_guard<std::mutex> lock(mu);
    if (comm.rank() == 0) out = r.steps;
  });
  return out;
}

std::string error_of(const TrainConfig& c, int ranks) {
  try {
    run(c, ranks);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

class Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("ctxpar_ckpt_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

TEST_F(Checkpoint, ResumeGivesTheLossesOfAnUninterruptedRun) {
  TrainConfig c = small();
  c.cp = 2;
  const auto whole = run(c, 2);
  // Same run, checkpointing every 4 steps; keep a copy of the step-4 file.
  c.save_path = path("ck.safetensors");
  c.save_every = 4;
  const auto saved = run(c, 2, [&](const StepRecord& r) {
    if (r.step == 4) fs::copy_file(c.save_path, path("ck4.safetensors"));
  });
  ASSERT_EQ(saved.size(), whole.size());
  for (size_t i = 0; i < whole.size(); ++i) EXPECT_EQ(saved[i].loss, whole[i].loss) << i;
  // Resume on another number of ranks (weights are replicated; the mesh may change).
  TrainConfig r = small();
  r.resume_path = path("ck4.safetensors");
  const auto resumed = run(r, 1);
  ASSERT_EQ(resumed.size(), 6u);
  EXPECT_EQ(resumed.front().step, 5);
  for (size_t i = 0; i < resumed.size(); ++i)
    // Another mesh changes only the order of fp32 additions: the rule of train_test.cc (1e-4
    // relative per loss; measured ~1e-9 on both AVX2 and AVX-512 kernels).
    EXPECT_NEAR(resumed[i].loss, whole[4 + i].loss, 1e-4 * whole[4 + i].loss) << "step " << 5 + i;
  r.cp = 2;
  const auto resumed2 = run(r, 2);
  for (size_t i = 0; i < resumed2.size(); ++i)
    EXPECT_EQ(resumed2[i].loss, whole[4 + i].loss) << "same mesh: bitwise, step " << 5 + i;
}

TEST_F(Checkpoint, TruncatedFileIsRefused) {
  TrainConfig c = small();
  c.steps = 2;
  c.save_path = path("ck.safetensors");
  run(c, 1);
  const auto size = fs::file_size(c.save_path);
  for (auto cut : {size - 4, size / 2, uintmax_t(5)}) {
    fs::copy_file(c.save_path, path("cut.safetensors"), fs::copy_options::overwrite_existing);
    fs::resize_file(path("cut.safetensors"), cut);
    TrainConfig r = small();
    r.resume_path = path("cut.safetensors");
    const std::string e = error_of(r, 1);
    EXPECT_NE(e.find("truncated"), std::string::npos) << "cut at " << cut << ": " << e;
  }
  EXPECT_FALSE(fs::exists(c.save_path + ".tmp"));
}

TEST_F(Checkpoint, OtherModelConfigIsRefused) {
  TrainConfig c = small();
  c.steps = 1;
  c.save_path = path("ck.safetensors");
  run(c, 1);
  TrainConfig r = small();
  r.model.dim = 48;
  r.resume_path = c.save_path;
  const std::string e = error_of(r, 1);
  EXPECT_NE(e.find("another model config"), std::string::npos) << e;
  EXPECT_NE(e.find("dim=32"), std::string::npos) << e;
  EXPECT_NE(e.find("dim=48"), std::string::npos) << e;
}

TEST_F(Checkpoint, FileIsSafetensorsWithAlignedData) {
  TrainConfig c = small();
  c.steps = 1;
  c.save_path = path("ck.safetensors");
  run(c, 1);
  std::ifstream in(c.save_path, std::ios::binary);
  uint8_t len_le[8];
  in.read(reinterpret_cast<char*>(len_le), 8);
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= uint64_t(len_le[i]) << (8 * i);
  EXPECT_EQ(len % 8, 0u);
  std::string header(len, '\0');
  in.read(header.data(), std::streamsize(len));
  EXPECT_EQ(header.front(), '{');
  EXPECT_NE(header.find("\"layers.0.wq\""), std::string::npos);
  EXPECT_NE(header.find("\"adam.v.final_norm\""), std::string::npos);
  auto f = model::read_safetensors(c.save_path);
  EXPECT_EQ(f.metadata["step"], "1");
  EXPECT_EQ(f.tensors.at("embed").shape, (std::vector<int64_t>{256, 32}));
}

}  // namespace
}  // namespace ctxpar

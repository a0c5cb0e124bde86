// Checkpoints: a resumed run continues with exactly the losses of an uninterrupted one; a
// truncated checkpoint, or one from another model config, is refused with a clear message;
// the file is valid safetensors (header length, JSON, 8-byte aligned data); the writer never
// writes through a planted link, and concurrent writers of one path leave one whole file.
// Crafted and corrupt files: checkpoint_file_test.cc.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <cstring>
#include <thread>

#include "ctxpar/comm.h"
#include "ctxpar/model.h"
#include "model/train_support.h"
#include "model/training.h"

namespace ctxpar {
namespace {

namespace fs = std::filesystem;
using test::small_train_config;
using Checkpoint = test::TempDirTest;

std::vector<StepRecord> run(const TrainConfig& c, int ranks,
                            const std::function<void(const StepRecord&)>& on_step = {}) {
  return test::run_train(c, ranks, on_step);
}
std::string error_of(const TrainConfig& c, int ranks) { return test::train_error(c, ranks); }
TrainConfig small() { return small_train_config(); }

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

// A checkpoint already at --steps (or past it): nothing is trained, and the result says so
// (no step records) rather than reporting a loss.
TEST_F(Checkpoint, ResumeAtOrPastStepsTrainsNothing) {
  TrainConfig c = small();
  c.steps = 3;
  c.save_path = path("ck.safetensors");
  run(c, 1);
  for (int64_t steps : {3, 2}) {
    TrainConfig r = small();
    r.steps = steps;
    r.resume_path = c.save_path;
    TrainResult result;
    run_threads(1, [&](Communicator& comm) { result = train(comm, r); });
    EXPECT_TRUE(result.steps.empty()) << "--steps " << steps;
    EXPECT_EQ(result.first_step, 4) << "--steps " << steps;
  }
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
  for (const auto& e : fs::directory_iterator(dir_))  // no temporary left behind
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << e.path();
}

// A link planted where a predictable temporary name would be: the writer must neither write
// through it nor fail because of it.
TEST_F(Checkpoint, LinkPlantedAtTheTemporaryNameIsNotFollowed) {
  const std::string victim = path("victim.txt");
  std::ofstream(victim) << "precious";
  TrainConfig c = small();
  c.steps = 2;
  c.save_path = path("ck.safetensors");
  fs::create_symlink(victim, c.save_path + ".tmp");
  run(c, 1);
  std::ifstream in(victim);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(text == "precious") << "the link's target was overwritten (" << text.size()
                                  << " bytes now)";
  EXPECT_TRUE(fs::is_symlink(c.save_path + ".tmp"));
  EXPECT_EQ(model::read_safetensors(c.save_path).metadata.at("step"), "2");
}

// Two writers of one path (two runs with the same --save): every save succeeds, and the file
// is always one writer's whole checkpoint, never a mix.
TEST_F(Checkpoint, ConcurrentWritersOfOnePathLeaveOneWholeFile) {
  const std::string target = path("ck.safetensors");
  const size_t n = 64 * 1024;  // floats per writer: big enough that writes interleave
  std::vector<std::vector<float>> payload = {std::vector<float>(n, 1.0f),
                                             std::vector<float>(n, 2.0f)};
  std::vector<std::string> errors(2);
  std::vector<std::thread> writers;
  for (int w = 0; w < 2; ++w)
    writers.emplace_back([&, w] {
      try {
        for (int i = 0; i < 20; ++i)
          model::write_safetensors(target, {{"x", "F32", {int64_t(n)}, payload[w].data(), n * 4}},
                                   {{"writer", std::to_string(w)}});
      } catch (const std::exception& e) {
        errors[w] = e.what();
      }
    });
  for (auto& t : writers) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  const auto f = model::read_safetensors(target);  // checks ranges and the checksum
  EXPECT_TRUE(f.checksummed);
  const int w = std::stoi(f.metadata.at("writer"));
  const auto& bytes = f.tensors.at("x").bytes;
  ASSERT_EQ(bytes.size(), n * 4);
  EXPECT_EQ(std::memcmp(bytes.data(), payload[w].data(), n * 4), 0) << "a mix of both writers";
  for (const auto& e : fs::directory_iterator(dir_))
    EXPECT_EQ(e.path().filename(), "ck.safetensors") << "left behind";
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

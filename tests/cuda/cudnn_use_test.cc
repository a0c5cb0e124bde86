// Whether the cuda device uses cuDNN (src/cuda/cudnn_use.h), on the CPU: the version floor
// against the versions that matter (torch 2.11's 9.17 on the GPU machine, this venv's 9.26,
// the known-bad 9.10.0 / 9.10.1, cuDNN 8), CTXPAR_CUDNN, the one line printed when cuDNN is
// off, and the factory's choice without a GPU.
#include <gtest/gtest.h>

#include <cstdlib>

#include "ctxpar/error.h"
#include "cuda/api.h"
#include "cuda/cuda_device.h"  // CudnnAttention, complete with or without the CUDA headers
#include "cuda/cudnn_use.h"

namespace ctxpar::cuda {
namespace {

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(CudnnUse, VersionNames) {
  EXPECT_EQ(cudnn_version_name(91700), "9.17.0");
  EXPECT_EQ(cudnn_version_name(92600), "9.26.0");
  EXPECT_EQ(cudnn_version_name(91002), "9.10.2");
  EXPECT_EQ(cudnn_version_name(8907), "8.9.7");
}

// The rule: cuDNN 9 >= kMinCudnn (9.10.2), the oldest the fused calls take; not the headers'
// version (9.19 here), which refused the GPU machine's 9.17.
TEST(CudnnUse, VersionFloorAcceptsTorchsCudnnAndRefusesOlderNamingBoth) {
  EXPECT_EQ(kMinCudnn, 91002);
  for (int64_t ok : {91700, 91900, 92600, 91002, 91400})
    EXPECT_EQ(cudnn_version_refusal(ok), "") << ok;
  for (int64_t bad : {91000, 91001}) {
    const std::string why = cudnn_version_refusal(bad);
    EXPECT_TRUE(has(why, "cuDNN " + cudnn_version_name(bad))) << why;
    EXPECT_TRUE(has(why, "known bf16 SDPA defects")) << why;
    EXPECT_TRUE(has(why, ">= 9.10.2")) << why;
  }
  for (int64_t old : {90900, 90600, 90000, 8907}) {
    const std::string why = cudnn_version_refusal(old);
    EXPECT_TRUE(has(why, "reports cuDNN " + cudnn_version_name(old))) << why;
    EXPECT_TRUE(has(why, "need cuDNN 9 >= 9.10.2")) << why;
    EXPECT_TRUE(has(why, "CTXPAR_CUDNN=off")) << why;  // a way on without it
  }
  EXPECT_TRUE(has(cudnn_version_refusal(100100), "not a cuDNN 9"));
}

TEST(CudnnUse, ModeFromTheEnvironmentValue) {
  EXPECT_EQ(parse_cudnn_mode(nullptr), CudnnMode::automatic);
  EXPECT_EQ(parse_cudnn_mode(""), CudnnMode::automatic);
  EXPECT_EQ(parse_cudnn_mode("auto"), CudnnMode::automatic);
  EXPECT_EQ(parse_cudnn_mode("off"), CudnnMode::off);
  EXPECT_EQ(parse_cudnn_mode("require"), CudnnMode::require);
  try {
    parse_cudnn_mode("on");
    FAIL() << "CTXPAR_CUDNN=on accepted";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_TRUE(has(m, "CTXPAR_CUDNN='on'") && has(m, "off") && has(m, "require")) << m;
  }
}

TEST(CudnnUse, NoteOncePrintsOncePerTopic) {
  ::testing::internal::CaptureStderr();
  EXPECT_TRUE(note_once("cudnn_use_test topic", "first"));
  EXPECT_FALSE(note_once("cudnn_use_test topic", "second"));
  EXPECT_TRUE(note_once("cudnn_use_test other", "third"));
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "ctxpar: first\nctxpar: third\n");
}

// The factory's choice (cudnn_of_mode) where cuDNN cannot be used (no GPU here: cudnnCreate
// fails, or no libcudnn, or no frontend in this build): off and auto run without it, saying
// why in cudnn_state() and once on stderr; require refuses naming CTXPAR_CUDNN and the reason.
class CudnnModeEnv : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (device_count(&why) > 0) GTEST_SKIP() << "this machine has a GPU: cuDNN may load";
  }
  void TearDown() override { unsetenv("CTXPAR_CUDNN"); }
};

TEST_F(CudnnModeEnv, OffAutoAndRequireWithoutAUsableCudnn) {
  setenv("CTXPAR_CUDNN", "off", 1);
  EXPECT_EQ(cudnn_of_mode(), nullptr);
  EXPECT_EQ(cudnn_state().off_reason, "CTXPAR_CUDNN=off");
  EXPECT_TRUE(cudnn_state().version.empty());

  unsetenv("CTXPAR_CUDNN");
  EXPECT_EQ(cudnn_of_mode(), nullptr);
  const CudnnState state = cudnn_state();
  EXPECT_TRUE(state.known);
  EXPECT_FALSE(state.off_reason.empty());
  EXPECT_NE(state.off_reason, "CTXPAR_CUDNN=off");

  setenv("CTXPAR_CUDNN", "require", 1);
  try {
    cudnn_of_mode();
    FAIL() << "CTXPAR_CUDNN=require went on without cuDNN";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_TRUE(has(m, "CTXPAR_CUDNN=require, but cuDNN cannot be used: " + state.off_reason)) << m;
  }
  setenv("CTXPAR_CUDNN", "sometimes", 1);
  EXPECT_THROW(cudnn_of_mode(), Error);
}

}  // namespace
}  // namespace ctxpar::cuda

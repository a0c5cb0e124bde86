// Presets against their published specifications.
#include <gtest/gtest.h>

#include "ctxpar/error.h"
#include "ctxpar/plan.h"

namespace ctxpar {
namespace {

// Parameter counts as the model cards publish them (Hugging Face safetensors totals): our
// count from the shapes must agree to 0.01%, which checks every preset field at once.
TEST(Presets, ParameterCountsMatchTheModelCards) {
  struct Case {
    const char* name;
    double params;
  } cases[] = {
      {"llama3-8b", 8'030'261'248.0},      // Meta-Llama-3-8B
      {"llama3-70b", 70'553'706'496.0},    // Meta-Llama-3-70B
      {"llama3-405b", 405'853'388'800.0},  // Meta-Llama-3.1-405B
      {"lwm-7b", 6'738'415'616.0},         // LLaMA-2-7B, the LWM-7B shape
  };
  for (const auto& c : cases) {
    const ModelSpec m = model_preset(c.name);
    EXPECT_NEAR(m.params() / c.params, 1.0, 1e-4) << c.name << ": " << m.params();
  }
}

TEST(Presets, LlamaShapes) {
  const ModelSpec m = model_preset("llama3-70b");
  EXPECT_EQ(m.layers, 80);
  EXPECT_EQ(m.heads, 64);
  EXPECT_EQ(m.kv_heads, 8);
  EXPECT_EQ(m.head_dim, 128);
  EXPECT_EQ(model_preset("lwm-7b").kv_heads, 32);  // LLaMA-2-7B has no GQA
}

TEST(Presets, HardwareFigures) {
  // Ring Attention (Liu et al. 2023) Table 2 hosts: A100 312 TFLOP/s with NVLink 300 GB/s or
  // InfiniBand 12.5 GB/s; TPU v4 275 TFLOP/s with 268 GB/s.
  EXPECT_DOUBLE_EQ(hardware_preset("a100-nvlink").flops, 312e12);
  EXPECT_DOUBLE_EQ(hardware_preset("a100-nvlink").intra.gbytes_per_second, 300);
  EXPECT_DOUBLE_EQ(hardware_preset("a100-infiniband").inter.gbytes_per_second, 12.5);
  EXPECT_EQ(hardware_preset("a100-infiniband").devices_per_node, 1);
  EXPECT_DOUBLE_EQ(hardware_preset("tpu-v4").flops, 275e12);
  EXPECT_DOUBLE_EQ(hardware_preset("h200").mem_gb, 141);
  for (const auto& name : hardware_preset_names()) {
    if (name == "local") continue;
    const HardwareSpec h = hardware_preset(name);
    EXPECT_GT(h.flops, 0) << name;
    EXPECT_GE(h.intra.gbytes_per_second, h.inter.gbytes_per_second) << name;
  }
}

TEST(Presets, UnknownNamesListTheValidOnes) {
  try {
    model_preset("llama4");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("llama3-8b"), std::string::npos) << e.what();
  }
  try {
    hardware_preset("a200");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("h100"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("local"), std::string::npos) << e.what();
  }
}

// One hour of video at 1 fps and 256 tokens per frame (LWM's VQGAN tokens) is 921,600 tokens.
TEST(Presets, VideoTokens) {
  EXPECT_EQ(video_tokens(1, 1, 256), 921600);
  EXPECT_EQ(video_tokens(0.5, 2, 256), 921600);
  EXPECT_THROW(video_tokens(0, 1, 256), Error);
  EXPECT_THROW(video_tokens(1, -1, 256), Error);
}

// frames x tokens per frame wrapped int64 (signed overflow): 488671.83456713834 h at 1e4 fps
// is 2^44 + 1 frames, and (2^44 + 1) x 2^20 = 2^64 + 2^20 came out as 2^20 tokens. Now refused
// naming the arguments (the command names its flags: cli_io NumberRanges); a product that
// fits is still exact.
TEST(Presets, VideoTokensRefusesAProductPastInt64) {
  try {
    const int64_t t = video_tokens(488671.83456713834, 1e4, int64_t{1} << 20);
    FAIL() << "no throw: " << t << " tokens";
  } catch (const Error& e) {
    const std::string m = e.what();
    for (const char* name : {"hours", "fps", "tokens_per_frame", "int64"})
      EXPECT_NE(m.find(name), std::string::npos) << m;
  }
  EXPECT_THROW(video_tokens(1e300, 1, 1), Error);  // frames alone past int64
  // 2^43 frames (2443359.1728356917 h at 1 fps) x 2^19 = 2^62: fits.
  EXPECT_EQ(video_tokens(8796093022208.0 / 3600, 1, int64_t{1} << 19), int64_t{1} << 62);
}

}  // namespace
}  // namespace ctxpar

// Model and hardware presets, from published specifications (sources in docs/plan.md, "Presets").
#include <cmath>
#include <map>

#include "ctxpar/error.h"
#include "ctxpar/plan.h"

namespace ctxpar {

double ModelSpec::layer_params() const {
  double h = static_cast<double>(hidden);
  double q = static_cast<double>(heads) * head_dim, kv = static_cast<double>(kv_heads) * head_dim;
  double attention = h * q + 2 * h * kv + q * h;  // Wq, Wk, Wv, Wo (no biases in LLaMA)
  double mlp = 3 * h * static_cast<double>(ffn);  // SwiGLU: gate, up, down
  return attention + mlp + 2 * h;                 // two RMSNorm gains
}

double ModelSpec::params() const {
  // Untied input embedding and LM head, plus the final norm.
  return layers * layer_params() + 2.0 * vocab * hidden + hidden;
}

namespace {

ModelSpec llama(const char* name, int64_t layers, int64_t hidden, int64_t heads, int64_t kv,
                int64_t ffn, int64_t vocab) {
  ModelSpec m;
  m.name = name;
  m.layers = layers;
  m.hidden = hidden;
  m.heads = heads;
  m.kv_heads = kv;
  m.head_dim = hidden / heads;
  m.ffn = ffn;
  m.vocab = vocab;
  return m;
}

// Llama 3 herd paper (Dubey et al. 2024, Table 3) and the released configs; LWM-7B is the
// LLaMA-2-7B shape (Touvron et al. 2023; Liu et al. 2024, "World Model on Million-Length
// Video and Language with Blockwise RingAttention").
const std::map<std::string, ModelSpec>& models() {
  static const std::map<std::string, ModelSpec> m = {
      {"llama3-8b", llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256)},
      {"llama3-70b", llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256)},
      {"llama3-405b", llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256)},
      {"lwm-7b", llama("lwm-7b", 32, 4096, 32, 32, 11008, 32000)},
  };
  return m;
}

HardwareSpec gpu(const char* name, double tflops, double mem_gb, double nvlink_gbs, double ib_gbs,
                 int per_node) {
  HardwareSpec h;
  h.name = name;
  h.flops = tflops * 1e12;
  h.mem_gb = mem_gb;
  h.intra = {nvlink_gbs, 3.0};
  h.inter = {ib_gbs, 5.0};
  h.devices_per_node = per_node;
  return h;
}

// Dense bf16 peak, HBM, one-direction link bandwidth per device. NVLink figures are half the
// vendor's bidirectional totals; InfiniBand is one NIC per GPU (HDR 200 Gb/s on DGX A100,
// NDR 400 Gb/s on DGX H100/H200/B200). The a100-infiniband and tpu-v4 rows are the Ring
// Attention paper's Table 2 hosts (Liu, Zaharia, Abbeel 2023): A100 over 100 Gb/s InfiniBand
// (12.5 GB/s) with one GPU per host, TPU v4 on ICI at 268 GB/s.
const std::map<std::string, HardwareSpec>& hardware() {
  static const std::map<std::string, HardwareSpec> m = [] {
    std::map<std::string, HardwareSpec> r;
    r["a100-nvlink"] = gpu("a100-nvlink", 312, 80, 300, 25, 8);
    r["a100-infiniband"] = gpu("a100-infiniband", 312, 80, 12.5, 12.5, 1);
    r["h100"] = gpu("h100", 989, 80, 450, 50, 8);
    r["h200"] = gpu("h200", 989, 141, 450, 50, 8);
    r["b200"] = gpu("b200", 2250, 180, 900, 50, 8);
    HardwareSpec tpu = gpu("tpu-v4", 275, 32, 268, 6.25, 4096);  // a pod is one ICI torus
    tpu.intra.latency_us = 2.0;
    tpu.inter.latency_us = 10.0;
    r["tpu-v4"] = tpu;
    return r;
  }();
  return m;
}

template <typename Map>
std::string names_of(const Map& m, const char* extra = nullptr) {
  std::string s;
  for (const auto& [name, _] : m) s += (s.empty() ? "" : ", ") + name;
  if (extra) s += std::string(", ") + extra;
  return s;
}

}  // namespace

double LinkSpec::seconds(double bytes) const {
  CTXPAR_ASSERT(gbytes_per_second > 0, "link without bandwidth");
  return latency_us * 1e-6 + bytes / (gbytes_per_second * 1e9);
}

ModelSpec model_preset(const std::string& name) {
  auto it = models().find(name);
  CTXPAR_CHECK(it != models().end(), "model: unknown preset '", name,
               "'; valid: ", names_of(models()));
  return it->second;
}

std::vector<std::string> model_preset_names() {
  std::vector<std::string> v;
  for (const auto& [name, _] : models()) v.push_back(name);
  return v;
}

HardwareSpec hardware_preset(const std::string& name) {
  auto it = hardware().find(name);
  CTXPAR_CHECK(it != hardware().end(), "hardware: unknown preset '", name,
               "'; valid: ", names_of(hardware(), "local"));
  return it->second;
}

std::vector<std::string> hardware_preset_names() {
  std::vector<std::string> v;
  for (const auto& [name, _] : hardware()) v.push_back(name);
  v.push_back("local");
  return v;
}

int64_t video_tokens(double hours, double fps, int64_t tokens_per_frame) {
  CTXPAR_CHECK(hours > 0, "video_tokens: hours must be > 0, got ", hours);
  CTXPAR_CHECK(fps > 0, "video_tokens: fps must be > 0, got ", fps);
  CTXPAR_CHECK(tokens_per_frame > 0, "video_tokens: tokens_per_frame must be > 0, got ",
               tokens_per_frame);
  // Checked: frames x tokens per frame wrapped int64 before (hours 488671.83456713834, fps
  // 1e4, 2^20 tokens per frame is (2^44 + 1) x 2^20 tokens and came out as 2^20).
  const double frames = std::floor(hours * 3600.0 * fps + 0.5);  // as rounded before
  int64_t tokens = 0;
  if (!(frames < 0x1p62) ||
      __builtin_mul_overflow(static_cast<int64_t>(frames), tokens_per_frame, &tokens))
    throw Error(detail::concat("video_tokens: hours x 3600 x fps x tokens_per_frame is ",
                               frames * double(tokens_per_frame),
                               " tokens, past int64; lower one of them"));
  return tokens;
}

}  // namespace ctxpar

#include "model/params.h"

#include <cmath>
#include <sstream>

#include "ctxpar/error.h"
#include "ctxpar/tensor.h"

namespace ctxpar {

void ModelConfig::validate() const {
  CTXPAR_CHECK(layers >= 1, "model: ModelConfig::layers must be >= 1, got ", layers);
  CTXPAR_CHECK(dim >= 1 && hidden >= 1,
               "model: ModelConfig::dim and ModelConfig::hidden must be >= 1");
  CTXPAR_CHECK(heads >= 1 && kv_heads >= 1 && heads % kv_heads == 0,
               "model: ModelConfig::heads must be a multiple of ModelConfig::kv_heads (GQA), got "
               "heads=",
               heads, " kv_heads=", kv_heads);
  CTXPAR_CHECK(head_dim >= 16 && head_dim <= 256 && head_dim % 2 == 0,
               "model: ModelConfig::head_dim must be even and in [16, 256] (kernel and RoPE), got ",
               head_dim);
  CTXPAR_CHECK(vocab == 256, "model: vocab must be 256 (byte tokens), got ", vocab);
}

std::string ModelConfig::describe() const {
  std::ostringstream s;
  s << "layers=" << layers << " dim=" << dim << " heads=" << heads << " kv_heads=" << kv_heads
    << " head_dim=" << head_dim << " hidden=" << hidden << " vocab=" << vocab
    << " rope_base=" << rope_base << " norm_eps=" << norm_eps;
  return s.str();
}

namespace model {

std::vector<ParamInfo> param_infos(const ModelConfig& m) {
  std::vector<ParamInfo> out;
  size_t offset = 0;
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    ParamInfo p;
    p.name = std::move(name);
    p.shape = std::move(shape);
    p.numel = 1;
    for (int64_t s : p.shape) p.numel *= size_t(s);
    p.offset = offset;
    p.decay = p.shape.size() == 2;
    offset += p.numel;
    out.push_back(std::move(p));
  };
  const int64_t c = m.dim, q = int64_t(m.heads) * m.head_dim, kv = int64_t(m.kv_heads) * m.head_dim;
  add("embed", {m.vocab, c});
  for (int l = 0; l < m.layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    add(p + "attn_norm", {c});
    add(p + "wq", {q, c});
    add(p + "wk", {kv, c});
    add(p + "wv", {kv, c});
    add(p + "wo", {c, q});
    add(p + "mlp_norm", {c});
    add(p + "w1", {m.hidden, c});
    add(p + "w3", {m.hidden, c});
    add(p + "w2", {c, m.hidden});
  }
  add("final_norm", {c});
  return out;
}

size_t param_count(const std::vector<ParamInfo>& infos) {
  return infos.empty() ? 0 : infos.back().offset + infos.back().numel;
}

ModelParams bind_params(const ModelConfig& config, float* flat) {
  auto infos = param_infos(config);
  size_t i = 0;
  auto next = [&]() { return flat + infos[i++].offset; };
  ModelParams p;
  p.embed = next();
  for (int l = 0; l < config.layers; ++l) {
    LayerParams lp;
    lp.attn_norm = next();
    lp.wq = next();
    lp.wk = next();
    lp.wv = next();
    lp.wo = next();
    lp.mlp_norm = next();
    lp.w1 = next();
    lp.w3 = next();
    lp.w2 = next();
    p.layers.push_back(lp);
  }
  p.final_norm = next();
  return p;
}

void init_params(const ModelConfig& config, std::vector<float>& flat, uint64_t seed) {
  auto infos = param_infos(config);
  flat.assign(param_count(infos), 0.0f);
  const float out_scale = 0.02f / std::sqrt(2.0f * float(config.layers));
  for (size_t i = 0; i < infos.size(); ++i) {
    const ParamInfo& p = infos[i];
    float* w = flat.data() + p.offset;
    if (p.shape.size() == 1) {
      for (size_t j = 0; j < p.numel; ++j) w[j] = 1.0f;
      continue;
    }
    const bool is_out = p.name.ends_with(".wo") || p.name.ends_with(".w2");
    fill_normal(TensorView(w, DType::f32, {int64_t(p.numel)}), seed * 1000003ull + i,
                is_out ? out_scale : 0.02f);
  }
}

}  // namespace model
}  // namespace ctxpar

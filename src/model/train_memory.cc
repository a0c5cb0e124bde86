// How much memory a training run needs, from the config alone, so that `--layers 100000` is
// refused with the figure before anything is allocated rather than found by the OOM killer.
//
// The activation term mirrors the buffers Transformer allocates (transformer.cc), the strategy
// term is the strategies' own model (attention_buffer_bytes); the test
// TrainMemory.ActivationEstimateBoundsTheMeasuredPeak holds both to what a step really holds.
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "ctxpar/error.h"
#include "ctxpar/model.h"
#include "ctxpar/strategy_memory.h"

namespace ctxpar {

namespace {

double file_bytes(const std::string& path) {
  struct stat st = {};
  return !path.empty() && ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) ? double(st.st_size)
                                                                                : 0.0;
}

std::string params_text(double n) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.3g", n);
  return buf;
}

}  // namespace

TrainMemory estimate_train_memory(const TrainConfig& config) {
  const ModelConfig& m = config.model;
  const double c = m.dim, f = m.hidden, v = m.vocab, h = m.heads;
  const double qw = h * m.head_dim, kvw = double(m.kv_heads) * m.head_dim;
  const double cp = config.cp > 0 ? config.cp : 1;
  const double t = double(config.seq), b = double(config.batch), tl = t / cp, n = b * tl;
  TrainMemory out;
  // param_infos, as arithmetic: embed [V, C], per block two norms, wq, wk, wv, wo and the
  // three MLP matrices, the final norm.
  out.params = v * c + double(m.layers) * (2 * c + 2 * qw * c + 2 * kvw * c + 3 * f * c) + c;
  out.state = 16 * out.params;
  // Per block: x_in, xn1, x_mid, xn2 [N, C]; rstd1, rstd2 [N]; q, att [N, qw]; k, v [N, kvw];
  // lse [B, H, Tl]; h1, h3, g [N, F]. Once: x, xf, xnf, dx, dxn, tmp [N, C]; rstdf [N];
  // logits [N, V]; dg, dh1, dh3 [N, F]; datt, dq [N, qw]; dk, dv [N, kvw]; RoPE cos and sin.
  const double per_block = n * (4 * c + 2 + 2 * qw + 2 * kvw + h + 3 * f);
  const double once = n * (6 * c + 1 + v + 3 * f + 2 * qw + 2 * kvw) + tl * m.head_dim;
  // The strategy's buffers at their peak, the larger of forward and backward: the runtime's
  // own model (ctxpar/strategy_memory.h) with the options the trainer gives the strategy
  // (trainer.cc; fp32 under a causal mask, with documents when packed).
  StrategyOptions options;
  options.kind = config.strategy;
  options.ulysses_degree = config.ulysses_degree;
  options.ulysses_groups = config.ulysses_groups;
  options.mask.causal = true;
  options.mask.documents = config.separator >= 0;  // document ids travel with the K/V
  options.kernel.threads = config.threads;
  AttentionDims dims;
  dims.batch = config.batch;
  dims.seq = layout_padded_tokens(config.layout, config.seq, int(cp));
  dims.heads = m.heads, dims.kv_heads = m.kv_heads, dims.head_dim = m.head_dim;
  const int ranks = int(cp);
  const double strategy =
      std::max(attention_buffer_bytes(options, dims, ranks, AttentionPass::forward),
               attention_buffer_bytes(options, dims, ranks, AttentionPass::backward));
  out.activations = 4 * (double(m.layers) * per_block + once) + strategy;
  // The --data file is not held (each step reads its sequences: data.cc); --resume is read
  // whole while loading.
  // Packed documents add a document id and a RoPE position (12 bytes) to each token.
  const double token_bytes = config.separator >= 0 ? 15 : 3;
  out.data = token_bytes * (b * t + n) + file_bytes(config.resume_path);
  return out;
}

void check_train_memory(const TrainConfig& config, int ranks_here, const MemoryLimit& limit) {
  if (!limit.known()) return;
  const TrainMemory need = estimate_train_memory(config);
  const double total = need.total() * ranks_here;
  CTXPAR_CHECK(total <= limit.bytes, "train: this run needs about ", bytes_text(total),
               " of memory (", ranks_here, " rank(s) on this machine, ", bytes_text(need.total()),
               " each) but ", limit.source_text(), " leaves ", bytes_text(limit.bytes), "; ",
               limit.raise_text(), ", or lower the run. Per rank:\n  ", bytes_text(need.state),
               " weights, gradients and Adam moments (", params_text(need.params),
               " parameters: lower ModelConfig::layers, "
               "ModelConfig::dim, ModelConfig::hidden or ModelConfig::heads)\n  ",
               bytes_text(need.activations),
               " activations (lower TrainConfig::seq or "
               "TrainConfig::batch, or spread them over more ranks with TrainConfig::cp on more "
               "machines)\n  ",
               bytes_text(need.data),
               " data (the batch, TrainConfig::data_path "
               "and TrainConfig::resume_path files, read whole)");
}

}  // namespace ctxpar

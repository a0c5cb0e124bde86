// Per-device memory and per-step FLOPs of mixed-precision training with Adam. See
// docs/plan.md, "Memory" and "FLOPs", for each term and where it comes from.
#include <algorithm>

#include "ctxpar/error.h"
#include "ctxpar/plan.h"
#include "ctxpar/strategy_memory.h"

namespace ctxpar {

void validate(const PlanInput& in) {
  const ModelSpec& m = in.model;
  CTXPAR_CHECK(m.layers > 0 && m.hidden > 0 && m.heads > 0 && m.kv_heads > 0 && m.head_dim > 0 &&
                   m.ffn > 0 && m.vocab > 0,
               "model: layers, hidden, heads, kv_heads, head_dim, ffn and vocab must all be > 0 "
               "(or use a model preset)");
  CTXPAR_CHECK(m.heads % m.kv_heads == 0, "model: heads (", m.heads,
               ") must be a multiple of kv_heads (", m.kv_heads, ")");
  CTXPAR_CHECK(in.seq > 0, "plan: seq must be > 0");
  CTXPAR_CHECK(in.batch > 0, "plan: batch must be > 0");
  CTXPAR_CHECK(in.dp >= 1 && in.cp >= 1 && in.tp >= 1 && in.pp >= 1,
               "plan: dp, cp, tp and pp must be >= 1");
  CTXPAR_CHECK(m.heads % in.tp == 0, "plan: tp = ", in.tp, " must divide the query heads (",
               m.heads, ")");
  CTXPAR_CHECK(m.kv_heads % in.tp == 0 || in.tp % m.kv_heads == 0, "plan: tp = ", in.tp,
               " must divide the KV heads (", m.kv_heads, ") or be a multiple of them");
  CTXPAR_CHECK(in.pp <= m.layers, "plan: pp = ", in.pp, " must not exceed the model's layers (",
               m.layers, ")");
  CTXPAR_CHECK(in.zero >= 0 && in.zero <= 3, "plan: zero must be 0, 1, 2 or 3, got ", in.zero);
  CTXPAR_CHECK(in.dtype == DType::bf16 || in.dtype == DType::f32,
               "plan: dtype must be bf16 or fp32");
  // Any seq: the layout pads it to its granule, as the runtime does (plan_padded_seq).
  const HardwareSpec& h = in.hardware;
  CTXPAR_CHECK(
      h.flops > 0 && h.mem_gb > 0 && h.intra.gbytes_per_second > 0 &&
          h.inter.gbytes_per_second > 0 && h.devices_per_node >= 1,
      "hardware: flops, mem_gb and link bandwidths must be > 0 (or use a hardware preset)");
  CTXPAR_CHECK(h.efficiency > 0 && h.efficiency <= 1, "hardware: efficiency must be in (0, 1]");
}

namespace {
double bytes_of(DType t) { return static_cast<double>(dtype_size(t)); }
int64_t kv_heads_per_device(const PlanInput& in) {
  return std::max<int64_t>(1, in.model.kv_heads / in.tp);  // replicated when tp > kv heads
}
}  // namespace

int64_t plan_padded_seq(const PlanInput& in) {
  return layout_padded_tokens(in.layout, in.seq, in.cp);
}

MemoryBreakdown plan_memory(const PlanInput& in) {
  validate(in);
  const ModelSpec& m = in.model;
  const double s = bytes_of(in.dtype);
  const double layers = static_cast<double>(layers_per_stage(in));
  // Embedding and LM head (with the final norm) live on the first and last pipeline stages;
  // count both when pp = 1.
  const double embed = (in.pp == 1 ? 2.0 : 1.0) * m.vocab * m.hidden + m.hidden;
  const double params = (layers * m.layer_params() + embed) / in.tp;
  const double shard = static_cast<double>(in.dp) * in.cp;  // ZeRO / FSDP group

  MemoryBreakdown mb;
  mb.weights = params * s / (in.zero >= 3 ? shard : 1);
  mb.gradients = params * 4.0 / (in.zero >= 2 ? shard : 1);  // fp32 gradient accumulation
  const double opt = in.dtype == DType::bf16 ? 12.0 : 8.0;   // (fp32 master +) Adam m, v
  mb.optimizer = params * opt / (in.zero >= 1 ? shard : 1);
  if (in.zero >= 3 && shard > 1) mb.gathered_weights = 2 * m.layer_params() / in.tp * s;

  // Saved activations per layer, per local token (sequence-parallel TP shards all of them):
  // norm-1 in and out, Q, K, V, attention out, norm-2 in and out, gate, up, gate*up, and the
  // fp32 LSE the flash-style backward needs. No score matrix is ever stored.
  const double tokens = static_cast<double>(in.batch) * (plan_padded_seq(in) / in.cp);
  const double qd = static_cast<double>(m.heads) * m.head_dim;
  const double kvd = static_cast<double>(m.kv_heads) * m.head_dim;
  const double per_token = s * (4.0 * m.hidden + 2 * qd + 2 * kvd + 3.0 * m.ffn) + 4.0 * m.heads;
  const double full_layer = tokens * per_token / in.tp;
  const double layer_input = tokens * m.hidden * s / in.tp;
  mb.activations_per_layer = in.recompute == Recompute::full ? layer_input : full_layer;
  // With pipeline stages (1F1B), the first stage holds pp micro-batches in flight.
  const double in_flight = static_cast<double>(in.pp);
  mb.activations = in.recompute == Recompute::full ? in_flight * layers * layer_input + full_layer
                                                   : in_flight * layers * full_layer;
  mb.logits = tokens * (static_cast<double>(m.vocab) / in.tp) * (s + 4.0);

  // The strategy's buffers for one layer at their peak, the larger of forward and backward:
  // the runtime's own model (ctxpar/strategy_memory.h), on the heads one device holds.
  StrategyOptions options;
  options.kind = in.strategy;
  options.ulysses_degree = in.strategy == StrategyKind::hybrid ? plan_ulysses_degree(in) : 0;
  options.mask.causal = in.causal;
  AttentionDims dims;
  dims.batch = in.batch;
  dims.seq = plan_padded_seq(in);
  dims.heads = m.heads / in.tp;
  dims.kv_heads = kv_heads_per_device(in);
  dims.head_dim = m.head_dim;
  dims.dtype = dims.out_dtype = in.dtype;
  mb.attention_buffers =
      std::max(attention_buffer_bytes(options, dims, in.cp, AttentionPass::forward),
               attention_buffer_bytes(options, dims, in.cp, AttentionPass::backward));
  mb.total = mb.weights + mb.gradients + mb.optimizer + mb.gathered_weights + mb.activations +
             mb.logits + mb.attention_buffers;
  mb.capacity = in.hardware.mem_gb * 1e9;
  mb.fits = mb.total <= mb.capacity;
  return mb;
}

FlopCount plan_flops(const PlanInput& in) {
  validate(in);
  const ModelSpec& m = in.model;
  const double T = static_cast<double>(in.seq), b = static_cast<double>(in.batch);
  const double pairs = in.causal ? T * (T + 1) / 2 : T * T;
  FlopCount f;
  f.attention_forward = 4.0 * b * m.heads * m.head_dim * pairs;
  // Backward is 2.5x forward (FA2: five matmuls to forward's two); recomputation adds one
  // more forward.
  const double passes = 3.5 + (in.recompute == Recompute::full ? 1.0 : 0.0);
  f.attention_step = m.layers * f.attention_forward * passes;
  const double tokens = b * T;
  const double dense_passes = 3.0 + (in.recompute == Recompute::full ? 1.0 : 0.0);
  f.dense_step =
      2.0 * tokens * m.layers * m.layer_params() * dense_passes + 6.0 * tokens * m.vocab * m.hidden;
  f.total_step = f.attention_step + f.dense_step;
  f.per_device = f.total_step / (static_cast<double>(in.cp) * in.tp * in.pp);
  return f;
}

}  // namespace ctxpar

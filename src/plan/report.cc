// A plan as JSON (every figure) and as the table `ctxpar plan` prints.
#include <cstdio>
#include <sstream>

#include <nlohmann/json.hpp>

#include "ctxpar/plan.h"

namespace ctxpar {
namespace {

nlohmann::json link_json(const LinkSpec& l) {
  return {{"gbytes_per_second", l.gbytes_per_second}, {"latency_us", l.latency_us}};
}

std::string gb(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GB", bytes / 1e9);
  return buf;
}

std::string fixed(double v, int digits) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string sci(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

}  // namespace

std::string plan_json(const Plan& p) {
  using nlohmann::json;
  const PlanInput& in = p.input;
  const ModelSpec& m = in.model;
  const HardwareSpec& h = in.hardware;
  json j;
  j["model"] = {{"name", m.name},   {"layers", m.layers},     {"hidden", m.hidden},
                {"heads", m.heads}, {"kv_heads", m.kv_heads}, {"head_dim", m.head_dim},
                {"ffn", m.ffn},     {"vocab", m.vocab},       {"params", m.params()}};
  j["hardware"] = {{"name", h.name},
                   {"flops", h.flops},
                   {"backward_flops", h.backward_flops > 0 ? h.backward_flops : h.flops},
                   {"efficiency", h.efficiency},
                   {"mem_gb", h.mem_gb},
                   {"intra", link_json(h.intra)},
                   {"inter", link_json(h.inter)},
                   {"devices_per_node", h.devices_per_node}};
  j["input"] = {{"seq", in.seq},
                {"batch", in.batch},
                {"dp", in.dp},
                {"cp", in.cp},
                {"tp", in.tp},
                {"pp", in.pp},
                {"zero", in.zero},
                {"devices", int64_t{in.dp} * in.cp * in.tp * in.pp},
                {"strategy", strategy_name(in.strategy)},
                {"layout", layout_name(in.layout)},
                {"causal", in.causal},
                {"dtype", dtype_name(in.dtype)},
                {"recompute", in.recompute == Recompute::full ? "full" : "none"}};
  const MemoryBreakdown& mb = p.memory;
  j["memory"] = {{"weights", mb.weights},
                 {"gradients", mb.gradients},
                 {"optimizer", mb.optimizer},
                 {"gathered_weights", mb.gathered_weights},
                 {"activations_per_layer", mb.activations_per_layer},
                 {"activations", mb.activations},
                 {"logits", mb.logits},
                 {"attention_buffers", mb.attention_buffers},
                 {"total", mb.total},
                 {"capacity", mb.capacity},
                 {"fits", mb.fits},
                 {"cp_to_fit", p.cp_to_fit},
                 {"cp_to_fit_recompute", p.cp_to_fit_recompute}};
  j["flops"] = {{"attention_forward_per_layer", p.flops.attention_forward},
                {"attention_step", p.flops.attention_step},
                {"dense_step", p.flops.dense_step},
                {"total_step", p.flops.total_step},
                {"per_device_step", p.flops.per_device}};
  json comm = json::array();
  for (const auto& c : p.comm)
    comm.push_back({{"strategy", strategy_name(c.strategy)},
                    {"forward_bytes_per_layer", c.forward_bytes},
                    {"backward_bytes_per_layer", c.backward_bytes},
                    {"bytes_per_step", c.step_bytes}});
  j["comm_bytes_per_device"] = comm;
  j["min_block_tokens"] = p.min_block.tokens;
  j["min_block_tokens_forward"] = p.min_block.forward;
  j["min_block_tokens_backward"] = p.min_block.backward;
  j["block_tokens"] = p.block_tokens;
  j["overlap_hides_transfers"] = p.block_tokens >= p.min_block.tokens;
  json ranks = json::array();
  for (size_t r = 0; r < p.ring.ranks.size(); ++r) {
    const RingRankTrace& t = p.ring.ranks[r];
    json steps = json::array();
    for (const auto* pass : {&t.forward, &t.backward})
      for (size_t s = 0; s < pass->size(); ++s)
        steps.push_back({{"pass", pass == &t.forward ? "forward" : "backward"},
                         {"step", s},
                         {"start", (*pass)[s].start},
                         {"compute", (*pass)[s].compute},
                         {"wait", (*pass)[s].wait}});
    json rank = {{"rank", r},
                 {"compute_seconds", t.compute},
                 {"wait_seconds", t.wait},
                 {"finish", t.finish},
                 {"bytes_sent", t.bytes_sent}};
    if (p.ring.ranks.size() <= kRingStepsTraced) rank["steps"] = steps;
    ranks.push_back(rank);
  }
  j["ring_layer"] = {
      {"forward_seconds", p.ring.forward_seconds},
      {"backward_seconds", p.ring.backward_seconds},
      {"seconds", p.ring.seconds},
      {"compute_seconds", p.ring.compute_seconds},
      {"exposed_comm_seconds", p.ring.exposed_comm},
      {"perfect_seconds", p.ring.perfect_seconds},
      {"efficiency", p.ring.efficiency},
      {"seconds_if_accumulator_waited_before_compute", p.ring_seconds_accumulator_before},
      {"ranks", ranks}};
  json cmp = json::array();
  for (const auto& e : p.compare) {
    json x = {{"strategy", strategy_name(e.strategy)}, {"valid", e.valid}};
    if (e.valid) {
      x["attention_seconds"] = e.attention_seconds;
      x["exposed_comm_seconds"] = e.exposed_comm_seconds;
      x["efficiency"] = e.efficiency;
      x["bytes_per_step"] = e.bytes_per_step;
      x["attention_buffer_bytes"] = e.attention_buffer_bytes;
      x["fits"] = e.fits;
    } else {
      x["why_invalid"] = e.why_invalid;
    }
    cmp.push_back(x);
  }
  j["strategies"] = cmp;
  j["dense_seconds"] = p.dense_seconds;
  j["step_seconds"] = p.step_seconds;
  return j.dump(2);
}

std::string plan_table(const Plan& p) {
  const PlanInput& in = p.input;
  const MemoryBreakdown& mb = p.memory;
  std::ostringstream o;
  o << "model " << in.model.name << " (" << fixed(in.model.params() / 1e9, 2) << "B params, "
    << in.model.layers << " layers, " << in.model.heads << "/" << in.model.kv_heads
    << " heads)  on " << in.hardware.name << " ("
    << (in.hardware.flops >= 1e12 ? fixed(in.hardware.flops / 1e12, 0) + " TFLOP/s"
                                  : fixed(in.hardware.flops / 1e9, 2) + " GFLOP/s")
    << " x " << in.hardware.efficiency << ", " << fixed(in.hardware.mem_gb, 1) << " GB, links "
    << in.hardware.intra.gbytes_per_second << " / " << in.hardware.inter.gbytes_per_second
    << " GB/s)\n";
  o << "sequence " << in.seq << " tokens"
    << (p.padded_seq > in.seq ? " (padded to " + std::to_string(p.padded_seq) + ")" : "")
    << " x batch " << in.batch << ", mesh dp " << in.dp << " cp " << in.cp << " tp " << in.tp
    << " pp " << in.pp << " (" << int64_t{in.dp} * in.cp * in.tp * in.pp << " devices), "
    << strategy_name(in.strategy) << " / " << layout_name(in.layout)
    << (in.causal ? " causal" : " full") << ", " << dtype_name(in.dtype) << ", recompute "
    << (in.recompute == Recompute::full ? "full" : "none") << ", zero " << in.zero << "\n\n";
  o << "memory per device\n";
  auto row = [&](const char* name, double v) {
    o << "  " << name << std::string(24 - std::string(name).size(), ' ') << gb(v) << "\n";
  };
  row("weights", mb.weights);
  row("gradients", mb.gradients);
  row("optimizer state", mb.optimizer);
  if (mb.gathered_weights > 0) row("gathered weights", mb.gathered_weights);
  row("activations / layer", mb.activations_per_layer);
  row("activations", mb.activations);
  row("logits", mb.logits);
  row("attention buffers", mb.attention_buffers);
  o << "  total                   " << gb(mb.total) << " of " << gb(mb.capacity) << ": "
    << (mb.fits ? "fits" : "DOES NOT FIT") << "\n";
  o << "  smallest cp that fits   "
    << (p.cp_to_fit ? std::to_string(p.cp_to_fit) : std::string("none <= 65536"))
    << " (with full recompute: "
    << (p.cp_to_fit_recompute ? std::to_string(p.cp_to_fit_recompute) : std::string("none"))
    << ")\n\n";
  o << "FLOPs per step (per replica)  attention " << sci(p.flops.attention_step) << ", dense "
    << sci(p.flops.dense_step) << ", total " << sci(p.flops.total_step) << ", per device "
    << sci(p.flops.per_device) << "\n\n";
  o << "bytes each device sends per step\n";
  for (const auto& c : p.comm)
    o << "  " << strategy_name(c.strategy)
      << std::string(12 - std::string(strategy_name(c.strategy)).size(), ' ') << gb(c.step_bytes)
      << "  (per layer fwd " << gb(c.forward_bytes) << ", bwd " << gb(c.backward_bytes) << ")\n";
  o << "\nring overlap: block " << p.block_tokens << " tokens per rank, minimal block "
    << fixed(p.min_block.tokens, 0) << " (forward " << fixed(p.min_block.forward, 0)
    << ", backward " << fixed(p.min_block.backward, 0) << "): transfers "
    << (p.block_tokens >= p.min_block.tokens ? "hide behind compute" : "are EXPOSED") << "\n";
  o << "ring schedule, one layer: " << fixed(p.ring.seconds * 1e3, 3) << " ms (forward "
    << fixed(p.ring.forward_seconds * 1e3, 3) << "), compute "
    << fixed(p.ring.compute_seconds * 1e3, 3) << " ms, exposed comm "
    << fixed(p.ring.exposed_comm * 1e3, 3) << " ms, efficiency "
    << fixed(100 * p.ring.efficiency, 1) << "% of perfect scaling\n";
  if (p.ring.ranks.size() <= 16) {
    o << "  rank  compute ms   wait ms  finish ms\n";
    for (size_t r = 0; r < p.ring.ranks.size(); ++r) {
      const auto& t = p.ring.ranks[r];
      char buf[96];
      std::snprintf(buf, sizeof buf, "  %4zu %11.3f %9.3f %10.3f\n", r, t.compute * 1e3,
                    t.wait * 1e3, t.finish * 1e3);
      o << buf;
    }
  }
  o << "\nstrategies (attention per step, all layers, forward + backward)\n";
  for (const auto& e : p.compare) {
    const std::string name = strategy_name(e.strategy);
    if (!e.valid) {
      o << "  " << name << std::string(12 - name.size(), ' ') << "invalid: " << e.why_invalid
        << "\n";
      continue;
    }
    o << "  " << name << std::string(12 - name.size(), ' ') << fixed(e.attention_seconds, 3)
      << " s, exposed comm " << fixed(e.exposed_comm_seconds, 3) << " s, efficiency "
      << fixed(100 * e.efficiency, 1) << "%, sends " << gb(e.bytes_per_step) << ", buffers "
      << gb(e.attention_buffer_bytes) << (e.fits ? "" : " (DOES NOT FIT)") << "\n";
  }
  o << "\nstep time per device: dense " << fixed(p.dense_seconds, 3)
    << " s + attention = " << fixed(p.step_seconds, 3) << " s\n";
  return o.str();
}

}  // namespace ctxpar

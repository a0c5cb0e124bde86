// Names, the exported head rules, and what every strategy shares: argument checks whose
// verdict all ranks agree on, and the check of the outputs.
#include "ctxpar/strategy.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <tuple>

#include "ctxpar/hash.h"
#include "kernel/finite.h"
#include "kernel/problem.h"  // fp32_products_of
#include "strategy/internal.h"

namespace ctxpar {

const char* strategy_name(StrategyKind k) {
  switch (k) {
    case StrategyKind::ring:
      return "ring";
    case StrategyKind::allgather:
      return "allgather";
    case StrategyKind::ulysses:
      return "ulysses";
    case StrategyKind::hybrid:
      return "hybrid";
  }
  return "?";
}

StrategyKind parse_strategy(const std::string& name) {
  if (name == "ring") return StrategyKind::ring;
  if (name == "allgather") return StrategyKind::allgather;
  if (name == "ulysses") return StrategyKind::ulysses;
  if (name == "hybrid") return StrategyKind::hybrid;
  throw Error("unknown strategy '" + name + "': use ring, allgather, ulysses or hybrid");
}

const char* exchange_name(Exchange e) {
  switch (e) {
    case Exchange::automatic:
      return "auto";
    case Exchange::ring:
      return "ring";
    case Exchange::needed:
      return "needed";
  }
  return "?";
}

Exchange parse_exchange(const std::string& name) {
  if (name == "auto") return Exchange::automatic;
  if (name == "ring") return Exchange::ring;
  if (name == "needed") return Exchange::needed;
  throw Error("unknown exchange '" + name + "': use auto, ring or needed");
}

Exchange exchange_of(const StrategyOptions& options) {
  if (options.exchange != Exchange::automatic) return options.exchange;
  // A mask that restricts by documents or slices leaves most of a rank's keys invisible to
  // most peers.
  const bool sparse = options.mask.documents || options.mask.sliced;
  return has_needed_exchange(options.kind) && sparse ? Exchange::needed : Exchange::ring;
}

bool has_needed_exchange(StrategyKind kind) {
  return kind == StrategyKind::ring || kind == StrategyKind::allgather;
}

std::string ulysses_heads_rule(int64_t hq, int ranks) {
  // KV heads that do not split over the ranks are replicated (see ulysses.cc, HeadSplit), so
  // only the query heads must divide.
  if (ranks < 1 || hq % ranks != 0)
    return detail::concat("query heads Hq = ", hq, " must be divisible by the ", ranks,
                          " Ulysses ranks (each rank takes Hq/P heads)");
  return "";
}

std::string allgather_head_groups_rule(int64_t hkv, int head_groups) {
  if (head_groups > 0 && hkv % head_groups != 0)
    return detail::concat("head_groups = ", head_groups, " must divide the kv heads Hkv = ", hkv);
  return "";
}

int64_t allgather_head_groups(int64_t hkv, int head_groups) {
  if (head_groups > 0) return head_groups;
  for (int64_t g = 4; g > 1; --g)
    if (hkv % g == 0) return g;
  return 1;
}

namespace strategy {
namespace {

// A NaN / Inf in this rank's own input, named by the token's global position (the kernel only
// sees slices: a head group, a gathered block, a Ulysses head shard) -- checked before any
// communication, so the verdict the ranks share names the rank that holds the bad token.
std::string check_finite(const char* name, const TensorView& t, const Tokens& tokens) {
  const kernel::NonFinite f = kernel::find_non_finite(t);
  if (!f.found()) return "";
  return detail::concat(name, ": non-finite value (", f.value, ") at token position ",
                        tokens.positions[f.t], ", batch ", f.b, ", head ", f.h, ", dim ", f.d,
                        " (local row ", f.t, " of this rank): ", kernel::kNonFiniteHint);
}

}  // namespace

std::string check_forward(const ForwardArgs& a, const Mask& mask, Dims& dims) {
  const TensorView &q = a.q, &k = a.k, &v = a.v, &out = a.out, &lse = a.lse;
  const Tokens& tokens = a.tokens;
  if (q.empty() || q.ndim() != 4)
    return detail::concat("q: expected a [B, Tl, Hq, D] tensor, got shape ", shape_str(q.shape()));
  if (k.empty() || k.ndim() != 4)
    return detail::concat("k: expected a [B, Tl, Hkv, D] tensor, got shape ", shape_str(k.shape()));
  dims.batch = q.dim(0);
  dims.tokens = q.dim(1);
  dims.hq = q.dim(2);
  dims.d = q.dim(3);
  dims.hkv = k.dim(2);
  dims.dtype = q.dtype();
  dims.out_dtype = out.dtype();
  dims.documents = mask.documents;
  std::string e;
  if (!(e = kernel::activation_verdict("q", q, true, q.shape(), "[B, Tl, Hq, D]")).empty())
    return e;
  if (dims.batch < 1 || dims.tokens < 1 || dims.hq < 1)
    return detail::concat("q: expected B, Tl, Hq >= 1, got shape ", shape_str(q.shape()));
  if (dims.d < 16 || dims.d > 256)
    return detail::concat("q: head dim D must be in 16..256, got ", dims.d);
  if (dims.hkv < 1 || dims.hq % dims.hkv != 0)
    return detail::concat("k: kv heads Hkv = ", dims.hkv, " must divide query heads Hq = ", dims.hq,
                          " (GQA)");
  const Shape kv{dims.batch, dims.tokens, dims.hkv, dims.d};
  if (!(e = kernel::activation_verdict("k", k, true, kv, "[B, Tl, Hkv, D]")).empty()) return e;
  if (!(e = kernel::activation_verdict("v", v, true, kv, "[B, Tl, Hkv, D]")).empty()) return e;
  if (k.dtype() != q.dtype() || v.dtype() != q.dtype())
    return detail::concat("q, k, v: expected one storage dtype, got ", dtype_name(q.dtype()), ", ",
                          dtype_name(k.dtype()), ", ", dtype_name(v.dtype()));
  if (!(e = kernel::activation_verdict("out", out, true, q.shape(), "q's [B, Tl, Hq, D]")).empty())
    return e;
  if (!(e = kernel::activation_verdict("lse", lse, false, {dims.batch, dims.hq, dims.tokens},
                                       "[B, Hq, Tl]"))
           .empty())
    return e;
  if (static_cast<int64_t>(tokens.positions.size()) != dims.tokens)
    return detail::concat("tokens.positions: expected ", dims.tokens, " entries (Tl), got ",
                          tokens.positions.size());
  if (mask.documents && static_cast<int64_t>(tokens.documents.size()) != dims.tokens)
    return detail::concat("tokens.documents: the documents mask needs one id per local token (",
                          dims.tokens, "), got ", tokens.documents.size());
  if (!(e = check_finite("q", q, tokens)).empty()) return e;
  if (!(e = check_finite("k", k, tokens)).empty()) return e;
  return check_finite("v", v, tokens);
}

std::string check_backward(const BackwardArgs& a, const Mask& mask, Dims& dims) {
  std::string e = check_forward({a.q, a.k, a.v, a.tokens, a.out, a.lse}, mask, dims);
  if (!e.empty()) return e;
  const TensorView &q = a.q, &out = a.out, &dout = a.dout, &dq = a.dq, &dk = a.dk, &dv = a.dv;
  const Shape kv{dims.batch, dims.tokens, dims.hkv, dims.d};
  e = kernel::activation_verdict("dout", dout, true, q.shape(), "q's [B, Tl, Hq, D]");
  if (!e.empty()) return e;
  if (dout.dtype() != out.dtype())
    return detail::concat("dout: expected out's dtype ", dtype_name(out.dtype()), ", got ",
                          dtype_name(dout.dtype()));
  if (!(e = kernel::activation_verdict("dq", dq, true, q.shape(), "q's [B, Tl, Hq, D]")).empty())
    return e;
  if (!(e = kernel::activation_verdict("dk", dk, true, kv, "k's [B, Tl, Hkv, D]")).empty())
    return e;
  if (!(e = kernel::activation_verdict("dv", dv, true, kv, "k's [B, Tl, Hkv, D]")).empty())
    return e;
  return check_finite("dout", dout, a.tokens);
}

Signature signature_of(const Dims& dims, const StrategyOptions& options) {
  auto num = [](auto v) { return std::to_string(v); };
  char scale[32];  // 9 significant digits: two different floats never print the same
  std::snprintf(scale, sizeof scale, "%.9g", double(options.kernel.scale));
  return {{"strategy", strategy_name(options.kind)},
          {"ulysses_degree", num(options.ulysses_degree)},
          {"head_groups", num(options.head_groups)},
          {"ulysses_groups", num(options.ulysses_groups)},
          {"exchange", exchange_name(options.exchange)},
          {"mask", options.mask.describe()},
          {"kernel scale", scale},
          {"kernel bf16 tier", bf16_tier_name(options.kernel.bf16_tier)},
          // Resolved (CTXPAR_FP32_PRODUCTS where automatic): the ranks' own environments.
          {"kernel fp32 products", fp32_products_name(kernel::fp32_products_of(options.kernel))},
          {"batch B", num(dims.batch)},
          {"local tokens Tl", num(dims.tokens)},
          {"query heads Hq", num(dims.hq)},
          {"kv heads Hkv", num(dims.hkv)},
          {"head dim D", num(dims.d)},
          {"dtype", dtype_name(dims.dtype)},
          {"out dtype", dtype_name(dims.out_dtype)},
          {"device", device_name(options.device.kind)}};
}

// ---- outputs: non-finite results from finite inputs ----------------------------------------

namespace {

// The first bad element of one output tensor [B, T, H, D] (out, dq, dk, dv) as a BadOutput.
void first_bad_row(const char* name, const TensorView& t, const Tokens& tokens, BadOutput& bad) {
  const kernel::NonFinite f = kernel::find_non_finite(t);
  if (!f.found()) return;
  bad.take(
      {f.b, tokens.positions[f.t], f.h,
       detail::concat(name, " = ", f.value, " at token position ", tokens.positions[f.t],
                      ", batch ", f.b, ", head ", f.h, ", dim ", f.d, " (local row ", f.t, ")")});
}

constexpr int kMessageBytes = 440;  // a rank's report of its first bad element, cut to this

constexpr const char* kOverflowHint =
    "the attention scores (q . k x scale) or the gradients go beyond the fp32 range (3.4e38) "
    "although the inputs are finite; scale q, k (or dout) down, or lower the softmax scale";

}  // namespace

void BadOutput::take(const BadOutput& other) {
  if (other.batch < 0) return;
  if (batch < 0 ||
      std::tie(other.batch, other.position, other.head) < std::tie(batch, position, head))
    *this = other;
}

BadOutput check_forward_outputs(const TensorView& out, const TensorView& lse,
                                const Tokens& tokens) {
  BadOutput bad;
  // LSE [B, Hq, Tl] fp32: -inf is a row whose every key is masked (its O is 0); +inf or NaN is
  // an overflow.
  const int64_t B = lse.dim(0), H = lse.dim(1), T = lse.dim(2);
  const float* l = lse.ptr<const float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const float* row = l + lse.offset(b, h, 0);
      bool any = false;
      for (int64_t t = 0; t < T; ++t)
        any |= std::isnan(row[t * lse.stride(2)]) || row[t * lse.stride(2)] == INFINITY;
      if (!any) continue;
      for (int64_t t = 0; t < T; ++t) {
        const float x = row[t * lse.stride(2)];
        if (!std::isnan(x) && x != INFINITY) continue;
        bad.take({b, tokens.positions[t], h,
                  detail::concat("lse = ", x, " at token position ", tokens.positions[t],
                                 ", batch ", b, ", head ", h, " (local row ", t, ")")});
      }
    }
  first_bad_row("out", out, tokens, bad);
  return bad;
}

BadOutput check_backward_outputs(const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                 const Tokens& tokens) {
  BadOutput bad;
  first_bad_row("dq", dq, tokens, bad);
  first_bad_row("dk", dk, tokens, bad);
  first_bad_row("dv", dv, tokens, bad);
  return bad;
}

void agree_outputs(Communicator& comm, const std::string& what, const BadOutput& mine) {
  struct Report {
    int64_t batch, position, head;
    char message[kMessageBytes];
  };
  Report r{};
  r.batch = mine.batch, r.position = mine.position, r.head = mine.head;
  std::strncpy(r.message, mine.message.c_str(), kMessageBytes - 1);
  std::vector<Report> all(comm.size());
  comm.allgather(&r, all.data(), sizeof(Report));
  int rank = -1;  // the rank holding the first bad element: lowest batch, position, head
  for (int p = 0; p < comm.size(); ++p) {
    const Report& x = all[p];
    if (x.batch < 0) continue;
    if (rank < 0 || std::tie(x.batch, x.position, x.head) <
                        std::tie(all[rank].batch, all[rank].position, all[rank].head))
      rank = p;
  }
  if (rank < 0) return;
  throw Error(detail::concat(what, ": non-finite output on rank ", rank, " (of ", comm.size(),
                             "): ", all[rank].message, ": ", kOverflowHint));
}

}  // namespace strategy
}  // namespace ctxpar

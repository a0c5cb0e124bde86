// Names, create(), and what every strategy shares: argument checks whose verdict all ranks
// agree on, per-call statistics, and the packed K/V block.
#include "ctxpar/strategy.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <tuple>

#include "ctxpar/hash.h"
#include "kernel/finite.h"
#include "strategy/internal.h"

namespace ctxpar {

const char* strategy_name(StrategyKind k) {
  switch (k) {
    case StrategyKind::ring: return "ring";
    case StrategyKind::allgather: return "allgather";
    case StrategyKind::ulysses: return "ulysses";
    case StrategyKind::hybrid: return "hybrid";
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

std::unique_ptr<Strategy> Strategy::create(Communicator& comm, const StrategyOptions& options) {
  // Options are checked here and agreed on by every rank before hybrid's split (a collective).
  std::string error;
  const int p = comm.size();
  if (options.ulysses_degree < 0)
    error = detail::concat("ulysses_degree: expected >= 0 (0 = P), got ", options.ulysses_degree);
  else if (options.kind == StrategyKind::hybrid && options.ulysses_degree > 0 &&
           p % options.ulysses_degree != 0)
    error = detail::concat("hybrid: ulysses_degree u = ", options.ulysses_degree,
                           " must divide the number of ranks P = ", p,
                           " (ulysses groups of u ranks x ring over P/u groups)");
  else if (options.head_groups < 0)
    error = detail::concat("head_groups: expected >= 0 (0 = auto), got ", options.head_groups);
  else if (options.ulysses_groups < 0 || options.ulysses_groups > kMaxUlyssesGroups)
    error = detail::concat("ulysses_groups: expected 0 (the default) or 1..", kMaxUlyssesGroups,
                           " (the most head groups Ulysses pipelines its all-to-alls over), got ",
                           options.ulysses_groups);
  else if (options.kernel.threads < 1)
    error = detail::concat("kernel.threads: expected >= 1, got ", options.kernel.threads);
  strategy::agree(comm, std::string(strategy_name(options.kind)) + " create", error,
                  strategy::signature_of(strategy::Dims{}, options));
  switch (options.kind) {
    case StrategyKind::ring: return strategy::make_ring(comm, options);
    case StrategyKind::allgather: return strategy::make_allgather(comm, options);
    case StrategyKind::ulysses: return strategy::make_ulysses(comm, options);
    case StrategyKind::hybrid: return strategy::make_hybrid(comm, options);
  }
  throw Error("unknown strategy kind");
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

std::string check_activation(const char* name, const TensorView& t, const Shape& want,
                             bool allow_bf16, const char* what) {
  if (t.empty()) return detail::concat(name, ": tensor is empty, expected ", what);
  if (t.shape() != want)
    return detail::concat(name, ": expected shape ", what, " = ", shape_str(want), ", got ",
                          shape_str(t.shape()));
  if (!(t.dtype() == DType::f32 || (allow_bf16 && t.dtype() == DType::bf16)))
    return detail::concat(name, ": expected dtype ", allow_bf16 ? "fp32 or bf16" : "fp32",
                          ", got ", dtype_name(t.dtype()));
  if (t.ndim() == 4 && t.dim(3) > 1 && t.stride(3) != 1)
    return detail::concat(name, ": the last dimension must be contiguous (stride 1)");
  return "";
}

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

std::string check_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                          const Tokens& tokens, const TensorView& out, const TensorView& lse,
                          const Mask& mask, Dims& dims) {
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
  if (!(e = check_activation("q", q, q.shape(), true, "[B, Tl, Hq, D]")).empty()) return e;
  if (dims.batch < 1 || dims.tokens < 1 || dims.hq < 1)
    return detail::concat("q: expected B, Tl, Hq >= 1, got shape ", shape_str(q.shape()));
  if (dims.d < 16 || dims.d > 256)
    return detail::concat("q: head dim D must be in 16..256, got ", dims.d);
  if (dims.hkv < 1 || dims.hq % dims.hkv != 0)
    return detail::concat("k: kv heads Hkv = ", dims.hkv, " must divide query heads Hq = ",
                          dims.hq, " (GQA)");
  const Shape kv{dims.batch, dims.tokens, dims.hkv, dims.d};
  if (!(e = check_activation("k", k, kv, true, "[B, Tl, Hkv, D]")).empty()) return e;
  if (!(e = check_activation("v", v, kv, true, "[B, Tl, Hkv, D]")).empty()) return e;
  if (k.dtype() != q.dtype() || v.dtype() != q.dtype())
    return detail::concat("q, k, v: expected one storage dtype, got ", dtype_name(q.dtype()), ", ",
                          dtype_name(k.dtype()), ", ", dtype_name(v.dtype()));
  if (!(e = check_activation("out", out, q.shape(), true, "q's [B, Tl, Hq, D]")).empty()) return e;
  if (!(e = check_activation("lse", lse, {dims.batch, dims.hq, dims.tokens}, false,
                             "[B, Hq, Tl]")).empty())
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

std::string check_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                           const Tokens& tokens, const TensorView& out, const TensorView& lse,
                           const TensorView& dout, const TensorView& dq, const TensorView& dk,
                           const TensorView& dv, const Mask& mask, Dims& dims) {
  std::string e = check_forward(q, k, v, tokens, out, lse, mask, dims);
  if (!e.empty()) return e;
  const Shape kv{dims.batch, dims.tokens, dims.hkv, dims.d};
  if (!(e = check_activation("dout", dout, q.shape(), true, "q's [B, Tl, Hq, D]")).empty()) return e;
  if (dout.dtype() != out.dtype())
    return detail::concat("dout: expected out's dtype ", dtype_name(out.dtype()), ", got ",
                          dtype_name(dout.dtype()));
  if (!(e = check_activation("dq", dq, q.shape(), true, "q's [B, Tl, Hq, D]")).empty()) return e;
  if (!(e = check_activation("dk", dk, kv, true, "k's [B, Tl, Hkv, D]")).empty()) return e;
  if (!(e = check_activation("dv", dv, kv, true, "k's [B, Tl, Hkv, D]")).empty()) return e;
  return check_finite("dout", dout, tokens);
}

std::string check_ulysses_heads(const Dims& dims, int ranks, const char* who) {
  const std::string e = ulysses_heads_rule(dims.hq, ranks);
  return e.empty() ? e : detail::concat(who, ": ", e);
}

namespace {
// ulysses_groups decides which messages Ulysses sends (not the answer): ranks that differ
// would mismatch their messages, so it has a slot of its own and a message of its own.
constexpr int kGroupsSlot = 16;
}  // namespace

std::vector<int64_t> signature_of(const Dims& dims, const StrategyOptions& options) {
  uint32_t scale_bits;
  std::memcpy(&scale_bits, &options.kernel.scale, 4);
  std::vector<int64_t> s = {
      static_cast<int64_t>(options.kind), options.ulysses_degree, options.head_groups,
      options.mask.causal, options.mask.window_left, options.mask.window_right,
      options.mask.documents, scale_bits, dims.batch, dims.tokens, dims.hq, dims.hkv, dims.d,
      static_cast<int64_t>(dims.dtype), static_cast<int64_t>(dims.out_dtype),
      static_cast<int64_t>(options.device.kind)};
  s.push_back(options.ulysses_groups);
  CTXPAR_ASSERT(s.size() == kGroupsSlot + 1);
  return s;
}

namespace {

constexpr int kSignatureSlots = 24;
constexpr int kMessageBytes = 440;

struct Verdict {
  int64_t signature[kSignatureSlots];
  int64_t failed;
  char message[kMessageBytes];
};

std::string describe_signature(const int64_t* s) {
  Mask m;
  m.causal = s[3];
  m.window_left = s[4];
  m.window_right = s[5];
  m.documents = s[6];
  return detail::concat(strategy_name(static_cast<StrategyKind>(s[0])), " u=", s[1],
                        " head_groups=", s[2], " mask=", m.describe(), " q=",
                        shape_str({s[8], s[9], s[10], s[12]}), " Hkv=", s[11], " dtype=",
                        dtype_name(static_cast<DType>(s[13])));
}

}  // namespace

void agree(Communicator& comm, const std::string& what, const std::string& local_error,
           const std::vector<int64_t>& signature) {
  CTXPAR_ASSERT(signature.size() <= kSignatureSlots);
  Verdict mine{};
  std::copy(signature.begin(), signature.end(), mine.signature);
  mine.failed = local_error.empty() ? 0 : 1;
  std::strncpy(mine.message, local_error.c_str(), kMessageBytes - 1);
  std::vector<Verdict> all(comm.size());
  comm.allgather(&mine, all.data(), sizeof(Verdict));
  std::string failed_ranks;
  int first = -1;
  for (int r = 0; r < comm.size(); ++r)
    if (all[r].failed) {
      failed_ranks += (failed_ranks.empty() ? "" : ", ") + std::to_string(r);
      if (first < 0) first = r;
    }
  if (first >= 0)
    throw Error(detail::concat(what, ": invalid arguments on rank ", failed_ranks, " (of ",
                               comm.size(), "): ", all[first].message));
  for (int r = 1; r < comm.size(); ++r)
    if (all[r].signature[kGroupsSlot] != all[0].signature[kGroupsSlot])
      throw Error(detail::concat(what, ": rank ", r, " runs with another ulysses_groups (",
                                 all[r].signature[kGroupsSlot], ") than rank 0 (",
                                 all[0].signature[kGroupsSlot], "): it decides which messages "
                                 "Ulysses sends; give every rank the same"));
  for (int r = 1; r < comm.size(); ++r)
    if (std::memcmp(all[r].signature, all[0].signature, sizeof(mine.signature)) != 0)
      throw Error(detail::concat(what, ": rank ", r, " was called with different shapes or options "
                                 "than rank 0 (every rank must pass the same): rank 0 has ",
                                 describe_signature(all[0].signature), "; rank ", r, " has ",
                                 describe_signature(all[r].signature)));
}

// ---- outputs: non-finite results from finite inputs ----------------------------------------

namespace {

// The first bad element of one output tensor [B, T, H, D] (out, dq, dk, dv) as a BadOutput.
void first_bad_row(const char* name, const TensorView& t, const Tokens& tokens, BadOutput& bad) {
  const kernel::NonFinite f = kernel::find_non_finite(t);
  if (!f.found()) return;
  bad.take({f.b, tokens.positions[f.t], f.h, detail::concat(
      name, " = ", f.value, " at token position ", tokens.positions[f.t], ", batch ", f.b,
      ", head ", f.h, ", dim ", f.d, " (local row ", f.t, ")")});
}

constexpr const char* kOverflowHint =
    "the attention scores (q . k x scale) or the gradients go beyond the fp32 range (3.4e38) "
    "although the inputs are finite; scale q, k (or dout) down, or lower the softmax scale";

}  // namespace

void BadOutput::take(const BadOutput& other) {
  if (other.batch < 0) return;
  if (batch < 0 || std::tie(other.batch, other.position, other.head) <
                       std::tie(batch, position, head))
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
      for (int64_t t = 0; t < T; ++t) any |= std::isnan(row[t * lse.stride(2)]) ||
                                             row[t * lse.stride(2)] == INFINITY;
      if (!any) continue;
      for (int64_t t = 0; t < T; ++t) {
        const float x = row[t * lse.stride(2)];
        if (!std::isnan(x) && x != INFINITY) continue;
        bad.take({b, tokens.positions[t], h, detail::concat(
            "lse = ", x, " at token position ", tokens.positions[t], ", batch ", b, ", head ", h,
            " (local row ", t, ")")});
      }
    }
  first_bad_row("out", out, tokens, bad);
  return bad;
}

BadOutput check_backward_outputs(const TensorView& dq, const TensorView& dk,
                                 const TensorView& dv, const Tokens& tokens) {
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

CallRecord::CallRecord(StrategyStats& stats, Device& device, std::vector<Communicator*> comms)
    : stats_(stats), device_(device), comms_(std::move(comms)) {
  stats_ = StrategyStats{};
  for (Communicator* c : comms_) {
    sent0_ += c->counters().bytes_sent;
    received0_ += c->counters().bytes_received;
  }
  device0_ = device_.counters();
  held0_ = device_.held_bytes();
  device_.reset_peak();
  t0_ = now_seconds();
}

void CallRecord::finish(const Run& run) {
  device_.synchronize();
  uint64_t sent = 0, received = 0;
  for (Communicator* c : comms_) {
    sent += c->counters().bytes_sent;
    received += c->counters().bytes_received;
  }
  const DeviceCounters d = device_.counters();
  stats_.bytes_sent = sent - sent0_;
  stats_.bytes_received = received - received0_;
  stats_.attention_flops = d.flops - device0_.flops;
  stats_.busy_seconds = d.busy_seconds - device0_.busy_seconds;
  stats_.comm_wait_seconds = d.wait_seconds - device0_.wait_seconds + run.host_wait_seconds;
  stats_.peak_bytes = device_.peak_bytes() - held0_;
  stats_.wall_seconds = now_seconds() - t0_;
}

DeviceBuffer KvPacking::pack(Device& dev, Stream s, const TensorView& k, const TensorView& v,
                             const Tokens& t) const {
  DeviceBuffer b = dev.alloc(bytes());
  dev.pack_kv(s, k, v, t, documents, this->k(b), this->v(b), b.data() + 2 * kv_bytes());
  return b;
}

TensorView KvPacking::k(const DeviceBuffer& b) const {
  return b.view(dtype, {batch, tokens, heads, d});
}

TensorView KvPacking::v(const DeviceBuffer& b) const {
  return b.view(dtype, {batch, tokens, heads, d}, kv_bytes());
}

Tokens KvPacking::tokens_of(const DeviceBuffer& b) const {
  Tokens t;
  t.positions = {reinterpret_cast<const int64_t*>(b.data() + 2 * kv_bytes()), size_t(tokens)};
  if (documents)
    t.documents = {reinterpret_cast<const int32_t*>(b.data() + 2 * kv_bytes() + tokens * 8),
                   size_t(tokens)};
  return t;
}

}  // namespace strategy
}  // namespace ctxpar

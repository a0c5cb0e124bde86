// Prefill: T new tokens of one sequence against its C cached ones, the queries and the new K/V
// split over the ranks by the cache's placement rule. Two ways (docs/inference.md, "Prefill"):
//
//   pass-KV: queries stay; every rank's shard (cache + its new rows) travels around the ring,
//            P-1 hops, as the ring strategy moves K/V (src/strategy/ring.cc). Moves the whole
//            cache: (P-1) (C + T) (2 Hkv D elements + position) bytes, all ranks together.
//   pass-Q:  shards stay; every rank's query rows travel around the ring, each rank attends
//            them over its shard, and sends the partial (O, LSE) home, where the P partials
//            merge in rank order. Moves (P-1) T (Hq D elements + position + Hq (D + 1) fp32)
//            bytes: fewer when C >> T (the paper's persistent-KV prefill).
//
// Both first append this rank's new K/V rows to its shard (no communication: the rows it is
// given are the ones the rule gives it), so that the new tokens see each other.
#include <algorithm>
#include <cstring>
#include <optional>

#include "ctxpar/error.h"
#include "inference/internal.h"
#include "strategy/ring_steps.h"

namespace ctxpar {
namespace {

constexpr int kRingTag = 1 << 20;              // + step: the travelling shard or query block
constexpr int kPartialTag = (1 << 20) + 8192;  // + producing rank: a partial (O, LSE) going home

int64_t held(const PrefillShape& s, int64_t n, int rank) {
  return placement_held_by(n, rank, s.ranks, s.block);
}
// The travelling blocks (strategy::KvPacking): a shard of n tokens [k | v | positions |
// documents] (pass-KV), and n query rows [q | positions | documents] (pass-Q).
strategy::KvPacking shard_packing(const PrefillShape& s, int64_t n) {
  return {1, n, s.hkv, s.head_dim, s.kv_dtype, s.documents};
}
strategy::KvPacking query_packing(const PrefillShape& s, int64_t n) {
  return {1, n, s.hq, s.head_dim, s.q_dtype, s.documents, 1};
}
// Pass-Q's partial result for n query rows.
PartialLayout partial_of(const PrefillShape& s, int64_t n) { return {1, n, s.hq, s.head_dim}; }

// ---- pass-KV ------------------------------------------------------------------------------

void pass_kv(KvCache& cache, int64_t seq, const PrefillShape& sh, const TensorView& q,
             const Tokens& q_tokens, const TensorView& out, const TensorView& lse) {
  Device& dev = cache.device();
  Communicator& comm = cache.comm();
  const KvCacheOptions& o = cache.options();
  const int64_t n_total = sh.cached + sh.new_tokens, tl = q.dim(1);
  auto shard = [&](int owner) { return shard_packing(sh, held(sh, n_total, owner)); };
  std::optional<DeviceForwardState> state;
  if (tl > 0) state.emplace(dev, 1, tl, q.dim(2), q.dim(3));
  const strategy::KvBlock mine{cache.k(seq), cache.v(seq), cache.local_token_ids(seq)};
  DeviceBuffer block;
  if (comm.size() > 1 && shard(comm.rank()).tokens > 0)
    block = shard(comm.rank()).pack(dev, kComputeStream, mine);
  auto compute = [&](int s, int holding, const DeviceBuffer& b) {
    const strategy::KvPacking pack = shard(holding);
    if (tl == 0 || pack.tokens == 0) return;
    const strategy::KvBlock kv = s == 0 ? mine : pack.block(b);
    dev.forward_block(kComputeStream, q, q_tokens, kv.k, kv.v, kv.tokens, o.mask, state->get(),
                      o.kernel);
  };
  strategy::ring_steps(dev, comm, std::move(block),
                       {kRingTag, [&](int owner) { return shard(owner).bytes(); }, compute});
  if (tl > 0) dev.forward_finalize(kComputeStream, state->get(), out, lse, o.kernel);
}

// ---- pass-Q -------------------------------------------------------------------------------

// This rank's query rows as a travelling block, packed on the host and uploaded (the caller's
// q may be strided); empty when it has none.
DeviceBuffer pack_queries(Device& dev, const strategy::KvPacking& pack, const TensorView& q,
                          const Tokens& q_tokens) {
  if (pack.tokens == 0) return {};
  std::vector<std::byte> host(pack.bytes());
  const Tensor qc = Tensor::copy_of(q);
  std::memcpy(host.data(), qc.data(), qc.bytes());
  std::memcpy(host.data() + pack.tokens_offset(), q_tokens.positions.data(),
              size_t(pack.tokens) * 8);
  if (pack.documents)
    std::memcpy(host.data() + pack.tokens_offset() + pack.tokens * 8, q_tokens.documents.data(),
                size_t(pack.tokens) * 4);
  return dev.upload(host.data(), host.size());
}

void pass_q(KvCache& cache, int64_t seq, const PrefillShape& sh, const TensorView& q,
            const Tokens& q_tokens, const TensorView& out, const TensorView& lse) {
  Device& dev = cache.device();
  Communicator& comm = cache.comm();
  const KvCacheOptions& o = cache.options();
  const int p = comm.size(), me = comm.rank();
  const int64_t hq = q.dim(2), d = q.dim(3), tl = q.dim(1);
  auto queries = [&](int owner) {
    return query_packing(sh,
                         held(sh, sh.cached + sh.new_tokens, owner) - held(sh, sh.cached, owner));
  };

  std::vector<DeviceBuffer> partials(static_cast<size_t>(p));
  std::vector<DeviceBuffer> outgoing(static_cast<size_t>(p));  // partials for other ranks
  std::vector<DeviceForwardState> states;
  states.reserve(size_t(p));
  auto compute = [&](int, int holding, const DeviceBuffer& b) {
    const strategy::KvPacking pack = queries(holding);
    const int64_t n = pack.tokens;
    if (n == 0) return;
    states.emplace_back(dev, 1, n, hq, d);
    const PartialLayout partial = partial_of(sh, n);
    DeviceBuffer part = dev.alloc(partial.bytes());
    if (cache.local_tokens(seq) > 0)
      dev.forward_block(kComputeStream, pack.k(b), pack.tokens_of(b), cache.k(seq), cache.v(seq),
                        cache.local_token_ids(seq), o.mask, states.back().get(), o.kernel);
    dev.forward_finalize(kComputeStream, states.back().get(), partial.o(part), partial.lse(part),
                         o.kernel);
    (holding == me ? partials[me] : outgoing[holding]) = std::move(part);
  };
  strategy::ring_steps(dev, comm, pack_queries(dev, queries(me), q, q_tokens),
                       {kRingTag, [&](int owner) { return queries(owner).bytes(); }, compute});
  // The partials go home once the ring is done. Posted earlier, they would sit in the queue of
  // transfers ahead of the ring's next hop, and the cpu device completes its transfers in
  // order: a home rank's receive, waiting for a rank that waits for the ring, would block the
  // ring. Receives first, then sends, on every rank: nothing waits for a receive not posted.
  dev.wait(kCommStream, dev.record(kComputeStream));
  for (int r = 0; r < p; ++r)
    if (r != me && tl > 0)
      partials[r] = dev.recv(kCommStream, comm, partial_of(sh, tl).bytes(), r, kPartialTag + r);
  for (int r = 0; r < p; ++r)
    if (!outgoing[r].empty()) dev.send(kCommStream, comm, outgoing[r], r, kPartialTag + me);
  if (tl == 0) {
    dev.synchronize();  // the sends read `outgoing` until done
    return;
  }
  dev.wait(kComputeStream, dev.record(kCommStream));
  const PartialLayout mine = partial_of(sh, tl);
  for (int r = 1; r < p; ++r)  // producer rank order: the same bits whatever arrives first
    dev.merge(kComputeStream, mine.o(partials[0]), mine.lse(partials[0]), mine.o(partials[r]),
              mine.lse(partials[r]));
  dev.copy(kComputeStream, mine.o(partials[0]), out);
  dev.copy(kComputeStream, mine.lse(partials[0]), lse);
  dev.synchronize();  // the sends read `outgoing` until done
}

}  // namespace

int64_t placement_held_by(int64_t n, int rank, int ranks, int64_t block) {
  const int64_t cycle = block * ranks, rest = n % cycle - rank * block;
  return n / cycle * block + std::clamp<int64_t>(rest, 0, block);
}

PrefillBytes predict_prefill_bytes(const PrefillShape& s) {
  CTXPAR_CHECK(s.ranks >= 1 && s.block >= 1 && s.cached >= 0 && s.new_tokens >= 0,
               "predict_prefill_bytes: ranks and block must be >= 1, token counts >= 0");
  PrefillBytes b;
  if (s.ranks == 1) return b;
  const uint64_t hops = uint64_t(s.ranks - 1);
  for (int r = 0; r < s.ranks; ++r) {
    const int64_t n = held(s, s.cached + s.new_tokens, r), rows = n - held(s, s.cached, r);
    b.pass_kv += hops * shard_packing(s, n).bytes();
    const size_t partial = rows > 0 ? partial_of(s, rows).bytes() : 0;
    b.pass_q += hops * (query_packing(s, rows).bytes() + partial);
  }
  return b;
}

PrefillMode choose_prefill(const PrefillShape& shape, PrefillMode forced) {
  if (forced != PrefillMode::automatic) return forced;
  const PrefillBytes b = predict_prefill_bytes(shape);
  return b.pass_q < b.pass_kv ? PrefillMode::pass_q : PrefillMode::pass_kv;
}

PrefillMode prefill(KvCache& cache, int64_t seq, int64_t new_tokens, const TensorView& q,
                    const TensorView& k, const TensorView& v, const TensorView& out,
                    const TensorView& lse, PrefillMode mode, std::span<const int32_t> documents) {
  const PrefillRequest request{seq, new_tokens, q, k, v, out, lse, documents};
  return prefill(cache, std::span(&request, 1), mode)[0];
}

std::vector<PrefillMode> prefill(KvCache& cache, std::span<const PrefillRequest> requests,
                                 PrefillMode mode) {
  // Per request: q, out [1, Tl, Hq, D]; k, v [1, Tl, Hkv, D]; lse [1, Hq, Tl]: this rank's Tl
  // new rows of its sequence.
  // The options first: the checks below read them, so a rank whose options differ would be
  // refused for its tensors' shapes instead of the option that differs.
  InferenceAccess::agree_kernels(cache, "prefill");
  const KvCacheOptions& o = cache.options();
  Communicator& comm = cache.comm();
  const size_t n = requests.size();
  // Every check, this rank's rows' values and its memory included, goes into the verdict the
  // ranks share before anything is stored or sent: a rank that refused alone once left its
  // ring messages queued (the next call took them for its own), and a NaN key stored before
  // the kernel refused it stayed in the cache, which decode trusts (Note [The cache checks
  // K/V at the door]). With several requests, all are checked before any is stored: one bad
  // prompt refuses the call and changes nothing.
  std::string error;
  std::vector<std::vector<int64_t>> indices(n);
  std::vector<int64_t> planned;
  std::vector<PrefillShape> shapes(n);
  Signature sig{{"requests (prompts in the call)", std::to_string(n)},
                {"slot table (live slots and their lengths)", slot_table_hash(cache)},
                {"mode", prefill_mode_name(mode)}};
  try {
    CTXPAR_CHECK(n >= 1, "prefill: no request given (pass at least one prompt)");
    std::vector<int64_t> lengths;
    std::vector<bool> named;
    for (size_t i = 0; i < n; ++i) {
      const PrefillRequest& r = requests[i];
      PrefillShape& sh = shapes[i];
      // One prompt's errors name the request where there are several.
      const std::string which = n > 1 ? detail::concat("request ", i, " (seq ", r.seq, "): ") : "";
      try {
        CTXPAR_CHECK(r.new_tokens >= 1, "prefill: new_tokens must be >= 1, got ", r.new_tokens);
        sh.cached = cache.tokens(r.seq);  // in range and live
        if (lengths.empty()) {
          lengths = lengths_after(cache, r.seq, 0);
          named.assign(lengths.size(), false);
        }
        CTXPAR_CHECK(!named[size_t(r.seq)], "prefill: sequence ", r.seq, " has two requests in ",
                     "one call; give it one (all its new tokens), or make two calls");
        named[size_t(r.seq)] = true;
        lengths[size_t(r.seq)] += r.new_tokens;
        indices[i] = cache.placement(sh.cached, r.new_tokens, comm.rank());
        const int64_t tl = int64_t(indices[i].size());
        const TensorView& q = r.q;
        CTXPAR_CHECK(q.ndim() == 4, "q: expected [1, Tl, Hq, D], got ", shape_str(q.shape()));
        kernel::check_activation("q", q, true, {1, tl, q.dim(2), o.head_dim});
        CTXPAR_CHECK(q.dim(2) % o.kv_heads == 0, "q: query heads (", q.dim(2), ") must be a ",
                     "multiple of KvCacheOptions::kv_heads = ", o.kv_heads);
        kernel::check_activation("out", r.out, true, {1, tl, q.dim(2), o.head_dim});
        kernel::check_activation("lse", r.lse, false, {1, q.dim(2), tl}, "[B, H, T]");
        const std::vector<int64_t>& rows = indices[i];
        auto where = [&](int64_t, int64_t t) {
          return std::pair<int64_t, int64_t>{r.seq, rows[size_t(t)]};
        };
        check_rows_finite("q", q, cache.device(), where, false);
        check_new_kv(o, cache.device(), r.k, r.v, tl, r.documents, "row of this rank", where);
        sh.hq = q.dim(2);
        sh.q_dtype = q.dtype();
      } catch (const Error& e) {
        throw Error(which + e.what());
      }
    }
    planned = InferenceAccess::plan_growth(cache, lengths);
  } catch (const Error& e) {
    error = e.what();
  }
  for (size_t i = 0; i < n; ++i) {
    const PrefillRequest& r = requests[i];
    PrefillShape& sh = shapes[i];
    sh.new_tokens = r.new_tokens;
    sh.ranks = comm.size();
    sh.hkv = o.kv_heads;
    sh.head_dim = o.head_dim;
    sh.block = o.block;
    sh.kv_dtype = o.dtype;
    sh.documents = o.mask.documents;
    // Request 0's fields keep the names a single prompt's refusal has always had.
    const std::string at = i == 0 ? "" : detail::concat(" of request ", i);
    sig.push_back({"seq" + at, std::to_string(r.seq)});
    sig.push_back({"new_tokens" + at, std::to_string(r.new_tokens)});
    sig.push_back({"cached tokens (KvCache::tokens(seq))" + at, std::to_string(sh.cached)});
    sig.push_back({"query heads (q.dim(2))" + at, std::to_string(sh.hq)});
    sig.push_back({"q dtype" + at, dtype_name(sh.q_dtype)});
  }
  require_agreement(comm, "prefill", sig, error);

  std::vector<PrefillMode> modes;
  InferenceStats& stats = InferenceAccess::stats(cache) = InferenceStats{};
  strategy::CallRecord record(cache.device(), {&comm});
  InferenceAccess::grow(cache, planned);
  for (size_t i = 0; i < n; ++i) {
    const PrefillRequest& r = requests[i];
    const PrefillShape& sh = shapes[i];
    const PrefillMode ran = choose_prefill(sh, mode);
    modes.push_back(ran);
    if (!indices[i].empty())
      InferenceAccess::store(cache, r.seq, indices[i], r.k, r.v, r.documents);
    InferenceAccess::set_length(cache, r.seq, sh.cached + r.new_tokens);
    Tokens q_tokens{indices[i], o.mask.documents ? r.documents : std::span<const int32_t>{}};
    if (ran == PrefillMode::pass_q)
      pass_q(cache, r.seq, sh, r.q, q_tokens, r.out, r.lse);
    else
      pass_kv(cache, r.seq, sh, r.q, q_tokens, r.out, r.lse);
  }
  InferenceAccess::drop_copies(cache);  // the pages gathered for the kernel
  stats.mode = modes.back();
  record_stats(stats, record.finish());
  return modes;
}

}  // namespace ctxpar

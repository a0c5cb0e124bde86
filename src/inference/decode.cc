// Decode: Tn new tokens of each of B sequences against the spread KV cache. See
// docs/inference.md, "Decode".
//
//   every rank                      (q, k_new, v_new replicated)
//     append k_new, v_new rows the placement rule gives this rank
//     (O_r, LSE_r) = attention(q, this rank's shard)          [B, Tn, Hq, D], [B, Hq, Tn]
//   all-gather (O_r, LSE_r), r = 0..P-1
//   O, LSE = merge(...merge(merge(O_0, O_1), O_2)..., O_{P-1})  rank order, on every rank
//   (KvCacheOptions::merge: or passed along a chain in rank order, the same bits, or merged by
//   recursive doubling, other bits)
//
// The merge order is fixed (not "whoever arrives first"), so out is bitwise the same on every
// rank and run; each shard's tokens depend only on their indices, so out does not depend on how
// the earlier tokens were cut into prefill and decode calls either.
#include <algorithm>
#include <cstring>
#include <numeric>

#include "ctxpar/error.h"
#include "inference/internal.h"
#include "kernel/decode.h"

namespace ctxpar {
namespace {
constexpr int64_t kDecodeChunk = 1024;  // Note [Decode streams the shard in chunks]

// The call's checks, before anything is stored: the sequences, shapes, then every input's
// values (the same rows on every rank: the same verdict).
void check_decode_args(KvCache& cache, std::span<const int64_t> seqs, const TensorView& q,
                       const TensorView& k_new, const TensorView& v_new, const TensorView& out,
                       const TensorView& lse, std::span<const int32_t> documents) {
  const KvCacheOptions& o = cache.options();
  const int64_t b = int64_t(seqs.size()), d = o.head_dim;
  CTXPAR_CHECK(b >= 1, "decode: no sequence to decode (seqs is empty, or no sequence is live: ",
               "add() one)");
  std::vector<bool> named(size_t(cache.slots()), false);
  for (int64_t s : seqs) {
    cache.tokens(s);  // in range and live
    CTXPAR_CHECK(!named[size_t(s)], "seqs: sequence ", s, " is named twice; name each once");
    named[size_t(s)] = true;
  }
  CTXPAR_CHECK(q.ndim() == 4, "q: expected [B, Tn, Hq, D], got ", shape_str(q.shape()));
  const int64_t tn = q.dim(1), hq = q.dim(2);
  CTXPAR_CHECK(tn >= 1, "q: decode needs at least one new token per sequence (Tn >= 1)");
  kernel::check_activation("q", q, true, {b, tn, hq, d});
  CTXPAR_CHECK(hq % o.kv_heads == 0, "q: query heads (", hq, ") must be a multiple of the ",
               "cache's KV heads (KvCacheOptions::kv_heads = ", o.kv_heads, ")");
  kernel::check_activation("k_new", k_new, true, {b, tn, o.kv_heads, d});
  kernel::check_activation("v_new", v_new, true, {b, tn, o.kv_heads, d});
  kernel::check_activation("out", out, true, {b, tn, hq, d});
  kernel::check_activation("lse", lse, false, {b, hq, tn}, "[B, H, T]");
  CTXPAR_CHECK(!o.mask.documents || int64_t(documents.size()) == b * tn, "documents: the mask ",
               "uses documents: give B * Tn = ", b * tn, " ids (row-major), got ",
               documents.size());
  auto where = [&](int64_t i, int64_t t) {
    return std::pair<int64_t, int64_t>{seqs[i], cache.tokens(seqs[i]) + t};
  };
  check_rows_finite("q", q, cache.device(), where, false);
  check_rows_finite("k_new", k_new, cache.device(), where);
  check_rows_finite("v_new", v_new, cache.device(), where);
}

std::string joined(std::span<const int64_t> xs) {
  std::string text;
  for (int64_t x : xs) {
    if (!text.empty()) text += ',';
    text += std::to_string(x);
  }
  return text;
}

// What every rank must agree on before decode changes anything. Read without throwing: a
// rank whose own arguments are bad still gives a signature (its error travels beside it).
Signature decode_signature(const KvCache& cache, std::span<const int64_t> seqs, const TensorView& q,
                           const TensorView& k_new, const TensorView& v_new) {
  std::vector<int64_t> lengths;
  for (int64_t s : seqs)
    lengths.push_back(s >= 0 && s < cache.slots() && cache.live(s) ? cache.tokens(s) : -1);
  const bool q4 = q.ndim() == 4;
  Signature sig{{"seqs (the sequences decoded)", joined(seqs)},
                {"lengths of the decoded sequences (KvCache::tokens)", joined(lengths)},
                {"slot table (live slots and their lengths)", slot_table_hash(cache)},
                {"new tokens per sequence (q.dim(1))", q4 ? std::to_string(q.dim(1)) : "?"},
                {"query heads (q.dim(2))", q4 ? std::to_string(q.dim(2)) : "?"},
                {"q dtype", dtype_name(q.dtype())}};
  const std::string h = inputs_hash(cache, {q, k_new, v_new});
  if (!h.empty()) sig.push_back({"q, k_new, v_new (a hash of their values)", h});
  return sig;
}

// Note [Decode packs a KV head's query heads as rows]: one new token has Hq query rows
// against the whole shard, and g = Hq / Hkv of them read the same KV head. Passed as they
// are, the kernel would stream the shard's K/V once per query head, and decode is bound by
// that stream. Packed as q_g [1, Tn * g, Hkv, D] (row t * g + j = query head h * g + j of
// token t, for KV head h; each row has its token's position), each KV head is read once for
// its g heads. The partials stay in this layout; the merged result is unpacked into out, lse.
struct HeadRows {
  int64_t b, tn, hkv, g, d;
  int64_t rows() const { return tn * g; }
  // q's (or out's) g heads of KV head h of token t of sequence s, as [1, g, Hkv, D].
  TensorView heads_of(const TensorView& t4, int64_t s, int64_t t) const {
    return TensorView(
        static_cast<std::byte*>(t4.data()) + t4.offset(s, t) * int64_t(dtype_size(t4.dtype())),
        t4.dtype(), {1, g, hkv, d}, {0, t4.stride(2), g * t4.stride(2), 1});
  }
};

// q as q_g [B, Tn g, Hkv, D], with each row's position (and document) per sequence.
struct PackedQueries {
  DeviceBuffer buffer;
  TensorView q_g;
  std::vector<int64_t> positions;
  std::vector<int32_t> documents;
  // Sequence s's rows' tokens.
  Tokens tokens(int64_t s, int64_t rows) const {
    Tokens t;
    t.positions = std::span<const int64_t>(positions).subspan(size_t(s * rows), size_t(rows));
    if (!documents.empty())
      t.documents = std::span<const int32_t>(documents).subspan(size_t(s * rows), size_t(rows));
    return t;
  }
};

PackedQueries pack_queries(Device& dev, const HeadRows& hr, const TensorView& q,
                           const std::vector<int64_t>& positions,
                           std::span<const int32_t> documents, bool with_documents) {
  PackedQueries pq;
  const int64_t rows = hr.rows();
  pq.buffer = dev.alloc(size_t(hr.b * rows * hr.hkv * hr.d) * dtype_size(q.dtype()));
  pq.q_g = pq.buffer.view(q.dtype(), {hr.b, rows, hr.hkv, hr.d});
  for (int64_t s = 0; s < hr.b; ++s)
    for (int64_t t = 0; t < hr.tn; ++t) {
      dev.copy(kComputeStream, hr.heads_of(q, s, t),
               pq.q_g.slice(0, s, s + 1).slice(1, t * hr.g, t * hr.g + hr.g));
      for (int64_t j = 0; j < hr.g; ++j) {
        pq.positions.push_back(positions[s * hr.tn + t]);
        if (with_documents) pq.documents.push_back(documents[s * hr.tn + t]);
      }
    }
  return pq;
}

// The P ranks' partial results, one message each: [O fp32 [B, Tn g, Hkv, D] | LSE [B, Hkv,
// Tn g]]. Ranks whose calls or caches differ were refused before (decode_signature).
struct Partials {
  HeadRows hr;
  PartialLayout layout;
  size_t part_bytes;
  DeviceBuffer parts;
  Partials(Device& dev, const HeadRows& h, int p)
      : hr(h),
        layout{h.b, h.rows(), h.hkv, h.d},
        part_bytes(layout.bytes()),
        parts(dev.alloc(part_bytes * size_t(p))) {}
  TensorView o(int r) const { return layout.o(parts, r * part_bytes); }
  TensorView lse(int r) const { return layout.lse(parts, r * part_bytes); }
};

// This rank's partial of the sequences seqs[i], i in `which` (the others' are left alone): each
// one's packed queries over its shard, into parts.o(me) and parts.lse(me).
void attend_shards(KvCache& cache, std::span<const int64_t> seqs, std::span<const int64_t> which,
                   const PackedQueries& pq, const Partials& parts, int me) {
  Device& dev = cache.device();
  const KvCacheOptions& o = cache.options();
  const HeadRows& hr = parts.hr;
  std::vector<DeviceForwardState> states;
  states.reserve(which.size());
  DeviceBuffer scratch;  // one chunk of K/V rows gathered from the pages
  for (const int64_t i : which) {
    const int64_t s = seqs[i];
    states.emplace_back(dev, 1, hr.rows(), hr.hkv, hr.d);
    const Tokens qt = pq.tokens(i, hr.rows());
    // Note [Decode streams the shard in chunks]: the kernel packs the K/V it is given (K^T
    // and V tiles) before computing, which for a whole shard writes a copy of it and reads it
    // back from memory. Given kDecodeChunk tokens at a time, the packed chunk stays in the
    // cache. The chunks' bounds depend on local indices only, so the bits still depend on the
    // tokens alone (not on how they were prefilled).
    const int64_t n = cache.local_tokens(s);
    const Tokens kt = cache.local_token_ids(s);
    KernelConfig checked = o.kernel;  // Note [The cache checks K/V at the door]
    checked.kv_checked = true;
    for (int64_t a = 0; a < n; a += kDecodeChunk) {
      const int64_t e = std::min(n, a + kDecodeChunk);
      Tokens ct;
      ct.positions = kt.positions.subspan(size_t(a), size_t(e - a));
      if (o.mask.documents) ct.documents = kt.documents.subspan(size_t(a), size_t(e - a));
      // The chunk's rows from their pages into one scratch chunk (stream-ordered: the next
      // chunk's copies follow this chunk's kernel), the same rows as a contiguous shard's.
      const auto [k, v] = InferenceAccess::local_rows(cache, s, a, e, scratch);
      dev.forward_block(kComputeStream, pq.q_g.slice(0, i, i + 1), qt, k, v, ct, o.mask,
                        states.back().get(), checked);
    }
    dev.forward_finalize(kComputeStream, states.back().get(), parts.o(me).slice(0, i, i + 1),
                         parts.lse(me).slice(0, i, i + 1), o.kernel);
  }
  dev.synchronize();
}

// The same partials through the in-place kernel (kernel/decode.h): q read as it is, each
// shard where it lies. Whether a call takes it: in_place(). Returns the indices i of the
// sequences the kernel refused (with documents, a query whose document's keys are not one run
// of the shard): the caller computes their partials on the tile path.
//
// Note [Each rank picks its documents' path]: that choice is this rank's, per sequence, from its
// own shard, and needs no agreement. Every rank merges the same P partials (merge_partials), so
// out and lse are the same bits on every rank whichever kernel made each partial; and the choice
// is a function of the sequence's token ids on this rank and of the call's queries, which the
// placement fixes by token index, so a run's bits are reproducible, do not depend on the other
// sequences of the call nor on how the tokens were prefilled. (The option decode_in_place is
// agreed: it is not data, and ranks that differ in it would give bits no single setting gives.)
std::vector<int64_t> attend_in_place(KvCache& cache, std::span<const int64_t> seqs,
                                     const TensorView& q, const std::vector<int64_t>& positions,
                                     std::span<const int32_t> documents, const Partials& parts,
                                     int me) {
  Device& dev = cache.device();
  dev.synchronize();  // the host reads the shards: the new rows' copies are done (sim queues them)
  const KvCacheOptions& o = cache.options();
  const int64_t tn = parts.hr.tn;
  const double t0 = strategy::now_seconds();
  std::vector<int64_t> refused;
  for (int64_t i = 0; i < parts.hr.b; ++i) {
    const int64_t s = seqs[i];
    const PageViews pages = InferenceAccess::local_pages(cache, s);  // read where they lie
    const Tokens kt = cache.local_token_ids(s);
    kernel::DecodeShard p;
    p.q = q.slice(0, i, i + 1);
    p.q_positions = std::span<const int64_t>(positions).subspan(size_t(i * tn), size_t(tn));
    if (o.mask.documents) {
      p.q_documents = documents.subspan(size_t(i * tn), size_t(tn));
      p.k_documents = kt.documents;
    }
    p.k_pages = pages.k;
    p.v_pages = pages.v;
    p.page_rows = o.block;
    p.k_positions = kt.positions;
    p.mask = o.mask;
    p.scale = o.kernel.scale;
    p.threads = o.kernel.threads;
    p.round_p = o.dtype == DType::bf16 && o.kernel.bf16_tier == Bf16Tier::fast;
    p.out = parts.o(me).slice(0, i, i + 1);
    p.lse = parts.lse(me).slice(0, i, i + 1);
    if (!kernel::decode_in_place(p)) refused.push_back(i);
  }
  InferenceAccess::stats(cache).attention_seconds += strategy::now_seconds() - t0;
  return refused;
}

// Whether decode reads the shards in place: asked for, a mask of one key range per query (with
// documents, per sequence where their keys are runs: attend_in_place), and a device whose
// memory the host reads.
bool in_place(const KvCacheOptions& o) {
  return o.decode_in_place && !o.mask.sliced && o.device.kind != DeviceKind::cuda;
}

// Tags of decode's point-to-point merges (DecodeMerge::chain / tree) on the cache's
// communicator: a round's own tag, so a timeout names it.
constexpr int kMergeTag = 7300;

// Sends `bytes` from p to `peer` (a copy: the threads transport hands the buffer over).
Request send_copy(Communicator& comm, const std::byte* p, size_t bytes, int peer, int tag) {
  Buffer b(bytes);
  std::memcpy(b.data(), p, bytes);
  return comm.isend(std::move(b), peer, tag);
}
void recv_into(Communicator& comm, std::byte* p, size_t bytes, int peer, int tag) {
  Request r = comm.irecv(bytes, peer, tag);
  r.wait();
  const Buffer b = r.take();
  std::memcpy(p, b.data(), bytes);
}

// Merges the ranks' partials into parts.o(0), parts.lse(0) (DecodeMerge says how): the same bits
// on every rank. On the host, after the device is synchronised (the communicator's rule,
// device.h). Slot 0 holds the running result; slot 1 (P >= 2) what a peer sent.
void merge_partials(Communicator& comm, Partials& parts, DecodeMerge how) {
  const int p = comm.size(), me = comm.rank();
  const size_t part_bytes = parts.part_bytes;
  std::byte* slot0 = parts.parts.data();
  std::byte* slot1 = slot0 + part_bytes;
  if (how == DecodeMerge::allgather) {
    // The all-gather's receive buffer holds this rank's own part at its place already.
    Buffer mine(part_bytes);
    std::memcpy(mine.data(), slot0 + me * part_bytes, part_bytes);
    comm.allgather(mine.data(), slot0, part_bytes);
    for (int r = 1; r < p; ++r)  // rank order: the same bits on every rank
      merge(parts.o(0), parts.lse(0), parts.o(r), parts.lse(r));  // host memory
    return;
  }
  if (me != 0) std::memcpy(slot0, slot0 + me * part_bytes, part_bytes);
  if (how == DecodeMerge::chain) {
    if (me > 0) {  // slot 0 <- merge(ranks 0..me-1), then mine after it: rank order
      std::memcpy(slot1, slot0, part_bytes);
      recv_into(comm, slot0, part_bytes, me - 1, kMergeTag);
      merge(parts.o(0), parts.lse(0), parts.o(1), parts.lse(1));
    }
    if (me < p - 1) {
      send_copy(comm, slot0, part_bytes, me + 1, kMergeTag).wait();
      recv_into(comm, slot0, part_bytes, p - 1, kMergeTag + 1);
    } else {
      std::vector<Request> sends;
      for (int r = 0; r < p - 1; ++r)
        sends.push_back(send_copy(comm, slot0, part_bytes, r, kMergeTag + 1));
      for (Request& r : sends) r.wait();
    }
    return;
  }
  // tree: the ranks past the largest power of two q <= P fold into rank r - q first, the q
  // ranks exchange with r ^ b for b = 1, 2, ..., q / 2, and the folded ranks get the result back.
  int q = 1;
  while (q * 2 <= p) q *= 2;
  int tag = kMergeTag + 2;
  // One pairwise step: this rank and `peer` both end with merge(lower's, higher's).
  auto pair = [&](int peer) {
    Request s = send_copy(comm, slot0, part_bytes, peer, tag);
    recv_into(comm, slot1, part_bytes, peer, tag);
    s.wait();
    if (me < peer) {
      merge(parts.o(0), parts.lse(0), parts.o(1), parts.lse(1));
    } else {
      merge(parts.o(1), parts.lse(1), parts.o(0), parts.lse(0));
      std::memcpy(slot0, slot1, part_bytes);
    }
  };
  if (me >= q) {
    send_copy(comm, slot0, part_bytes, me - q, tag).wait();
    recv_into(comm, slot0, part_bytes, me - q, kMergeTag + 63);
    return;
  }
  if (me + q < p) {
    recv_into(comm, slot1, part_bytes, me + q, tag);
    merge(parts.o(0), parts.lse(0), parts.o(1), parts.lse(1));
  }
  for (int b = 1; b < q; b *= 2) {
    ++tag;
    pair(me ^ b);
  }
  if (me + q < p) send_copy(comm, slot0, part_bytes, me + q, kMergeTag + 63).wait();
}

// The merged result (Note [Decode packs a KV head's query heads as rows]) into out, lse.
void unpack(Device& dev, const Partials& parts, const TensorView& out, const TensorView& lse) {
  const HeadRows& hr = parts.hr;
  const int64_t g = hr.g, hkv = hr.hkv;
  for (int64_t s = 0; s < hr.b; ++s)
    for (int64_t t = 0; t < hr.tn; ++t) {
      dev.copy(kComputeStream, parts.o(0).slice(0, s, s + 1).slice(1, t * g, t * g + g),
               hr.heads_of(out, s, t));
      // lse_g[s, h, t g + j] -> lse[s, h g + j, t]
      const TensorView from = parts.lse(0);
      dev.copy(kComputeStream,
               TensorView(from.ptr<float>() + from.offset(s, 0, t * g), DType::f32, {1, hkv, g},
                          {0, from.stride(1), 1}),
               TensorView(lse.ptr<float>() + lse.offset(s, 0, t), DType::f32, {1, hkv, g},
                          {0, g * lse.stride(1), lse.stride(1)}));
    }
}

}  // namespace

DecodeMergeTimes time_decode_merges(Communicator& comm, const KvCacheOptions& o, int64_t hq,
                                    int64_t tn, int reps) {
  CTXPAR_CHECK(reps >= 1 && tn >= 1 && o.sequences >= 1 && o.kv_heads >= 1 && hq >= 1 &&
                   hq % o.kv_heads == 0,
               "time_decode_merges: reps, tn, sequences >= 1 and kv_heads dividing hq");
  DecodeMergeTimes t;
  if (comm.size() == 1) return t;
  const std::unique_ptr<Device> dev = make_device(DeviceOptions{}, comm.rank());
  const HeadRows hr{o.sequences, tn, o.kv_heads, hq / o.kv_heads, o.head_dim};
  Partials parts(*dev, hr, comm.size());
  std::memset(parts.parts.data(), 0, parts.part_bytes * size_t(comm.size()));  // finite partials
  const DecodeMerge kinds[] = {DecodeMerge::allgather, DecodeMerge::chain, DecodeMerge::tree};
  double mine[3];
  for (int i = 0; i < 3; ++i) {
    merge_partials(comm, parts, kinds[i]);  // warm
    comm.barrier();
    const double t0 = strategy::now_seconds();
    for (int r = 0; r < reps; ++r) merge_partials(comm, parts, kinds[i]);
    mine[i] = (strategy::now_seconds() - t0) / reps;
  }
  std::vector<double> gathered(size_t(3 * comm.size()));
  comm.allgather(mine, gathered.data(), sizeof mine);
  double slowest[3] = {0, 0, 0};
  for (int r = 0; r < comm.size(); ++r)
    for (int i = 0; i < 3; ++i) slowest[i] = std::max(slowest[i], gathered[size_t(3 * r + i)]);
  t.allgather = slowest[0], t.chain = slowest[1], t.tree = slowest[2];
  t.fastest = slowest[1] < slowest[0] ? DecodeMerge::chain : DecodeMerge::allgather;
  t.fastest_any = slowest[2] < std::min(slowest[0], slowest[1]) ? DecodeMerge::tree : t.fastest;
  return t;
}

void decode(KvCache& cache, const TensorView& q, const TensorView& k_new, const TensorView& v_new,
            const TensorView& out, const TensorView& lse, std::span<const int32_t> documents) {
  decode(cache, cache.live_sequences(), q, k_new, v_new, out, lse, documents);
}

void decode(KvCache& cache, std::span<const int64_t> seqs, const TensorView& q,
            const TensorView& k_new, const TensorView& v_new, const TensorView& out,
            const TensorView& lse, std::span<const int32_t> documents) {
  // q, out [B, Tn, Hq, D]; k_new, v_new [B, Tn, Hkv, D]; lse [B, Hq, Tn]; B = len(seqs)
  // First, before any check that reads the options: a rank whose options differ would fail
  // those alone and leave the others waiting in the agreement.
  InferenceAccess::agree_kernels(cache, "decode");
  const KvCacheOptions& o = cache.options();
  Communicator& comm = cache.comm();
  // Every check, the growth within the limits and this rank's memory included, goes into the
  // verdict the ranks share before anything is stored: a rank that refused alone left the
  // others waiting in the all-gather, and ranks with other shapes or lengths were found only
  // after each had stored the new tokens.
  std::string error;
  std::vector<int64_t> planned;
  try {
    check_decode_args(cache, seqs, q, k_new, v_new, out, lse, documents);
    std::vector<int64_t> lengths = lengths_after(cache, seqs[0], 0);
    for (int64_t s : seqs) lengths[s] += q.dim(1);
    planned = InferenceAccess::plan_growth(cache, lengths);
  } catch (const Error& e) {
    error = e.what();
  }
  require_agreement(comm, "decode", decode_signature(cache, seqs, q, k_new, v_new), error);

  const int64_t b = int64_t(seqs.size()), tn = q.dim(1), hq = q.dim(2);
  InferenceStats& stats = InferenceAccess::stats(cache) = InferenceStats{};
  strategy::CallRecord record(cache.device(), {&comm});
  Device& dev = cache.device();
  std::vector<int64_t> positions(static_cast<size_t>(b * tn));
  for (int64_t i = 0; i < b; ++i)
    for (int64_t t = 0; t < tn; ++t) positions[i * tn + t] = cache.tokens(seqs[i]) + t;
  InferenceAccess::grow(cache, planned);
  for (int64_t i = 0; i < b; ++i) {
    std::span<const int32_t> docs;
    if (o.mask.documents) docs = documents.subspan(size_t(i * tn), size_t(tn));
    InferenceAccess::append_rows(cache, seqs[i], k_new.slice(0, i, i + 1), v_new.slice(0, i, i + 1),
                                 docs);
  }

  const HeadRows hr{b, tn, o.kv_heads, hq / o.kv_heads, o.head_dim};
  Partials parts(dev, hr, comm.size());
  std::vector<int64_t> tiles(static_cast<size_t>(b));  // the sequences the tile path computes
  std::iota(tiles.begin(), tiles.end(), int64_t(0));
  if (in_place(o))
    tiles = attend_in_place(cache, seqs, q, positions, documents, parts, comm.rank());
  if (!tiles.empty()) {
    const PackedQueries pq = pack_queries(dev, hr, q, positions, documents, o.mask.documents);
    attend_shards(cache, seqs, tiles, pq, parts, comm.rank());
  }
  const double t_merge = strategy::now_seconds();
  if (comm.size() > 1) merge_partials(comm, parts, o.merge);
  unpack(dev, parts, out, lse);
  const double in_place_seconds = stats.attention_seconds;
  record_stats(stats, record.finish());
  stats.attention_seconds += in_place_seconds;
  stats.merge_seconds = strategy::now_seconds() - t_merge;
}

}  // namespace ctxpar

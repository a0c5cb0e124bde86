// ctxpar._KvCache: a Python handle on ctxpar::KvCache (include/ctxpar/inference.h) and its
// prefill and decode. ctxpar.KVCache (python/ctxpar/inference.py) checks the arguments,
// allocates the outputs in the caller's framework and calls these; see docs/inference.md.
//   whole rows   append, prefill: every rank passes all T new tokens [1, T, H, D]; prefill
//                picks this rank's rows (KvCache::placement), runs, and all-gathers the
//                outputs so every rank gets out [1, T, Hq, D], lse [1, Hq, T]
//   local rows   append_local, prefill_local: this rank's rows only, as in C++
// The GIL is released while ranks compute and communicate.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "communicator.h"
#include "ctxpar/inference.h"

namespace ctxpar::python {
namespace {

struct PyKvCache {
  PyCommunicator comm;  // keeps an owned communicator alive; says when a threads rank ended
  std::unique_ptr<KvCache> cache;

  KvCache& get() {
    comm.get();  // raises once the run_threads block of a borrowed rank has ended
    return *cache;
  }
};

std::unique_ptr<PyKvCache> make_cache(const PyCommunicator& comm, int64_t sequences,
                                      int64_t kv_heads, int64_t head_dim, const std::string& dtype,
                                      int64_t block, const std::string& mask, int threads,
                                      std::optional<float> scale, const std::string& device,
                                      int64_t max_tokens_per_rank, double max_bytes_per_rank,
                                      bool check_memory_limit, const std::string& bf16_tier,
                                      std::optional<bool> hash_inputs, const std::string& merge) {
  KvCacheOptions o;
  o.sequences = sequences;
  o.kv_heads = kv_heads;
  o.head_dim = head_dim;
  if (dtype != "float32" && dtype != "bfloat16")
    throw nb::value_error(
        ("dtype: expected 'float32' or 'bfloat16' for the cache's storage, got '" + dtype + "'")
            .c_str());
  o.dtype = dtype == "bfloat16" ? DType::bf16 : DType::f32;
  o.block = block;
  try {
    o.mask = parse_mask(mask);
    o.device.kind = parse_device(device);
  } catch (const Error& e) {
    throw nb::value_error(detail::concat("mask / device: ", e.what()).c_str());
  }
  check_cache_mask(o.mask, "mask");  // the library's rule, named as ctxpar.KVCache's argument
  o.kernel.threads = threads;
  if (scale) o.kernel.scale = *scale;
  o.kernel.bf16_tier = bf16_tier_arg(bf16_tier);  // ctxpar.KVCache checked it (_checks.py)
  o.max_tokens_per_rank = max_tokens_per_rank;
  o.max_bytes_per_rank = max_bytes_per_rank;
  o.check_memory_limit = check_memory_limit;
  o.hash_inputs = hash_inputs;
  try {
    o.merge = parse_decode_merge(merge);
  } catch (const Error& e) {
    throw nb::value_error(detail::concat("merge: ", e.what()).c_str());
  }
  auto c = std::make_unique<PyKvCache>(PyKvCache{comm, nullptr});
  c->cache = std::make_unique<KvCache>(comm.get(), o);
  return c;
}

std::vector<int32_t> ids(const std::optional<ReadArray>& a, int64_t n) {
  return int_vector<int32_t>(a, "document_ids", n);
}

// Rows `rows` (token indices relative to the view's first) of a [1, T, H, D] view, copied
// contiguous.
Tensor gather_rows(const TensorView& t, const std::vector<int64_t>& rows) {
  Tensor out(t.dtype(), {1, int64_t(rows.size()), t.dim(2), t.dim(3)});
  for (size_t i = 0; i < rows.size(); ++i)
    copy_into(t.slice(1, rows[i], rows[i] + 1), out.view().slice(1, int64_t(i), int64_t(i) + 1));
  return out;
}

void append_whole(PyKvCache& c, int64_t seq, const ReadArray& k, const ReadArray& v,
                  const std::optional<ReadArray>& documents) {
  KvCache& cache = c.get();
  const TensorView kv = view_of(k, "k", 4), vv = view_of(v, "v", 4);
  const std::vector<int32_t> docs = ids(documents, kv.dim(1));
  nb::gil_scoped_release release;
  cache.append(seq, kv, vv, docs);
}

void append_local(PyKvCache& c, int64_t seq, int64_t count, const ReadArray& k, const ReadArray& v,
                  const std::optional<ReadArray>& documents) {
  KvCache& cache = c.get();
  const TensorView kv = view_of(k, "k", 4), vv = view_of(v, "v", 4);
  const std::vector<int32_t> docs = ids(documents, kv.dim(1));
  nb::gil_scoped_release release;
  cache.append_local(seq, count, kv, vv, docs);
}

// seqs: the sequences decoded, in q's order (None: every live one, in slot order).
void decode_py(PyKvCache& c, const ReadArray& q, const ReadArray& k, const ReadArray& v,
               const Array& out, const Array& lse, const std::optional<ReadArray>& documents,
               const std::optional<std::vector<int64_t>>& seqs) {
  KvCache& cache = c.get();
  const TensorView qv = view_of(q, "q", 4), kv = view_of(k, "k_new", 4),
                   vv = view_of(v, "v_new", 4), ov = view_of(out, "out", 4),
                   lv = view_of(lse, "lse", 3);
  const std::vector<int32_t> docs = ids(documents, qv.dim(0) * qv.dim(1));
  nb::gil_scoped_release release;
  decode(cache, seqs ? *seqs : cache.live_sequences(), qv, kv, vv, ov, lv, docs);
}

// The arguments both prefill entry points share, as views, and the mode parsed.
struct PrefillArgs {
  TensorView q, k, v, out, lse;
  PrefillMode mode;
  PrefillArgs(const ReadArray& q_, const ReadArray& k_, const ReadArray& v_, const Array& out_,
              const Array& lse_, const std::string& mode_name)
      : q(view_of(q_, "q", 4)),
        k(view_of(k_, "k", 4)),
        v(view_of(v_, "v", 4)),
        out(view_of(out_, "out", 4)),
        lse(view_of(lse_, "lse", 3)) {
    try {
      mode = parse_prefill_mode(mode_name);
    } catch (const Error& e) {
      throw nb::value_error(detail::concat("mode: ", e.what()).c_str());
    }
  }
};

std::string prefill_local(PyKvCache& c, int64_t seq, int64_t new_tokens, const ReadArray& q,
                          const ReadArray& k, const ReadArray& v, const Array& out,
                          const Array& lse, const std::string& mode,
                          const std::optional<ReadArray>& documents) {
  KvCache& cache = c.get();
  const PrefillArgs a(q, k, v, out, lse, mode);
  const std::vector<int32_t> docs = ids(documents, a.q.dim(1));
  nb::gil_scoped_release release;
  return prefill_mode_name(
      prefill(cache, seq, new_tokens, a.q, a.k, a.v, a.out, a.lse, a.mode, docs));
}

// Whole rows in, whole rows out, for one prompt or several (one request each, in one call):
// this rank's rows of each prompt's q, k, v (and ids) go to prefill; every rank's outputs come
// back through one all-gather per prompt, padded to the largest share.
struct WholePrompt {
  std::vector<std::vector<int64_t>> rows;  // per rank: its rows (relative to the prompt's first)
  int64_t most = 0, hq = 0, d = 0;
  Tensor q, k, v;
  std::vector<int32_t> docs;
  std::vector<float> send;  // [out fp32 [most, Hq, D] | lse fp32 [Hq, most]]
  int64_t part() const { return most * hq * (d + 1); }
};

std::vector<std::string> prefill_whole(PyKvCache& c, const std::vector<int64_t>& seqs,
                                       const std::vector<ReadArray>& qs,
                                       const std::vector<ReadArray>& ks,
                                       const std::vector<ReadArray>& vs,
                                       const std::vector<Array>& outs,
                                       const std::vector<Array>& lses, const std::string& mode,
                                       const std::vector<std::optional<ReadArray>>& documents) {
  KvCache& cache = c.get();
  const size_t n = seqs.size();
  // ctxpar.KVCache gives one of each per prompt.
  CTXPAR_CHECK(qs.size() == n && ks.size() == n && vs.size() == n && outs.size() == n &&
                   lses.size() == n && documents.size() == n,
               "prefill: give one q, k, v, out, lse, document_ids per sequence (internal)");
  std::vector<PrefillArgs> args;
  std::vector<std::vector<int32_t>> docs;
  for (size_t i = 0; i < n; ++i) {
    args.emplace_back(qs[i], ks[i], vs[i], outs[i], lses[i], mode);
    docs.push_back(ids(documents[i], args.back().q.dim(1)));
  }
  nb::gil_scoped_release release;
  Communicator& comm = cache.comm();
  const int p = comm.size(), me = comm.rank();
  std::vector<WholePrompt> prompts(n);
  std::vector<PrefillRequest> requests;
  for (size_t i = 0; i < n; ++i) {
    WholePrompt& w = prompts[i];
    const TensorView& qv = args[i].q;
    const int64_t t = qv.dim(1);
    w.hq = qv.dim(2), w.d = qv.dim(3);
    // A free or unknown sequence: placed as if empty; prefill refuses it on every rank.
    const int64_t first =
        seqs[i] >= 0 && seqs[i] < cache.slots() && cache.live(seqs[i]) ? cache.tokens(seqs[i]) : 0;
    w.rows.resize(size_t(p));
    for (int r = 0; r < p; ++r) {
      w.rows[r] = cache.placement(first, t, r);
      for (int64_t& x : w.rows[r]) x -= first;
      w.most = std::max<int64_t>(w.most, int64_t(w.rows[r].size()));
    }
    const std::vector<int64_t>& mine = w.rows[me];
    const TensorView &kv = args[i].k, &vv = args[i].v;
    // Rows are picked from [1, T, H, D] tensors only; others go to prefill as they are, whose
    // checks refuse them on every rank (a batch [B > 1, T, ...] was cut row by row here, an
    // internal error on the ranks that had rows while the others waited in the agreement).
    const bool whole_rows =
        qv.dim(0) == 1 && kv.dim(0) == 1 && vv.dim(0) == 1 && kv.dim(1) == t && vv.dim(1) == t;
    TensorView ql = qv, kl = kv, vl = vv;
    if (whole_rows) {
      w.q = gather_rows(qv, mine), w.k = gather_rows(kv, mine), w.v = gather_rows(vv, mine);
      ql = w.q.view(), kl = w.k.view(), vl = w.v.view();
      for (int64_t x : mine)
        if (!docs[i].empty()) w.docs.push_back(docs[i][size_t(x)]);
    }
    w.send.assign(size_t(w.part()), 0.0f);
    const int64_t tl = int64_t(mine.size());
    requests.push_back({seqs[i], t, ql, kl, vl,
                        TensorView(w.send.data(), DType::f32, {1, tl, w.hq, w.d}),
                        TensorView(w.send.data() + w.most * w.hq * w.d, DType::f32, {1, w.hq, tl},
                                   {w.hq * w.most, w.most, 1}),
                        w.docs});
  }
  const std::vector<PrefillMode> ran = prefill(cache, requests, args[0].mode);
  std::vector<std::string> names;
  for (size_t i = 0; i < n; ++i) {
    const WholePrompt& w = prompts[i];
    const int64_t part = w.part(), hq = w.hq, d = w.d, most = w.most;
    std::vector<float> recv(size_t(part) * size_t(p));
    if (p > 1)
      comm.allgather(w.send.data(), recv.data(), size_t(part) * 4);
    else
      recv = w.send;
    for (int r = 0; r < p; ++r) {
      const float* base = recv.data() + size_t(r) * size_t(part);
      for (size_t j = 0; j < w.rows[r].size(); ++j) {
        const int64_t row = w.rows[r][j];
        copy_into(
            TensorView(const_cast<float*>(base) + int64_t(j) * hq * d, DType::f32, {1, 1, hq, d}),
            args[i].out.slice(1, row, row + 1));
        copy_into(TensorView(const_cast<float*>(base) + most * hq * d + int64_t(j), DType::f32,
                             {1, hq, 1}, {hq * most, most, 1}),
                  args[i].lse.slice(2, row, row + 1));
      }
    }
    names.push_back(prefill_mode_name(ran[i]));
  }
  return names;
}

nb::dict stats_of(const InferenceStats& s) {
  nb::dict d;
  d["bytes_sent"] = s.bytes_sent;
  d["bytes_received"] = s.bytes_received;
  d["wall_seconds"] = s.wall_seconds;
  d["attention_seconds"] = s.attention_seconds;
  d["merge_seconds"] = s.merge_seconds;
  d["cpu_seconds"] = s.cpu_seconds;
  d["mode"] = std::string(prefill_mode_name(s.mode));
  return d;
}

PrefillShape shape_of(int64_t cached, int64_t new_tokens, int ranks, int64_t hq, int64_t hkv,
                      int64_t head_dim, int64_t block, const std::string& kv_dtype,
                      const std::string& q_dtype, bool documents) {
  PrefillShape s;
  s.cached = cached, s.new_tokens = new_tokens, s.ranks = ranks, s.hq = hq, s.hkv = hkv;
  s.head_dim = head_dim, s.block = block, s.documents = documents;
  s.kv_dtype = kv_dtype == "bfloat16" ? DType::bf16 : DType::f32;
  s.q_dtype = q_dtype == "bfloat16" ? DType::bf16 : DType::f32;
  return s;
}

}  // namespace

void bind_inference(nb::module_& m) {
  nb::class_<PyKvCache>(m, "_KvCache")
      .def(nb::new_(&make_cache), nb::arg("comm"), nb::arg("sequences"), nb::arg("kv_heads"),
           nb::arg("head_dim"), nb::arg("dtype"), nb::arg("block"), nb::arg("mask"),
           nb::arg("threads"), nb::arg("scale").none(), nb::arg("device"),
           nb::arg("max_tokens_per_rank"), nb::arg("max_bytes_per_rank"),
           nb::arg("check_memory_limit"), nb::arg("bf16_tier") = "exact",
           nb::arg("hash_inputs").none() = nb::none(), nb::arg("merge") = "allgather")
      .def("tokens", [](PyKvCache& c, int64_t s) { return c.get().tokens(s); })
      .def("local_tokens", [](PyKvCache& c, int64_t s) { return c.get().local_tokens(s); })
      .def("bytes", [](PyKvCache& c) { return c.get().bytes(); })
      .def("bytes_for", [](PyKvCache& c, const std::vector<int64_t>& lengths,
                           int rank) { return c.get().bytes_for(lengths, rank); })
      .def("token_bytes", [](PyKvCache& c) { return c.get().token_bytes(); })
      .def("reserve",
           [](PyKvCache& c, const std::vector<int64_t>& lengths) {
             KvCache& cache = c.get();
             nb::gil_scoped_release release;
             cache.reserve(lengths);
           })
      .def("slots", [](PyKvCache& c) { return c.get().slots(); })
      .def("live", [](PyKvCache& c, int64_t s) { return c.get().live(s); })
      .def("live_sequences", [](PyKvCache& c) { return c.get().live_sequences(); })
      .def("add", [](PyKvCache& c) { return c.get().add(); })
      .def("free",
           [](PyKvCache& c, int64_t s) {
             KvCache& cache = c.get();
             nb::gil_scoped_release release;
             cache.free(s);
           })
      .def("reset", [](PyKvCache& c, int64_t s) { c.get().reset(s); })
      .def("truncate", [](PyKvCache& c, int64_t s, int64_t n) { c.get().truncate(s, n); })
      .def("fork",
           [](PyKvCache& c, int64_t s, int64_t n) {
             KvCache& cache = c.get();
             nb::gil_scoped_release release;
             return cache.fork(s, n);
           })
      .def("rank_of", [](PyKvCache& c, int64_t i) { return c.get().rank_of(i); })
      .def("placement", [](PyKvCache& c, int64_t first, int64_t count,
                           int rank) { return c.get().placement(first, count, rank); })
      .def("local_positions",
           [](PyKvCache& c, int64_t s) {
             const Tokens t = c.get().local_token_ids(s);
             return std::vector<int64_t>(t.positions.begin(), t.positions.end());
           })
      .def("append", &append_whole)
      .def("append_local", &append_local)
      .def("decode", &decode_py, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
           nb::arg("lse"), nb::arg("documents").none(), nb::arg("seqs").none())
      .def("prefill", &prefill_whole)
      .def("prefill_local", &prefill_local)
      .def("last_stats", [](PyKvCache& c) { return stats_of(c.get().last_stats()); });
  m.def("_predict_prefill_bytes", [](int64_t cached, int64_t new_tokens, int ranks, int64_t hq,
                                     int64_t hkv, int64_t head_dim, int64_t block,
                                     const std::string& kv_dtype, const std::string& q_dtype,
                                     bool documents) {
    const PrefillShape s =
        shape_of(cached, new_tokens, ranks, hq, hkv, head_dim, block, kv_dtype, q_dtype, documents);
    const PrefillBytes b = predict_prefill_bytes(s);
    return nb::make_tuple(b.pass_kv, b.pass_q, std::string(prefill_mode_name(choose_prefill(s))));
  });
}

}  // namespace ctxpar::python

#include "inference/inference_support.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>

namespace ctxpar::testing {

void Scenario::build() {
  q.clear(), k.clear(), v.clear(), positions.clear(), documents.clear();
  for (int64_t b = 0; b < sequences(); ++b) {
    const int64_t n = length(b);
    Tensor qf(DType::f32, {1, n, hq, d}), kf(DType::f32, {1, n, hkv, d}),
        vf(DType::f32, {1, n, hkv, d});
    fill_normal(qf, seed * 100 + b * 10 + 1);
    fill_normal(kf, seed * 100 + b * 10 + 2);
    fill_normal(vf, seed * 100 + b * 10 + 3);
    q.push_back(Tensor::copy_of(qf, dtype));
    k.push_back(Tensor::copy_of(kf, dtype));
    v.push_back(Tensor::copy_of(vf, dtype));
    std::vector<int64_t> pos(static_cast<size_t>(n));
    std::vector<int32_t> doc(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) pos[t] = t, doc[t] = int32_t((t * t) / 997);  // uneven docs
    positions.push_back(pos);
    documents.push_back(doc);
  }
}

KvCacheOptions Scenario::cache_options() const {
  KvCacheOptions o;
  o.sequences = sequences();
  o.kv_heads = hkv;
  o.head_dim = d;
  o.dtype = dtype;
  o.block = block;
  o.merge = merge;
  o.mask = mask;
  o.device.kind = device;
  o.device.sim_max_delay_us = 20;
  o.kernel.bf16_products = bf16_products;
  o.kernel.threads = threads;
  o.decode_in_place = decode_in_place;
  return o;
}

Tensor rows_of(const Tensor& full, const std::vector<int64_t>& indices) {
  const int64_t h = full.dim(2), d = full.dim(3);
  Tensor out(full.dtype(), {1, int64_t(indices.size()), h, d});
  const size_t row = size_t(h * d) * dtype_size(full.dtype());
  for (int64_t i : indices)  // a placement's indices are the sequence's: past `full` is a test bug
    CTXPAR_CHECK(i >= 0 && i < full.dim(1), "rows_of: row ", i, " outside the ", full.dim(1),
                 " rows given");
  for (size_t i = 0; i < indices.size(); ++i)
    std::memcpy(static_cast<std::byte*>(out.data()) + i * row,
                static_cast<const std::byte*>(full.data()) + size_t(indices[i]) * row, row);
  return out;
}

namespace {

// Writes rows [1, m, H, D] / [1, H, m] of a call's result into the whole-sequence tensors.
void put_rows(const Tensor& out, const Tensor& lse, const std::vector<int64_t>& at,
              Tensor& full_out, Tensor& full_lse) {
  const int64_t h = out.dim(2), d = out.dim(3), n = full_out.dim(1);
  for (size_t i = 0; i < at.size(); ++i) {
    std::memcpy(full_out.ptr<float>() + at[i] * h * d, out.ptr<float>() + i * h * d,
                size_t(h * d) * 4);
    for (int64_t hi = 0; hi < h; ++hi)
      full_lse.ptr<float>()[hi * n + at[i]] =
          lse.ptr<float>()[hi * int64_t(at.size()) + int64_t(i)];
  }
}

std::vector<int32_t> pick(const std::vector<int32_t>& all, const std::vector<int64_t>& at) {
  std::vector<int32_t> out;
  for (int64_t i : at) out.push_back(all[i]);
  return out;
}

}  // namespace

RankResult run_rank(Communicator& comm, const Scenario& s) {
  KvCache cache(comm, s.cache_options());
  RankResult r;
  const int64_t nseq = s.sequences();
  for (int64_t b = 0; b < nseq; ++b) {
    r.out.emplace_back(DType::f32, Shape{1, s.length(b), s.hq, s.d});
    r.lse.emplace_back(DType::f32, Shape{1, s.hq, s.length(b)});
  }
  for (int64_t b = 0; b < nseq; ++b) {
    const int64_t chunk = s.chunk > 0 ? s.chunk : s.prefill[b];
    for (int64_t at = 0; at < s.prefill[b]; at += chunk) {
      const int64_t t = std::min(chunk, s.prefill[b] - at);
      const std::vector<int64_t> mine = cache.placement(at, t, comm.rank());
      const int64_t tl = int64_t(mine.size());
      Tensor out(DType::f32, {1, tl, s.hq, s.d}), lse(DType::f32, {1, s.hq, tl});
      std::vector<int32_t> docs;
      if (s.mask.documents) docs = pick(s.documents[b], mine);
      r.modes.push_back(prefill(cache, b, t, rows_of(s.q[b], mine), rows_of(s.k[b], mine),
                                rows_of(s.v[b], mine), out, lse, s.mode, docs));
      r.prefill_stats.push_back(cache.last_stats());
      put_rows(out, lse, mine, r.out[b], r.lse[b]);
    }
  }
  std::vector<int64_t> decoded = cache.live_sequences();
  if (s.fork)
    for (int64_t& b : decoded) b = cache.fork(b);
  const int64_t tn = s.decode_tokens;
  for (int64_t step = 0; step < s.decode_steps; ++step) {
    Tensor q(s.dtype, {nseq, tn, s.hq, s.d}), k(s.dtype, {nseq, tn, s.hkv, s.d}),
        v(s.dtype, {nseq, tn, s.hkv, s.d});
    std::vector<int32_t> docs;
    std::vector<std::vector<int64_t>> at(static_cast<size_t>(nseq));
    for (int64_t b = 0; b < nseq; ++b) {
      for (int64_t i = 0; i < tn; ++i) at[b].push_back(s.prefill[b] + step * tn + i);
      copy_into(rows_of(s.q[b], at[b]), q.view().slice(0, b, b + 1));
      copy_into(rows_of(s.k[b], at[b]), k.view().slice(0, b, b + 1));
      copy_into(rows_of(s.v[b], at[b]), v.view().slice(0, b, b + 1));
      if (s.mask.documents)
        for (int64_t i : at[b]) docs.push_back(s.documents[b][i]);
    }
    Tensor out(DType::f32, {nseq, tn, s.hq, s.d}), lse(DType::f32, {nseq, s.hq, tn});
    decode(cache, decoded, q, k, v, out, lse, docs);
    for (int64_t b = 0; b < nseq; ++b)
      put_rows(Tensor::copy_of(out.view().slice(0, b, b + 1)),
               Tensor::copy_of(lse.view().slice(0, b, b + 1)), at[b], r.out[b], r.lse[b]);
  }
  r.bf16_products = cache.options().kernel.bf16_products;
  return r;
}

std::vector<RankResult> run_on_threads(const Scenario& s, int ranks) {
  std::vector<RankResult> results(static_cast<size_t>(ranks));
  ThreadsOptions opt;
  opt.timeout = std::chrono::seconds(getenv("CTXPAR_TEST_QUICK") ? 5 : 60);
  run_threads(
      ranks, [&](Communicator& comm) { results[comm.rank()] = run_rank(comm, s); }, opt);
  return results;
}

Combined combine(const std::vector<RankResult>& results, const Scenario& s, int64_t b) {
  const int p = int(results.size());
  const int64_t n = s.length(b), hd = s.hq * s.d;
  Combined c{Tensor(DType::f32, {1, n, s.hq, s.d}), Tensor(DType::f32, {1, s.hq, n})};
  for (int64_t t = 0; t < n; ++t) {
    const int owner = t < s.prefill[b] ? int((t / s.block) % p) : 0;
    const RankResult& r = results[owner];
    std::memcpy(c.out.ptr<float>() + t * hd, r.out[b].ptr<float>() + t * hd, size_t(hd) * 4);
    for (int64_t h = 0; h < s.hq; ++h)
      c.lse.ptr<float>()[h * n + t] = r.lse[b].ptr<float>()[h * n + t];
  }
  return c;
}

namespace {
double max_err(const float* x, const std::vector<double>& ref, size_t from, size_t to,
               size_t stride, size_t per) {
  double e = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const size_t t = (i / per) % stride;
    if (t < from || t >= to) continue;
    if (std::isinf(ref[i]) && double(x[i]) == ref[i]) continue;
    e = std::max(e, std::abs(double(x[i]) - ref[i]));
  }
  return e;
}
}  // namespace

std::string check_accuracy(const Scenario& s, int64_t b, const Combined& c, int64_t from) {
  const Tokens tok{s.positions[b], s.mask.documents ? std::span<const int32_t>(s.documents[b])
                                                    : std::span<const int32_t>{}};
  const auto ref = reference::attention_f64(s.q[b], tok, s.k[b], s.v[b], tok, s.mask);
  const auto naive = reference::attention_naive_f32(s.q[b], tok, s.k[b], s.v[b], tok, s.mask);
  const size_t n = size_t(s.length(b)), hd = size_t(s.hq * s.d);
  std::vector<float> naive_o(naive.o.begin(), naive.o.end()),
      naive_l(naive.lse.begin(), naive.lse.end());
  auto ref_max = [](const std::vector<double>& r) {
    double m = 0;
    for (double x : r)
      if (std::isfinite(x)) m = std::max(m, std::abs(x));
    return m;
  };
  // out [1, N, Hq, D]: token = (i / (Hq D)) % N; lse [1, Hq, N]: token = i % N
  const double eo = max_err(c.out.ptr<float>(), ref.o, size_t(from), n, n, hd);
  const double el = max_err(c.lse.ptr<float>(), ref.lse, size_t(from), n, n, 1);
  const double to =
      reference::accuracy_tolerance(max_err(naive_o.data(), ref.o, 0, n, n, hd), ref_max(ref.o));
  const double tl =
      reference::accuracy_tolerance(max_err(naive_l.data(), ref.lse, 0, n, n, 1), ref_max(ref.lse));
  std::string why;
  if (!(eo <= to)) why += "out error " + std::to_string(eo) + " > " + std::to_string(to) + "; ";
  if (!(el <= tl)) why += "lse error " + std::to_string(el) + " > " + std::to_string(tl) + "; ";
  return why;
}

}  // namespace ctxpar::testing

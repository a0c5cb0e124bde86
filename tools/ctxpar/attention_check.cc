#include "attention_check.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <thread>

#include "ctxpar/reference.h"

namespace ctxpar::cli {
namespace {

// Rows `rows` of a [B, T, H, D] view as a contiguous [B, S, H, D] tensor of the same dtype.
Tensor gather_rows(const TensorView& full, const std::vector<int64_t>& rows) {
  const int64_t b = full.dim(0), h = full.dim(2), d = full.dim(3);
  const int64_t s = static_cast<int64_t>(rows.size());
  Tensor t(full.dtype(), {b, s, h, d});
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t i = 0; i < s; ++i)
      copy_into(full.slice(0, bi, bi + 1).slice(1, rows[i], rows[i] + 1),
                t.view().slice(0, bi, bi + 1).slice(1, i, i + 1));
  return t;
}

// Evenly spaced token indices 0 .. T-1, `count` of them (all of them when count >= T).
std::vector<int64_t> spaced_rows(int64_t tokens, int64_t count) {
  std::vector<int64_t> rows;
  if (count >= tokens) {
    for (int64_t t = 0; t < tokens; ++t) rows.push_back(t);
    return rows;
  }
  for (int64_t i = 0; i < count; ++i) {
    int64_t t = count == 1 ? 0 : (i * (tokens - 1) + (count - 1) / 2) / (count - 1);
    if (rows.empty() || rows.back() != t) rows.push_back(t);
  }
  return rows;
}

// Runs fn(i) for i in [0, n) on up to `threads` std::threads (reference rows are independent).
template <typename Fn>
void parallel_for(int64_t n, int threads, Fn fn) {
  int workers = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n)));
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      for (int64_t i = w; i < n; i += workers) fn(i);
    });
  for (auto& t : pool) t.join();
}

// Running error of one quantity: run vs ref64 and naive32 vs ref64.
struct ErrorAcc {
  double run = 0, naive = 0, ref_max = 0;
  void add(double run_v, double naive_v, double ref_v) {
    run = std::max(run, diff(run_v, ref_v));
    naive = std::max(naive, diff(naive_v, ref_v));
    if (std::isfinite(ref_v)) ref_max = std::max(ref_max, std::fabs(ref_v));
  }
  // -inf LSE rows (fully masked) must agree exactly; a NaN is never within tolerance.
  static double diff(double a, double b) {
    if (std::isinf(a) || std::isinf(b))
      return a == b ? 0.0 : std::numeric_limits<double>::infinity();
    if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::infinity();
    return std::fabs(a - b);
  }
};

QuantityCheck finish(const std::string& name, const ErrorAcc& e, double floor_rel) {
  QuantityCheck c;
  c.name = name;
  c.max_abs_err = e.run;
  c.naive_err = e.naive;
  // A naive32 that overflowed (inf / NaN) says nothing about what fp32 can reach: then only
  // the floor counts, rather than an infinite tolerance that would pass anything.
  c.tolerance = reference::accuracy_tolerance(e.naive, e.ref_max, floor_rel);
  c.passed = c.max_abs_err <= c.tolerance;
  return c;
}

// dK, dV of key row j (batch b, kv head hk) summed over every visible query of every query
// head of its group, in precision R, from the run's LSE and O (delta = rowsum(dO * O)).
// All inputs fp32 contiguous: q, dout, out [B, T, Hq, D]; k, v [B, T, Hkv, D]; lse [B, Hq, T].
template <typename R>
void key_row_grads(const float* q, const float* k, const float* v, const float* dout,
                   const float* out, const float* lse, const Tokens& tok, const Mask& mask,
                   int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t b, int64_t j, int64_t hk,
                   R* dk, R* dv) {
  const R scale = static_cast<R>(1.0 / std::sqrt(static_cast<double>(D)));
  const int64_t group = Hq / Hkv;
  const bool docs = !tok.documents.empty();
  const float* kj = k + ((b * T + j) * Hkv + hk) * D;
  const float* vj = v + ((b * T + j) * Hkv + hk) * D;
  std::fill(dk, dk + D, R(0));
  std::fill(dv, dv + D, R(0));
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
    for (int64_t i = 0; i < T; ++i) {
      if (!mask.visible(tok.positions[i], tok.positions[j], docs ? tok.documents[i] : 0,
                        docs ? tok.documents[j] : 0))
        continue;
      const float lse_i = lse[(b * Hq + h) * T + i];
      if (std::isinf(lse_i)) continue;
      const float* qi = q + ((b * T + i) * Hq + h) * D;
      const float* doi = dout + ((b * T + i) * Hq + h) * D;
      const float* oi = out + ((b * T + i) * Hq + h) * D;
      R s = 0, dp = 0, delta = 0;
      for (int64_t d = 0; d < D; ++d) {
        s += R(qi[d]) * R(kj[d]);
        dp += R(doi[d]) * R(vj[d]);
        delta += R(doi[d]) * R(oi[d]);
      }
      const R p = std::exp(s * scale - R(lse_i));
      const R ds = p * (dp - delta);
      for (int64_t d = 0; d < D; ++d) {
        dv[d] += p * R(doi[d]);
        dk[d] += scale * ds * R(qi[d]);
      }
    }
}

// True when, for all tokens i, j: label_i == label_j exactly when id_i == id_j, and
// label_i < label_j exactly when id_i < id_j. Then the mask (equality) and the kernel's tile
// skipping (id ranges) read the labels as they would read the ids, and so can the reference.
// Proof by one sort: along tokens ordered by id, equal neighbours must have equal labels and
// increasing neighbours increasing labels.
bool labels_preserve_ids(std::span<const int32_t> labels, std::span<const int64_t> ids) {
  if (labels.size() != ids.size()) return false;
  std::vector<size_t> order(ids.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ids[a] < ids[b]; });
  for (size_t n = 1; n < order.size(); ++n) {
    const size_t a = order[n - 1], b = order[n];
    if (ids[a] == ids[b] ? labels[a] != labels[b] : labels[a] >= labels[b]) return false;
  }
  return true;
}

// dK, dV when every query row was a reference row: the sums of the chunks' contributions.
void compare_summed_key_grads(const CheckInputs& in, const std::vector<reference::Result>& ref,
                              const std::vector<reference::Result>& naive, ErrorAcc& e_dk,
                              ErrorAcc& e_dv) {
  const int64_t B = in.q.dim(0), T = in.q.dim(1), D = in.q.dim(3), Hkv = in.k.dim(2);
  const int64_t chunks = static_cast<int64_t>(ref.size());
  const size_t n = static_cast<size_t>(B * T * Hkv * D);
  std::vector<double> rdk(n, 0), rdv(n, 0), ndk(n, 0), ndv(n, 0);
  for (int64_t c = 0; c < chunks; ++c)
    for (size_t x = 0; x < n; ++x) {
      rdk[x] += ref[c].dk[x], rdv[x] += ref[c].dv[x];
      ndk[x] += naive[c].dk[x], ndv[x] += naive[c].dv[x];
    }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const size_t x = static_cast<size_t>(((b * T + t) * Hkv + h) * D + d);
          e_dk.add(in.dk.get(b, t, h, d), ndk[x], rdk[x]);
          e_dv.add(in.dv.get(b, t, h, d), ndv[x], rdv[x]);
        }
}

// dK, dV on `count` evenly spaced key rows when the query rows were a sample: fp64 and naive
// fp32 sums over all queries, from the run's LSE and O. Returns the key rows.
std::vector<int64_t> compare_sampled_key_grads(const CheckInputs& in, int64_t count, int threads,
                                               ErrorAcc& e_dk, ErrorAcc& e_dv) {
  const int64_t B = in.q.dim(0), T = in.q.dim(1), Hq = in.q.dim(2), D = in.q.dim(3);
  const int64_t Hkv = in.k.dim(2);
  const std::vector<int64_t> key_rows = spaced_rows(T, count);
  Tensor q = Tensor::copy_of(in.q, DType::f32), k = Tensor::copy_of(in.k, DType::f32);
  Tensor v = Tensor::copy_of(in.v, DType::f32), dout = Tensor::copy_of(in.dout, DType::f32);
  Tensor out = Tensor::copy_of(in.out, DType::f32), lse = Tensor::copy_of(in.lse, DType::f32);
  const int64_t nk = static_cast<int64_t>(key_rows.size());
  std::vector<double> r64(nk * B * Hkv * 2 * D);
  std::vector<float> r32(r64.size());
  parallel_for(nk * B * Hkv, threads, [&](int64_t x) {
    const int64_t hk = x % Hkv, b = (x / Hkv) % B, j = key_rows[x / (Hkv * B)];
    key_row_grads<double>(q.ptr<float>(), k.ptr<float>(), v.ptr<float>(), dout.ptr<float>(),
                          out.ptr<float>(), lse.ptr<float>(), in.tokens, in.mask, T, Hq, Hkv, D, b,
                          j, hk, &r64[x * 2 * D], &r64[x * 2 * D + D]);
    key_row_grads<float>(q.ptr<float>(), k.ptr<float>(), v.ptr<float>(), dout.ptr<float>(),
                         out.ptr<float>(), lse.ptr<float>(), in.tokens, in.mask, T, Hq, Hkv, D, b,
                         j, hk, &r32[x * 2 * D], &r32[x * 2 * D + D]);
  });
  for (int64_t x = 0; x < nk * B * Hkv; ++x) {
    const int64_t hk = x % Hkv, b = (x / Hkv) % B, j = key_rows[x / (Hkv * B)];
    for (int64_t d = 0; d < D; ++d) {
      e_dk.add(in.dk.get(b, j, hk, d), r32[x * 2 * D + d], r64[x * 2 * D + d]);
      e_dv.add(in.dv.get(b, j, hk, d), r32[x * 2 * D + D + d], r64[x * 2 * D + D + d]);
    }
  }
  return key_rows;
}

// The reference over chunks of the query rows `rows`, in parallel: fp64 and naive fp32 on the
// same rows.
struct ReferenceChunks {
  std::vector<std::vector<int64_t>> rows;
  std::vector<reference::Result> ref, naive;
};

ReferenceChunks reference_chunks(const CheckInputs& in, const std::vector<int64_t>& rows,
                                 int threads, bool sampled) {
  const bool backward = !in.dout.empty();
  const int64_t S = static_cast<int64_t>(rows.size());
  const int64_t chunk = std::max<int64_t>(1, (S + 4 * threads - 1) / (4 * threads));
  const int64_t chunks = (S + chunk - 1) / chunk;
  ReferenceChunks out;
  out.ref.resize(chunks), out.naive.resize(chunks), out.rows.resize(chunks);
  std::vector<reference::Result>& ref = out.ref;
  std::vector<reference::Result>& naive = out.naive;
  std::vector<std::vector<int64_t>>& chunk_rows = out.rows;
  for (int64_t c = 0; c < chunks; ++c)
    chunk_rows[c].assign(rows.begin() + c * chunk, rows.begin() + std::min(S, (c + 1) * chunk));
  const bool docs = !in.tokens.documents.empty();
  parallel_for(chunks * 2, threads, [&](int64_t job) {
    const int64_t c = job / 2;
    const auto& cr = chunk_rows[c];
    Tensor qc = gather_rows(in.q, cr);
    Tensor doc = backward ? gather_rows(in.dout, cr) : Tensor();
    std::vector<int64_t> pos;
    std::vector<int32_t> ids;
    for (int64_t t : cr) {
      pos.push_back(in.tokens.positions[t]);
      if (docs) ids.push_back(in.tokens.documents[t]);
    }
    Tokens qt{pos, ids};
    TensorView dov = backward ? doc.view() : TensorView();
    reference::Result& r = job % 2 == 0 ? ref[c] : naive[c];
    r = job % 2 == 0 ? reference::attention_f64(qc, qt, in.k, in.v, in.tokens, in.mask, dov)
                     : reference::attention_naive_f32(qc, qt, in.k, in.v, in.tokens, in.mask, dov);
    // A sample of rows gives only part of dK, dV (checked by key rows below): drop the chunk's
    // [B, T, Hkv, D] partial sums at once, or the chunks together would hold gigabytes.
    if (sampled) r.dk = {}, r.dv = {};
  });
  return out;
}

// The checks' verdicts from the errors, each against its floor.
void record_checks(const CheckInputs& in, const ErrorAcc& e_out, const ErrorAcc& e_lse,
                   const ErrorAcc& e_dq, const ErrorAcc& e_dk, const ErrorAcc& e_dv,
                   AttentionResult& result) {
  const bool backward = !in.dout.empty();
  const bool bf16 = in.dtype == DType::bf16;
  // Floors, relative to the largest reference value: fp32 storage leaves only the arithmetic
  // (covered by 2 x naive32); bf16 storage also rounds O to 8 bits of mantissa (2^-9 relative),
  // and the backward then reads that rounded O in delta = rowsum(dO * O).
  const double f32_floor = reference::kAccuracyFloor;
  // The fast tier (--bf16-tier fast) rounds P and dS to bf16 too: its own rule, floor 2^-7
  // for every product it rounds (docs/kernel.md, "bf16 tiers"); the LSE sums the fp32 P.
  const bool fast = bf16 && in.bf16_tier == Bf16Tier::fast;
  const double out_floor = fast ? reference::kFastBf16TierFloor : bf16 ? 0x1.0p-8 : f32_floor;
  const double grad_floor = bf16 ? 0x1.0p-7 : f32_floor;

  result.checked = true;
  result.checks = {finish("out", e_out, out_floor), finish("lse", e_lse, f32_floor)};
  if (backward) {
    result.checks.push_back(finish("dq", e_dq, grad_floor));
    result.checks.push_back(finish("dk", e_dk, grad_floor));
    result.checks.push_back(finish("dv", e_dv, grad_floor));
  }
  if (!in.document_ids.empty()) {
    // The reference reads the labels; it may only because they are proven to be the ids'.
    QuantityCheck ids;
    ids.name = "document ids";
    ids.passed = labels_preserve_ids(in.tokens.documents, in.document_ids);
    ids.max_abs_err = ids.passed ? 0.0 : std::numeric_limits<double>::infinity();
    result.checks.push_back(ids);
  }
  result.check_passed = true;
  double worst = -1;
  for (const auto& c : result.checks) {
    result.check_passed = result.check_passed && c.passed;
    double ratio = c.tolerance > 0 ? c.max_abs_err / c.tolerance : c.max_abs_err;
    if (ratio > worst)
      worst = ratio, result.max_abs_err = c.max_abs_err, result.tolerance = c.tolerance;
  }
}

}  // namespace

void check_against_reference(const CheckInputs& in, double budget, int threads,
                             AttentionResult& result) {
  const int64_t B = in.q.dim(0), T = in.q.dim(1), Hq = in.q.dim(2), D = in.q.dim(3);
  const bool backward = !in.dout.empty();
  const double per_row = static_cast<double>(B) * Hq * T * D;
  const int64_t budget_rows = static_cast<int64_t>(budget / per_row);
  const int64_t count = std::min<int64_t>(T, std::max<int64_t>(16, budget_rows));
  const std::vector<int64_t> rows = spaced_rows(T, count);
  const bool sampled = static_cast<int64_t>(rows.size()) < T;
  const int64_t S = static_cast<int64_t>(rows.size());

  const ReferenceChunks chunked = reference_chunks(in, rows, threads, sampled);
  const std::vector<reference::Result>& ref = chunked.ref;
  const std::vector<reference::Result>& naive = chunked.naive;
  const std::vector<std::vector<int64_t>>& chunk_rows = chunked.rows;
  const int64_t chunks = static_cast<int64_t>(chunk_rows.size());

  ErrorAcc e_out, e_lse, e_dq, e_dk, e_dv;
  for (int64_t c = 0; c < chunks; ++c) {
    const auto& cr = chunk_rows[c];
    const int64_t sc = static_cast<int64_t>(cr.size());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < sc; ++i)
        for (int64_t h = 0; h < Hq; ++h) {
          const int64_t li = (b * Hq + h) * sc + i;
          e_lse.add(in.lse.get(b, h, cr[i]), naive[c].lse[li], ref[c].lse[li]);
          for (int64_t d = 0; d < D; ++d) {
            const int64_t oi = ((b * sc + i) * Hq + h) * D + d;
            e_out.add(in.out.get(b, cr[i], h, d), naive[c].o[oi], ref[c].o[oi]);
            if (backward) e_dq.add(in.dq.get(b, cr[i], h, d), naive[c].dq[oi], ref[c].dq[oi]);
          }
        }
  }

  std::vector<int64_t> key_rows;
  if (backward && !sampled) {
    compare_summed_key_grads(in, ref, naive, e_dk, e_dv);
  } else if (backward) {
    key_rows = compare_sampled_key_grads(in, count, threads, e_dk, e_dv);
  }

  record_checks(in, e_out, e_lse, e_dq, e_dk, e_dv, result);
  result.check_sampled = sampled;
  result.check_query_rows = sampled ? rows : std::vector<int64_t>{};
  result.check_key_rows = key_rows;
  if (!sampled) {
    result.check_note = "every row against the fp64 reference of the whole problem";
  } else {
    result.check_note = std::to_string(S) + " of " + std::to_string(T) +
                        " query rows (evenly spaced, first and last included) against the fp64 "
                        "reference over all keys";
    if (backward)
      result.check_note += "; dk, dv on " + std::to_string(key_rows.size()) +
                           " key rows, fp64 sums over all queries using the run's LSE and O";
  }
}

}  // namespace ctxpar::cli

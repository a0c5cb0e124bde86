#include "strategy/strategy_support.h"

#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>

#include "ctxpar/threads_run.h"

namespace ctxpar::testing {

void Problem::build() {
  q = Tensor(dtype, {batch, tokens, hq, d});
  k = Tensor(dtype, {batch, tokens, hkv, d});
  v = Tensor(dtype, {batch, tokens, hkv, d});
  dout = Tensor(DType::f32, {batch, tokens, hq, d});
  fill_normal(q, seed * 10 + 1);
  fill_normal(k, seed * 10 + 2);
  fill_normal(v, seed * 10 + 3);
  fill_normal(dout, seed * 10 + 4);
  positions.resize(tokens);
  documents.resize(tokens);
  // Documents of lengths 5, 11, 7, 5, 11, 7, ...: boundaries fall inside every layout's chunks.
  const int lengths[] = {5, 11, 7};
  int32_t doc = 0;
  int64_t left = lengths[0];
  for (int64_t t = 0; t < tokens; ++t) {
    positions[t] = t;
    if (left == 0) left = lengths[++doc % 3];
    documents[t] = doc;
    --left;
  }
}

RunResult run_sharded(const Problem& pr, int ranks, LayoutKind layout_kind,
                      const StrategyOptions& options, bool backward) {
  RunResult res;
  res.o = Tensor(DType::f32, {pr.batch, pr.tokens, pr.hq, pr.d});
  res.lse = Tensor(DType::f32, {pr.batch, pr.hq, pr.tokens});
  if (backward) {
    res.dq = Tensor(DType::f32, {pr.batch, pr.tokens, pr.hq, pr.d});
    res.dk = Tensor(DType::f32, {pr.batch, pr.tokens, pr.hkv, pr.d});
    res.dv = Tensor(DType::f32, {pr.batch, pr.tokens, pr.hkv, pr.d});
  }
  WholeAttention whole;
  whole.q = pr.q, whole.k = pr.k, whole.v = pr.v;
  whole.tokens.positions = pr.positions;  // padding: kPaddingPosition
  if (options.mask.documents) whole.tokens.documents = pr.documents;
  whole.out = res.o, whole.lse = res.lse;
  whole.dout = pr.dout;
  if (backward) whole.dq = res.dq, whole.dk = res.dk, whole.dv = res.dv;
  whole.shard_dtype = pr.out_dtype;  // the ranks hold out, dout and the gradients so
  ThreadsRunStats stats;
  ThreadsOptions topt;
  topt.timeout = std::chrono::seconds(20);
  run_whole_on_threads(ranks, layout_kind, options, whole, true, backward, &stats, topt);
  res.forward_stats = std::move(stats.forward);
  res.backward_stats = std::move(stats.backward);
  res.counters = std::move(stats.counters);
  return res;
}

const References& references_of(const Problem& pr) {
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int, uint64_t, std::string>;
  static std::mutex mu;
  static std::map<Key, References> cache;
  std::lock_guard<std::mutex> lock(mu);
  // dout is fp32 in the problem; ranks holding it as bf16 see it rounded, as the reference must.
  Key key{pr.batch, pr.tokens,         pr.hq, pr.hkv, pr.d, int(pr.dtype) * 8 + int(pr.out_dtype),
          pr.seed,  pr.mask.describe()};
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  References& r = cache[key];
  Tokens t = pr.token_ids();
  if (!pr.mask.documents) t.documents = {};
  const Tensor dout = Tensor::copy_of(Tensor::copy_of(pr.dout, pr.out_dtype), DType::f32);
  r.ref64 = reference::attention_f64(pr.q, t, pr.k, pr.v, t, pr.mask, dout);
  r.naive32 = reference::attention_naive_f32(pr.q, t, pr.k, pr.v, t, pr.mask, dout);
  return r;
}

double max_err(const Tensor& t, const std::vector<double>& ref) {
  const float* x = t.ptr<const float>();
  double e = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i]) && std::isinf(x[i]) && (ref[i] < 0) == (x[i] < 0)) continue;
    double d = std::abs(double(x[i]) - ref[i]);
    if (!(d <= e)) e = d;  // NaN propagates as a failure
  }
  return e;
}

double max_abs(const std::vector<double>& ref) {
  double m = 0;
  for (double x : ref)
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  return m;
}

// The rule's floor alone: accuracy_tolerance with no naive error.
double floor_of(const std::vector<double>& ref) {
  return reference::accuracy_tolerance(0.0, max_abs(ref));
}

namespace {
double vec_err(const std::vector<double>& a, const std::vector<double>& ref) {
  double e = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i]) && std::isinf(a[i])) continue;
    e = std::max(e, std::abs(a[i] - ref[i]));
  }
  return e;
}
}  // namespace

Errors errors_of(const RunResult& run, const References& refs, bool backward) {
  Errors e;
  e.o = max_err(run.o, refs.ref64.o);
  e.lse = max_err(run.lse, refs.ref64.lse);
  if (backward) {
    e.dq = max_err(run.dq, refs.ref64.dq);
    e.dk = max_err(run.dk, refs.ref64.dk);
    e.dv = max_err(run.dv, refs.ref64.dv);
  }
  return e;
}

Errors bounds_of(const References& refs, bool backward) {
  auto bound = [](const std::vector<double>& n, const std::vector<double>& r) {
    return reference::accuracy_tolerance(vec_err(n, r), max_abs(r));
  };
  Errors b;
  b.o = bound(refs.naive32.o, refs.ref64.o);
  b.lse = bound(refs.naive32.lse, refs.ref64.lse);
  if (backward) {
    b.dq = bound(refs.naive32.dq, refs.ref64.dq);
    b.dk = bound(refs.naive32.dk, refs.ref64.dk);
    b.dv = bound(refs.naive32.dv, refs.ref64.dv);
  }
  return b;
}

std::vector<std::string> errors_on_ranks(int p, const std::function<void(Communicator&)>& fn,
                                         double* seconds) {
  std::vector<std::string> errors(p);
  ThreadsOptions opt;
  opt.timeout = std::chrono::seconds(5);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    run_threads(
        p,
        [&](Communicator& comm) {
          try {
            fn(comm);
          } catch (const Error& e) {
            errors[comm.rank()] = e.what();
            throw;
          }
        },
        opt);
  } catch (const Error&) {}
  if (seconds)
    *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return errors;
}

}  // namespace ctxpar::testing

#include "strategy/strategy_support.h"

#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>

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
  const Layout layout(layout_kind, pr.tokens, ranks);
  const int64_t tl = layout.local_tokens();
  struct Rank {
    Tensor q, k, v, dout, o, lse, dq, dk, dv;
    std::vector<int64_t> positions;
    std::vector<int32_t> documents;
  };
  std::vector<Rank> rk(ranks);
  for (int r = 0; r < ranks; ++r) {
    Rank& x = rk[r];
    x.q = layout.shard(pr.q, r);
    x.k = layout.shard(pr.k, r);
    x.v = layout.shard(pr.v, r);
    x.dout = Tensor::copy_of(layout.shard(pr.dout, r), pr.out_dtype);
    x.positions = layout.token_positions(r, pr.positions);  // padding: kPaddingPosition
    if (options.mask.documents) x.documents = layout.shard(pr.documents, r);
    x.o = Tensor(pr.out_dtype, {pr.batch, tl, pr.hq, pr.d});
    x.lse = Tensor(DType::f32, {pr.batch, pr.hq, tl});
    x.dq = Tensor(pr.out_dtype, {pr.batch, tl, pr.hq, pr.d});
    x.dk = Tensor(pr.out_dtype, {pr.batch, tl, pr.hkv, pr.d});
    x.dv = Tensor(pr.out_dtype, {pr.batch, tl, pr.hkv, pr.d});
  }
  RunResult res;
  res.forward_stats.resize(ranks);
  res.backward_stats.resize(ranks);
  res.counters.resize(ranks);
  ThreadsOptions topt;
  topt.timeout = std::chrono::seconds(20);
  run_threads(
      ranks,
      [&](Communicator& comm) {
        Rank& x = rk[comm.rank()];
        auto strategy = Strategy::create(comm, options);
        Tokens tokens{x.positions, x.documents};
        strategy->forward(x.q, x.k, x.v, tokens, x.o, x.lse);
        res.forward_stats[comm.rank()] = strategy->last_stats();
        res.counters[comm.rank()] = comm.counters();
        if (backward) {
          strategy->backward(x.q, x.k, x.v, tokens, x.o, x.lse, x.dout, x.dq, x.dk, x.dv);
          res.backward_stats[comm.rank()] = strategy->last_stats();
        }
      },
      topt);
  auto gather = [&](auto member, const Shape& shape, int token_dim) {
    Tensor full(DType::f32, shape);
    std::vector<TensorView> parts;
    for (Rank& x : rk) parts.push_back(x.*member);
    layout.unshard(parts, full, token_dim);
    return full;
  };
  res.o = gather(&Rank::o, {pr.batch, pr.tokens, pr.hq, pr.d}, 1);
  res.lse = gather(&Rank::lse, {pr.batch, pr.hq, pr.tokens}, 2);
  if (backward) {
    res.dq = gather(&Rank::dq, {pr.batch, pr.tokens, pr.hq, pr.d}, 1);
    res.dk = gather(&Rank::dk, {pr.batch, pr.tokens, pr.hkv, pr.d}, 1);
    res.dv = gather(&Rank::dv, {pr.batch, pr.tokens, pr.hkv, pr.d}, 1);
  }
  return res;
}

const References& references_of(const Problem& pr) {
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int, uint64_t, std::string>;
  static std::mutex mu;
  static std::map<Key, References> cache;
  std::lock_guard<std::mutex> lock(mu);
  // dout is fp32 in the problem; ranks holding it as bf16 see it rounded, as the reference must.
  Key key{pr.batch, pr.tokens, pr.hq, pr.hkv, pr.d, int(pr.dtype) * 8 + int(pr.out_dtype), pr.seed,
          pr.mask.describe()};
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
  } catch (const Error&) {
  }
  if (seconds)
    *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return errors;
}

}  // namespace ctxpar::testing

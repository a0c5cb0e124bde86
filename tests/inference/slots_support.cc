// The slot and page tests' server and refusals (slots_support.h).
#include "inference/slots_support.h"

#include <cmath>

#include "ctxpar/error.h"

namespace ctxpar::testing {

KvCacheOptions slot_options(int64_t sequences) {
  KvCacheOptions o;
  o.sequences = sequences;
  o.kv_heads = kHkv;
  o.head_dim = kD;
  o.block = 16;
  return o;
}

Tensor normal(Shape shape, uint64_t seed) {
  Tensor t(DType::f32, shape);
  fill_normal(t, seed);
  return t;
}

std::string check_rows(const Pool& pool, const Rows& rows, const std::vector<int64_t>& at,
                       const TensorView& out, const TensorView& lse) {
  const Tensor q = rows_of(pool.q, rows), k = rows_of(pool.k, rows), v = rows_of(pool.v, rows);
  const int64_t n = int64_t(rows.size());
  std::vector<int64_t> pos(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) pos[t] = t;
  const Tokens tok{pos, {}};
  const Mask causal = Mask::causal_mask();
  const auto ref = reference::attention_f64(q, tok, k, v, tok, causal);
  const auto naive = reference::attention_naive_f32(q, tok, k, v, tok, causal);
  double naive_o = 0, naive_l = 0, max_o = 0, max_l = 0, err_o = 0, err_l = 0;
  for (size_t i = 0; i < ref.o.size(); ++i) {
    naive_o = std::max(naive_o, std::abs(double(float(naive.o[i])) - ref.o[i]));
    max_o = std::max(max_o, std::abs(ref.o[i]));
  }
  for (size_t i = 0; i < ref.lse.size(); ++i) {
    naive_l = std::max(naive_l, std::abs(double(float(naive.lse[i])) - ref.lse[i]));
    max_l = std::max(max_l, std::abs(ref.lse[i]));
  }
  const Tensor o = Tensor::copy_of(out), l = Tensor::copy_of(lse);
  const int64_t m = int64_t(at.size()), hd = kHq * kD;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < hd; ++j)  // ref.o [1, n, Hq, D]
      err_o = std::max(err_o, std::abs(double(o.ptr<float>()[i * hd + j]) - ref.o[at[i] * hd + j]));
    for (int64_t h = 0; h < kHq; ++h)  // ref.lse [1, Hq, n]
      err_l = std::max(err_l, std::abs(double(l.ptr<float>()[h * m + i]) - ref.lse[h * n + at[i]]));
  }
  std::string why;
  if (!(err_o <= reference::accuracy_tolerance(naive_o, max_o)))
    why += "out error " + std::to_string(err_o) + "; ";
  if (!(err_l <= reference::accuracy_tolerance(naive_l, max_l)))
    why += "lse error " + std::to_string(err_l) + "; ";
  return why;
}

// ---- refused calls change nothing --------------------------------------------------------

namespace {

// Everything a refused call could change on this rank: the slot table, each live slot's
// length, positions and K/V bytes, and the memory held.
struct Snapshot {
  std::vector<std::vector<int64_t>> slots;  // {live, tokens, positions...}
  std::vector<std::vector<std::byte>> kv;
  size_t bytes = 0;
  bool operator==(const Snapshot&) const = default;
};

Snapshot snapshot(const KvCache& c) {
  Snapshot s;
  s.bytes = c.bytes();
  for (int64_t i = 0; i < c.slots(); ++i) {
    std::vector<int64_t> row{c.live(i)};
    std::vector<std::byte> kv;
    if (c.live(i)) {
      row.push_back(c.tokens(i));
      const Tokens t = c.local_token_ids(i);
      row.insert(row.end(), t.positions.begin(), t.positions.end());
      for (const TensorView& x : {c.k(i), c.v(i)}) {
        if (x.empty()) continue;
        const Tensor dense = Tensor::copy_of(x);
        const auto* p = static_cast<const std::byte*>(dense.data());
        kv.insert(kv.end(), p, p + dense.bytes());
      }
    }
    s.slots.push_back(row);
    s.kv.push_back(kv);
  }
  return s;
}

}  // namespace

std::vector<std::string> refused_everywhere(
    int p, const std::function<void(Communicator&, KvCache&)>& setup,
    const std::function<void(Communicator&, KvCache&)>& call, KvCacheOptions o) {
  std::vector<std::string> errors(static_cast<size_t>(p));
  ThreadsOptions opt;
  opt.timeout = std::chrono::seconds(20);
  run_threads(
      p,
      [&](Communicator& comm) {
        KvCache cache(comm, o);
        setup(comm, cache);
        const Snapshot before = snapshot(cache);
        try {
          call(comm, cache);
          ADD_FAILURE() << "accepted on rank " << comm.rank();
        } catch (const Error& e) {
          errors[comm.rank()] = e.what();
        }
        EXPECT_TRUE(snapshot(cache) == before) << "rank " << comm.rank() << " changed";
      },
      opt);
  return errors;
}

void expect_all_contain(const std::vector<std::string>& errors, const std::string& want) {
  for (size_t r = 0; r < errors.size(); ++r)
    EXPECT_NE(errors[r].find(want), std::string::npos) << "rank " << r << ": " << errors[r];
}

void three_sequences(Communicator&, KvCache& c) {
  c.append(0, normal({1, 30, kHkv, kD}, 1), normal({1, 30, kHkv, kD}, 2));
  c.append(1, normal({1, 45, kHkv, kD}, 3), normal({1, 45, kHkv, kD}, 4));
  c.append(2, normal({1, 12, kHkv, kD}, 5), normal({1, 12, kHkv, kD}, 6));
}

void decode_of(KvCache& c, const std::vector<int64_t>& seqs, int64_t tn, uint64_t seed) {
  const int64_t b = int64_t(seqs.size());
  Tensor out(DType::f32, {b, tn, kHq, kD}), lse(DType::f32, {b, kHq, tn});
  decode(c, seqs, normal({b, tn, kHq, kD}, seed), normal({b, tn, kHkv, kD}, seed + 1),
         normal({b, tn, kHkv, kD}, seed + 2), out, lse);
}

}  // namespace ctxpar::testing

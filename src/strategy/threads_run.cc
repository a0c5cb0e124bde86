// run_whole_on_threads (ctxpar/threads_run.h): shard, run, unshard on thread ranks.
#include "ctxpar/threads_run.h"

namespace ctxpar {
namespace {

Shape local_shape(const TensorView& whole, int token_dim, int64_t local) {
  Shape s = whole.shape();
  s[token_dim] = local;
  return s;
}

}  // namespace

void run_whole_on_threads(int ranks, LayoutKind layout_kind, const StrategyOptions& options,
                          const WholeAttention& w, bool forward, bool backward,
                          ThreadsRunStats* stats, const ThreadsOptions& threads) {
  const Layout layout(layout_kind, w.q.dim(1), ranks,
                      {options.mask, w.tokens.documents, w.tokens.positions});
  const int64_t tl = layout.local_tokens();
  auto dtype_of = [&](const TensorView& whole) { return w.shard_dtype.value_or(whole.dtype()); };
  const std::vector<int64_t> positions(w.tokens.positions.begin(), w.tokens.positions.end());
  const std::vector<int32_t> documents(w.tokens.documents.begin(), w.tokens.documents.end());
  struct Rank {
    Tensor out, lse, dq, dk, dv;
  };
  std::vector<Rank> rk(ranks);
  if (stats) {
    stats->forward.assign(ranks, {});
    stats->backward.assign(ranks, {});
    stats->counters.assign(ranks, {});
  }
  run_threads(
      ranks,
      [&](Communicator& comm) {
        const int r = comm.rank();
        Rank& x = rk[r];
        // Padding tokens get kPaddingPosition.
        const std::vector<int64_t> pos = layout.token_positions(r, positions);
        const std::vector<int32_t> docs =
            documents.empty() ? std::vector<int32_t>{} : layout.shard(documents, r);
        const Tokens tokens{pos, docs};
        const Tensor q = layout.shard(w.q, r), k = layout.shard(w.k, r), v = layout.shard(w.v, r);
        auto strategy = Strategy::create(comm, options);
        if (forward) {
          x.out = Tensor(dtype_of(w.out), local_shape(w.out, 1, tl));
          x.lse = Tensor(DType::f32, local_shape(w.lse, 2, tl));
          strategy->forward(q, k, v, tokens, x.out, x.lse);
          if (stats) {
            stats->forward[r] = strategy->last_stats();
            stats->counters[r] = comm.counters();
          }
        } else {
          x.out = Tensor::copy_of(layout.shard(w.out, r), dtype_of(w.out));
          x.lse = layout.shard(w.lse, r, 2);
        }
        if (!backward) return;
        const Tensor dout = Tensor::copy_of(layout.shard(w.dout, r), dtype_of(w.dout));
        x.dq = Tensor(dtype_of(w.dq), local_shape(w.dq, 1, tl));
        x.dk = Tensor(dtype_of(w.dk), local_shape(w.dk, 1, tl));
        x.dv = Tensor(dtype_of(w.dv), local_shape(w.dv, 1, tl));
        strategy->backward(q, k, v, tokens, x.out, x.lse, dout, x.dq, x.dk, x.dv);
        if (stats) stats->backward[r] = strategy->last_stats();
      },
      threads);
  auto unshard = [&](Tensor Rank::*member, const TensorView& whole, int token_dim) {
    std::vector<TensorView> parts;
    for (Rank& x : rk) parts.push_back(x.*member);
    layout.unshard(parts, whole, token_dim);
  };
  if (forward) {
    unshard(&Rank::out, w.out, 1);
    unshard(&Rank::lse, w.lse, 2);
  }
  if (backward) {
    unshard(&Rank::dq, w.dq, 1);
    unshard(&Rank::dk, w.dk, 1);
    unshard(&Rank::dv, w.dv, 1);
  }
}

}  // namespace ctxpar

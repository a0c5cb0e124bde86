// Faults: invalid arguments on some ranks only, different shapes on one rank, bad options, and
// a rank that fails in the middle of a ring. Every rank must fail with a clear message, and
// nothing may hang: each case runs with a short communicator timeout and is timed.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <thread>

#include "strategy/strategy_support.h"

namespace ctxpar::testing {
namespace {

const StrategyKind kAll[] = {StrategyKind::ring, StrategyKind::allgather, StrategyKind::ulysses,
                             StrategyKind::hybrid};

struct Shard {
  Tensor q, k, v, o, lse, dout, dq, dk, dv;
  std::vector<int64_t> positions;
};
Shard make_shard(int p, int r, int64_t hq = 4, int64_t hkv = 2, int64_t d = 16, int64_t t = 48) {
  const Layout layout(LayoutKind::zigzag, t, p);
  const int64_t tl = t / p;
  Shard s;
  s.q = Tensor(DType::f32, {1, tl, hq, d});
  s.k = Tensor(DType::f32, {1, tl, hkv, d});
  s.v = Tensor(DType::f32, {1, tl, hkv, d});
  for (Tensor* x : {&s.q, &s.k, &s.v}) fill_normal(*x, 11 + r);
  s.o = Tensor(DType::f32, {1, tl, hq, d});
  s.dout = Tensor(DType::f32, {1, tl, hq, d});
  fill_normal(s.dout, 5);
  s.lse = Tensor(DType::f32, {1, hq, tl});
  s.dq = Tensor(DType::f32, {1, tl, hq, d});
  s.dk = Tensor(DType::f32, {1, tl, hkv, d});
  s.dv = Tensor(DType::f32, {1, tl, hkv, d});
  s.positions = layout.positions(r);
  return s;
}

TEST(Faults, InvalidArgumentsOnOneRankFailEveryRank) {
  for (StrategyKind kind : kAll)
    for (bool backward : {false, true}) {
      double seconds = 0;
      auto errors = errors_on_ranks(
          4,
          [&](Communicator& comm) {
            StrategyOptions opt;
            opt.kind = kind;
            opt.mask = Mask::causal_mask();
            opt.ulysses_degree = kind == StrategyKind::hybrid ? 2 : 0;
            auto s = Strategy::create(comm, opt);
            Shard x = make_shard(4, comm.rank());
            Tensor bad_lse(DType::f32, {1, 4, 5});  // rank 2 passes a wrong lse
            const TensorView lse = comm.rank() == 2 ? bad_lse.view() : x.lse.view();
            Tokens tok{x.positions, {}};
            if (!backward)
              s->forward(x.q, x.k, x.v, tok, x.o, lse);
            else
              s->backward(x.q, x.k, x.v, tok, x.o, lse, x.dout, x.dq, x.dk, x.dv);
          },
          &seconds);
      for (int r = 0; r < 4; ++r) {
        EXPECT_NE(errors[r].find("invalid arguments on rank 2"), std::string::npos)
            << strategy_name(kind) << " rank " << r << ": '" << errors[r] << "'";
        EXPECT_NE(errors[r].find("lse"), std::string::npos) << errors[r];
      }
      EXPECT_LT(seconds, 4.0) << "a failing call must not wait for the timeout";
    }
}

TEST(Faults, NonFiniteInputNamesItsGlobalToken) {
  // A NaN (or Inf) at global token 200, batch 1, head 1, dim 3 of q, k, v or dO: every rank
  // fails before any communication with a message naming that token by its global position,
  // under every strategy and layout (the kernel alone named the row of the slice it was given,
  // e.g. token 72 of a gathered block).
  const int p = 4;
  const int64_t t = 256, hq = 4, hkv = 2, d = 16;
  for (StrategyKind kind : kAll)
    for (LayoutKind layout_kind : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped})
      for (const char* name : {"q", "k", "v", "dout"}) {
        const bool backward = std::string(name) == "dout";
        const Layout layout(layout_kind, t, p);
        Tensor full[4];  // q, k, v, dout [2, T, H, D]
        for (int i = 0; i < 4; ++i) {
          full[i] = Tensor(DType::f32, {2, t, i == 1 || i == 2 ? hkv : hq, d});
          fill_normal(full[i], 30 + i);
        }
        const int which = std::string("qkvd").find(name[0]);
        const float poison = which == 2 ? INFINITY : NAN;
        full[which].ptr<float>()[full[which].view().offset(1, 200, 1, 3)] = poison;
        const auto errors = errors_on_ranks(p, [&](Communicator& comm) {
          StrategyOptions opt;
          opt.kind = kind;
          opt.mask = Mask::causal_mask();
          opt.ulysses_degree = kind == StrategyKind::hybrid ? 2 : 0;
          auto s = Strategy::create(comm, opt);
          const int r = comm.rank();
          Tensor q = layout.shard(full[0], r), k = layout.shard(full[1], r);
          Tensor v = layout.shard(full[2], r), dout = layout.shard(full[3], r);
          const std::vector<int64_t> pos = layout.positions(r);
          const int64_t tl = pos.size();
          Tensor o(DType::f32, {2, tl, hq, d}), lse(DType::f32, {2, hq, tl});
          Tensor dq(DType::f32, {2, tl, hq, d}), dk(DType::f32, {2, tl, hkv, d});
          Tensor dv(DType::f32, {2, tl, hkv, d});
          const Tokens tok{pos, {}};
          if (!backward)
            s->forward(q, k, v, tok, o, lse);
          else
            s->backward(q, k, v, tok, o, lse, dout, dq, dk, dv);
        });
        const std::string want = std::string(name) + ": non-finite value (" +
                                 (poison == INFINITY ? "inf" : "nan") +
                                 ") at token position 200, batch 1, head 1, dim 3";
        for (int r = 0; r < p; ++r)
          EXPECT_NE(errors[r].find(want), std::string::npos)
              << strategy_name(kind) << " " << layout_name(layout_kind) << " rank " << r << ": '"
              << errors[r] << "'";
      }
}

TEST(Faults, DifferentShapesOnOneRankFailEveryRank) {
  for (StrategyKind kind : kAll) {
    auto errors = errors_on_ranks(4, [&](Communicator& comm) {
      StrategyOptions opt;
      opt.kind = kind;
      opt.ulysses_degree = kind == StrategyKind::hybrid ? 2 : 0;
      auto s = Strategy::create(comm, opt);
      Shard x = make_shard(4, comm.rank(), 4, 2, comm.rank() == 1 ? 32 : 16);
      s->forward(x.q, x.k, x.v, Tokens{x.positions, {}}, x.o, x.lse);
    });
    for (int r = 0; r < 4; ++r)
      EXPECT_NE(errors[r].find("the ranks were called with different arguments: head dim D is "
                               "16 on rank 0 but 32 on rank 1"),
                std::string::npos)
          << strategy_name(kind) << " rank " << r << ": '" << errors[r] << "'";
  }
}

TEST(Faults, BadOptionsAndHeadCountsAreClearErrors) {
  // u must divide P.
  auto errors = errors_on_ranks(4, [&](Communicator& comm) {
    StrategyOptions opt;
    opt.kind = StrategyKind::hybrid;
    opt.ulysses_degree = 3;
    Strategy::create(comm, opt);
  });
  for (const std::string& e : errors) EXPECT_NE(e.find("must divide"), std::string::npos) << e;
  // Options that differ on one rank (its mask) fail in create(), on every rank.
  errors = errors_on_ranks(3, [&](Communicator& comm) {
    StrategyOptions opt;
    opt.kind = StrategyKind::ring;
    if (comm.rank() == 2) opt.mask = Mask::causal_mask();
    Strategy::create(comm, opt);
  });
  for (const std::string& e : errors) EXPECT_NE(e.find("rank 2"), std::string::npos) << e;
  // Ulysses: Hq % P != 0 (KV heads that do not split are replicated, not an error).
  struct HeadCase {
    int p;
    int64_t hq, hkv;
    const char* expect;
  } cases[] = {{4, 6, 6, "Hq = 6"}, {3, 4, 2, "Hq = 4"}};
  for (const HeadCase& hc : cases) {
    errors = errors_on_ranks(hc.p, [&](Communicator& comm) {
      StrategyOptions opt;
      opt.kind = StrategyKind::ulysses;
      auto s = Strategy::create(comm, opt);
      Shard x = make_shard(hc.p, comm.rank(), hc.hq, hc.hkv);
      s->forward(x.q, x.k, x.v, Tokens{x.positions, {}}, x.o, x.lse);
    });
    for (const std::string& e : errors) EXPECT_NE(e.find(hc.expect), std::string::npos) << e;
  }
  // allgather: head groups must divide Hkv.
  errors = errors_on_ranks(2, [&](Communicator& comm) {
    StrategyOptions opt;
    opt.kind = StrategyKind::allgather;
    opt.head_groups = 3;
    auto s = Strategy::create(comm, opt);
    Shard x = make_shard(2, comm.rank());
    s->forward(x.q, x.k, x.v, Tokens{x.positions, {}}, x.o, x.lse);
  });
  for (const std::string& e : errors) EXPECT_NE(e.find("head_groups"), std::string::npos) << e;
  EXPECT_THROW(parse_strategy("rings"), Error);
  EXPECT_EQ(parse_strategy("hybrid"), StrategyKind::hybrid);
}

// A communicator that forwards to the real one but throws on its n-th point-to-point send:
// a rank failing in the middle of the ring.
class FailingComm final : public Communicator {
 public:
  // drop = true: the n-th send silently never happens (a lost message) instead of throwing.
  // recv_timeout > 0: point-to-point receives (the ring's steps, posted after every collective
  // that agrees on the call) wait that long; collectives keep the inner timeout.
  FailingComm(Communicator& inner, int fail_at, bool drop = false,
              std::chrono::milliseconds recv_timeout = std::chrono::milliseconds(0))
      : inner_(inner), fail_at_(fail_at), drop_(drop), recv_timeout_(recv_timeout) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  TransportKind transport() const override { return inner_.transport(); }
  bool shares_send_buffers() const override { return inner_.shares_send_buffers(); }
  Request isend(Buffer&& buf, int peer, int tag) override {
    if (++sends_ == fail_at_) {
      if (drop_) return Request();
      throw Error("injected failure at send " + std::to_string(sends_));
    }
    return inner_.isend(std::move(buf), peer, tag);
  }
  Request irecv(size_t bytes, int peer, int tag) override {
    if (recv_timeout_.count() > 0) inner_.set_timeout(recv_timeout_);  // a request keeps it
    return inner_.irecv(bytes, peer, tag);
  }
  void allgather(const void* s, void* r, size_t b) override { inner_.allgather(s, r, b); }
  void reduce_scatter(const float* s, float* r, size_t c) override {
    inner_.reduce_scatter(s, r, c);
  }
  void alltoall(const void* s, void* r, size_t b) override { inner_.alltoall(s, r, b); }
  void allreduce(float* b, size_t c) override { inner_.allreduce(b, c); }
  void allreduce(double* b, size_t c) override { inner_.allreduce(b, c); }
  void barrier() override { inner_.barrier(); }
  std::unique_ptr<Communicator> split(int color, int key) override {
    return inner_.split(color, key);
  }

 private:
  Communicator& inner_;
  int fail_at_;
  bool drop_;
  std::chrono::milliseconds recv_timeout_;
  int sends_ = 0;
};

TEST(Faults, RankFailingMidRingFailsTheGroupPromptly) {
  // The ring's needed exchange too: its direct messages and the gradients going home.
  for (auto [kind, exchange] : {std::pair{StrategyKind::ring, Exchange::ring},
                                {StrategyKind::ring, Exchange::needed},
                                {StrategyKind::allgather, Exchange::automatic}})
    for (bool backward : {false, true}) {
      double seconds = 0;
      auto errors = errors_on_ranks(
          4,
          [&](Communicator& comm) {
            FailingComm failing(comm, comm.rank() == 1 ? 2 : 1 << 30);
            StrategyOptions opt;
            opt.kind = kind;
            opt.exchange = exchange;
            auto s = Strategy::create(failing, opt);
            Shard x = make_shard(4, comm.rank());
            Tokens tok{x.positions, {}};
            if (!backward)
              s->forward(x.q, x.k, x.v, tok, x.o, x.lse);
            else
              s->backward(x.q, x.k, x.v, tok, x.o, x.lse, x.dout, x.dq, x.dk, x.dv);
          },
          &seconds);
      EXPECT_NE(errors[1].find("injected failure"), std::string::npos) << errors[1];
      for (int r = 0; r < 4; ++r)
        EXPECT_NE(errors[r].find("injected failure"), std::string::npos)
            << strategy_name(kind) << " " << exchange_name(exchange) << " rank " << r
            << " did not fail naming the cause: '" << errors[r] << "'";
      EXPECT_LT(seconds, 4.0) << "the group must fail promptly, not at the timeout";
    }
}

// A lost message mid-ring: the rank waiting for it times out (after the communicator's
// timeout, here 1 s) with a message naming itself, the peer and the step (the tag). P = 2 so
// that exactly one rank waits. Only rank 0's ring receives get the short timeout: the
// agreements before them keep the default, so a thread stalled for a second on a loaded
// machine (CI: ASan, four MPI ranks beside, two cores) cannot make another wait expire first.
// Rank 1, the hung peer, keeps the default throughout and learns of rank 0's failure.
TEST(Faults, LostMessageMidRingTimesOutNamingRankPeerAndStep) {
  double seconds = 0;
  auto errors = errors_on_ranks(
      2,
      [&](Communicator& comm) {
        const bool waiter = comm.rank() == 0;
        FailingComm lossy(comm, waiter ? 1 << 30 : 1, /*drop=*/true,
                          std::chrono::milliseconds(waiter ? 1000 : 0));
        StrategyOptions opt;
        auto s = Strategy::create(lossy, opt);
        Shard x = make_shard(2, comm.rank());
        s->forward(x.q, x.k, x.v, Tokens{x.positions, {}}, x.o, x.lse);
        // Rank 1 stays alive (a hung peer): it blocks in the forward's output agreement, whose
        // allgather waits for rank 0 (default 5 s timeout), so rank 0's 1 s wait can only end by
        // its timeout and is the first to expire. (Were its forward to return, this sleep would
        // keep it alive past rank 0's timeout.)
        if (!waiter) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      },
      &seconds);
  // Rank 1's first send is step 1's block to rank 0 (tag 1).
  EXPECT_NE(errors[0].find("rank 0: timed out"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("rank 1"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("tag 1"), std::string::npos) << errors[0];
  EXPECT_LT(seconds, 4.0);
}

}  // namespace
}  // namespace ctxpar::testing

// Bytes one device sends for one layer's attention, per strategy: the formulas of
// docs/plan.md, "Communication volume", written from the schedules of src/strategy/.
// tests/plan/comm_volume_test.cc checks them against the counters of our communicators
// running the real strategies.
//
// Per device: n = T/P local tokens; K and V blocks of kv = B n Hkv D s bytes each, Q (and O,
// dO) of q = B n Hq D s bytes; gradients that accumulate across ranks travel in fp32; every
// block carries the global positions of its tokens (8 bytes a token) so masks need no table.
#include <algorithm>

#include "ctxpar/error.h"
#include "ctxpar/plan.h"

namespace ctxpar {
namespace {

struct Sizes {
  double n, s, b, hq, hkv, d;
  double q() const { return b * n * hq * d * s; }
  double kv() const { return b * n * hkv * d * s; }
  double positions() const { return n * 8; }
  double rows() const { return b * n * hq * 4; }  // one fp32 value per query row (lse, delta)
};

// Ring: K, V and positions visit the P-1 other ranks (P-1 sends); in backward they go round
// again, and each block's fp32 dK, dV accumulator, started by its first visitor, makes the
// P-1 hops home.
CommVolume ring(int P, const Sizes& z) {
  CommVolume c;
  c.strategy = StrategyKind::ring;
  if (P == 1) return c;
  const double block = 2 * z.kv() + z.positions();
  c.forward_bytes = (P - 1) * block;
  c.backward_bytes = (P - 1) * (block + 2 * z.kv() * 4 / z.s);
  return c;
}

// All-gather: each rank's K, V reach P-1 others in g head groups (each group's message
// carries the positions), again in backward, where the fp32 dK, dV partials are
// reduce-scattered (P-1 blocks sent).
CommVolume allgather(int P, const Sizes& z, int groups) {
  CommVolume c;
  c.strategy = StrategyKind::allgather;
  if (P == 1) return c;
  const double block = 2 * z.kv() + groups * z.positions();
  c.forward_bytes = (P - 1) * block;
  c.backward_bytes = (P - 1) * block + (P - 1) * 2 * z.kv() * 4 / z.s;
  return c;
}

// Ulysses: every all-to-all keeps 1/P of the local shard and sends the rest to the P-1
// others; positions are all-gathered first. Rank j receives Hq/P query heads and Hkv/P KV
// heads, or the one KV head they read when Hkv < P (KV heads replicated).
//   forward:  in q, k, v;          back o and lse
//   backward: in q, k, v, dO, lse and delta (nothing is kept between calls);
//             back dq, dk, dv in fp32
CommVolume ulysses(int P, const Sizes& z) {
  CommVolume c;
  c.strategy = StrategyKind::ulysses;
  if (P == 1) return c;
  const double others = P - 1.0;
  const double q_chunk = z.q() / P, rows_chunk = z.rows() / P;
  const double kv_heads_each = z.hkv >= P ? z.hkv / P : 1.0;
  const double kv_chunk = z.kv() * kv_heads_each / z.hkv;
  const double fp32 = 4 / z.s;
  c.forward_bytes = others * (z.positions() + q_chunk + 2 * kv_chunk + q_chunk + rows_chunk);
  c.backward_bytes = others * (z.positions() + 2 * q_chunk + 2 * kv_chunk + 2 * rows_chunk +
                               fp32 * (q_chunk + 2 * kv_chunk));
  return c;
}

}  // namespace

CommVolume attention_comm_bytes(StrategyKind kind, int P, int ulysses_degree, int64_t batch,
                                int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                size_t dtype_bytes, int head_groups) {
  CTXPAR_CHECK(P >= 1 && seq % P == 0, "attention_comm_bytes: seq ", seq,
               " must be a multiple of ranks ", P);
  CTXPAR_CHECK(heads > 0 && kv_heads > 0 && head_dim > 0 && batch > 0,
               "attention_comm_bytes: batch, heads, kv_heads and head_dim must be > 0");
  const Sizes z{static_cast<double>(seq) / P,  static_cast<double>(dtype_bytes),
                static_cast<double>(batch),    static_cast<double>(heads),
                static_cast<double>(kv_heads), static_cast<double>(head_dim)};
  switch (kind) {
    case StrategyKind::ring:
      return ring(P, z);
    case StrategyKind::allgather: {
      // As src/strategy/allgather.cc: the largest divisor of Hkv up to 4 unless given.
      const int g = static_cast<int>(allgather_head_groups(kv_heads, head_groups));
      CTXPAR_CHECK(kv_heads % g == 0, "allgather: head groups ", g, " must divide kv heads ",
                   kv_heads);
      return allgather(P, z, g);
    }
    case StrategyKind::ulysses:
      return ulysses(P, z);
    case StrategyKind::hybrid: {
      const int u = ulysses_degree > 0 ? ulysses_degree : P;
      CTXPAR_CHECK(P % u == 0, "hybrid: ulysses degree ", u, " must divide ranks ", P);
      const CommVolume a = ulysses(u, z);
      // After the all-to-all each rank holds n*u tokens of Hq/u heads (and Hkv/u KV heads, at
      // least one); the ring runs over the P/u groups.
      Sizes zr = z;
      zr.n = z.n * u;
      zr.hq = z.hq / u;
      zr.hkv = z.hkv >= u ? z.hkv / u : 1.0;
      const CommVolume b = ring(P / u, zr);
      CommVolume c;
      c.strategy = StrategyKind::hybrid;
      c.forward_bytes = a.forward_bytes + b.forward_bytes;
      c.backward_bytes = a.backward_bytes + b.backward_bytes;
      return c;
    }
  }
  return {};
}

}  // namespace ctxpar

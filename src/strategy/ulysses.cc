// DeepSpeed-Ulysses: trade the token split for a head split with one all-to-all, run attention
// on the whole sequence for Hq/P heads, and trade back. See docs/ulysses.md.
//
//   rank r: [Tl tokens, all H heads] --all-to-all--> [all T tokens, H/P heads] --kernel-->
//           [T, H/P] --all-to-all--> [Tl, H]
//
// The gathered sequence is put in global position order (positions are all-gathered first),
// so the kernel's tiles see increasing positions whatever the layout and skip masked tiles.
// GQA: when Hkv % P != 0 each rank receives the KV heads its Hq/P query heads read (KV heads
// replicated over ranks, see HeadSplit); in backward the replicas' dK/dV are summed in rank
// order.
#include <algorithm>
#include <cstring>
#include <numeric>

#include "strategy/internal.h"

namespace ctxpar::strategy {
namespace {

// How heads are dealt out over the P ranks of a Ulysses group: rank j takes query heads
// [j*Hq/P, (j+1)*Hq/P) and, for its local KV slot i, the global KV head kv_heads[j][i].
//   Hkv % P == 0:             its Hkv/P KV heads (split like the query heads);
//   (Hq/Hkv) % (Hq/P) == 0:   its query heads all read one KV head: that one (replicated);
//   otherwise:                one KV slot per query head (replicated; locally MHA).
struct HeadSplit {
  int64_t hq_local, hkv_local;
  std::vector<std::vector<int64_t>> kv_heads;

  HeadSplit(const Dims& dims, int p) : hq_local(dims.hq / p) {
    const int64_t group = dims.hq / dims.hkv;
    hkv_local = dims.hkv % p == 0 ? dims.hkv / p : group % hq_local == 0 ? 1 : hq_local;
    for (int j = 0; j < p; ++j) {
      std::vector<int64_t> heads;
      for (int64_t i = 0; i < hkv_local; ++i) {
        if (dims.hkv % p == 0) heads.push_back(j * hkv_local + i);
        else if (hkv_local == 1) heads.push_back(j * hq_local / group);
        else heads.push_back((j * hq_local + i) / group);
      }
      kv_heads.push_back(heads);
    }
  }
};

// dst [B, Tl, hkv_local, D] <- src's KV heads `heads`, one slot each.
void copy_kv_heads(const TensorView& src, const std::vector<int64_t>& heads, const TensorView& dst) {
  for (size_t i = 0; i < heads.size(); ++i)
    copy_into(src.slice(2, heads[i], heads[i] + 1), dst.slice(2, int64_t(i), int64_t(i) + 1));
}

// The whole sequence of the group: positions (and documents) of every rank, in rank order,
// and `sorted_index[g]`, where gathered token g goes in increasing-position order.
struct GroupTokens {
  std::vector<int64_t> positions;
  std::vector<int32_t> documents;
  std::vector<int64_t> sorted_index;
  Tokens tokens() const { return {positions, documents}; }
};

GroupTokens gather_tokens(Communicator& comm, Run& run, const Tokens& local, int64_t tl) {
  const int p = comm.size();
  std::vector<int64_t> pos(size_t(p) * tl);
  std::vector<int32_t> docs;
  run.waiting([&] {
    comm.allgather(local.positions.data(), pos.data(), size_t(tl) * 8);
    if (run.mask.documents) {
      docs.resize(size_t(p) * tl);
      comm.allgather(local.documents.data(), docs.data(), size_t(tl) * 4);
    }
  });
  std::vector<int64_t> order(pos.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return pos[a] < pos[b]; });
  GroupTokens g;
  g.sorted_index.resize(pos.size());
  g.positions.resize(pos.size());
  if (run.mask.documents) g.documents.resize(pos.size());
  for (size_t i = 0; i < order.size(); ++i) {
    g.sorted_index[order[i]] = int64_t(i);
    g.positions[i] = pos[order[i]];
    if (run.mask.documents) g.documents[i] = docs[order[i]];
  }
  return g;
}

// Moves token rows between a rank's chunk [B, Tl, h, D] (tokens in that rank's local order) and
// the sorted group tensor [B, T, h, D]: row t of source rank `src` is group row
// sorted_index[src * Tl + t]. Same dtype both sides.
void chunk_to_group(const std::byte* chunk, const TensorView& group, const GroupTokens& g,
                    int src, int64_t tl) {
  const int64_t b = group.dim(0), t = group.dim(1);
  const size_t row = size_t(group.dim(2) * group.dim(3)) * dtype_size(group.dtype());
  auto* dst = static_cast<std::byte*>(group.data());
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t i = 0; i < tl; ++i)
      std::memcpy(dst + (bi * t + g.sorted_index[src * tl + i]) * row, chunk + (bi * tl + i) * row,
                  row);
}
void group_to_chunk(const TensorView& group, std::byte* chunk, const GroupTokens& g, int dst_rank,
                    int64_t tl) {
  const int64_t b = group.dim(0), t = group.dim(1);
  const size_t row = size_t(group.dim(2) * group.dim(3)) * dtype_size(group.dtype());
  const auto* src = static_cast<const std::byte*>(group.data());
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t i = 0; i < tl; ++i)
      std::memcpy(chunk + (bi * tl + i) * row,
                  src + (bi * t + g.sorted_index[dst_rank * tl + i]) * row, row);
}
// Same for per-row statistics [B, h, Tl] <-> [B, h, T] (fp32).
void rows_chunk_to_group(const float* chunk, const TensorView& group, const GroupTokens& g,
                         int src, int64_t tl) {
  const int64_t b = group.dim(0), h = group.dim(1), t = group.dim(2);
  float* dst = group.ptr<float>();
  for (int64_t bh = 0; bh < b * h; ++bh)
    for (int64_t i = 0; i < tl; ++i) dst[bh * t + g.sorted_index[src * tl + i]] = chunk[bh * tl + i];
}
void rows_group_to_chunk(const TensorView& group, float* chunk, const GroupTokens& g,
                         int dst_rank, int64_t tl) {
  const int64_t b = group.dim(0), h = group.dim(1), t = group.dim(2);
  const float* src = group.ptr<const float>();
  for (int64_t bh = 0; bh < b * h; ++bh)
    for (int64_t i = 0; i < tl; ++i) chunk[bh * tl + i] = src[bh * t + g.sorted_index[dst_rank * tl + i]];
}

// Sections of one all-to-all chunk, laid out back to back.
struct Sections {
  std::vector<size_t> offset;
  size_t bytes = 0;
  size_t add(size_t n) {
    offset.push_back(bytes);
    bytes += n;
    return offset.size() - 1;
  }
};

}  // namespace

void ulysses_forward(Communicator& comm, Run& run, const Dims& dims, const TensorView& q,
                     const TensorView& k, const TensorView& v, const Tokens& tokens,
                     const TensorView& out, const TensorView& lse,
                     const UlyssesForwardInner& inner) {
  // q, out [B, Tl, Hq, D]; k, v [B, Tl, Hkv, D]; lse [B, Hq, Tl]
  const int p = comm.size();
  const int64_t b = dims.batch, tl = dims.tokens, t = tl * p, d = dims.d;
  const HeadSplit split(dims, p);
  const size_t es = dtype_size(dims.dtype), eo = dtype_size(dims.out_dtype);
  const GroupTokens group = gather_tokens(comm, run, tokens, tl);

  Sections in;
  const size_t sq = in.add(b * tl * split.hq_local * d * es);
  const size_t sk = in.add(b * tl * split.hkv_local * d * es);
  const size_t sv = in.add(b * tl * split.hkv_local * d * es);
  std::vector<std::byte> send(in.bytes * p), recv(in.bytes * p);
  run.memory->hold(2 * send.size());
  const Shape qc{b, tl, split.hq_local, d}, kc{b, tl, split.hkv_local, d};
  for (int j = 0; j < p; ++j) {
    std::byte* c = send.data() + j * in.bytes;
    const int64_t h0 = j * split.hq_local;
    copy_into(q.slice(2, h0, h0 + split.hq_local), TensorView(c + in.offset[sq], dims.dtype, qc));
    copy_kv_heads(k, split.kv_heads[j], TensorView(c + in.offset[sk], dims.dtype, kc));
    copy_kv_heads(v, split.kv_heads[j], TensorView(c + in.offset[sv], dims.dtype, kc));
  }
  run.waiting([&] { comm.alltoall(send.data(), recv.data(), in.bytes); });
  Tensor qf(dims.dtype, {b, t, split.hq_local, d}), kf(dims.dtype, {b, t, split.hkv_local, d}),
      vf(dims.dtype, {b, t, split.hkv_local, d});
  Tensor of(dims.out_dtype, {b, t, split.hq_local, d}), lf(DType::f32, {b, split.hq_local, t});
  run.memory->hold(qf.bytes() + kf.bytes() + vf.bytes() + of.bytes() + lf.bytes());
  for (int i = 0; i < p; ++i) {
    const std::byte* c = recv.data() + i * in.bytes;
    chunk_to_group(c + in.offset[sq], qf, group, i, tl);
    chunk_to_group(c + in.offset[sk], kf, group, i, tl);
    chunk_to_group(c + in.offset[sv], vf, group, i, tl);
  }
  run.memory->release(2 * send.size());  // the all-to-all buffers are done with
  std::vector<std::byte>().swap(send);
  std::vector<std::byte>().swap(recv);
  inner(qf, kf, vf, group.tokens(), of, lf);

  Sections back;
  const size_t so = back.add(b * tl * split.hq_local * d * eo);
  const size_t sl = back.add(b * split.hq_local * tl * 4);
  std::vector<std::byte> send2(back.bytes * p), recv2(back.bytes * p);
  run.memory->hold(2 * send2.size());
  for (int i = 0; i < p; ++i) {
    std::byte* c = send2.data() + i * back.bytes;
    group_to_chunk(of, c + back.offset[so], group, i, tl);
    rows_group_to_chunk(lf, reinterpret_cast<float*>(c + back.offset[sl]), group, i, tl);
  }
  run.waiting([&] { comm.alltoall(send2.data(), recv2.data(), back.bytes); });
  for (int j = 0; j < p; ++j) {
    const std::byte* c = recv2.data() + j * back.bytes;
    const int64_t h0 = j * split.hq_local;
    copy_into(TensorView(const_cast<std::byte*>(c + back.offset[so]), dims.out_dtype, qc),
              out.slice(2, h0, h0 + split.hq_local));
    copy_into(TensorView(const_cast<std::byte*>(c + back.offset[sl]), DType::f32,
                         {b, split.hq_local, tl}),
              lse.slice(1, h0, h0 + split.hq_local));
  }
}

void ulysses_backward(Communicator& comm, Run& run, const Dims& dims, const TensorView& q,
                      const TensorView& k, const TensorView& v, const Tokens& tokens,
                      const TensorView& out, const TensorView& lse, const TensorView& dout,
                      const TensorView& dq, const TensorView& dk, const TensorView& dv,
                      const UlyssesBackwardInner& inner) {
  // q, out, dout, dq [B, Tl, Hq, D]; k, v, dk, dv [B, Tl, Hkv, D]; lse [B, Hq, Tl]
  const int p = comm.size();
  const int64_t b = dims.batch, tl = dims.tokens, t = tl * p, d = dims.d;
  const HeadSplit split(dims, p);
  const int64_t hq = split.hq_local, hk = split.hkv_local;
  const size_t es = dtype_size(dims.dtype), eo = dtype_size(dims.out_dtype);

  // delta = rowsum(dO * O) is per (token, head): computed where the tokens are, sent instead of O.
  Tensor delta(DType::f32, {b, dims.hq, tl});
  run.memory->hold(delta.bytes());
  run.busy([&] {
    attention_backward_delta(out, dout, delta, run.kernel);
    return KernelStats{};
  });
  const GroupTokens group = gather_tokens(comm, run, tokens, tl);

  Sections in;
  const size_t sq = in.add(b * tl * hq * d * es), sk = in.add(b * tl * hk * d * es),
               sv = in.add(b * tl * hk * d * es), sdo = in.add(b * tl * hq * d * eo),
               sl = in.add(b * hq * tl * 4), sdl = in.add(b * hq * tl * 4);
  std::vector<std::byte> send(in.bytes * p), recv(in.bytes * p);
  run.memory->hold(2 * send.size());
  const Shape qc{b, tl, hq, d}, kc{b, tl, hk, d}, rc{b, hq, tl};
  for (int j = 0; j < p; ++j) {
    std::byte* c = send.data() + j * in.bytes;
    const int64_t h0 = j * hq;
    copy_into(q.slice(2, h0, h0 + hq), TensorView(c + in.offset[sq], dims.dtype, qc));
    copy_kv_heads(k, split.kv_heads[j], TensorView(c + in.offset[sk], dims.dtype, kc));
    copy_kv_heads(v, split.kv_heads[j], TensorView(c + in.offset[sv], dims.dtype, kc));
    copy_into(dout.slice(2, h0, h0 + hq), TensorView(c + in.offset[sdo], dims.out_dtype, qc));
    copy_into(lse.slice(1, h0, h0 + hq), TensorView(c + in.offset[sl], DType::f32, rc));
    copy_into(delta.view().slice(1, h0, h0 + hq), TensorView(c + in.offset[sdl], DType::f32, rc));
  }
  run.waiting([&] { comm.alltoall(send.data(), recv.data(), in.bytes); });
  Tensor qf(dims.dtype, {b, t, hq, d}), kf(dims.dtype, {b, t, hk, d}), vf(dims.dtype, {b, t, hk, d});
  Tensor dof(dims.out_dtype, {b, t, hq, d}), lf(DType::f32, {b, hq, t}), df(DType::f32, {b, hq, t});
  Tensor dqf(DType::f32, {b, t, hq, d}), dkf(DType::f32, {b, t, hk, d}), dvf(DType::f32, {b, t, hk, d});
  run.memory->hold(qf.bytes() + kf.bytes() + vf.bytes() + dof.bytes() + lf.bytes() + df.bytes() +
                   dqf.bytes() + dkf.bytes() + dvf.bytes());
  for (int i = 0; i < p; ++i) {
    const std::byte* c = recv.data() + i * in.bytes;
    chunk_to_group(c + in.offset[sq], qf, group, i, tl);
    chunk_to_group(c + in.offset[sk], kf, group, i, tl);
    chunk_to_group(c + in.offset[sv], vf, group, i, tl);
    chunk_to_group(c + in.offset[sdo], dof, group, i, tl);
    rows_chunk_to_group(reinterpret_cast<const float*>(c + in.offset[sl]), lf, group, i, tl);
    rows_chunk_to_group(reinterpret_cast<const float*>(c + in.offset[sdl]), df, group, i, tl);
  }
  run.memory->release(2 * send.size());
  std::vector<std::byte>().swap(send);
  std::vector<std::byte>().swap(recv);
  inner(qf, kf, vf, group.tokens(), dof, lf, df, dqf, dkf, dvf);

  Sections back;
  const size_t gq = back.add(b * tl * hq * d * 4), gk = back.add(b * tl * hk * d * 4),
               gv = back.add(b * tl * hk * d * 4);
  std::vector<std::byte> send2(back.bytes * p), recv2(back.bytes * p);
  run.memory->hold(2 * send2.size());
  for (int i = 0; i < p; ++i) {
    std::byte* c = send2.data() + i * back.bytes;
    group_to_chunk(dqf, c + back.offset[gq], group, i, tl);
    group_to_chunk(dkf, c + back.offset[gk], group, i, tl);
    group_to_chunk(dvf, c + back.offset[gv], group, i, tl);
  }
  run.waiting([&] { comm.alltoall(send2.data(), recv2.data(), back.bytes); });
  // Replicated KV heads get a dK/dV part from every rank that read them: summed in rank order,
  // in fp32, so the result is the same run after run.
  Tensor dk32(DType::f32, {b, tl, dims.hkv, d}), dv32(DType::f32, {b, tl, dims.hkv, d});
  run.memory->hold(dk32.bytes() + dv32.bytes());
  for (int j = 0; j < p; ++j) {
    const std::byte* c = recv2.data() + j * back.bytes;
    const int64_t h0 = j * hq;
    const std::vector<int64_t>& heads = split.kv_heads[j];
    copy_into(TensorView(const_cast<std::byte*>(c + back.offset[gq]), DType::f32, qc),
              dq.slice(2, h0, h0 + hq));
    const float* pk = reinterpret_cast<const float*>(c + back.offset[gk]);
    const float* pv = reinterpret_cast<const float*>(c + back.offset[gv]);
    float* ak = dk32.ptr<float>();
    float* av = dv32.ptr<float>();
    for (int64_t row = 0; row < b * tl; ++row)
      for (int64_t h = 0; h < hk; ++h)
        for (int64_t x = 0; x < d; ++x) {
          ak[(row * dims.hkv + heads[h]) * d + x] += pk[(row * hk + h) * d + x];
          av[(row * dims.hkv + heads[h]) * d + x] += pv[(row * hk + h) * d + x];
        }
  }
  copy_into(dk32, dk);
  copy_into(dv32, dv);
}

namespace {

class UlyssesStrategy final : public Strategy {
 public:
  UlyssesStrategy(Communicator& comm, const StrategyOptions& options) : Strategy(comm, options) {}

  void forward(const TensorView& q, const TensorView& k, const TensorView& v,
               const Tokens& tokens, const TensorView& out, const TensorView& lse) override {
    Dims dims;
    std::string e = check_forward(q, k, v, tokens, out, lse, options_.mask, dims);
    if (e.empty()) e = check_ulysses_heads(dims, comm_.size(), "ulysses");
    CallScope call(comm_, stats_, options_, "ulysses forward", e, dims, {&comm_});
    Run& run = call.run;
    MemoryTracker& memory = call.memory;
    ulysses_forward(comm_, run, dims, q, k, v, tokens, out, lse,
                    [&](const TensorView& qf, const TensorView& kf, const TensorView& vf,
                        const Tokens& tf, const TensorView& of, const TensorView& lf) {
                      ForwardState state(qf.dim(0), qf.dim(1), qf.dim(2), qf.dim(3));
                      memory.hold(state.bytes());
                      run.busy([&] {
                        KernelStats ks = attention_forward_block(qf, tf, kf, vf, tf, run.mask,
                                                                 state, run.kernel);
                        attention_forward_finalize(state, of, lf, run.kernel);
                        return ks;
                      });
                    });
    call.finish();
  }

  void backward(const TensorView& q, const TensorView& k, const TensorView& v,
                const Tokens& tokens, const TensorView& out, const TensorView& lse,
                const TensorView& dout, const TensorView& dq, const TensorView& dk,
                const TensorView& dv) override {
    Dims dims;
    std::string e =
        check_backward(q, k, v, tokens, out, lse, dout, dq, dk, dv, options_.mask, dims);
    if (e.empty()) e = check_ulysses_heads(dims, comm_.size(), "ulysses");
    CallScope call(comm_, stats_, options_, "ulysses backward", e, dims, {&comm_});
    Run& run = call.run;
    ulysses_backward(
        comm_, run, dims, q, k, v, tokens, out, lse, dout, dq, dk, dv,
        [&](const TensorView& qf, const TensorView& kf, const TensorView& vf, const Tokens& tf,
            const TensorView& dof, const TensorView& lf, const TensorView& df,
            const TensorView& dqf, const TensorView& dkf, const TensorView& dvf) {
          run.busy([&] {
            return attention_backward_block(qf, tf, kf, vf, tf, run.mask, dof, lf, df, dqf, dkf,
                                            dvf, run.kernel);
          });
        });
    call.finish();
  }
};

}  // namespace

std::unique_ptr<Strategy> make_ulysses(Communicator& comm, const StrategyOptions& options) {
  return std::make_unique<UlyssesStrategy>(comm, options);
}

}  // namespace ctxpar::strategy

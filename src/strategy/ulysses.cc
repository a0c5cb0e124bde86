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
void copy_kv_heads(Device& dev, const TensorView& src, const std::vector<int64_t>& heads,
                   const TensorView& dst) {
  for (size_t i = 0; i < heads.size(); ++i)
    dev.copy(kComputeStream, src.slice(2, heads[i], heads[i] + 1),
             dst.slice(2, int64_t(i), int64_t(i) + 1));
}

// The whole sequence of the group on the device: positions (and documents) sorted by
// position, and `sorted_index[g]`, where gathered token g (rank-major) goes.
struct GroupTokens {
  DeviceBuffer positions, documents, sorted_index;
  int64_t tl = 0;
  Tokens tokens() const {
    const size_t t = positions.size() / 8;
    Tokens out;
    out.positions = {reinterpret_cast<const int64_t*>(positions.data()), t};
    if (!documents.empty())
      out.documents = {reinterpret_cast<const int32_t*>(documents.data()), t};
    return out;
  }
  // The rows of rank `rank`'s chunk: chunk row i is group row index(rank)[i].
  TensorView index(int rank) const {
    return sorted_index.view(DType::i64, {tl}, size_t(rank) * size_t(tl) * 8);
  }
};

GroupTokens gather_tokens(Communicator& comm, Run& run, const Tokens& local, int64_t tl) {
  const int p = comm.size();
  std::vector<int64_t> pos(size_t(p) * tl);
  std::vector<int32_t> docs;
  run.host_collective([&] {
    comm.allgather(local.positions.data(), pos.data(), size_t(tl) * 8);
    if (run.mask.documents) {
      docs.resize(size_t(p) * tl);
      comm.allgather(local.documents.data(), docs.data(), size_t(tl) * 4);
    }
  });
  std::vector<int64_t> order(pos.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return pos[a] < pos[b]; });
  std::vector<int64_t> sorted_index(pos.size()), positions(pos.size());
  std::vector<int32_t> documents(run.mask.documents ? pos.size() : 0);
  for (size_t i = 0; i < order.size(); ++i) {
    sorted_index[order[i]] = int64_t(i);
    positions[i] = pos[order[i]];
    if (run.mask.documents) documents[i] = docs[order[i]];
  }
  GroupTokens g;
  g.tl = tl;
  g.sorted_index = run.dev->upload(sorted_index.data(), sorted_index.size() * 8);
  g.positions = run.dev->upload(positions.data(), positions.size() * 8);
  if (run.mask.documents) g.documents = run.dev->upload(documents.data(), documents.size() * 4);
  return g;
}

// Sections of one all-to-all chunk, laid out back to back; view() is section i of chunk j.
struct Sections {
  std::vector<size_t> offset;
  std::vector<DType> dtype;
  std::vector<Shape> shape;
  size_t bytes = 0;
  size_t add(DType t, const Shape& s) {
    int64_t n = 1;
    for (int64_t x : s) n *= x;
    offset.push_back(bytes);
    dtype.push_back(t);
    shape.push_back(s);
    bytes += size_t(n) * dtype_size(t);
    return offset.size() - 1;
  }
  TensorView view(const DeviceBuffer& b, int j, size_t i) const {
    return b.view(dtype[i], shape[i], size_t(j) * bytes + offset[i]);
  }
};

// The all-to-all of `sections`: send -> recv on the comm stream, after what the compute stream
// wrote into `send`, before what it reads from `recv`.
void exchange(Device& dev, Communicator& comm, const DeviceBuffer& send, const DeviceBuffer& recv,
              const Sections& sections) {
  dev.wait(kCommStream, dev.record(kComputeStream));
  dev.alltoall(kCommStream, comm, send, recv, sections.bytes);
  dev.wait(kComputeStream, dev.record(kCommStream));
}

}  // namespace

void ulysses_forward(Communicator& comm, Run& run, const Dims& dims, const TensorView& q,
                     const TensorView& k, const TensorView& v, const Tokens& tokens,
                     const TensorView& out, const TensorView& lse,
                     const UlyssesForwardInner& inner) {
  // q, out [B, Tl, Hq, D]; k, v [B, Tl, Hkv, D]; lse [B, Hq, Tl]
  Device& dev = *run.dev;
  const int p = comm.size();
  const int64_t b = dims.batch, tl = dims.tokens, t = tl * p, d = dims.d;
  const HeadSplit split(dims, p);
  const int64_t hq = split.hq_local, hk = split.hkv_local;
  const GroupTokens group = gather_tokens(comm, run, tokens, tl);

  Sections in;
  const size_t sq = in.add(dims.dtype, {b, tl, hq, d}), sk = in.add(dims.dtype, {b, tl, hk, d}),
               sv = in.add(dims.dtype, {b, tl, hk, d});
  DeviceBuffer send = dev.alloc(in.bytes * p), recv = dev.alloc(in.bytes * p);
  for (int j = 0; j < p; ++j) {
    const int64_t h0 = j * hq;
    dev.copy(kComputeStream, q.slice(2, h0, h0 + hq), in.view(send, j, sq));
    copy_kv_heads(dev, k, split.kv_heads[j], in.view(send, j, sk));
    copy_kv_heads(dev, v, split.kv_heads[j], in.view(send, j, sv));
  }
  exchange(dev, comm, send, recv, in);
  DeviceBuffer qf = dev.alloc(size_t(b * t * hq * d) * dtype_size(dims.dtype));
  DeviceBuffer kf = dev.alloc(size_t(b * t * hk * d) * dtype_size(dims.dtype));
  DeviceBuffer vf = dev.alloc(size_t(b * t * hk * d) * dtype_size(dims.dtype));
  DeviceBuffer of = dev.alloc(size_t(b * t * hq * d) * dtype_size(dims.out_dtype));
  DeviceBuffer lf = dev.alloc(size_t(b * hq * t) * 4);
  const TensorView qv = qf.view(dims.dtype, {b, t, hq, d});
  const TensorView kv = kf.view(dims.dtype, {b, t, hk, d}), vv = vf.view(dims.dtype, {b, t, hk, d});
  const TensorView ov = of.view(dims.out_dtype, {b, t, hq, d});
  const TensorView lv = lf.view(DType::f32, {b, hq, t});
  for (int i = 0; i < p; ++i) {
    dev.scatter_tokens(kComputeStream, in.view(recv, i, sq), qv, group.index(i));
    dev.scatter_tokens(kComputeStream, in.view(recv, i, sk), kv, group.index(i));
    dev.scatter_tokens(kComputeStream, in.view(recv, i, sv), vv, group.index(i));
  }
  send.reset();  // the all-to-all buffers are done with (freed stream-ordered)
  recv.reset();
  inner(qv, kv, vv, group.tokens(), ov, lv);

  Sections back;
  const size_t so = back.add(dims.out_dtype, {b, tl, hq, d});
  const size_t sl = back.add(DType::f32, {b, hq, tl});
  DeviceBuffer send2 = dev.alloc(back.bytes * p), recv2 = dev.alloc(back.bytes * p);
  for (int i = 0; i < p; ++i) {
    dev.gather_tokens(kComputeStream, ov, back.view(send2, i, so), group.index(i));
    dev.gather_tokens(kComputeStream, lv, back.view(send2, i, sl), group.index(i));
  }
  exchange(dev, comm, send2, recv2, back);
  for (int j = 0; j < p; ++j) {
    const int64_t h0 = j * hq;
    dev.copy(kComputeStream, back.view(recv2, j, so), out.slice(2, h0, h0 + hq));
    dev.copy(kComputeStream, back.view(recv2, j, sl), lse.slice(1, h0, h0 + hq));
  }
}

void ulysses_backward(Communicator& comm, Run& run, const Dims& dims, const TensorView& q,
                      const TensorView& k, const TensorView& v, const Tokens& tokens,
                      const TensorView& out, const TensorView& lse, const TensorView& dout,
                      const TensorView& dq, const TensorView& dk, const TensorView& dv,
                      const UlyssesBackwardInner& inner) {
  // q, out, dout, dq [B, Tl, Hq, D]; k, v, dk, dv [B, Tl, Hkv, D]; lse [B, Hq, Tl]
  Device& dev = *run.dev;
  const int p = comm.size();
  const int64_t b = dims.batch, tl = dims.tokens, t = tl * p, d = dims.d;
  const HeadSplit split(dims, p);
  const int64_t hq = split.hq_local, hk = split.hkv_local;
  const DType es = dims.dtype, eo = dims.out_dtype;

  // delta = rowsum(dO * O) is per (token, head): computed where the tokens are, sent instead of O.
  DeviceBuffer delta = dev.alloc(size_t(b * dims.hq * tl) * 4);
  const TensorView delta_v = delta.view(DType::f32, {b, dims.hq, tl});
  dev.backward_delta(kComputeStream, out, dout, delta_v, run.kernel);
  const GroupTokens group = gather_tokens(comm, run, tokens, tl);

  Sections in;
  const size_t sq = in.add(es, {b, tl, hq, d}), sk = in.add(es, {b, tl, hk, d}),
               sv = in.add(es, {b, tl, hk, d}), sdo = in.add(eo, {b, tl, hq, d}),
               sl = in.add(DType::f32, {b, hq, tl}), sdl = in.add(DType::f32, {b, hq, tl});
  DeviceBuffer send = dev.alloc(in.bytes * p), recv = dev.alloc(in.bytes * p);
  for (int j = 0; j < p; ++j) {
    const int64_t h0 = j * hq;
    dev.copy(kComputeStream, q.slice(2, h0, h0 + hq), in.view(send, j, sq));
    copy_kv_heads(dev, k, split.kv_heads[j], in.view(send, j, sk));
    copy_kv_heads(dev, v, split.kv_heads[j], in.view(send, j, sv));
    dev.copy(kComputeStream, dout.slice(2, h0, h0 + hq), in.view(send, j, sdo));
    dev.copy(kComputeStream, lse.slice(1, h0, h0 + hq), in.view(send, j, sl));
    dev.copy(kComputeStream, delta_v.slice(1, h0, h0 + hq), in.view(send, j, sdl));
  }
  exchange(dev, comm, send, recv, in);
  // The whole group sequence for hq heads, in one buffer: q, k, v, dout, lse, delta, then the
  // fp32 gradients dq, dk, dv (zeroed: the inner adds into them).
  Sections whole;
  const size_t fq = whole.add(es, {b, t, hq, d}), fk = whole.add(es, {b, t, hk, d}),
               fv = whole.add(es, {b, t, hk, d}), fdo = whole.add(eo, {b, t, hq, d}),
               fl = whole.add(DType::f32, {b, hq, t}), fdl = whole.add(DType::f32, {b, hq, t}),
               fdq = whole.add(DType::f32, {b, t, hq, d}),
               fdk = whole.add(DType::f32, {b, t, hk, d}),
               fdv = whole.add(DType::f32, {b, t, hk, d});
  DeviceBuffer full = dev.alloc(whole.bytes);
  auto f = [&](size_t i) { return whole.view(full, 0, i); };
  for (size_t i : {fdq, fdk, fdv}) dev.fill_zero(kComputeStream, f(i));
  for (int i = 0; i < p; ++i) {
    const TensorView idx = group.index(i);
    dev.scatter_tokens(kComputeStream, in.view(recv, i, sq), f(fq), idx);
    dev.scatter_tokens(kComputeStream, in.view(recv, i, sk), f(fk), idx);
    dev.scatter_tokens(kComputeStream, in.view(recv, i, sv), f(fv), idx);
    dev.scatter_tokens(kComputeStream, in.view(recv, i, sdo), f(fdo), idx);
    dev.scatter_tokens(kComputeStream, in.view(recv, i, sl), f(fl), idx);
    dev.scatter_tokens(kComputeStream, in.view(recv, i, sdl), f(fdl), idx);
  }
  send.reset();
  recv.reset();
  inner(f(fq), f(fk), f(fv), group.tokens(), f(fdo), f(fl), f(fdl), f(fdq), f(fdk), f(fdv));

  Sections back;
  const size_t gq = back.add(DType::f32, {b, tl, hq, d}), gk = back.add(DType::f32, {b, tl, hk, d}),
               gv = back.add(DType::f32, {b, tl, hk, d});
  DeviceBuffer send2 = dev.alloc(back.bytes * p), recv2 = dev.alloc(back.bytes * p);
  for (int i = 0; i < p; ++i) {
    dev.gather_tokens(kComputeStream, f(fdq), back.view(send2, i, gq), group.index(i));
    dev.gather_tokens(kComputeStream, f(fdk), back.view(send2, i, gk), group.index(i));
    dev.gather_tokens(kComputeStream, f(fdv), back.view(send2, i, gv), group.index(i));
  }
  exchange(dev, comm, send2, recv2, back);
  // Replicated KV heads get a dK/dV part from every rank that read them: summed in rank order,
  // in fp32, so the result is the same run after run.
  const size_t kv32_bytes = size_t(b * tl * dims.hkv * d) * 4;
  DeviceBuffer dkv32 = dev.alloc(2 * kv32_bytes);
  const TensorView dk32 = dkv32.view(DType::f32, {b, tl, dims.hkv, d});
  const TensorView dv32 = dkv32.view(DType::f32, {b, tl, dims.hkv, d}, kv32_bytes);
  dev.fill_zero(kComputeStream, flat_f32(dkv32));
  for (int j = 0; j < p; ++j) {
    const int64_t h0 = j * hq;
    const std::vector<int64_t>& heads = split.kv_heads[j];
    dev.copy(kComputeStream, back.view(recv2, j, gq), dq.slice(2, h0, h0 + hq));
    for (int64_t h = 0; h < hk; ++h) {
      dev.add(kComputeStream, back.view(recv2, j, gk).slice(2, h, h + 1),
              dk32.slice(2, heads[h], heads[h] + 1));
      dev.add(kComputeStream, back.view(recv2, j, gv).slice(2, h, h + 1),
              dv32.slice(2, heads[h], heads[h] + 1));
    }
  }
  dev.copy(kComputeStream, dk32, dk);
  dev.copy(kComputeStream, dv32, dv);
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
    CallScope call(comm_, *device_, stats_, options_, "ulysses forward", e, dims, {&comm_});
    Run& run = call.run;
    Device& dev = *device_;
    ulysses_forward(comm_, run, dims, q, k, v, tokens, out, lse,
                    [&](const TensorView& qf, const TensorView& kf, const TensorView& vf,
                        const Tokens& tf, const TensorView& of, const TensorView& lf) {
                      DeviceForwardState state(dev, qf.dim(0), qf.dim(1), qf.dim(2), qf.dim(3));
                      dev.forward_block(kComputeStream, qf, tf, kf, vf, tf, run.mask, state.get(),
                                        run.kernel);
                      dev.forward_finalize(kComputeStream, state.get(), of, lf, run.kernel);
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
    CallScope call(comm_, *device_, stats_, options_, "ulysses backward", e, dims, {&comm_});
    Run& run = call.run;
    ulysses_backward(
        comm_, run, dims, q, k, v, tokens, out, lse, dout, dq, dk, dv,
        [&](const TensorView& qf, const TensorView& kf, const TensorView& vf, const Tokens& tf,
            const TensorView& dof, const TensorView& lf, const TensorView& df,
            const TensorView& dqf, const TensorView& dkf, const TensorView& dvf) {
          run.dev->backward_block(kComputeStream, qf, tf, kf, vf, tf, run.mask, dof, lf, df, dqf,
                                  dkf, dvf, run.kernel);
        });
    call.finish();
  }
};

}  // namespace

std::unique_ptr<Strategy> make_ulysses(Communicator& comm, const StrategyOptions& options) {
  return std::make_unique<UlyssesStrategy>(comm, options);
}

}  // namespace ctxpar::strategy

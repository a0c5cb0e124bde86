// DeepSpeed-Ulysses: trade the token split for a head split with one all-to-all, run attention
// on the whole sequence for Hq/P heads, and trade back. See docs/ulysses.md.
//
//   rank r: [Tl tokens, all H heads] --all-to-all--> [all T tokens, H/P heads] --kernel-->
//           [T, H/P] --all-to-all--> [Tl, H]
//
// Pipelined over up to 4 head groups (Groups below; hybrid: 1 unless options.ulysses_groups
// asks): group g+1's all-to-all in and group g-1's all-to-all back travel while group g
// computes; same bytes, same bits as one group.
//
// The gathered sequence is put in global position order (positions are all-gathered first),
// so the kernel's tiles see increasing positions whatever the layout and skip masked tiles.
// GQA: when Hkv % P != 0 each rank receives the KV heads its Hq/P query heads read (KV heads
// replicated over ranks, see HeadSplit); in backward the replicas' dK/dV are summed in rank
// order.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <utility>

#include "ctxpar/strategy_memory.h"
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

  HeadSplit(const Dims& dims, int p)
      : hq_local(dims.hq / p), hkv_local(ulysses_kv_slots(dims.hq, dims.hkv, p)) {
    const int64_t group = dims.hq / dims.hkv;
    for (int j = 0; j < p; ++j) {
      std::vector<int64_t> heads;
      for (int64_t i = 0; i < hkv_local; ++i) {
        if (dims.hkv % p == 0)
          heads.push_back(j * hkv_local + i);
        else if (hkv_local == 1)
          heads.push_back(j * hq_local / group);
        else
          heads.push_back((j * hq_local + i) / group);
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
    if (!documents.empty()) out.documents = {reinterpret_cast<const int32_t*>(documents.data()), t};
    return out;
  }
  // The rows of rank `rank`'s chunk: chunk row i is group row index(rank)[i].
  TensorView index(int rank) const {
    return sorted_index.view(DType::i64, {tl}, size_t(rank) * size_t(tl) * 8);
  }
};

GroupTokens gather_tokens(Communicator& comm, Call& call, const Tokens& local, int64_t tl) {
  const int p = comm.size();
  std::vector<int64_t> pos(size_t(p) * tl);
  std::vector<int32_t> docs;
  call.host_collective([&] {
    comm.allgather(local.positions.data(), pos.data(), size_t(tl) * 8);
    if (call.mask.documents) {
      docs.resize(size_t(p) * tl);
      comm.allgather(local.documents.data(), docs.data(), size_t(tl) * 4);
    }
  });
  std::vector<int64_t> order(pos.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return pos[a] < pos[b]; });
  std::vector<int64_t> sorted_index(pos.size()), positions(pos.size());
  std::vector<int32_t> documents(call.mask.documents ? pos.size() : 0);
  for (size_t i = 0; i < order.size(); ++i) {
    sorted_index[order[i]] = int64_t(i);
    positions[i] = pos[order[i]];
    if (call.mask.documents) documents[i] = docs[order[i]];
  }
  GroupTokens g;
  g.tl = tl;
  g.sorted_index = call.dev->upload(sorted_index.data(), sorted_index.size() * 8);
  g.positions = call.dev->upload(positions.data(), positions.size() * 8);
  if (call.mask.documents) g.documents = call.dev->upload(documents.data(), documents.size() * 4);
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

// Head groups (the pipeline, docs/ulysses.md): group g of a rank's hq query heads is
// [g*hq/G, (g+1)*hq/G) and of its hk KV slots [g*hk/G, (g+1)*hk/G). G divides both, so a
// group's query heads read only its own KV slots (split KV heads: query i reads slot
// i/(hq/hk); one slot per query head: slot i) and each KV slot travels once, with its group.
// One replicated KV head read by all hq (hk = 1) gives G = 1.
struct Groups {
  int count = 1;
  int64_t hq = 0, hk = 0;  // per group
  // The KV heads of chunk j's group g (a slice of HeadSplit::kv_heads[j]).
  std::vector<int64_t> kv_heads(const HeadSplit& split, int j, int g) const {
    const auto& all = split.kv_heads[j];
    return {all.begin() + g * hk, all.begin() + (g + 1) * hk};
  }
};

// Chunk j of group g: q of the query heads rank j takes, k and v of the KV slots they read.
void pack_qkv(Device& dev, const HeadSplit& split, const Groups& groups, int j, int g,
              const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& to_q,
              const TensorView& to_k, const TensorView& to_v) {
  const int64_t h0 = j * split.hq_local + g * groups.hq;
  dev.copy(kComputeStream, q.slice(2, h0, h0 + groups.hq), to_q);
  copy_kv_heads(dev, k, groups.kv_heads(split, j, g), to_k);
  copy_kv_heads(dev, v, groups.kv_heads(split, j, g), to_v);
}

// User tags of the all-to-alls (in: even, back: odd), one per group and direction: pending
// ones never match each other, nor the ring's (step, 16384 + step) on hybrid's communicators.
constexpr int kTagBase = 1 << 19;
int tag_in(int g) { return kTagBase + 2 * g; }
int tag_back(int g) { return kTagBase + 2 * g + 1; }

// The most groups up to the limit that divide hq and hk (ulysses_pipeline_groups: the rule the
// memory model shares, with why backward keeps enough KV heads per kernel call).
Groups choose_groups(const HeadSplit& split, const Dims& dims, int p, int threads,
                     AttentionPass pass, int limit) {
  Groups g;
  g.count = ulysses_pipeline_groups(dims.hq, dims.hkv, p, dims.batch, threads, pass, limit);
  g.hq = split.hq_local / g.count;
  g.hk = split.hkv_local / g.count;
  return g;
}

// One all-to-all on its way: its buffers and the comm stream's event right after it.
struct Exchange {
  DeviceBuffer send, recv;
  Event done;
};

// Starts the all-to-all of `send` (written on the compute stream) on the comm stream; it
// runs while the compute stream goes on. `arrive` makes the compute stream wait for it.
Exchange start_exchange(Device& dev, Communicator& comm, DeviceBuffer send,
                        const Sections& sections, int tag) {
  Exchange x;
  x.recv = dev.alloc(sections.bytes * comm.size());
  dev.wait(kCommStream, dev.record(kComputeStream));
  dev.alltoall(kCommStream, comm, send, x.recv, sections.bytes, tag);
  x.done = dev.record(kCommStream);  // before anything later on the comm stream
  x.send = std::move(send);
  return x;
}
void arrive(Device& dev, const Exchange& x) { dev.wait(kComputeStream, x.done); }

// The layout of the gradients a group sends back: [dq | dk | dv] fp32, each rank's tokens.
struct GradSections {
  const Sections& sections;
  size_t dq, dk, dv;
};

// Backward's end: every group's returned gradients into dq, dk, dv. Replicated KV heads get a
// dK/dV part from every rank that read them: summed in rank order (then slot order, as without
// groups), in fp32, so the result is the same run after run.
void collect_gradients(Device& dev, int p, const Dims& dims, const HeadSplit& split,
                       const Groups& groups, const GradSections& back,
                       const std::vector<Exchange>& returned, const BackwardArgs& a) {
  const int64_t b = dims.batch, tl = dims.tokens, d = dims.d;
  const int64_t hq = split.hq_local, gq = groups.hq, gk = groups.hk;
  const Sections& at = back.sections;
  const size_t kv32_bytes = size_t(b * tl * dims.hkv * d) * 4;
  DeviceBuffer dkv32 = dev.alloc(2 * kv32_bytes);
  const TensorView dk32 = dkv32.view(DType::f32, {b, tl, dims.hkv, d});
  const TensorView dv32 = dkv32.view(DType::f32, {b, tl, dims.hkv, d}, kv32_bytes);
  dev.fill_zero(kComputeStream, flat_f32(dkv32));
  for (const Exchange& x : returned) arrive(dev, x);
  for (int j = 0; j < p; ++j) {
    const std::vector<int64_t>& heads = split.kv_heads[j];
    for (int g = 0; g < groups.count; ++g) {
      const int64_t h0 = j * hq + g * gq;
      dev.copy(kComputeStream, at.view(returned[g].recv, j, back.dq), a.dq.slice(2, h0, h0 + gq));
    }
    for (int64_t h = 0; h < split.hkv_local; ++h) {
      const DeviceBuffer& from = returned[h / gk].recv;
      const int64_t s = h % gk, kh = heads[h];
      dev.add(kComputeStream, at.view(from, j, back.dk).slice(2, s, s + 1),
              dk32.slice(2, kh, kh + 1));
      dev.add(kComputeStream, at.view(from, j, back.dv).slice(2, s, s + 1),
              dv32.slice(2, kh, kh + 1));
    }
  }
  dev.copy(kComputeStream, dk32, a.dk);
  dev.copy(kComputeStream, dv32, a.dv);
}

}  // namespace

// The pipeline (both directions): the in-all-to-all of group g+1 is enqueued before group g
// computes, and group g's back all-to-all runs while group g+1 computes.
void ulysses_forward(Communicator& comm, Call& call, const ForwardArgs& a,
                     const UlyssesForwardInner& inner, int max_groups) {
  // q, out [B, Tl, Hq, D]; k, v [B, Tl, Hkv, D]; lse [B, Hq, Tl]
  const TensorView &q = a.q, &k = a.k, &v = a.v, &out = a.out, &lse = a.lse;
  const Dims& dims = call.dims;
  Device& dev = *call.dev;
  const int p = comm.size();
  const int64_t b = dims.batch, tl = dims.tokens, t = tl * p, d = dims.d;
  const HeadSplit split(dims, p);
  const Groups groups =
      choose_groups(split, dims, p, call.kernel.threads, AttentionPass::forward, max_groups);
  const int64_t hq = split.hq_local, gq = groups.hq, gk = groups.hk;
  const GroupTokens group = gather_tokens(comm, call, a.tokens, tl);

  Sections in;
  const size_t sq = in.add(dims.dtype, {b, tl, gq, d}), sk = in.add(dims.dtype, {b, tl, gk, d}),
               sv = in.add(dims.dtype, {b, tl, gk, d});
  Sections back;
  const size_t so = back.add(dims.out_dtype, {b, tl, gq, d});
  const size_t sl = back.add(DType::f32, {b, gq, tl});
  auto send_in = [&](int g) {
    DeviceBuffer send = dev.alloc(in.bytes * p);
    for (int j = 0; j < p; ++j)
      pack_qkv(dev, split, groups, j, g, q, k, v, in.view(send, j, sq), in.view(send, j, sk),
               in.view(send, j, sv));
    return start_exchange(dev, comm, std::move(send), in, tag_in(g));
  };
  auto receive_back = [&](int g, Exchange x) {
    arrive(dev, x);
    for (int j = 0; j < p; ++j) {
      const int64_t h0 = j * hq + g * gq;
      dev.copy(kComputeStream, back.view(x.recv, j, so), out.slice(2, h0, h0 + gq));
      dev.copy(kComputeStream, back.view(x.recv, j, sl), lse.slice(1, h0, h0 + gq));
    }
  };

  Exchange incoming = send_in(0), returning;
  for (int g = 0; g < groups.count; ++g) {
    Exchange next;
    if (g + 1 < groups.count) next = send_in(g + 1);
    arrive(dev, incoming);
    DeviceBuffer qf = dev.alloc(size_t(b * t * gq * d) * dtype_size(dims.dtype));
    DeviceBuffer kf = dev.alloc(size_t(b * t * gk * d) * dtype_size(dims.dtype));
    DeviceBuffer vf = dev.alloc(size_t(b * t * gk * d) * dtype_size(dims.dtype));
    DeviceBuffer of = dev.alloc(size_t(b * t * gq * d) * dtype_size(dims.out_dtype));
    DeviceBuffer lf = dev.alloc(size_t(b * gq * t) * 4);
    const TensorView qv = qf.view(dims.dtype, {b, t, gq, d});
    const TensorView kv = kf.view(dims.dtype, {b, t, gk, d}),
                     vv = vf.view(dims.dtype, {b, t, gk, d});
    const TensorView ov = of.view(dims.out_dtype, {b, t, gq, d});
    const TensorView lv = lf.view(DType::f32, {b, gq, t});
    for (int i = 0; i < p; ++i) {
      dev.scatter_tokens(kComputeStream, in.view(incoming.recv, i, sq), qv, group.index(i));
      dev.scatter_tokens(kComputeStream, in.view(incoming.recv, i, sk), kv, group.index(i));
      dev.scatter_tokens(kComputeStream, in.view(incoming.recv, i, sv), vv, group.index(i));
    }
    incoming = Exchange();  // its buffers are done with (freed stream-ordered)
    inner({qv, kv, vv, group.tokens(), ov, lv});

    DeviceBuffer send = dev.alloc(back.bytes * p);
    for (int i = 0; i < p; ++i) {
      dev.gather_tokens(kComputeStream, ov, back.view(send, i, so), group.index(i));
      dev.gather_tokens(kComputeStream, lv, back.view(send, i, sl), group.index(i));
    }
    Exchange sent = start_exchange(dev, comm, std::move(send), back, tag_back(g));
    if (g > 0) receive_back(g - 1, std::move(returning));
    returning = std::move(sent);
    incoming = std::move(next);
  }
  receive_back(groups.count - 1, std::move(returning));
}

void ulysses_backward(Communicator& comm, Call& call, const BackwardArgs& a,
                      const UlyssesBackwardInner& inner, int max_groups) {
  // q, out, dout, dq [B, Tl, Hq, D]; k, v, dk, dv [B, Tl, Hkv, D]; lse [B, Hq, Tl]
  const TensorView &q = a.q, &k = a.k, &v = a.v, &out = a.out, &lse = a.lse, &dout = a.dout;
  const Dims& dims = call.dims;
  Device& dev = *call.dev;
  const int p = comm.size();
  const int64_t b = dims.batch, tl = dims.tokens, t = tl * p, d = dims.d;
  const HeadSplit split(dims, p);
  const Groups groups =
      choose_groups(split, dims, p, call.kernel.threads, AttentionPass::backward, max_groups);
  const int64_t hq = split.hq_local, gq = groups.hq, gk = groups.hk;
  const DType es = dims.dtype, eo = dims.out_dtype;

  // delta = rowsum(dO * O) is per (token, head): computed where the tokens are, sent instead of O.
  DeviceBuffer delta = dev.alloc(size_t(b * dims.hq * tl) * 4);
  const TensorView delta_v = delta.view(DType::f32, {b, dims.hq, tl});
  dev.backward_delta(kComputeStream, out, dout, delta_v, call.kernel);
  const GroupTokens group = gather_tokens(comm, call, a.tokens, tl);

  Sections in;
  const size_t sq = in.add(es, {b, tl, gq, d}), sk = in.add(es, {b, tl, gk, d}),
               sv = in.add(es, {b, tl, gk, d}), sdo = in.add(eo, {b, tl, gq, d}),
               sl = in.add(DType::f32, {b, gq, tl}), sdl = in.add(DType::f32, {b, gq, tl});
  // The whole group sequence for one head group, in one buffer: q, k, v, dout, lse, delta,
  // then the fp32 gradients dq, dk, dv (zeroed: the inner adds into them).
  Sections whole;
  const size_t fq = whole.add(es, {b, t, gq, d}), fk = whole.add(es, {b, t, gk, d}),
               fv = whole.add(es, {b, t, gk, d}), fdo = whole.add(eo, {b, t, gq, d}),
               fl = whole.add(DType::f32, {b, gq, t}), fdl = whole.add(DType::f32, {b, gq, t}),
               fdq = whole.add(DType::f32, {b, t, gq, d}),
               fdk = whole.add(DType::f32, {b, t, gk, d}),
               fdv = whole.add(DType::f32, {b, t, gk, d});
  Sections back;
  const size_t gdq = back.add(DType::f32, {b, tl, gq, d}),
               gdk = back.add(DType::f32, {b, tl, gk, d}),
               gdv = back.add(DType::f32, {b, tl, gk, d});
  auto send_in = [&](int g) {
    DeviceBuffer send = dev.alloc(in.bytes * p);
    for (int j = 0; j < p; ++j) {
      const int64_t h0 = j * hq + g * gq;
      pack_qkv(dev, split, groups, j, g, q, k, v, in.view(send, j, sq), in.view(send, j, sk),
               in.view(send, j, sv));
      dev.copy(kComputeStream, dout.slice(2, h0, h0 + gq), in.view(send, j, sdo));
      dev.copy(kComputeStream, lse.slice(1, h0, h0 + gq), in.view(send, j, sl));
      dev.copy(kComputeStream, delta_v.slice(1, h0, h0 + gq), in.view(send, j, sdl));
    }
    return start_exchange(dev, comm, std::move(send), in, tag_in(g));
  };

  // The groups' gradients come back while the next group computes; they are kept (one
  // receive buffer of the whole, as before) and summed at the end in the unpipelined order.
  std::vector<Exchange> returned(groups.count);
  Exchange incoming = send_in(0);
  for (int g = 0; g < groups.count; ++g) {
    Exchange next;
    if (g + 1 < groups.count) next = send_in(g + 1);
    arrive(dev, incoming);
    DeviceBuffer full = dev.alloc(whole.bytes);
    auto f = [&](size_t i) { return whole.view(full, 0, i); };
    for (size_t i : {fdq, fdk, fdv}) dev.fill_zero(kComputeStream, f(i));
    const std::pair<size_t, size_t> inputs[] = {{sq, fq},   {sk, fk}, {sv, fv},
                                                {sdo, fdo}, {sl, fl}, {sdl, fdl}};
    for (int i = 0; i < p; ++i)  // each rank's tokens of each input, to their sorted places
      for (const auto& [from, to] : inputs)
        dev.scatter_tokens(kComputeStream, in.view(incoming.recv, i, from), f(to), group.index(i));
    incoming = Exchange();
    inner({f(fq), f(fk), f(fv), group.tokens(), f(fdo), f(fl), f(fdl), f(fdq), f(fdk), f(fdv)});

    DeviceBuffer send = dev.alloc(back.bytes * p);
    for (int i = 0; i < p; ++i) {
      dev.gather_tokens(kComputeStream, f(fdq), back.view(send, i, gdq), group.index(i));
      dev.gather_tokens(kComputeStream, f(fdk), back.view(send, i, gdk), group.index(i));
      dev.gather_tokens(kComputeStream, f(fdv), back.view(send, i, gdv), group.index(i));
    }
    returned[g] = start_exchange(dev, comm, std::move(send), back, tag_back(g));
    returned[g].send.reset();
    incoming = std::move(next);
  }
  collect_gradients(dev, p, dims, split, groups, {back, gdq, gdk, gdv}, returned, a);
}

namespace {

class UlyssesStrategy final : public Strategy {
 public:
  UlyssesStrategy(Communicator& comm, const StrategyOptions& options,
                  std::unique_ptr<Device> device)
      : Strategy(comm, options, std::move(device)) {}

 protected:
  std::string check_heads(int64_t hq, int64_t hkv) const override {
    const std::string e = ulysses_heads_rule(hq, comm_.size());
    return e.empty() ? e : "ulysses: " + e;
  }

  void run_forward(const ForwardArgs& a, Call& call) override {
    ulysses_forward(
        comm_, call, a,
        [&](const ForwardArgs& f) {  // one block: all the keys of the group's heads
          call.dev->forward_whole(kComputeStream, f.q, f.tokens, f.k, f.v, f.tokens, call.mask,
                                  f.out, f.lse, call.kernel);
        },
        groups_limit(options_, kUlyssesDefaultGroups));
  }

  void run_backward(const BackwardArgs& a, Call& call) override {
    ulysses_backward(
        comm_, call, a,
        [&](const GradArgs& g) {
          call.dev->backward_block(kComputeStream, g.q, g.tokens, g.k, g.v, g.tokens, call.mask,
                                   g.dout, g.lse, g.delta, g.dq, g.dk, g.dv, call.kernel);
        },
        groups_limit(options_, kUlyssesDefaultGroups));
  }
};

}  // namespace

std::unique_ptr<Strategy> make_ulysses(Communicator& comm, const StrategyOptions& options,
                                       std::unique_ptr<Device> device) {
  return std::make_unique<UlyssesStrategy>(comm, options, std::move(device));
}

}  // namespace ctxpar::strategy

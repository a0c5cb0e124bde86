// MPI: every rank's measurements and (when the root needs them) tensors go to rank 0; the
// fastest repeat; unsharding a field of every rank's data.
#include <algorithm>
#include <cstring>

#include "job_internal.h"

namespace ctxpar::cli::job {
namespace {

constexpr int kStatFields = 9;
constexpr size_t kRankFields = 7;  // tokens, shard and input bytes, the four cuDNN counts

void pack_stats(const StrategyStats& s, double wall, double cpu, double* out) {
  const double v[kStatFields] = {cpu,
                                 wall,
                                 s.attention_flops,
                                 s.busy_seconds,
                                 s.wall_seconds,
                                 s.comm_wait_seconds,
                                 static_cast<double>(s.bytes_sent),
                                 static_cast<double>(s.bytes_received),
                                 static_cast<double>(s.peak_bytes)};
  std::copy(v, v + kStatFields, out);
}

StrategyStats unpack_stats(const double* in, double& wall, double& cpu) {
  StrategyStats s;
  cpu = *in++;
  wall = in[0];
  s.attention_flops = in[1], s.busy_seconds = in[2], s.wall_seconds = in[3];
  s.comm_wait_seconds = in[4];
  s.bytes_sent = static_cast<uint64_t>(in[5]), s.bytes_received = static_cast<uint64_t>(in[6]);
  s.peak_bytes = static_cast<size_t>(in[7]);
  return s;
}

}  // namespace

void gather_to_root(Communicator& comm, const AttentionJob& job, RankData& mine,
                    std::vector<RankData>& all, bool tensors) {
  const int P = comm.size(), R = job.repeats;
  const size_t n = kRankFields + 2 * static_cast<size_t>(R) * kStatFields;
  std::vector<double> send(n, 0), recv(n * P);
  send[0] = static_cast<double>(mine.tokens), send[1] = static_cast<double>(mine.shard_bytes);
  send[2] = static_cast<double>(mine.input_bytes_read);
  send[3] = static_cast<double>(mine.cudnn_blocks), send[4] = static_cast<double>(mine.cudnn_calls);
  send[5] = static_cast<double>(mine.fallback_blocks);
  send[6] = static_cast<double>(mine.cudnn_refused_blocks);
  for (int rep = 0; rep < R; ++rep) {
    pack_stats(mine.fwd_stats[rep], mine.fwd_wall[rep], mine.fwd_cpu[rep],
               &send[kRankFields + rep * kStatFields]);
    if (job.backward)
      pack_stats(mine.bwd_stats[rep], mine.bwd_wall[rep], mine.bwd_cpu[rep],
                 &send[kRankFields + (R + rep) * kStatFields]);
  }
  comm.allgather(send.data(), recv.data(), n * sizeof(double));
  if (comm.rank() == 0) {
    all.resize(P);
    for (int p = 0; p < P; ++p) {
      const double* in = &recv[p * n];
      RankData& rd = all[p];
      rd.tokens = static_cast<int64_t>(in[0]), rd.shard_bytes = static_cast<size_t>(in[1]);
      rd.input_bytes_read = static_cast<uint64_t>(in[2]);
      rd.cudnn_blocks = static_cast<int64_t>(in[3]), rd.cudnn_calls = static_cast<int64_t>(in[4]);
      rd.fallback_blocks = static_cast<int64_t>(in[5]);
      rd.cudnn_refused_blocks = static_cast<int64_t>(in[6]);
      rd.fwd_wall.resize(R), rd.fwd_cpu.resize(R), rd.fwd_stats.resize(R);
      for (int rep = 0; rep < R; ++rep) {
        rd.fwd_stats[rep] =
            unpack_stats(&in[kRankFields + rep * kStatFields], rd.fwd_wall[rep], rd.fwd_cpu[rep]);
        if (!job.backward) continue;
        rd.bwd_wall.resize(R), rd.bwd_cpu.resize(R), rd.bwd_stats.resize(R);
        rd.bwd_stats[rep] = unpack_stats(&in[kRankFields + (R + rep) * kStatFields],
                                         rd.bwd_wall[rep], rd.bwd_cpu[rep]);
      }
    }
  }
  if (!tensors) return;
  auto fields = [](RankData& rd) {
    return std::vector<Tensor*>{&rd.q,    &rd.k,  &rd.v,  &rd.out, &rd.lse,
                                &rd.dout, &rd.dq, &rd.dk, &rd.dv};
  };
  if (comm.rank() != 0) {
    std::vector<Request> sends;
    int tag = 0;
    for (Tensor* t : fields(mine)) {
      ++tag;
      if (t->empty()) continue;
      Buffer buf(t->bytes());
      std::memcpy(buf.data(), t->data(), t->bytes());
      sends.push_back(comm.isend(std::move(buf), 0, 1 << 20 | tag));
    }
    for (auto& s : sends) s.wait();
    return;
  }
  all[0].q = mine.q, all[0].k = mine.k, all[0].v = mine.v, all[0].out = mine.out;
  all[0].lse = mine.lse, all[0].dout = mine.dout, all[0].dq = mine.dq, all[0].dk = mine.dk;
  all[0].dv = mine.dv;
  for (int p = 1; p < P; ++p) {
    std::vector<Tensor*> theirs = fields(all[p]), ours = fields(mine);
    for (size_t f = 0; f < ours.size(); ++f) {
      if (ours[f]->empty()) continue;
      *theirs[f] = Tensor(ours[f]->dtype(), ours[f]->shape());
      Buffer buf = comm.irecv(ours[f]->bytes(), p, 1 << 20 | static_cast<int>(f + 1)).take();
      std::memcpy(theirs[f]->data(), buf.data(), buf.size());
    }
  }
}

int fastest_repeat(const std::vector<RankData>& all, bool backward_phase) {
  int best = 0;
  double best_wall = 1e300;
  const size_t R = backward_phase ? all[0].bwd_wall.size() : all[0].fwd_wall.size();
  for (size_t rep = 0; rep < R; ++rep) {
    double wall = 0;
    for (const auto& rd : all)
      wall = std::max(wall, backward_phase ? rd.bwd_wall[rep] : rd.fwd_wall[rep]);
    if (wall < best_wall) best_wall = wall, best = static_cast<int>(rep);
  }
  return best;
}

Tensor unshard_field(const Layout& layout, std::vector<RankData>& all, Tensor RankData::*f,
                     int token_dim) {
  if ((all[0].*f).empty()) return {};
  Shape shape = (all[0].*f).shape();
  shape[token_dim] = layout.tokens();
  Tensor full((all[0].*f).dtype(), shape);
  std::vector<TensorView> shards;
  for (auto& rd : all) shards.push_back((rd.*f).view());
  layout.unshard(shards, full, token_dim);
  return full;
}

}  // namespace ctxpar::cli::job

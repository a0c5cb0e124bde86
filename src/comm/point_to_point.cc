// Collectives over point-to-point, shared by every transport (see point_to_point.h and
// docs/comm.md for the algorithms and their byte counts).
//
// Determinism: every sum adds the ranks' contributions in rank order 0, 1, ..., P-1, one
// element at a time, whatever order the messages arrive in; so the result is the same run after
// run and on every transport.
#include "comm/point_to_point.h"

#include <algorithm>
#include <cstring>

namespace ctxpar::comm_detail {

namespace {
constexpr int kSplitKind = 15;  // split's exchange is not a CommKind (it is not counted)

const char* kind_name(int kind) {
  if (kind == kSplitKind) return "split";
  if (kind >= 0 && kind < static_cast<int>(CommKind::count_))
    return comm_kind_name(static_cast<CommKind>(kind));
  return "?";
}

int make_tag(uint32_t call, int kind, int phase) {
  return static_cast<int>(((call & 0xfffu) << 8) | (static_cast<uint32_t>(kind) << 4) |
                          static_cast<uint32_t>(phase));
}

void copy_bytes(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memmove(dst, src, bytes);
}

// out[i] = in[0][i] + in[1][i] + ... + in[P-1][i], added left to right (rank order).
template <typename T>
void sum_in_rank_order(const std::vector<const T*>& in, T* out, size_t n) {
  std::copy(in[0], in[0] + n, out);
  for (size_t j = 1; j < in.size(); ++j) {
    const T* s = in[j];
    for (size_t i = 0; i < n; ++i) out[i] += s[i];
  }
}
}  // namespace

int collective_tag(uint32_t call, CommKind kind, int phase) {
  return make_tag(call, static_cast<int>(kind), phase);
}

const char* tag_kind_name(int tag) { return kind_name((tag >> 4) & 15); }

std::string describe_tag(Channel ch, int tag) {
  if (ch == Channel::user) return detail::concat("tag ", tag);
  return detail::concat("tag ", tag, " of ", kind_name((tag >> 4) & 15), " call ", tag >> 8,
                        ", phase ", tag & 15);
}

void throw_timeout(const Where& at, const char* waiting_for) {
  throw Error(detail::concat("rank ", at.me, ": timed out after ", at.timeout.count() / 1000.0,
                             " s waiting for ", waiting_for, " rank ", at.peer, " (",
                             describe_tag(at.ch, at.tag), ")"));
}

void check_message_size(const Where& at, size_t expected, size_t got) {
  CTXPAR_CHECK(got == expected, "rank ", at.me, ": recv from rank ", at.peer, " (",
               describe_tag(at.ch, at.tag), ") expected ", expected, " bytes, but the message has ",
               got, " bytes");
}

void check_same_collective(const Where& at, int their_tag, int from) {
  if (tag_call(their_tag) != tag_call(at.tag) || ((their_tag >> 4) & 15) == ((at.tag >> 4) & 15))
    return;
  throw Error(detail::concat("rank ", at.me, ": collective mismatch: this rank is in ",
                             tag_kind_name(at.tag), " (call ", tag_call(at.tag), ") but rank ",
                             from, " called ", tag_kind_name(their_tag),
                             "; every rank must call the same collectives in the same order"));
}

void throw_stopped(int me, int failed_rank, const std::string& failure) {
  throw Error(
      detail::concat("rank ", me, ": stopped because rank ", failed_rank, " failed: ", failure));
}

uint32_t PointToPointCommunicator::next_call(CommKind) { return calls_++; }

void PointToPointCommunicator::check_peer(int peer, const char* what) const {
  CTXPAR_CHECK(peer >= 0 && peer < size(), what, ": peer must be in [0, ", size(), "), got ", peer);
}

Request PointToPointCommunicator::isend(Buffer&& buf, int peer, int tag) {
  check_peer(peer, "isend");
  CTXPAR_CHECK(tag >= 0 && tag <= max_user_tag(), "isend: tag must be in [0, ", max_user_tag(),
               "], got ", tag);
  count(CommKind::send, buf.size(), 0);
  return post_send(std::move(buf), peer, tag, Channel::user);
}

Request PointToPointCommunicator::irecv(size_t bytes, int peer, int tag) {
  check_peer(peer, "irecv");
  CTXPAR_CHECK(tag >= 0 && tag <= max_user_tag(), "irecv: tag must be in [0, ", max_user_tag(),
               "], got ", tag);
  count(CommKind::recv, 0, bytes);
  return post_recv(bytes, peer, tag, Channel::user);
}

// Ring all-gather of variable-sized segments: segment j is data[offsets[j], offsets[j+1]) and
// this rank's own segment is already in place. Step s forwards the segment received in step
// s-1 to the right neighbour, handing the received Buffer on without copying it.
void PointToPointCommunicator::ring_allgatherv(const std::vector<size_t>& offsets, std::byte* data,
                                               int tag) {
  const int p = size(), r = rank();
  const int right = (r + 1) % p, left = (r + p - 1) % p;
  if (p == 1) return;
  auto len = [&](int j) { return offsets[j + 1] - offsets[j]; };
  Buffer cur = Buffer::uninitialized(len(r));
  copy_bytes(cur.data(), data + offsets[r], len(r));
  for (int s = 0; s < p - 1; ++s) {
    const int from = (r - s - 1 + 2 * p) % p;  // whose segment arrives in this step
    Request rq = post_recv(len(from), left, tag, Channel::collective);
    Request sq = post_send(std::move(cur), right, tag, Channel::collective);
    cur = rq.take();
    copy_bytes(data + offsets[from], cur.data(), len(from));
    sq.wait();
  }
}

void PointToPointCommunicator::allgather(const void* send, void* recv, size_t bytes) {
  // send: [bytes] on every rank; recv: [size()][bytes], rank order.
  CTXPAR_CHECK(bytes == 0 || (send && recv), "allgather: send and recv must not be null");
  const int p = size(), r = rank();
  const int tag = collective_tag(next_call(CommKind::allgather), CommKind::allgather, 0);
  auto* out = static_cast<std::byte*>(recv);
  copy_bytes(out + r * bytes, send, bytes);
  std::vector<size_t> offsets(p + 1);
  for (int j = 0; j <= p; ++j) offsets[j] = j * bytes;
  ring_allgatherv(offsets, out, tag);
  count(CommKind::allgather, (p - 1) * bytes, (p - 1) * bytes);
}

void PointToPointCommunicator::post_pairwise(const std::byte* chunks, size_t bytes, int tag,
                                             std::vector<Request>& rq, std::vector<Request>& sq) {
  const int p = size(), r = rank();
  for (int k = 1; k < p; ++k) {
    const int j = (r - k + p) % p;
    rq[j] = post_recv(bytes, j, tag, Channel::collective);
  }
  for (int k = 1; k < p; ++k) {
    const int j = (r + k) % p;
    Buffer b = Buffer::uninitialized(bytes);
    copy_bytes(b.data(), chunks + j * bytes, bytes);
    sq[j] = post_send(std::move(b), j, tag, Channel::collective);
  }
}

void PointToPointCommunicator::reduce_scatter(const float* send, float* recv, size_t n) {
  // send: [size()][n] fp32; recv: [n] = sum over ranks of their chunk rank().
  CTXPAR_CHECK(n == 0 || (send && recv), "reduce_scatter: send and recv must not be null");
  const int p = size(), r = rank();
  const size_t bytes = n * sizeof(float);
  const int tag = collective_tag(next_call(CommKind::reduce_scatter), CommKind::reduce_scatter, 0);
  std::vector<Request> rq(p), sq(p);
  post_pairwise(reinterpret_cast<const std::byte*>(send), bytes, tag, rq, sq);
  std::vector<Buffer> got(p);
  std::vector<const float*> parts(p);
  for (int j = 0; j < p; ++j) {
    if (j == r) {
      parts[j] = send + r * n;
    } else {
      got[j] = rq[j].take();
      parts[j] = got[j].as<float>();
    }
  }
  // A temporary, because recv may overlap send.
  std::vector<float> sum(n);
  if (n) sum_in_rank_order(parts, sum.data(), n);
  copy_bytes(recv, sum.data(), bytes);
  for (auto& q : sq) q.wait();
  count(CommKind::reduce_scatter, (p - 1) * bytes, (p - 1) * bytes);
}

void PointToPointCommunicator::alltoall(const void* send, void* recv, size_t bytes) {
  // send: [size()][bytes], chunk j for rank j; recv: [size()][bytes], chunk i from rank i.
  CTXPAR_CHECK(bytes == 0 || (send && recv), "alltoall: send and recv must not be null");
  const int p = size(), r = rank();
  const int tag = collective_tag(next_call(CommKind::alltoall), CommKind::alltoall, 0);
  const auto* in = static_cast<const std::byte*>(send);
  auto* out = static_cast<std::byte*>(recv);
  std::vector<Request> rq(p), sq(p);
  post_pairwise(in, bytes, tag, rq, sq);
  // Every outgoing chunk is already copied out, so recv may alias send.
  copy_bytes(out + r * bytes, in + r * bytes, bytes);
  for (int j = 0; j < p; ++j) {
    if (j == r) continue;
    Buffer b = rq[j].take();
    copy_bytes(out + j * bytes, b.data(), bytes);
  }
  for (auto& q : sq) q.wait();
  count(CommKind::alltoall, (p - 1) * bytes, (p - 1) * bytes);
}

// Reduce-scatter to chunk owners (rank j owns elements [j*n/P, (j+1)*n/P)), each owner adds
// the P contributions in rank order, then a ring all-gather spreads the sums.
template <typename T>
void PointToPointCommunicator::allreduce_sum(T* buf, size_t n) {
  CTXPAR_CHECK(n == 0 || buf, "allreduce: buf must not be null");
  const int p = size(), r = rank();
  const uint32_t call = next_call(CommKind::allreduce);
  if (p == 1) {
    count(CommKind::allreduce, 0, 0);
    return;
  }
  std::vector<size_t> off(p + 1), byte_off(p + 1);
  for (int j = 0; j <= p; ++j) {
    off[j] = n * j / p;
    byte_off[j] = off[j] * sizeof(T);
  }
  auto len = [&](int j) { return off[j + 1] - off[j]; };
  const int tag0 = collective_tag(call, CommKind::allreduce, 0);
  std::vector<Request> rq(p), sq(p);
  for (int k = 1; k < p; ++k) {
    const int j = (r - k + p) % p;
    rq[j] = post_recv(len(r) * sizeof(T), j, tag0, Channel::collective);
  }
  for (int k = 1; k < p; ++k) {
    const int j = (r + k) % p;
    Buffer b = Buffer::uninitialized(len(j) * sizeof(T));
    copy_bytes(b.data(), buf + off[j], len(j) * sizeof(T));
    sq[j] = post_send(std::move(b), j, tag0, Channel::collective);
  }
  std::vector<Buffer> got(p);
  std::vector<const T*> parts(p);
  for (int j = 0; j < p; ++j) {
    if (j == r) {
      parts[j] = buf + off[r];
    } else {
      got[j] = rq[j].take();
      parts[j] = got[j].template as<T>();
    }
  }
  std::vector<T> sum(len(r));
  if (len(r)) sum_in_rank_order(parts, sum.data(), len(r));
  copy_bytes(buf + off[r], sum.data(), len(r) * sizeof(T));
  for (auto& q : sq) q.wait();
  ring_allgatherv(byte_off, reinterpret_cast<std::byte*>(buf),
                  collective_tag(call, CommKind::allreduce, 1));
  const uint64_t sent = (n - len(r)) + (n - len((r + 1) % p));
  const uint64_t received = (p - 1) * len(r) + (n - len(r));
  count(CommKind::allreduce, sent * sizeof(T), received * sizeof(T));
}

void PointToPointCommunicator::allreduce(float* buf, size_t n) { allreduce_sum(buf, n); }
void PointToPointCommunicator::allreduce(double* buf, size_t n) { allreduce_sum(buf, n); }

// Dissemination barrier: in round k every rank signals rank + 2^k and waits for rank - 2^k;
// after ceil(log2 P) rounds every rank has (transitively) heard from every other.
void PointToPointCommunicator::barrier() {
  const int p = size(), r = rank();
  const uint32_t call = next_call(CommKind::barrier);
  int round = 0;
  for (int k = 1; k < p; k <<= 1, ++round) {
    const int tag = collective_tag(call, CommKind::barrier, round);
    Request rq = post_recv(0, (r - k + p) % p, tag, Channel::collective);
    Request sq = post_send(Buffer(), (r + k) % p, tag, Channel::collective);
    rq.wait();
    sq.wait();
  }
  count(CommKind::barrier, 0, 0);
}

std::unique_ptr<Communicator> PointToPointCommunicator::split(int color, int key) {
  const int p = size(), r = rank();
  // Everyone learns every (color, key) first, so a bad color is refused on all ranks alike.
  std::vector<int> table(2 * p);
  table[2 * r] = color;
  table[2 * r + 1] = key;
  std::vector<size_t> offsets(p + 1);
  for (int j = 0; j <= p; ++j) offsets[j] = j * 2 * sizeof(int);
  ring_allgatherv(offsets, reinterpret_cast<std::byte*>(table.data()),
                  make_tag(calls_++, kSplitKind, 0));
  for (int j = 0; j < p; ++j)
    CTXPAR_CHECK(table[2 * j] >= 0, "split: color must be >= 0 on every rank; rank ", j, " gave ",
                 table[2 * j]);
  std::vector<int> members;
  for (int j = 0; j < p; ++j)
    if (table[2 * j] == color) members.push_back(j);
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return table[2 * a + 1] < table[2 * b + 1]; });
  auto sub = make_split(color, key, members, splits_++);
  sub->set_timeout(timeout());
  return sub;
}

}  // namespace ctxpar::comm_detail

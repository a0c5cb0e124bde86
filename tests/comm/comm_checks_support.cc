#include "comm/comm_checks.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>

namespace ctxpar::testing {

namespace {

uint64_t mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

unsigned char byte_value(int rank, size_t i, int salt) {
  return static_cast<unsigned char>(mix((uint64_t(salt) << 40) ^ (uint64_t(rank) << 32) ^ i));
}

// What the counters must have grown by in one call.
void expect_delta(const CommCounters& before, const CommCounters& after, CommKind kind,
                  uint64_t sent, uint64_t received, const char* what) {
  const int k = static_cast<int>(kind);
  EXPECT_EQ(after.calls[k] - before.calls[k], 1u) << what;
  EXPECT_EQ(after.bytes_sent_by[k] - before.bytes_sent_by[k], sent) << what;
  EXPECT_EQ(after.bytes_sent - before.bytes_sent, sent) << what;
  EXPECT_EQ(after.bytes_received - before.bytes_received, received) << what;
}

// Rank j's share of an n-element allreduce: [j*n/P, (j+1)*n/P) (docs/comm.md).
size_t chunk_len(size_t n, int p, int j) { return n * (j + 1) / p - n * j / p; }

template <typename T>
void check_allreduce_typed(Communicator& comm, size_t n, int salt) {
  const int p = comm.size(), r = comm.rank();
  std::vector<T> buf(n);
  for (size_t i = 0; i < n; ++i) buf[i] = static_cast<T>(input_value(r, i, salt));
  const CommCounters before = comm.counters();
  comm.allreduce(buf.data(), n);
  const size_t lr = chunk_len(n, p, r), lnext = chunk_len(n, p, (r + 1) % p);
  const uint64_t sent = p == 1 ? 0 : (2 * n - lr - lnext) * sizeof(T);
  const uint64_t received = p == 1 ? 0 : (n + (p - 2) * lr) * sizeof(T);
  expect_delta(before, comm.counters(), CommKind::allreduce, sent, received, "allreduce");
  for (size_t i = 0; i < n; ++i) {
    // The contract: contributions added in rank order, in T.
    T in_order = static_cast<T>(input_value(0, i, salt));
    double exact = input_value(0, i, salt), magnitude = std::fabs(exact);
    for (int j = 1; j < p; ++j) {
      in_order += static_cast<T>(input_value(j, i, salt));
      exact += input_value(j, i, salt);
      magnitude += std::fabs(input_value(j, i, salt));
    }
    ASSERT_EQ(std::memcmp(&buf[i], &in_order, sizeof(T)), 0)
        << "allreduce element " << i << " of " << n << ": " << buf[i] << " vs " << in_order;
    // Tolerance: P-1 additions, each rounding by at most one ulp of the magnitude.
    const double eps = sizeof(T) == 4 ? 0x1p-24 : 0x1p-53;
    EXPECT_LE(std::fabs(buf[i] - exact), p * eps * magnitude) << "allreduce element " << i;
  }
}

}  // namespace

float input_value(int rank, size_t i, int salt) {
  const uint64_t h = mix((uint64_t(salt) << 40) ^ (uint64_t(rank + 1) << 32) ^ i);
  const float unit = static_cast<float>(h >> 40) / float(1 << 24) * 2.0f - 1.0f;  // [-1, 1)
  return std::ldexp(unit, static_cast<int>(h % 21) - 10);
}

void check_point_to_point(Communicator& comm) {
  const int p = comm.size(), r = comm.rank();
  const int right = (r + 1) % p, left = (r + p - 1) % p;
  // Two messages on the same tag and one on another: same-tag messages keep their order,
  // whatever order the receives are waited in.
  auto size_of = [](int rank, int m) {
    return m == 2 ? size_t(0) : (m ? 3000 : 100) + size_t(rank);
  };
  const int tags[3] = {5, 5, 6};
  const CommCounters before = comm.counters();
  std::vector<Request> recvs;
  for (int m = 0; m < 3; ++m) recvs.push_back(comm.irecv(size_of(left, m), left, tags[m]));
  std::vector<Request> sends;
  for (int m = 0; m < 3; ++m) {
    Buffer b(size_of(r, m));
    for (size_t i = 0; i < b.size(); ++i) b.as<unsigned char>()[i] = byte_value(r, i, m);
    sends.push_back(comm.isend(std::move(b), right, tags[m]));
  }
  for (int m = 2; m >= 0; --m) {
    Buffer got = recvs[m].take();
    ASSERT_EQ(got.size(), size_of(left, m));
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(got.as<unsigned char>()[i], byte_value(left, i, m)) << "message " << m;
  }
  for (auto& s : sends) s.wait();
  const CommCounters& after = comm.counters();
  const uint64_t out = size_of(r, 0) + size_of(r, 1) + size_of(r, 2);
  const uint64_t in = size_of(left, 0) + size_of(left, 1) + size_of(left, 2);
  EXPECT_EQ(after.calls_of(CommKind::send) - before.calls_of(CommKind::send), 3u);
  EXPECT_EQ(after.calls_of(CommKind::recv) - before.calls_of(CommKind::recv), 3u);
  EXPECT_EQ(after.sent_by(CommKind::send) - before.sent_by(CommKind::send), out);
  EXPECT_EQ(after.bytes_sent - before.bytes_sent, out);
  EXPECT_EQ(after.bytes_received - before.bytes_received, in);

  // A rank may send to itself.
  Request self_recv = comm.irecv(64, r, 9);
  Buffer b(64);
  b.as<unsigned char>()[63] = 42;
  comm.isend(std::move(b), r, 9).wait();
  EXPECT_EQ(self_recv.take().as<unsigned char>()[63], 42);
}

void check_allgather(Communicator& comm, size_t bytes) {
  const int p = comm.size(), r = comm.rank();
  std::vector<unsigned char> send(bytes), recv(p * bytes + 1, 0xee);
  for (size_t i = 0; i < bytes; ++i) send[i] = byte_value(r, i, 1);
  const CommCounters before = comm.counters();
  comm.allgather(send.data(), recv.data(), bytes);
  expect_delta(before, comm.counters(), CommKind::allgather, (p - 1) * bytes, (p - 1) * bytes,
               "allgather");
  for (int j = 0; j < p; ++j)
    for (size_t i = 0; i < bytes; ++i)
      ASSERT_EQ(recv[j * bytes + i], byte_value(j, i, 1))
          << "allgather rank " << j << " byte " << i;
  EXPECT_EQ(recv[p * bytes], 0xee) << "allgather wrote past the end";
}

void check_reduce_scatter(Communicator& comm, size_t n) {
  const int p = comm.size(), r = comm.rank();
  std::vector<float> send(p * n), recv(n + 1, -7.0f);
  for (size_t i = 0; i < p * n; ++i) send[i] = input_value(r, i, 2);
  const CommCounters before = comm.counters();
  comm.reduce_scatter(send.data(), recv.data(), n);
  const uint64_t bytes = (p - 1) * n * sizeof(float);
  expect_delta(before, comm.counters(), CommKind::reduce_scatter, bytes, bytes, "reduce_scatter");
  for (size_t i = 0; i < n; ++i) {
    const size_t g = r * n + i;
    float in_order = input_value(0, g, 2);
    double exact = in_order, magnitude = std::fabs(exact);
    for (int j = 1; j < p; ++j) {
      in_order += input_value(j, g, 2);
      exact += input_value(j, g, 2);
      magnitude += std::fabs(input_value(j, g, 2));
    }
    ASSERT_EQ(std::memcmp(&recv[i], &in_order, 4), 0) << "reduce_scatter element " << i;
    EXPECT_LE(std::fabs(recv[i] - exact), p * 0x1p-24 * magnitude);
  }
  EXPECT_EQ(recv[n], -7.0f) << "reduce_scatter wrote past the end";
}

void check_alltoall(Communicator& comm, size_t bytes) {
  const int p = comm.size(), r = comm.rank();
  // Chunk j of rank r's send is made from (r, j): rank r must receive (i, r) in slot i.
  std::vector<unsigned char> send(p * bytes), recv(p * bytes + 1, 0xee);
  for (int j = 0; j < p; ++j)
    for (size_t i = 0; i < bytes; ++i) send[j * bytes + i] = byte_value(r, i, 100 + j);
  const CommCounters before = comm.counters();
  comm.alltoall(send.data(), recv.data(), bytes);
  expect_delta(before, comm.counters(), CommKind::alltoall, (p - 1) * bytes, (p - 1) * bytes,
               "alltoall");
  for (int j = 0; j < p; ++j)
    for (size_t i = 0; i < bytes; ++i)
      ASSERT_EQ(recv[j * bytes + i], byte_value(j, i, 100 + r)) << "alltoall from " << j;
  EXPECT_EQ(recv[p * bytes], 0xee) << "alltoall wrote past the end";
}

void check_allreduce(Communicator& comm, size_t n) {
  check_allreduce_typed<float>(comm, n, 3);
  check_allreduce_typed<double>(comm, n, 4);
}

void check_barrier(Communicator& comm) {
  const CommCounters before = comm.counters();
  comm.barrier();
  expect_delta(before, comm.counters(), CommKind::barrier, 0, 0, "barrier");
}

void check_split_mesh(Communicator& comm) {
  const int p = comm.size(), r = comm.rank();
  // Mesh data x context with D = 2 when P is even: rank = d * C + c.
  const int d_size = p % 2 == 0 ? 2 : 1, c_size = p / d_size;
  const int d = r / c_size, c = r % c_size;
  const CommCounters before = comm.counters();
  auto context = comm.split(/*color=*/d, /*key=*/c);
  auto data = comm.split(/*color=*/c, /*key=*/d);
  // split is not counted, and a new group's counters start at zero.
  EXPECT_EQ(comm.counters().bytes_sent, before.bytes_sent);
  EXPECT_EQ(comm.counters().bytes_received, before.bytes_received);
  EXPECT_EQ(context->counters().bytes_sent + context->counters().calls_of(CommKind::allgather), 0u);
  ASSERT_EQ(context->size(), c_size);
  ASSERT_EQ(context->rank(), c);
  ASSERT_EQ(data->size(), d_size);
  ASSERT_EQ(data->rank(), d);
  EXPECT_EQ(context->transport(), comm.transport());
  EXPECT_EQ(context->timeout(), comm.timeout());
  // Sum of parent ranks inside each group, through the group's own allreduce.
  double s[1] = {double(r)};
  context->allreduce(s, 1);
  EXPECT_EQ(s[0], double(d * c_size * c_size + c_size * (c_size - 1) / 2));
  s[0] = r;
  data->allreduce(s, 1);
  EXPECT_EQ(s[0], double(c * d_size + c_size * d_size * (d_size - 1) / 2));
  // Messages inside a sub-group use sub-group ranks and do not leak into the parent.
  check_point_to_point(*context);
  check_allgather(*data, 24);
  // Ordering by key: a negative key reverses the ranks; equal keys keep the parent order.
  auto reversed = comm.split(0, -r);
  EXPECT_EQ(reversed->rank(), p - 1 - r);
  auto same = comm.split(0, 7);
  EXPECT_EQ(same->rank(), r);
  // Split of a split: the context group's ranks into singletons.
  auto single = context->split(context->rank(), 0);
  EXPECT_EQ(single->size(), 1);
  check_allgather(*single, 8);
  EXPECT_THROW(comm.split(r == 0 ? -1 : 0, 0), Error);  // refused on every rank alike
}

void check_all(Communicator& comm) {
  const int p = comm.size();
  check_point_to_point(comm);
  for (size_t bytes : {size_t(0), size_t(1), size_t(4096 + 3)}) check_allgather(comm, bytes);
  for (size_t n : {size_t(0), size_t(1), size_t(1000)}) check_reduce_scatter(comm, n);
  for (size_t bytes : {size_t(0), size_t(7), size_t(2048)}) check_alltoall(comm, bytes);
  // Counts below P, not divisible by P, divisible by P.
  for (size_t n : {size_t(0), size_t(1), size_t(p + 1), size_t(3 * p), size_t(1001)})
    check_allreduce(comm, n);
  check_barrier(comm);
  check_split_mesh(comm);
}

std::vector<unsigned char> reduction_results(Communicator& comm) {
  const int p = comm.size(), r = comm.rank();
  const size_t n = 777;
  std::vector<float> send(p * n), rs(n), arf(n);
  std::vector<double> ard(n);
  for (size_t i = 0; i < p * n; ++i) send[i] = input_value(r, i, 11);
  for (size_t i = 0; i < n; ++i) {
    arf[i] = input_value(r, i, 12);
    ard[i] = input_value(r, i, 13) * 1.000000001;
  }
  comm.reduce_scatter(send.data(), rs.data(), n);
  comm.allreduce(arf.data(), n);
  comm.allreduce(ard.data(), n);
  std::vector<unsigned char> out(n * (4 + 4 + 8));
  std::memcpy(out.data(), rs.data(), n * 4);
  std::memcpy(out.data() + n * 4, arf.data(), n * 4);
  std::memcpy(out.data() + n * 8, ard.data(), n * 8);
  return out;
}

}  // namespace ctxpar::testing

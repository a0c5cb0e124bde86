#include "comm/host_delegating.h"

namespace ctxpar {

HostDelegatingComm::Counting::~Counting() {
  const CommCounters& after = self.host_->counters();
  for (int k = 0; k < static_cast<int>(CommKind::count_); ++k) {
    self.counters_.calls[k] += after.calls[k] - before.calls[k];
    self.counters_.bytes_sent_by[k] += after.bytes_sent_by[k] - before.bytes_sent_by[k];
  }
  self.counters_.bytes_sent += after.bytes_sent - before.bytes_sent;
  self.counters_.bytes_received += after.bytes_received - before.bytes_received;
}

Request HostDelegatingComm::isend(Buffer&& buf, int peer, int tag) {
  return delegate([&](Communicator& h) { return h.isend(std::move(buf), peer, tag); });
}
Request HostDelegatingComm::irecv(size_t bytes, int peer, int tag) {
  return delegate([&](Communicator& h) { return h.irecv(bytes, peer, tag); });
}
void HostDelegatingComm::allgather(const void* send, void* recv, size_t bytes) {
  delegate([&](Communicator& h) { h.allgather(send, recv, bytes); });
}
void HostDelegatingComm::reduce_scatter(const float* send, float* recv, size_t count) {
  delegate([&](Communicator& h) { h.reduce_scatter(send, recv, count); });
}
void HostDelegatingComm::alltoall(const void* send, void* recv, size_t bytes) {
  delegate([&](Communicator& h) { h.alltoall(send, recv, bytes); });
}
void HostDelegatingComm::allreduce(float* buf, size_t count) {
  delegate([&](Communicator& h) { h.allreduce(buf, count); });
}
void HostDelegatingComm::allreduce(double* buf, size_t count) {
  delegate([&](Communicator& h) { h.allreduce(buf, count); });
}
void HostDelegatingComm::barrier() {
  delegate([&](Communicator& h) { h.barrier(); });
}

}  // namespace ctxpar

// A communicator whose host-side work (host point-to-point, collectives, barrier) goes to
// another communicator, `host`, with this one's timeout, and whose counters count it too: the
// transports that move device memory themselves (src/cuda/loopback.h, src/cuda/nccl_comm.h)
// keep their host work on the world they wrap. Written once here for both.
#pragma once
#include <memory>

#include "ctxpar/comm.h"

namespace ctxpar {

class HostDelegatingComm : public Communicator {
 public:
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  Request isend(Buffer&& buf, int peer, int tag) override;
  Request irecv(size_t bytes, int peer, int tag) override;
  void allgather(const void* send, void* recv, size_t bytes) override;
  void reduce_scatter(const float* send, float* recv, size_t count) override;
  void alltoall(const void* send, void* recv, size_t bytes) override;
  void allreduce(float* buf, size_t count) override;
  void allreduce(double* buf, size_t count) override;
  void barrier() override;
  const Communicator& host() const { return *host_; }

 protected:
  // `host` must outlive this communicator; the second form owns it (a split's).
  explicit HostDelegatingComm(Communicator& host) : host_(&host) {}
  explicit HostDelegatingComm(std::unique_ptr<Communicator> host)
      : owned_host_(std::move(host)), host_(owned_host_.get()) {}
  Communicator& host_comm() const { return *host_; }
  // Runs f(host) with this one's timeout, adding what the host counted meanwhile to this
  // one's counters (also when f throws).
  template <class F>
  auto delegate(F&& f) {
    host_->set_timeout(timeout());
    Counting counting{*this, host_->counters()};
    return f(*host_);
  }

 private:
  struct Counting {
    HostDelegatingComm& self;
    CommCounters before;
    ~Counting();
  };
  std::unique_ptr<Communicator> owned_host_;
  Communicator* host_;
};

}  // namespace ctxpar

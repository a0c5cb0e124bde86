// The shared half of every transport: a transport supplies uncounted point-to-point sends and
// receives on two channels (user messages and collective traffic, so a user tag never meets a
// collective's message), and this class builds the counted public calls and every collective
// on top of them. Both transports therefore run the same collective algorithms, in the same
// summation order, and give bitwise identical results. See docs/comm.md.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ctxpar/comm.h"

namespace ctxpar::comm_detail {

enum class Channel { user = 0, collective = 1 };

// Collective tags: call number (12 bits, wraps) | kind (4 bits) | phase (4 bits). The kind is in
// the tag so that ranks calling different collectives never match each other's messages.
int collective_tag(uint32_t call, CommKind kind, int phase);
// The parts of a collective tag.
inline uint32_t tag_call(int tag) { return static_cast<uint32_t>(tag) >> 8; }
const char* tag_kind_name(int tag);
// "tag 5" for user messages, "tag 5 of allgather call 3" for collective ones.
std::string describe_tag(Channel ch, int tag);

// Who waits for what, for the transports' error messages; ranks are world ranks, so a message
// from a sub-group names the thread or process it means.
struct Where {
  int me = 0;
  int peer = 0;
  int tag = 0;
  Channel ch = Channel::user;
  std::chrono::milliseconds timeout{};  // the communicator's, when the request was posted
};

// Every transport's errors, in one wording (a test reads them on each transport):
// "rank 1: timed out after 2 s waiting for recv from rank 0 (tag 5)"
[[noreturn]] void throw_timeout(const Where& at, const char* waiting_for);
// A receive whose message has `got` bytes where `at` expected `expected`.
void check_message_size(const Where& at, size_t expected, size_t got);
// A collective message `their_tag` from world rank `from`, seen while `at` waits in a
// collective: the same call number of another kind means that rank called a different
// collective, and nothing this rank waits for will come; throws naming both.
void check_same_collective(const Where& at, int their_tag, int from);
// "rank 2: stopped because rank 0 failed: <failure>": another rank of the job failed first.
[[noreturn]] void throw_stopped(int me, int failed_rank, const std::string& failure);

class PointToPointCommunicator : public Communicator {
 public:
  Request isend(Buffer&& buf, int peer, int tag) final;
  Request irecv(size_t bytes, int peer, int tag) final;

  void allgather(const void* send, void* recv, size_t bytes) final;
  void reduce_scatter(const float* send, float* recv, size_t count) final;
  void alltoall(const void* send, void* recv, size_t bytes) final;
  void allreduce(float* buf, size_t count) final;
  void allreduce(double* buf, size_t count) final;
  void barrier() final;
  std::unique_ptr<Communicator> split(int color, int key) final;

  // This rank's number in the outermost group (the one run_threads / mpirun made): errors
  // name ranks this way, so a message from a sub-group points at the right thread/process.
  virtual int world_rank() const = 0;
  virtual int world_rank_of(int peer) const = 0;

 protected:
  // Uncounted transfers; tags are the caller's (user) or from collective_tag (collective).
  virtual Request post_send(Buffer&& buf, int peer, int tag, Channel ch) = 0;
  virtual Request post_recv(size_t bytes, int peer, int tag, Channel ch) = 0;
  // Makes the communicator of the ranks that share this rank's color. `members` are the
  // parent ranks of that group in their new order (by key, then parent rank); every rank of
  // the parent calls this once per split, in the same order.
  virtual std::unique_ptr<Communicator> make_split(int color, int key,
                                                   const std::vector<int>& members,
                                                   uint32_t split_number) = 0;
  virtual int max_user_tag() const = 0;
  // The Where of a transfer with `peer` (this communicator's rank) posted now.
  Where where(int peer, int tag, Channel ch) const {
    return Where{world_rank(), world_rank_of(peer), tag, ch, timeout()};
  }

 private:
  uint32_t next_call(CommKind kind);
  void check_peer(int peer, const char* what) const;
  void ring_allgatherv(const std::vector<size_t>& offsets, std::byte* data, int tag);
  // Posts, for every other rank j, a receive of `bytes` (rq[j]) and a send of a copy of
  // chunks[j * bytes, (j + 1) * bytes) (sq[j]); the shifted orders spread the load. Every
  // outgoing chunk is copied before return, so the caller may then overwrite `chunks`.
  void post_pairwise(const std::byte* chunks, size_t bytes, int tag, std::vector<Request>& rq,
                     std::vector<Request>& sq);
  template <typename T>
  void allreduce_sum(T* buf, size_t count);

  uint32_t calls_ = 0;  // collectives called so far (all kinds): the call number in tags
  uint32_t splits_ = 0;
};

}  // namespace ctxpar::comm_detail

// The gloo transport's shared state (one per connected process group; split communicators
// share it) and its point-to-point requests. See gloo.cc and docs/comm.md ("Gloo transport").
#pragma once
#include <gloo/transport/context.h>
#include <gloo/transport/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <array>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "comm/point_to_point.h"

namespace ctxpar::comm_detail {

// Slots (Gloo's 64-bit tags). A message is two Gloo messages: a 16-byte header (the payload's
// size) on the header slot, then the payload on a data slot that also encodes the size, so a
// receive never matches a payload of another size (Gloo would overrun or silently short it):
// the header arrives whatever the size, and the receive reports the mismatch.
//   header slot: 1 | group (31 bits) | channel (1 bit) | tag (31 bits)
//   data slot:   0 | hash(header slot, size) (63 bits)
uint64_t header_slot(uint32_t group, Channel ch, int tag);
uint64_t data_slot(uint64_t header, uint64_t bytes);
constexpr uint32_t kAbortGroup = 0x7fffffffu;  // the abort message's slot (never a group id)
constexpr size_t kAbortBytes = 1024;           // an abort message, padded

struct GlooWorld {
  int rank = 0, size = 1;
  std::chrono::milliseconds connect_timeout{120000};
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::transport::Context> context;
  std::string peer_names;  // for errors
  // A pipe made before the pairs, so that those of a bootstrap that never connected go in
  // milliseconds, even once the process is out of descriptors; `connected`: connect()
  // succeeded, the pairs go at Gloo's pace (Note [Gloo's teardown waits a tick per pair]).
  int teardown_tick[2] = {-1, -1};
  bool connected = false;

  std::mutex mu;
  std::condition_variable cv;
  // The first failure this process heard of (its own, or a peer's abort message).
  int failed_rank = -1;
  std::string failure;
  // Gloo buffers a rank thread is blocked on: an abort wakes them (abortWaitRecv/Send).
  std::set<gloo::transport::UnboundBuffer*> waiting_recv, waiting_send;
  // Requests dropped before they completed: Gloo may still read or write their memory.
  std::vector<std::shared_ptr<void>> detached;

  // Self-sends (Gloo has no pair to oneself): per key, messages nobody asked for yet, and
  // receives waiting for one.
  struct SelfSlot {
    std::deque<Buffer> unexpected;
    std::deque<std::shared_ptr<struct SelfMessage>> posted;
  };
  std::map<uint64_t, SelfSlot> self;

  // The abort listener: a receive from any rank on the abort slot, waited on by a thread.
  std::array<char, kAbortBytes> abort_in{};
  std::unique_ptr<gloo::transport::UnboundBuffer> abort_buffer;
  std::thread abort_thread;
  bool stopping = false;

  ~GlooWorld();
  void start_abort_listener();
  // Records a failure (the first one wins) and wakes every blocked wait.
  void fail(int rank, const std::string& message);
  // Tells every other rank that `rank` failed (best effort: waits at most ~2 s).
  void broadcast_abort(int failed, const std::string& message);
  // Throws "rank R: stopped because rank Q failed: ..." if a failure was recorded.
  // Caller holds mu.
  void check_failed_locked(int me) const;
  // A connection that closed: a rank that fails sends its reason to every rank and then exits,
  // so its abort message comes before its connection closes, but the listener thread that
  // reads it may not have run yet. Waits up to `grace` for a recorded failure and throws it as
  // check_failed_locked does, so that the reason wins over "lost the connection" (a rank
  // killed outright sends nothing: the wait then costs `grace` once, on the way to the error).
  void await_failure(int me, std::chrono::milliseconds grace);
};

struct SelfMessage {
  bool arrived = false;
  Buffer payload;
};

// The communicator of all of w's ranks (after every pair is connected).
std::unique_ptr<Communicator> make_gloo_communicator(std::shared_ptr<GlooWorld> w);

}  // namespace ctxpar::comm_detail

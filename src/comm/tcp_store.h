// A minimal client (and server) of PyTorch's c10d TCPStore wire protocol: what a gloo
// bootstrap under torchrun needs to exchange addresses through the store torchrun's agent
// hosts at MASTER_ADDR:MASTER_PORT. Checked against torch 2.15's TCPStore
// (tests/gloo/tcp_store_torch_test.py). The protocol, little-endian, strings as u64 length +
// bytes:
//
//   VALIDATE (0)     u32 0x3C85F7CE                 (no reply)
//   PING (13)        u32 nonce                      -> u32 nonce
//   SET (1)          key, value                     (no reply)
//   COMPARE_SET (2)  key, expected, desired         -> the key's value afterwards (desired is
//                                                      stored only if the value was `expected`,
//                                                      "" meaning unset: a first writer wins)
//   GET (3)          key                            -> value
//   ADD (4)          key, i64 delta                 -> i64 new value
//   CHECK (5)        u64 n, n keys                  -> u8 0 ready | 1 not ready
//   WAIT (6)         u64 n, n keys                  -> u8 0 (stop waiting) once all are set
//   CANCEL_WAIT (12)                                -> u8 1 (wait canceled)
//
// torch's client prefixes every key with "/"; so does this one, so the two see the same keys.
//
// Note [The store serves anyone who reaches it]
// Like torch's, the store has no authentication, and rank 0's server listens on MASTER_ADDR's
// address: any host that reaches it may send any bytes. So every length is bounded
// (kMaxStore*), a client that breaks the protocol (an unknown command, a length past its
// bound, ADD on a value that is not a number) is dropped alone, every socket is non-blocking
// (a client that never reads cannot stall the others), and the thread stops at once when the
// server is destroyed. docs/comm.md ("The TCP store") says what an attacker can still do.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace ctxpar::comm_detail {

// Bounds of the store, each far above what a gloo rendezvous needs (the largest value is a
// rank's address: ~136 bytes per peer, 136 KiB at kMaxGlooRanks).
constexpr uint64_t kMaxStoreKeyBytes = 4096;
constexpr uint64_t kMaxStoreValueBytes = uint64_t{4} << 20;
constexpr uint64_t kMaxStoreKeysPerWait = 1024;
// Everything the server holds: keys, values, and the bytes buffered for its clients.
constexpr uint64_t kMaxStoreHeldBytes = uint64_t{512} << 20;
constexpr int kMaxStoreClients = 4096;

class TcpStoreClient {
 public:
  // Connects (retrying until `timeout`: the server may start after this process), validates.
  // Every later wait ends by the same deadline: the whole rendezvous is bounded by `timeout`.
  // A host name that does not resolve is refused at once, with the resolver's error; a
  // temporary resolver failure is retried. `who` ("rank 1") and `host_of_store` ("rank 0's")
  // word the errors and the waiting notice.
  TcpStoreClient(const std::string& host, int port, std::chrono::milliseconds timeout,
                 const std::string& who = "this process",
                 const std::string& host_of_store = "the launcher's",
                 std::chrono::milliseconds notice_after = std::chrono::seconds(5));
  ~TcpStoreClient();
  TcpStoreClient(const TcpStoreClient&) = delete;
  TcpStoreClient& operator=(const TcpStoreClient&) = delete;
  void set(const std::string& key, const std::string& value);
  // Stores `value` unless the key is set; returns the key's value afterwards (== value when
  // this call stored it).
  std::string claim(const std::string& key, const std::string& value);
  // Waits until the key is set (until the deadline), then reads it. `what` ("rank 1's
  // address") words the errors and the waiting notice.
  std::string get(const std::string& key, const std::string& what);
  std::string where() const { return where_; }

 private:
  void send_all(const std::string& bytes);
  // Reads n bytes by the deadline; `what` and `hint` word the error past it.
  void recv_all(void* out, size_t n, const std::string& what, const char* hint);
  std::string recv_value(const std::string& key, const std::string& what, const char* hint);
  // Prints the waiting notice once per kind of wait (connect, key), once it is due.
  void notice_if_due(const std::string& what);
  int fd_ = -1;
  std::string where_, who_, host_of_store_;
  std::chrono::milliseconds timeout_, notice_after_;
  std::chrono::steady_clock::time_point deadline_, wait_started_;
  bool noticed_connect_ = false, noticed_key_ = false;
};

// The store's server side (what torch's rank 0 hosts for env:// without torchrun's agent):
// serves the commands above from a thread until destroyed, on every address `host` resolves
// to that belongs to this machine (MASTER_ADDR: its interface, not every interface). Throws,
// naming host and port, if it cannot listen there. `preset`: keys (as a client names them)
// set before any client can connect. Note [The store serves anyone who reaches it].
class TcpStoreServer {
 public:
  TcpStoreServer(const std::string& host, int port,
                 const std::map<std::string, std::string>& preset = {});
  ~TcpStoreServer();
  int port() const;
  // The addresses it listens on ("127.0.0.1:29500"), for messages.
  std::string listening() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

namespace store_wire {
constexpr uint32_t kValidationMagic = 0x3C85F7CE;
enum Query : uint8_t {
  kValidate = 0,
  kSet = 1,
  kCompareSet = 2,
  kGet = 3,
  kAdd = 4,
  kCheck = 5,
  kWait = 6,
  kCancelWait = 12,
  kPing = 13
};
template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
inline void put_string(std::string& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  out += s;
}
}  // namespace store_wire

}  // namespace ctxpar::comm_detail

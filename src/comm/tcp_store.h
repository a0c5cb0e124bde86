// A minimal client (and server) of PyTorch's c10d TCPStore wire protocol: what a gloo
// bootstrap under torchrun needs to exchange addresses through the store torchrun's agent
// hosts at MASTER_ADDR:MASTER_PORT. Checked against torch 2.15's TCPStore
// (tests/gloo/tcp_store_torch_test.py). The protocol, little-endian, strings as u64 length +
// bytes:
//
//   VALIDATE (0)  u32 0x3C85F7CE                 (no reply)
//   PING (13)     u32 nonce                      -> u32 nonce
//   SET (1)       key, value                     (no reply)
//   GET (3)       key                            -> value
//   ADD (4)       key, i64 delta                 -> i64 new value
//   CHECK (5)     u64 n, n keys                  -> u8 0 ready | 1 not ready
//   WAIT (6)      u64 n, n keys                  -> u8 0 (stop waiting) once all are set
//   CANCEL_WAIT (12)                             -> u8 1 (wait canceled)
//
// torch's client prefixes every key with "/"; so does this one, so the two see the same keys.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace ctxpar::comm_detail {

class TcpStoreClient {
 public:
  // Connects (retrying until `timeout`: the server may start after this process), validates.
  TcpStoreClient(const std::string& host, int port, std::chrono::milliseconds timeout);
  ~TcpStoreClient();
  void set(const std::string& key, const std::string& value);
  // Waits until the key is set (at most the timeout), then reads it.
  std::string get(const std::string& key);

 private:
  void send_all(const std::string& bytes);
  void recv_all(void* out, size_t n, std::chrono::steady_clock::time_point deadline);
  int fd_ = -1;
  std::string where_;
  std::chrono::milliseconds timeout_;
};

// The store's server side (what torch's rank 0 hosts for env:// without torchrun's agent):
// serves the commands above from a thread until destroyed. Throws, naming the port, if it
// cannot listen there.
class TcpStoreServer {
 public:
  explicit TcpStoreServer(int port);
  ~TcpStoreServer();
  int port() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace ctxpar::comm_detail

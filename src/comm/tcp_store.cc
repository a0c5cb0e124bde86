// PyTorch TCPStore protocol, the client (see tcp_store.h for the commands; the server is
// tcp_store_server.cc).
#include "comm/tcp_store.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

#include "ctxpar/error.h"

namespace ctxpar::comm_detail {

namespace {
using Clock = std::chrono::steady_clock;
using namespace store_wire;

double seconds(std::chrono::milliseconds t) { return t.count() / 1000.0; }

// The hints of a wait past the deadline: for an answer that comes at once from a store, and
// for a key that another rank sets.
constexpr const char* kIsItAStore = "is MASTER_PORT a c10d TCPStore, on a host that answers?";
constexpr const char* kDidEveryRankStart =
    "did every process of the job start, with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE?";

// One connection attempt to host:port: the socket, or -1 with errno set, or with *gai set to
// getaddrinfo's error when the name did not resolve.
int connect_once(const std::string& host, int port, int* gai) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  *gai = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (*gai != 0) return -1;
  int fd = -1;
  for (addrinfo* a = res; a; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
    const int e = errno;
    ::close(fd);
    errno = e;
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd >= 0) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  return fd;
}
}  // namespace

TcpStoreClient::TcpStoreClient(const std::string& host, int port, std::chrono::milliseconds timeout,
                               const std::string& who, const std::string& host_of_store,
                               std::chrono::milliseconds notice_after)
    : where_(host + ":" + std::to_string(port)),
      who_(who),
      host_of_store_(host_of_store),
      timeout_(timeout),
      notice_after_(notice_after),
      deadline_(Clock::now() + timeout),
      wait_started_(Clock::now()) {
  std::string last_error;
  for (;;) {
    int gai = 0;
    fd_ = connect_once(host, port, &gai);
    if (fd_ >= 0) break;
    // A name that does not resolve will not resolve by waiting: say so now, with the
    // resolver's words. A temporary failure (EAI_AGAIN: no answer from DNS yet) is retried.
    if (gai != 0 && gai != EAI_AGAIN && gai != EAI_SYSTEM)
      throw Error(detail::concat("MASTER_ADDR '", host, "' cannot be resolved (", gai_strerror(gai),
                                 "); set MASTER_ADDR to the host name or IP address of the "
                                 "machine of rank 0 (the host of the job's TCP store)"));
    last_error = gai != 0 ? gai_strerror(gai) : std::strerror(errno);
    if (Clock::now() >= deadline_)
      throw Error(detail::concat(who_, ": cannot connect to ", host_of_store_, " TCP store at ",
                                 where_, " (MASTER_ADDR:MASTER_PORT) within ", seconds(timeout_),
                                 " s (", last_error, "); is it running there?"));
    notice_if_due("");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::string msg;
  put<uint8_t>(msg, kValidate);
  put<uint32_t>(msg, kValidationMagic);
  const uint32_t nonce = static_cast<uint32_t>(::getpid());
  put<uint8_t>(msg, kPing);
  put<uint32_t>(msg, nonce);
  send_all(msg);
  uint32_t echo = 0;
  recv_all(&echo, sizeof(echo), "the answer to its ping", kIsItAStore);
  CTXPAR_CHECK(echo == nonce, "TCP store at ", where_, ": the server answered the ping with ", echo,
               " instead of ", nonce, "; is MASTER_PORT a c10d TCPStore?");
}

TcpStoreClient::~TcpStoreClient() {
  if (fd_ >= 0) ::close(fd_);
}

void TcpStoreClient::notice_if_due(const std::string& what) {
  bool& noticed = what.empty() ? noticed_connect_ : noticed_key_;
  if (noticed || Clock::now() - wait_started_ < notice_after_) return;
  noticed = true;
  const std::string text = what.empty()
                               ? detail::concat("ctxpar: ", who_, " waiting for ", host_of_store_,
                                                " TCP store at ", where_,
                                                " (MASTER_ADDR:MASTER_PORT) for up "
                                                "to ",
                                                seconds(timeout_), " s\n")
                               : detail::concat("ctxpar: ", who_, " waiting for ", what,
                                                " in the TCP store "
                                                "at ",
                                                where_, " (MASTER_ADDR:MASTER_PORT) for up to ",
                                                seconds(timeout_), " s\n");
  std::fputs(text.c_str(), stderr);
  std::fflush(stderr);
}

void TcpStoreClient::send_all(const std::string& bytes) {
  size_t off = 0;
  while (off < bytes.size()) {
    const ssize_t n = ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw Error(detail::concat(who_, ": TCP store at ", where_, ": send failed (",
                                 std::strerror(errno), "); ", host_of_store_,
                                 " store's host may "
                                 "have exited (its own error says why)"));
    off += n;
  }
}

void TcpStoreClient::recv_all(void* out, size_t n, const std::string& what, const char* hint) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const auto now = Clock::now();
    // Wake for the notice while it is still to come.
    auto until = deadline_;
    if (!noticed_key_) until = std::min(until, wait_started_ + notice_after_);
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - now);
    pollfd pfd{fd_, POLLIN, 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(std::max<int64_t>(0, left.count())));
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) {
      if (Clock::now() >= deadline_)
        throw Error(detail::concat(who_, ": waited ", seconds(timeout_), " s for ", what,
                                   " in the TCP store at ", where_, " (MASTER_ADDR:MASTER_PORT); ",
                                   hint));
      notice_if_due(what);
      continue;
    }
    const ssize_t got = ::recv(fd_, p, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0)
      throw Error(detail::concat(who_, ": the TCP store at ", where_, " closed the connection (",
                                 got < 0 ? std::strerror(errno) : "end of stream", ") while ", who_,
                                 " waited for ", what, ": ", host_of_store_,
                                 " store's host "
                                 "exited or failed (its own error says why), or dropped this "
                                 "client for breaking the protocol"));
    p += got;
    n -= got;
  }
}

std::string TcpStoreClient::recv_value(const std::string& key, const std::string& what,
                                       const char* hint) {
  uint64_t len = 0;
  recv_all(&len, sizeof(len), what, hint);
  CTXPAR_CHECK(len <= kMaxStoreValueBytes, who_, ": TCP store at ", where_, ": the value of '", key,
               "' claims ", len, " bytes, more than a store value may hold (", kMaxStoreValueBytes,
               "); is MASTER_PORT a c10d TCPStore?");
  std::string value(len, '\0');
  recv_all(value.data(), len, what, hint);
  return value;
}

void TcpStoreClient::set(const std::string& key, const std::string& value) {
  std::string msg;
  put<uint8_t>(msg, kSet);
  put_string(msg, "/" + key);
  put_string(msg, value);
  send_all(msg);
}

std::string TcpStoreClient::claim(const std::string& key, const std::string& value) {
  std::string msg;
  put<uint8_t>(msg, kCompareSet);
  put_string(msg, "/" + key);
  put_string(msg, "");
  put_string(msg, value);
  send_all(msg);
  wait_started_ = Clock::now();
  return recv_value(key, "the answer to its claim of '" + key + "'", kIsItAStore);
}

std::string TcpStoreClient::get(const std::string& key, const std::string& what) {
  std::string msg;
  put<uint8_t>(msg, kWait);
  put<uint64_t>(msg, 1);
  put_string(msg, "/" + key);
  send_all(msg);
  wait_started_ = Clock::now();
  uint8_t response = 0;
  recv_all(&response, 1, what, kDidEveryRankStart);
  CTXPAR_CHECK(response == 0, who_, ": TCP store at ", where_, ": unexpected wait response ",
               int(response), "; is MASTER_PORT a c10d TCPStore?");
  msg.clear();
  put<uint8_t>(msg, kGet);
  put_string(msg, "/" + key);
  send_all(msg);
  return recv_value(key, what, kIsItAStore);
}

}  // namespace ctxpar::comm_detail

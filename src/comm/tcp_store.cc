// PyTorch TCPStore protocol, client and server (see tcp_store.h for the commands).
#include "comm/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "ctxpar/error.h"

namespace ctxpar::comm_detail {

namespace {
using Clock = std::chrono::steady_clock;
constexpr uint32_t kValidationMagic = 0x3C85F7CE;
enum Query : uint8_t {
  kValidate = 0, kSet = 1, kGet = 3, kAdd = 4, kCheck = 5, kWait = 6, kCancelWait = 12, kPing = 13
};

template <typename T>
void put(std::string& out, T v) { out.append(reinterpret_cast<const char*>(&v), sizeof(T)); }
void put_string(std::string& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  out += s;
}

// One connection attempt to host:port; -1 on failure (errno set).
int connect_once(const std::string& host, int port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return -1;
  int fd = -1;
  for (addrinfo* a = res; a; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
    ::close(fd);
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

TcpStoreClient::TcpStoreClient(const std::string& host, int port,
                               std::chrono::milliseconds timeout)
    : where_(host + ":" + std::to_string(port)), timeout_(timeout) {
  const auto deadline = Clock::now() + timeout;
  int last_errno = 0;
  while ((fd_ = connect_once(host, port)) < 0) {
    last_errno = errno;
    if (Clock::now() >= deadline)
      throw Error(detail::concat("TCP store at ", where_, " (MASTER_ADDR:MASTER_PORT): cannot "
                                 "connect within ", timeout.count() / 1000.0, " s (",
                                 std::strerror(last_errno), "); is the launcher's store running "
                                 "there?"));
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
  recv_all(&echo, sizeof(echo), Clock::now() + timeout_);
  CTXPAR_CHECK(echo == nonce, "TCP store at ", where_, ": the server answered the ping with ",
               echo, " instead of ", nonce, "; is MASTER_PORT a c10d TCPStore?");
}

TcpStoreClient::~TcpStoreClient() {
  if (fd_ >= 0) ::close(fd_);
}

void TcpStoreClient::send_all(const std::string& bytes) {
  size_t off = 0;
  while (off < bytes.size()) {
    const ssize_t n = ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw Error(detail::concat("TCP store at ", where_, ": send failed (",
                                 std::strerror(errno), "); the store's host may have exited"));
    off += n;
  }
}

void TcpStoreClient::recv_all(void* out, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
    pollfd pfd{fd_, POLLIN, 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(std::max<int64_t>(0, left.count())));
    if (r < 0 && errno == EINTR) continue;
    if (r == 0)
      throw Error(detail::concat("TCP store at ", where_, ": no answer within ",
                                 timeout_.count() / 1000.0, " s"));
    const ssize_t got = ::recv(fd_, p, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0)
      throw Error(detail::concat("TCP store at ", where_, ": the connection closed (",
                                 got < 0 ? std::strerror(errno) : "end of stream",
                                 "); the store's host may have exited"));
    p += got;
    n -= got;
  }
}

void TcpStoreClient::set(const std::string& key, const std::string& value) {
  std::string msg;
  put<uint8_t>(msg, kSet);
  put_string(msg, "/" + key);
  put_string(msg, value);
  send_all(msg);
}

std::string TcpStoreClient::get(const std::string& key) {
  std::string msg;
  put<uint8_t>(msg, kWait);
  put<uint64_t>(msg, 1);
  put_string(msg, "/" + key);
  send_all(msg);
  uint8_t response = 0;
  try {
    recv_all(&response, 1, Clock::now() + timeout_);
  } catch (const Error&) {
    throw Error(detail::concat("TCP store at ", where_, ": key '", key, "' was not set within ",
                               timeout_.count() / 1000.0, " s; did every process of the job "
                               "start?"));
  }
  CTXPAR_CHECK(response == 0, "TCP store at ", where_, ": unexpected wait response ",
               int(response));
  msg.clear();
  put<uint8_t>(msg, kGet);
  put_string(msg, "/" + key);
  send_all(msg);
  uint64_t len = 0;
  recv_all(&len, sizeof(len), Clock::now() + timeout_);
  CTXPAR_CHECK(len < (uint64_t(1) << 30), "TCP store at ", where_, ": value of '", key,
               "' claims ", len, " bytes");
  std::string value(len, '\0');
  recv_all(value.data(), len, Clock::now() + timeout_);
  return value;
}

// ---- server ------------------------------------------------------------------------------

struct TcpStoreServer::State {
  int listen_fd = -1;
  int port = 0;
  int wake[2] = {-1, -1};  // a pipe: the destructor writes to stop the thread
  std::thread thread;
  std::map<std::string, std::string> data;
  struct Client {
    int fd;
    std::string in;
    std::vector<std::string> waiting;  // keys of a pending WAIT
  };
  std::vector<Client> clients;

  void run();
  // Parses and answers complete commands in c.in; false when the client must be dropped.
  bool serve(Client& c);
  bool ready(const std::vector<std::string>& keys) const {
    for (const auto& k : keys)
      if (!data.count(k)) return false;
    return true;
  }
};

TcpStoreServer::TcpStoreServer(int port) : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.listen_fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int zero = 0, one = 1;
  setsockopt(s.listen_fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
  setsockopt(s.listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in6 addr{};
  addr.sin6_family = AF_INET6;
  addr.sin6_addr = in6addr_any;
  addr.sin6_port = htons(static_cast<uint16_t>(port));
  if (::bind(s.listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(s.listen_fd, 128) != 0) {
    const int e = errno;
    ::close(s.listen_fd);
    throw Error(detail::concat("cannot host the TCP store on port ", port, " (MASTER_PORT): ",
                               std::strerror(e), "; choose a free MASTER_PORT"));
  }
  socklen_t len = sizeof(addr);
  getsockname(s.listen_fd, reinterpret_cast<sockaddr*>(&addr), &len);
  s.port = ntohs(addr.sin6_port);
  if (::pipe2(s.wake, O_CLOEXEC) != 0) throw Error("TCP store: pipe2 failed");
  s.thread = std::thread([&s] { s.run(); });
}

TcpStoreServer::~TcpStoreServer() {
  State& s = *state_;
  const char x = 1;
  (void)!::write(s.wake[1], &x, 1);
  s.thread.join();
  for (auto& c : s.clients) ::close(c.fd);
  ::close(s.listen_fd);
  ::close(s.wake[0]);
  ::close(s.wake[1]);
}

int TcpStoreServer::port() const { return state_->port; }

void TcpStoreServer::State::run() {
  for (;;) {
    std::vector<pollfd> fds{{wake[0], POLLIN, 0}, {listen_fd, POLLIN, 0}};
    for (auto& c : clients) fds.push_back({c.fd, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[0].revents) return;
    if (fds[1].revents & POLLIN) {
      const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) clients.push_back({fd, {}, {}});
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      Client& c = clients[i - 2];
      char buf[65536];
      const ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
      if (n > 0) c.in.append(buf, n);
      if (n <= 0 || !serve(c)) {
        ::close(c.fd);
        c.fd = -1;
      }
    }
    std::erase_if(clients, [](const Client& c) { return c.fd < 0; });
    // A SET may have completed other clients' waits.
    for (auto& c : clients) {
      if (!c.waiting.empty() && ready(c.waiting)) {
        c.waiting.clear();
        const uint8_t stop = 0;
        (void)!::send(c.fd, &stop, 1, MSG_NOSIGNAL);
        if (!serve(c)) ::close(c.fd), c.fd = -1;
      }
    }
    std::erase_if(clients, [](const Client& c) { return c.fd < 0; });
  }
}

bool TcpStoreServer::State::serve(Client& c) {
  for (;;) {
    if (!c.waiting.empty()) {
      // Only CANCEL_WAIT may come while a WAIT is pending.
      if (c.in.empty()) return true;
      if (uint8_t(c.in[0]) != kCancelWait) return false;
      c.in.erase(0, 1);
      c.waiting.clear();
      const uint8_t canceled = 1;
      return ::send(c.fd, &canceled, 1, MSG_NOSIGNAL) == 1 && serve(c);
    }
    size_t at = 0;
    auto need = [&](size_t n) { return c.in.size() >= at + n; };
    auto u64 = [&](uint64_t& v) {
      if (!need(8)) return false;
      std::memcpy(&v, c.in.data() + at, 8);
      at += 8;
      return true;
    };
    auto str = [&](std::string& s) {
      uint64_t n = 0;
      if (!u64(n) || !need(n)) return false;
      s.assign(c.in, at, n);
      at += n;
      return true;
    };
    if (c.in.empty()) return true;
    const uint8_t cmd = c.in[0];
    at = 1;
    std::string reply, key, value;
    bool complete = true;
    std::vector<std::string> keys;
    switch (cmd) {
      case kValidate:
      case kPing: {
        if (!need(4)) { complete = false; break; }
        uint32_t v;
        std::memcpy(&v, c.in.data() + at, 4);
        at += 4;
        if (cmd == kValidate && v != kValidationMagic) return false;
        if (cmd == kPing) put<uint32_t>(reply, v);
        break;
      }
      case kSet:
        if (!str(key) || !str(value)) { complete = false; break; }
        data[key] = value;
        break;
      case kGet:
        if (!str(key)) { complete = false; break; }
        put_string(reply, data.count(key) ? data[key] : std::string());
        break;
      case kAdd: {
        uint64_t delta = 0;
        if (!str(key) || !u64(delta)) { complete = false; break; }
        const int64_t v = (data.count(key) ? std::stoll(data[key]) : 0) + int64_t(delta);
        data[key] = std::to_string(v);
        put<int64_t>(reply, v);
        break;
      }
      case kCheck:
      case kWait: {
        uint64_t n = 0;
        if (!u64(n)) { complete = false; break; }
        for (uint64_t k = 0; k < n && complete; ++k) {
          keys.emplace_back();
          complete = str(keys.back());
        }
        if (!complete) break;
        if (cmd == kCheck) put<uint8_t>(reply, ready(keys) ? 0 : 1);
        else if (ready(keys)) put<uint8_t>(reply, 0);
        else c.waiting = keys;
        break;
      }
      default:
        return false;  // a command this minimal store does not serve
    }
    if (!complete) return true;  // wait for the rest of the command
    c.in.erase(0, at);
    if (!reply.empty() && ::send(c.fd, reply.data(), reply.size(), MSG_NOSIGNAL) !=
                              static_cast<ssize_t>(reply.size()))
      return false;
  }
}

}  // namespace ctxpar::comm_detail

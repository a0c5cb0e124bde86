// PyTorch TCPStore protocol, the server rank 0 hosts when no launcher's agent does (see
// tcp_store.h for the commands, and Note [The store serves anyone who reaches it]).
//
// One thread polls the listening sockets and every client, all non-blocking. Each client has
// an input buffer (the bytes of its commands, parsed as they complete) and an output buffer
// (the replies not sent yet); `held` counts every byte the server holds, buffers and data, and
// a client whose bytes would take it past kMaxStoreHeldBytes is dropped.
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "comm/tcp_store.h"
#include "ctxpar/error.h"

namespace ctxpar::comm_detail {

namespace {
using Clock = std::chrono::steady_clock;
using namespace store_wire;

// The largest reply a client may leave unread: two values' worth (a client that keeps asking
// without reading is dropped, never waited for).
constexpr uint64_t kMaxUnsentBytes = 2 * (kMaxStoreValueBytes + 16);

enum class Parse { done, more, bad };

// Reads a command's fields from a client's input; `at` starts after the command byte.
struct Reader {
  const std::string& in;
  size_t at = 1;
  Parse fixed(void* out, size_t n) {
    if (in.size() - at < n) return Parse::more;
    std::memcpy(out, in.data() + at, n);
    at += n;
    return Parse::done;
  }
  // A length-prefixed string of at most `max` bytes; a longer one breaks the protocol.
  Parse bytes(std::string& s, uint64_t max) {
    uint64_t n = 0;
    if (Parse p = fixed(&n, 8); p != Parse::done) return p;
    if (n > max) return Parse::bad;
    if (in.size() - at < n) return Parse::more;
    s.assign(in, at, n);
    at += n;
    return Parse::done;
  }
};

std::string text_of(const sockaddr* a, socklen_t len) {
  char host[NI_MAXHOST] = {}, port[NI_MAXSERV] = {};
  if (getnameinfo(a, len, host, sizeof(host), port, sizeof(port),
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return "?";
  return std::strchr(host, ':') ? detail::concat("[", host, "]:", port)
                                : detail::concat(host, ":", port);
}
}  // namespace

struct TcpStoreServer::State {
  std::vector<int> listen_fds;
  int port = 0;
  std::string listening;
  int wake[2] = {-1, -1};  // a pipe: the destructor writes to stop the thread
  std::thread thread;
  std::map<std::string, std::string> data;
  struct Client {
    int fd;
    std::string in, out;
    std::vector<std::string> waiting;  // keys of a pending WAIT
  };
  std::vector<Client> clients;
  uint64_t held = 0;  // data's keys and values, and every client's in and out
  Clock::time_point accept_paused_until{};

  void run();
  void accept_one(int listen_fd);
  // Reads what the client sent; false when it must be dropped.
  bool receive(Client& c);
  // Parses and answers complete commands in c.in; false when the client must be dropped.
  bool serve(Client& c);
  // Sends what c.out holds, as far as the socket takes it; false when the client is gone.
  bool flush(Client& c);
  bool reply(Client& c, const std::string& bytes);
  void store(const std::string& key, std::string value);
  // COMPARE_SET: torch's semantics, an unset key takes `value` only when `expected` is "".
  // Replies with the key's value after it.
  void compare_set(const std::string& key, const std::string& expected, std::string value,
                   std::string& out);
  // ADD: the key's value, a whole number as decimal text (0 when unset), plus `delta`; replies
  // with the sum. False (the client is dropped) when the value is not a whole number or the
  // sum leaves int64.
  bool add(const std::string& key, int64_t delta, std::string& out);
  void drop(Client& c) {
    held -= c.in.size() + c.out.size();
    ::close(c.fd);
    c.fd = -1;
  }
  bool ready(const std::vector<std::string>& keys) const {
    for (const auto& k : keys)
      if (!data.count(k)) return false;
    return true;
  }
};

TcpStoreServer::TcpStoreServer(const std::string& host, int port,
                               const std::map<std::string, std::string>& preset)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  for (const auto& [key, value] : preset) s.store("/" + key, value);
  const std::string where = detail::concat("MASTER_ADDR=", host, " MASTER_PORT=", port);
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  if (const int gai = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res))
    throw Error(detail::concat("rank 0 cannot host the TCP store at ", where,
                               ": MASTER_ADDR "
                               "cannot be resolved (",
                               gai_strerror(gai),
                               "); set MASTER_ADDR to "
                               "the host name or IP address of rank 0's machine"));
  int first_error = 0;
  for (addrinfo* a = res; a; a = a->ai_next) {
    const int fd =
        ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_storage addr{};
    std::memcpy(&addr, a->ai_addr, a->ai_addrlen);
    // Port 0 (tests): the first socket's port for every address. sin_port and sin6_port
    // share their offset.
    if (s.port != 0) reinterpret_cast<sockaddr_in*>(&addr)->sin_port = htons(uint16_t(s.port));
    socklen_t len = a->ai_addrlen;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(fd, 128) != 0) {
      // An address of another machine (EADDRNOTAVAIL), or a duplicate of one bound already.
      if (!first_error || first_error == EADDRNOTAVAIL) first_error = errno;
      ::close(fd);
      continue;
    }
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    s.port = ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    s.listening +=
        (s.listen_fds.empty() ? "" : ", ") + text_of(reinterpret_cast<sockaddr*>(&addr), len);
    s.listen_fds.push_back(fd);
  }
  freeaddrinfo(res);
  if (s.listen_fds.empty())
    throw Error(detail::concat(
        "rank 0 cannot host the TCP store at ", where, ": ", std::strerror(first_error),
        first_error == EADDRINUSE ? "; another job (or another program) holds MASTER_PORT there: "
                                    "give each job a free MASTER_PORT of its own"
        : first_error == EADDRNOTAVAIL ? "; rank 0 hosts the store on MASTER_ADDR's address, so "
                                         "MASTER_ADDR must be an address of rank 0's machine "
                                         "(start rank 0 there, or set MASTER_ADDR to it)"
                                       : ""));
  if (::pipe2(s.wake, O_CLOEXEC) != 0) {
    for (int fd : s.listen_fds) ::close(fd);
    throw Error(detail::concat("rank 0 cannot host the TCP store: pipe2 failed (",
                               std::strerror(errno), ")"));
  }
  s.thread = std::thread([&s] { s.run(); });
}

TcpStoreServer::~TcpStoreServer() {
  State& s = *state_;
  const char x = 1;
  (void)!::write(s.wake[1], &x, 1);
  s.thread.join();
  for (auto& c : s.clients) ::close(c.fd);
  for (int fd : s.listen_fds) ::close(fd);
  ::close(s.wake[0]);
  ::close(s.wake[1]);
}

int TcpStoreServer::port() const { return state_->port; }
std::string TcpStoreServer::listening() const { return state_->listening; }

void TcpStoreServer::State::run() {
  for (;;) {
    // Out of descriptors: the pending connection stays readable, so stop polling for it a
    // while rather than spin.
    const bool accepting = Clock::now() >= accept_paused_until;
    std::vector<pollfd> fds{{wake[0], POLLIN, 0}};
    for (int fd : listen_fds) fds.push_back({accepting ? fd : -1, POLLIN, 0});
    const size_t first = fds.size(), polled = clients.size();
    for (auto& c : clients)
      fds.push_back({c.fd, static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
    if (::poll(fds.data(), fds.size(), accepting ? -1 : 100) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[0].revents) return;
    for (size_t i = 1; i < first; ++i)
      if (fds[i].revents & POLLIN) accept_one(fds[i].fd);
    for (size_t i = 0; i < polled; ++i) {
      Client& c = clients[i];
      const short ev = fds[first + i].revents;
      if ((ev & (POLLIN | POLLHUP | POLLERR)) && !(receive(c) && serve(c)))
        drop(c);
      else if ((ev & POLLOUT) && !flush(c))
        drop(c);
    }
    // A SET may have completed other clients' waits.
    for (auto& c : clients) {
      if (c.fd < 0 || c.waiting.empty() || !ready(c.waiting)) continue;
      c.waiting.clear();
      if (!reply(c, std::string(1, '\0')) || !serve(c)) drop(c);
    }
    std::erase_if(clients, [](const Client& c) { return c.fd < 0; });
  }
}

void TcpStoreServer::State::accept_one(int listen_fd) {
  const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) {
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
      accept_paused_until = Clock::now() + std::chrono::milliseconds(100);
    return;
  }
  if (clients.size() >= static_cast<size_t>(kMaxStoreClients)) {
    ::close(fd);
    return;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  clients.push_back({fd, {}, {}, {}});
}

bool TcpStoreServer::State::receive(Client& c) {
  char buf[65536];
  const ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
  if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  if (n == 0 || held + n > kMaxStoreHeldBytes) return false;
  c.in.append(buf, n);
  held += n;
  return true;
}

bool TcpStoreServer::State::flush(Client& c) {
  while (!c.out.empty()) {
    const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    c.out.erase(0, n);
    held -= n;
  }
  return true;
}

bool TcpStoreServer::State::reply(Client& c, const std::string& bytes) {
  if (c.out.size() + bytes.size() > kMaxUnsentBytes || held + bytes.size() > kMaxStoreHeldBytes)
    return false;
  c.out += bytes;
  held += bytes.size();
  return flush(c);
}

void TcpStoreServer::State::store(const std::string& key, std::string value) {
  auto [it, added] = data.try_emplace(key);
  if (!added) held -= key.size() + it->second.size();
  held += key.size() + value.size();
  it->second = std::move(value);
}

void TcpStoreServer::State::compare_set(const std::string& key, const std::string& expected,
                                        std::string value, std::string& out) {
  if (auto it = data.find(key); it == data.end() ? expected.empty() : it->second == expected)
    store(key, std::move(value));
  put_string(out, data.count(key) ? data[key] : expected);
}

bool TcpStoreServer::State::add(const std::string& key, int64_t delta, std::string& out) {
  int64_t now = 0;
  // The value must be a whole number that the sum keeps in range (torch's store keeps
  // counters as decimal text); anything else breaks the protocol.
  if (auto it = data.find(key); it != data.end()) {
    const std::string& v = it->second;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), now);
    if (ec != std::errc() || end != v.data() + v.size() || v.empty()) return false;
  }
  if (__builtin_add_overflow(now, delta, &now)) return false;
  store(key, std::to_string(now));
  put<int64_t>(out, now);
  return true;
}

bool TcpStoreServer::State::serve(Client& c) {
  while (!c.in.empty()) {
    if (!c.waiting.empty()) {
      // Only CANCEL_WAIT may come while a WAIT is pending.
      if (uint8_t(c.in[0]) != kCancelWait) return false;
      c.in.erase(0, 1);
      held -= 1;
      c.waiting.clear();
      if (!reply(c, std::string(1, '\1'))) return false;
      continue;
    }
    Reader r{c.in};
    std::string out, key, value, expected;
    std::vector<std::string> keys;
    Parse p = Parse::done;
    switch (uint8_t(c.in[0])) {
      case kValidate:
      case kPing: {
        uint32_t v = 0;
        p = r.fixed(&v, 4);
        if (p != Parse::done) break;
        if (uint8_t(c.in[0]) == kValidate && v != kValidationMagic) return false;
        if (uint8_t(c.in[0]) == kPing) put<uint32_t>(out, v);
        break;
      }
      case kSet:
        p = r.bytes(key, kMaxStoreKeyBytes);
        if (p == Parse::done) p = r.bytes(value, kMaxStoreValueBytes);
        if (p == Parse::done) store(key, std::move(value));
        break;
      case kCompareSet:
        p = r.bytes(key, kMaxStoreKeyBytes);
        if (p == Parse::done) p = r.bytes(expected, kMaxStoreValueBytes);
        if (p == Parse::done) p = r.bytes(value, kMaxStoreValueBytes);
        if (p == Parse::done) compare_set(key, expected, std::move(value), out);
        break;
      case kGet:
        p = r.bytes(key, kMaxStoreKeyBytes);
        if (p == Parse::done) put_string(out, data.count(key) ? data[key] : std::string());
        break;
      case kAdd: {
        int64_t delta = 0;
        p = r.bytes(key, kMaxStoreKeyBytes);
        if (p == Parse::done) p = r.fixed(&delta, 8);
        if (p == Parse::done && !add(key, delta, out)) return false;
        break;
      }
      case kCheck:
      case kWait: {
        uint64_t n = 0;
        p = r.fixed(&n, 8);
        if (p == Parse::done && n > kMaxStoreKeysPerWait) return false;
        for (uint64_t k = 0; k < n && p == Parse::done; ++k)
          p = r.bytes(keys.emplace_back(), kMaxStoreKeyBytes);
        if (p != Parse::done) break;
        if (uint8_t(c.in[0]) == kCheck)
          put<uint8_t>(out, ready(keys) ? 0 : 1);
        else if (ready(keys))
          put<uint8_t>(out, 0);
        else
          c.waiting = std::move(keys);
        break;
      }
      default:
        return false;  // a command this minimal store does not serve
    }
    if (p == Parse::bad) return false;
    if (p == Parse::more) return true;  // wait for the rest of the command
    c.in.erase(0, r.at);
    held -= r.at;
    if (!out.empty() && !reply(c, out)) return false;
  }
  return true;
}

}  // namespace ctxpar::comm_detail

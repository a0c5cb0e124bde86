// A loopback TCP port for tests that start a TCP store (torchrun's MASTER_PORT).
#pragma once
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace ctxpar::test {

// A loopback port bound (not listening) while this lives: a connection to it is refused, and no
// other process can listen there meanwhile.
struct HeldPort {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int port = 0;
  HeldPort() {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), len);
    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
  }
  ~HeldPort() { ::close(fd); }
};

// A port for rank 0's store (free when this returns; the store binds it at once).
inline int free_port() { return HeldPort().port; }

}  // namespace ctxpar::test

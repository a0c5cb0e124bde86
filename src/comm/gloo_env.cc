// gloo_from_torchrun_env: a gloo communicator from torchrun's environment, the addresses
// exchanged through the c10d TCPStore at MASTER_ADDR:MASTER_PORT (tcp_store.h).
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <optional>

#include "comm/tcp_store.h"
#include "ctxpar/gloo.h"

namespace ctxpar {

namespace {
constexpr const char* kHowToLaunch =
    "start it with torchrun (torchrun --nproc-per-node N --no-python ctxpar ...), or set RANK, "
    "WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun does";

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

long env_int(const char* name, long lo, long hi) {
  const std::string v = env_or_empty(name);
  CTXPAR_CHECK(!v.empty(), name, " is not set; ", kHowToLaunch);
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  CTXPAR_CHECK(*end == '\0' && n >= lo && n <= hi, name, " must be a whole number in [", lo, ", ",
               hi, "], got '", v, "'; ", kHowToLaunch);
  return n;
}

// The local address from which MASTER_ADDR is reached: where the other ranks can reach this
// one too, when they run on the master's network (a UDP connect sends nothing).
std::string address_towards(const std::string& host, int port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_DGRAM;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return "";
  std::string out;
  for (addrinfo* a = res; a && out.empty(); a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    char text[INET6_ADDRSTRLEN] = {};
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        getnameinfo(reinterpret_cast<sockaddr*>(&local), len, text, sizeof(text), nullptr, 0,
                    NI_NUMERICHOST) == 0)
      out = text;
    ::close(fd);
  }
  freeaddrinfo(res);
  return out;
}
}  // namespace

std::unique_ptr<Communicator> gloo_from_torchrun_env(const GlooOptions& options) {
  const long size = env_int("WORLD_SIZE", 1, 1 << 20);
  const long rank = env_int("RANK", 0, 1 << 20);
  CTXPAR_CHECK(rank < size, "RANK=", rank, " is not below WORLD_SIZE=", size,
               "; the launcher's environment is inconsistent: ", kHowToLaunch);
  if (!env_or_empty("LOCAL_RANK").empty() && !env_or_empty("LOCAL_WORLD_SIZE").empty()) {
    const long local = env_int("LOCAL_RANK", 0, 1 << 20);
    const long local_size = env_int("LOCAL_WORLD_SIZE", 1, 1 << 20);
    CTXPAR_CHECK(local < local_size && local_size <= size, "LOCAL_RANK=", local,
                 " / LOCAL_WORLD_SIZE=", local_size, " do not fit WORLD_SIZE=", size,
                 "; the launcher's environment is inconsistent: ", kHowToLaunch);
  }
  const std::string master = env_or_empty("MASTER_ADDR");
  CTXPAR_CHECK(!master.empty(), "MASTER_ADDR is not set (the host of the job's TCP store); ",
               kHowToLaunch);
  const int port = static_cast<int>(env_int("MASTER_PORT", 1, 65535));

  GlooOptions o = options;
  if (o.hostname_or_interface.empty() && env_or_empty("CTXPAR_GLOO_IFNAME").empty() &&
      env_or_empty("CTXPAR_GLOO_HOST").empty())
    o.hostname_or_interface = address_towards(master, port);

  // torchrun's agent hosts the store and says so; otherwise rank 0 hosts it, as torch's env://
  // does.
  std::optional<comm_detail::TcpStoreServer> server;
  const std::string agent = env_or_empty("TORCHELASTIC_USE_AGENT_STORE");
  if (rank == 0 && agent != "True" && agent != "true" && agent != "1") server.emplace(port);
  comm_detail::TcpStoreClient store(master, port, o.timeout);

  // Keys are unique per run, restart and call, so a restarted job or a second communicator
  // never reads a stale address.
  static int calls = 0;
  const std::string prefix = "ctxpar/gloo/" + env_or_empty("TORCHELASTIC_RUN_ID") + "/" +
                             env_or_empty("TORCHELASTIC_RESTART_COUNT") + "/" +
                             std::to_string(calls++) + "/";
  GlooBootstrap boot(static_cast<int>(rank), static_cast<int>(size), o);
  store.set(prefix + std::to_string(rank), boot.address());
  std::vector<std::string> addresses(size);
  for (long j = 0; j < size; ++j)
    addresses[j] = j == rank ? boot.address() : store.get(prefix + std::to_string(j));
  auto comm = boot.connect(addresses);
  // Every rank has read every address once every pair is connected; rank 0 may stop serving.
  comm->barrier();
  comm->reset_counters();
  return comm;
}

}  // namespace ctxpar
